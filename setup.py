# The metadata lives in pyproject.toml; this file declares the cffi build.
import sys; sys.path.insert(0, "isolate")  # noqa: E702 (the build helper, not the package)
from setuptools import setup; from _build import BuildExt  # noqa: E402,E702
setup(cffi_modules=["isolate/_build.py:ffibuilder"], cmdclass={"build_ext": BuildExt})
