"""A persistent shell in a kept sandbox: ``cd``, variables and functions persist between runs.

Each ``run`` writes the command line and then a marker line that prints the
command's exit status after a random token; the output is what came before
the marker. A run that times out is interrupted (SIGINT to what the shell
runs, not the shell); an interactive shell then drops the rest of its input,
marker included, so the next run first synchronises on a marker of its own.
"""

from __future__ import annotations

import os
import secrets
import signal
import termios
import time
from typing import Any

from .backends.native.commands import wait_seconds
from .errors import IsolationError
from .fdwait import ready

#: The most output one run keeps (its tail); what a command floods beyond is dropped as it comes.
OUTPUT_LIMIT = 16 << 20


class Shell:
    """A persistent shell in a sandbox: ``run(command)`` returns (output, exit status); state persists."""

    def __init__(self, box: Any, name: str, pty: bool) -> None:
        self.name = name
        self.pty = pty
        self._token = secrets.token_hex(8)
        env = {"PS1": "", "PS2": "", "TERM": "dumb"}
        self._process = box.spawn(["/bin/sh"], env=env, pty=pty)
        if pty:
            attrs = termios.tcgetattr(self._process.master_fd)
            attrs[3] &= ~(termios.ECHO | termios.ICANON)  # no echo of what the host types
            attrs[1] &= ~termios.ONLCR
            termios.tcsetattr(self._process.master_fd, termios.TCSANOW, attrs)
        self._buffer = bytearray()
        self._seq = 0
        self._unsynced = False

    @property
    def alive(self) -> bool:
        return self._process.poll() is None

    def run(self, command: str, timeout: float | None = 60.0) -> tuple[str, int]:
        """Run one command line; returns its output (stdout and stderr, as printed) and exit status."""
        timeout = wait_seconds(timeout, "timeout")
        if not self.alive:
            raise IsolationError(f"shell {self.name!r} has ended")
        if self._unsynced:
            self._exchange(":", 10.0)  # what an interrupted run left goes with it
            self._unsynced = False
        return self._exchange(command, timeout)

    def _exchange(self, command: str, timeout: float | None) -> tuple[str, int]:
        self._seq += 1
        marker = f"__isolate_{self._token}_{self._seq}_".encode()
        redirect = "" if self.pty else " 2>&1"
        self._process.write(f"{{ {command}\n}}{redirect}\nprintf '\\n%s%d__\\n' '{marker.decode()}' \"$?\"\n")
        deadline = None if timeout is None else time.monotonic() + timeout
        # The command's output may be a flood: it is kept in a bytearray (appending is not a copy),
        # only its tail is kept, and only what is new is searched for the marker (a search from
        # the start each time would make a flood cost the host quadratic time).
        start = 0
        while True:
            at = self._buffer.find(marker, start)
            end = self._buffer.find(b"__\n", at + len(marker)) if at >= 0 else -1
            if end >= 0:
                try:
                    status = int(self._buffer[at + len(marker):end] or b"-1")
                except ValueError:
                    status = -1
                output = bytes(self._buffer[:at]).removesuffix(b"\n")  # the marker's own line break
                del self._buffer[:end + 3]
                return output.decode(errors="replace"), status
            start = at if at >= 0 else max(0, len(self._buffer) - len(marker) - 32)
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                self.interrupt()
                self._unsynced = True
                self._buffer = bytearray()
                raise TimeoutError(f"shell {self.name!r}: {command[:60]!r} did not finish within {timeout} s "
                                   "(it was interrupted)")
            if ready([self._process.stdout_fd], timeout=wait):
                try:
                    chunk = os.read(self._process.stdout_fd, 65536)
                except OSError:
                    chunk = b""
                if not chunk:
                    raise IsolationError(f"shell {self.name!r} ended")
                self._buffer += chunk
                excess = len(self._buffer) - OUTPUT_LIMIT
                if excess > 0:
                    del self._buffer[:excess]
                    start = max(0, start - excess)

    def interrupt(self) -> None:
        """SIGINT to what the shell is running (not the shell itself)."""
        self._process.signal(signal.SIGINT, descendants=True)

    def close(self) -> None:
        self._process.kill()
        self._process.close()
