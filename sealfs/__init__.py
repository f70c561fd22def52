"""sealfs: an encrypted filesystem whose store holds only sealed objects."""

__version__ = "0.2.0"
