"""Object stores: dumb, validated-name containers of opaque bytes.

A store knows nothing of crypto, keys or the volume format. It moves bytes
under names and reports typed errors from sealfs.errors.
"""
