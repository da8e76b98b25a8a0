"""The Java context: JShell inside the sandbox's JVM (``IsolateDriver.java``; ``driver.py``'s protocol).

What the upstream image's Java kernel (IJava) gives: snippets keep their
state from cell to cell, a cell's last expression is its result, and a
snippet that throws is an ``EvalException`` (one that does not compile, a
``CompilationException``). The driver is a single source file run by the
``java`` launcher (JDK 11 or later), which reads it from its standard input:
a sealed memfd of the host's. No file of the sandbox's holds it: one there
(the first version wrote it to a private temporary directory) could be
replaced by another process of the sandbox, same uid, between its writing
and the launcher's read, and that process's code would then be the driver
and answer for every cell. A sealed memfd cannot be written, by anyone, and
each open of it reads from its start (a pipe could be drained and refilled).
The JShell uses its "local" execution engine: no second JVM, no debugger port.

A context of a kept sandbox keeps its JShell past the server (``start_kept``;
JDK 16 or later, the top of ``IsolateDriver.java`` says how): each server
connects a relay to it (``connect``, a JVM of the same sealed source), and
only what that driver sends on its connection reaches the host's channel.
"""

from __future__ import annotations

import fcntl
import os
from importlib import resources

from ...kept.sandbox import Sandbox
from ...model.errors import CommandNotFoundError
from .driver import HELLO_TIMEOUT, Driver, read_pending, unavailable
from .python import socket_path

SOURCE = resources.files(__package__).joinpath("IsolateDriver.java").read_text(encoding="utf-8")
# --add-opens: the driver takes descriptor 3 through java.io.FileDescriptor's field (Java has no fdopen).
# The serial collector and C1 only: a context is small and should start fast.
# The sandbox's memory limit ($1, bytes) is the JVM's RAM, half of it the heap: inside the sandbox the JVM
# sees no cgroup and would size its heap to the host's memory, and a cell allocating past the limit would
# have the whole driver killed instead of getting an OutOfMemoryError.
# Under an address-space limit (RLIMIT_AS: memory without a cgroup) the JVM's default reservations (half of
# it for the heap, 1 GiB of class space, 240 MiB of code cache, a malloc arena per thread) do not fit: a
# quarter for the heap, small fixed ones, and one malloc arena (each reserves 64 MiB of the limit).
# -XX:+DisableAttachMechanism: the HotSpot attach listener (jcmd, agents; opened for any process of the
# same uid that drops /tmp/.attach_pidN and sends SIGQUIT) would let another process of the sandbox load
# code into the driver and answer for it.
LAUNCH = r'''sized=
if [ -n "$1" ]; then
    sized="-XX:MaxRAM=$1 -XX:MaxRAMPercentage=50"
fi
shift
v=$(ulimit -v)
if [ "$v" != unlimited ]; then
    sized="-Xmx$((v / 4))k -XX:CompressedClassSpaceSize=32m -XX:ReservedCodeCacheSize=32m"
    export MALLOC_ARENA_MAX=1
fi
exec java -XX:+DisableAttachMechanism -XX:+UseSerialGC -XX:TieredStopAtLevel=1 $sized \
    --add-opens java.base/java.io=ALL-UNNAMED --source 11 /proc/self/fd/0 "$@"
'''


def _sealed_source() -> int:
    """A memfd holding the driver's source, sealed: no write, no resize, no new seal."""
    fd = os.memfd_create("isolate-java-driver", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        data = memoryview(SOURCE.encode())
        while data:
            data = data[os.write(fd, data):]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


HINT = "it needs a JDK 11 or later inside the sandbox, with its jdk.jshell module " \
       "(Debian: apt-get install default-jdk-headless)"


class NotKeepable(Exception):
    """The sandbox's JDK is older than 16 (no unix sockets): its contexts end with their server."""


def _argv(box: Sandbox, *args: str) -> list[str]:
    memory = box.policy.limits.value("memory")
    return ["sh", "-c", LAUNCH, "isolate-java", "" if memory is None else str(int(memory)), *args]


def start(box: Sandbox) -> Driver:
    source = _sealed_source()
    try:
        return Driver(box, _argv(box), {}, "java", HINT, stdin=source)
    finally:
        os.close(source)  # the command has its own


def start_kept(box: Sandbox, context_id: str) -> None:
    """Start a kept driver (the top of ``IsolateDriver.java`` says how); a relay then connects to it."""
    source = _sealed_source()
    try:
        proc = box.spawn(_argv(box, "--kept", socket_path(context_id)), stdin=source, timeout=HELLO_TIMEOUT)
    except CommandNotFoundError as exc:
        raise unavailable("java", str(exc), HINT) from None
    finally:
        os.close(source)
    try:
        status = proc.wait()
        said = read_pending(proc.stderr_fd).decode(errors="replace")
    finally:
        proc.close()
    if status == 3:
        raise NotKeepable(said.strip())
    if status != 0:
        raise unavailable("java", (said.strip().splitlines() or ["it ended without a word"])[-1], HINT)


def connect(box: Sandbox, context_id: str, fresh: bool = False) -> Driver:
    """A relay to the kept driver of the context: its hello names the driver (``Driver.said_pid``). Not ``fresh``
    (a later server's), it first interrupts a cell the driver may still run for the last server."""
    source = _sealed_source()
    try:
        return Driver(box, _argv(box, "--relay-fresh" if fresh else "--relay", socket_path(context_id)), {}, "java",
                      HINT, stdin=source)
    finally:
        os.close(source)
