"""Metadata: inodes, operation records, log segments and snapshots, and replay.

This layer owns what the volume looks like as data (the tree, attributes and
extent maps) and how it is written as sealed objects. It performs no I/O: the
volume layer fetches and stores the bytes.
"""
