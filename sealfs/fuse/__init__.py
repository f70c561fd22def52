"""The FUSE front end: a thin pyfuse3 adapter over the volume engine.

No storage or crypto logic lives here (import-linter enforces it): this
package translates requests and replies, and maps typed errors to errno.
"""

# First, before any module here imports pyfuse3 (see conncaps).
from sealfs.fuse import conncaps as conncaps
