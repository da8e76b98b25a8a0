# The metadata lives in pyproject.toml; this file declares the cffi build and the native isolate-run,
# which build_ext links (isolate/_build.py) and build_scripts copies as is into the scripts directory.
import sys; sys.path.insert(0, "isolate")  # noqa: E702 (the build helper, not the package)
from setuptools import setup; from _build import CLI_PATH, BuildExt, BuildScripts  # noqa: E402,E702
setup(cffi_modules=["isolate/_build.py:ffibuilder"], cmdclass={"build_ext": BuildExt, "build_scripts": BuildScripts},
      scripts=[CLI_PATH])
