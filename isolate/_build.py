"""The build of isolate's C core: a cffi extension and the init executable.

``setup.py`` names ``ffibuilder`` (cffi's API mode, compiled at install
time) and ``BuildExt``, which first compiles ``csrc/`` with
``-Wall -Wextra -Werror``, links the static init binary beside the package,
then lets cffi build the extension against those objects.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from distutils.command.build_scripts import build_scripts  # (setuptools provides distutils)

from cffi import FFI
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CSRC = os.path.join(ROOT, "csrc")
HEADER = os.path.join(CSRC, "isolate.h")
CFLAGS = ["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", "-fPIC", "-fno-strict-aliasing"]
# The extension's C files; init.c is the init's main, linked on its own.
CORE_SOURCES = ["spawn.c", "preexec.c", "process.c", "userns.c", "mounts.c", "net.c",
                "rlimits.c", "caps.c", "landlock.c", "seccomp.c", "beneath.c"]
INIT_SOURCES = ["init.c", "landlock.c", "supervise.c", "why.c", "execserver.c", "xs_wire.c", "xs_files.c",
                "xs_monitor.c", "xs_keep.c", "process.c"]
INIT_NAME = "isolate-init"
# The native isolate-run (csrc/cli.c): the core's objects and its main, linked here and installed into
# the scripts directory (<prefix>/bin) as a data file by setup.py (the console script is gone).
CLI_SOURCES = ["cli.c", "cli_util.c", "cli_plan.c", "cli_report.c"]
CLI_DIR = os.path.join("build", "isolate-run-bin")
CLI_PATH = os.path.join(CLI_DIR, "isolate-run")
# The init and the native isolate-run are static executables that start once per sandbox (and per
# command line).  glibc's static start-up probes the CPU with some 70 `cpuid` instructions, each a VM
# exit under a hypervisor (7 to 9 µs apiece here): 0.6 ms of every start, where musl's takes none
# (77 µs from spawn to exit against 612 µs, measured on the development VM).  So they are linked with
# musl when musl-gcc is installed (apt-get install musl-tools), with glibc otherwise; ISOLATE_MUSL=0
# keeps glibc.  The Python extension always uses the interpreter's compiler and C library.
MUSL_CC = "musl-gcc"


def _c_string(text: str) -> str:
    """A C string literal of any path (octal escapes: no quoting or trigraph surprises)."""
    return '"' + "".join(f"\\{byte:03o}" for byte in os.fsencode(text)) + '"'


def cdef_source() -> str:
    """The header as cffi's cdef: declarations only, integer #defines kept."""
    with open(HEADER, encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    kept = []
    for line in lines:
        if line.startswith("#"):
            if re.match(r"#define\s+ISO_\w+\s+0x[0-9a-fA-F]+\s*$|#define\s+ISO_\w+\s+\d+\s*$", line):
                kept.append(line)
            continue
        kept.append(line)
    return "\n".join(kept)


ffibuilder = FFI()
ffibuilder.cdef(cdef_source())
ffibuilder.set_source(
    "isolate._native",
    '#include "isolate.h"',
    include_dirs=["csrc"],
    extra_compile_args=["-std=gnu11"],
)


def _musl_includes(build_temp: str) -> list[str] | None:
    """musl-gcc's search path plus the kernel's uapi headers (linux/, asm/, asm-generic/) and nothing else
    of the system's (musl ships none of them; glibc's own headers must not leak in); None: no musl."""
    if os.environ.get("ISOLATE_MUSL", "1") == "0" or not shutil.which(MUSL_CC):
        return None
    multiarch = subprocess.run(["gcc", "-print-multiarch"], capture_output=True, text=True).stdout.strip()
    sources = {"linux": "/usr/include/linux", "asm-generic": "/usr/include/asm-generic",
               "asm": next((d for d in (f"/usr/include/{multiarch}/asm", "/usr/include/asm") if os.path.isdir(d)),
                           "")}
    if not all(os.path.isdir(d) for d in sources.values()):
        return None
    include = os.path.join(build_temp, "musl-uapi")
    os.makedirs(include, exist_ok=True)
    for name, target in sources.items():
        link = os.path.join(include, name)
        if os.path.islink(link) and os.readlink(link) != target:
            os.unlink(link)
        if not os.path.lexists(link):
            os.symlink(target, link)
    return ["-isystem", include]


def _missing_toolchain() -> str | None:
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if not shutil.which(compiler):
        return f"no C compiler ({compiler}) found: apt-get install gcc (dnf install gcc)"
    include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        return f"no Python headers in {include}: apt-get install python3-dev (dnf install python3-devel)"
    return None


class BuildExt(build_ext):  # type: ignore[misc]
    """Compile csrc/ strictly, link the init, then build the cffi extension."""

    def run(self) -> None:
        problem = _missing_toolchain()
        if problem:
            raise SystemExit(f"isolate cannot be built: {problem}")
        compiler = (sysconfig.get_config_var("CC") or "cc").split()
        objects_dir = os.path.join(self.build_temp, "csrc")
        os.makedirs(objects_dir, exist_ok=True)
        objects = {}
        # The interpreter the CLI binary hands over to: this build's (pip builds with the target's).
        config = os.path.join(objects_dir, "cli_config.h")
        with open(config, "w", encoding="ascii") as handle:
            handle.write(f"#define ISO_CLI_PYTHON {_c_string(sys.executable)}\n")
        for name in sorted(set(CORE_SOURCES) | set(INIT_SOURCES) | set(CLI_SOURCES)):
            obj = os.path.join(objects_dir, name[:-2] + ".o")
            extra = ["-include", config] if name in CLI_SOURCES else []
            self._run(compiler + CFLAGS + extra + ["-c", os.path.join(CSRC, name), "-o", obj])
            objects[name] = obj
        package_dir = HERE if self.inplace else os.path.join(self.build_lib, "isolate")
        os.makedirs(package_dir, exist_ok=True)
        init_path = os.path.join(package_dir, INIT_NAME)
        cli_path = os.path.join(ROOT, CLI_PATH)
        os.makedirs(os.path.dirname(cli_path), exist_ok=True)
        init_names, cli_names = INIT_SOURCES, CLI_SOURCES + CORE_SOURCES
        musl = self._musl_objects(objects_dir, config, sorted(set(init_names) | set(cli_names)))
        if musl is not None:
            try:
                self._run([MUSL_CC, "-static", "-o", init_path, *[musl[n] for n in init_names]])
                self._run([MUSL_CC, "-static", "-o", cli_path, *[musl[n] for n in cli_names]])
            except SystemExit as exc:
                print(f"isolate: linking with musl failed; linking with glibc\n{exc}", file=sys.stderr)
                musl = None
        if musl is None:
            try:
                self._run([*compiler, "-static", "-o", init_path, *[objects[n] for n in init_names]])
            except SystemExit:
                raise SystemExit(
                    "isolate cannot be built: linking the static init failed; the C library's static "
                    "archive is missing: apt-get install libc6-dev (dnf install glibc-static)"
                ) from None
            cli_objects = [objects[n] for n in cli_names]
            try:
                self._run([*compiler, "-static", "-o", cli_path, *cli_objects])
            except SystemExit:
                self._run([*compiler, "-o", cli_path, *cli_objects])  # a dynamic one still starts in about 1 ms
        for ext in self.extensions:
            ext.extra_objects = [objects[n] for n in CORE_SOURCES]
            ext.depends = list(ext.depends) + ext.extra_objects
        super().run()

    def _musl_objects(self, objects_dir: str, config: str, names: list[str]) -> dict[str, str] | None:
        """The executables' objects compiled by musl-gcc (as strictly); None: no musl here, or it failed."""
        includes = _musl_includes(self.build_temp)
        if includes is None:
            return None
        out = os.path.join(objects_dir, "musl")
        os.makedirs(out, exist_ok=True)
        objects = {}
        for name in names:
            obj = os.path.join(out, name[:-2] + ".o")
            extra = ["-include", config] if name in CLI_SOURCES else []
            command = [MUSL_CC, *CFLAGS, *includes, *extra, "-c", os.path.join(CSRC, name), "-o", obj]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                print(f"isolate: musl-gcc could not compile {name}; linking with glibc\n{result.stderr}",
                      file=sys.stderr)
                return None
            objects[name] = obj
        return objects

    @staticmethod
    def _run(command: list[str]) -> None:
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(f"isolate: build step failed: {' '.join(command)}\n{result.stderr}")


class BuildScripts(build_scripts):  # type: ignore[misc]
    """Copy the scripts (the native isolate-run only) byte for byte: no shebang to adjust in a binary.

    setuptools' own copy reads each script as Python text; the ELF file is not."""

    def run(self) -> None:
        self.mkpath(self.build_dir)
        for script in self.scripts or []:
            target = os.path.join(self.build_dir, os.path.basename(script))
            self.copy_file(script, target, preserve_mode=True)
            os.chmod(target, 0o755)


if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
