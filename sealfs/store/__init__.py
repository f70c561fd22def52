"""Object stores: dumb, validated-name containers of opaque bytes.

A store knows nothing of crypto, keys or the volume format. It moves bytes
under names and reports typed errors from sealfs.errors. The S3 backend
(sealfs.store.s3) is imported only when an s3:// URL is opened: boto3 is
slow to import, and local stores do not need it.
"""

from sealfs.store.base import ObjectInfo, ObjectStore, validate_name, validate_prefix
from sealfs.store.url import is_local_url, is_s3_url, local_path, open_store

__all__ = [
    "ObjectInfo",
    "ObjectStore",
    "is_local_url",
    "is_s3_url",
    "local_path",
    "open_store",
    "validate_name",
    "validate_prefix",
]
