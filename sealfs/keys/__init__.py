"""The volume header and its keyslots: from a secret to the master key.

This layer parses and writes the bytes of `sealfs.vol`, runs the passphrase KDF
and wraps or unwraps the master key. It may import sealfs.crypto and nothing
above it; it does no I/O of its own (callers fetch and store the header bytes).
"""
