"""The engine: POSIX-like operations on a Volume, buffers, caches and commits.

Front ends (FUSE, CLI, the Python API) call only this layer.
"""
