"""Pure cryptographic functions: AEAD sealing, the object envelope, subkeys, chunk ids.

This layer owns every use of a cipher, MAC or KDF on data objects. It performs no
I/O (os.urandom for fresh nonces is the only exception) and imports nothing from
sealfs but sealfs.errors, so it can be reviewed and tested on its own.
"""
