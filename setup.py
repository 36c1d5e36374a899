"""The one compiled part: the memory tier's copy-and-CRC32C, and a local save's writes and load's
reads with their CRC32Cs (optional: without a C compiler, or off x86-64, the package installs
without it and copies with memmove + the crc32c package, writes and reads item by item in Python)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("areal_lightning.write._crc32c_copy", ["areal_lightning/write/_crc32c_copy.c"],
                             extra_compile_args=["-O3"], optional=True)])
