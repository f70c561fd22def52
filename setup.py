"""Builds the one compiled part of sealfs; everything else is in pyproject.toml.

sealfs/fuse/conncaps.c becomes a plain shared library (no Python module in it)
that sealfs.fuse.conncaps loads with ctypes. It compiles against libfuse 3's
headers, found as pyfuse3's build finds them: pkg-config fuse3.
"""

import subprocess

from setuptools import Extension, setup


def fuse3_include_dirs() -> list[str]:
    flags = subprocess.run(
        ["pkg-config", "--cflags-only-I", "fuse3"], check=True, capture_output=True, text=True
    ).stdout.split()
    return [flag.removeprefix("-I") for flag in flags]


setup(
    ext_modules=[
        Extension(
            "sealfs.fuse._conncaps",
            sources=["sealfs/fuse/conncaps.c"],
            include_dirs=fuse3_include_dirs(),
        )
    ]
)
