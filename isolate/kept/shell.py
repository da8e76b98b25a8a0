"""A persistent shell in a kept sandbox: ``cd``, variables and functions persist between runs.

The framing is out of band. The shell gets, as its descriptor 3, one end of a socket pair that only it
and this driver hold: each command line runs with descriptor 3 closed (``3>&-``), so neither the
command nor anything it leaves in the background has it, a socket cannot be reopened through
``/proc/PID/fd``, and the default seccomp filter refuses ``pidfd_getfd``. After the command the shell
asks on that socket for the run's marker, a random value the driver sends there and nowhere else,
prints it on the output (where the command's output ends) and reports the exit status on the socket
with it. No output of any process can end, truncate or fake a run: it would need the marker, which
exists only in the socket, the driver and, for the instant between reading and printing it, the
shell's memory. A run that times out is interrupted (SIGINT to what the shell runs, not the shell);
an interactive shell then drops the rest of its input, so the next run first synchronises on a run
of its own; the requests carry the run's number, and one of an earlier run gets a value that ends
nothing.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import termios
import time
from typing import Any

from ..backends.native.commands import wait_seconds
from ..kernel.fdwait import ready
from ..model.errors import IsolationError

#: Every signal a trap can be set on (KILL and STOP take none): a trap a command set is reset after its run.
_SIGNALS = " ".join(str(n) for n in range(1, 65) if n not in (9, 19))

#: What runs the command, on one line with it. Before the command, ``command`` loses any function of that
#: name (``unset`` is a POSIX special builtin, which no function can shadow in dash, busybox ash or bash in
#: POSIX mode: ``POSIXLY_CORRECT`` set, an assignment, turns bash's on whatever ``set +o posix`` did). The
#: command is a quoted string for ``command eval``: a syntax error is its status (2), not the end of the
#: shell, and no text of it can close the framing. After it, still with the channel (descriptor 3) closed,
#: the status is taken by an assignment and every trap the command set is reset, so no trap (a signal's, or
#: bash's ``DEBUG``/``RETURN``/``ERR``) runs while the shell holds the channel; printing options (``-x``,
#: ``-v``) end too, as they would print the marker.
_PREFIX = "{{ POSIXLY_CORRECT=y; \\unset -f command; {{ \\command eval {command}; }}{redirect}; __isolate_s=$?; " \
          "\\set +vx; \\trap - {traps}; }} 3>&-"

#: What follows, on its own line: it calls only what no earlier command can redefine (``echo``, ``printf``
#: and ``read`` lose their functions first; every name is quoted with a backslash, which no alias matches).
_TRAILER = ("\\unset -f echo printf read; "
            "\\echo 'marker {seq}' >&3; IFS= \\read -r __isolate_m <&3; "
            "\\printf '\\n%s\\n' \"$__isolate_m\"; \\echo \"status $__isolate_m $__isolate_s\" >&3; "
            "\\unset __isolate_m __isolate_s")


def _quoted(text: str) -> str:
    """``text`` as one single-quoted shell word (the same in every POSIX shell)."""
    return "'" + text.replace("'", "'\\''") + "'"


#: The most output one run keeps (its tail); what a command floods beyond is dropped as it comes.
OUTPUT_LIMIT = 16 << 20


class Shell:
    """A persistent shell in a sandbox: ``run(command)`` returns (output, exit status); state persists."""

    def __init__(self, box: Any, name: str, pty: bool, argv: tuple[str, ...] = ("/bin/sh",)) -> None:
        self.name = name
        self.pty = pty
        env = {"PS1": "", "PS2": "", "TERM": "dumb"}
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._process = box.spawn(list(argv), env=env, pty=pty, fd3=theirs.fileno())
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # the shell holds its own copy now
        self._channel = ours
        if pty:
            attrs = termios.tcgetattr(self._process.master_fd)
            attrs[3] &= ~(termios.ECHO | termios.ICANON)  # no echo of what the host types
            attrs[1] &= ~termios.ONLCR
            termios.tcsetattr(self._process.master_fd, termios.TCSANOW, attrs)
        self._buffer = bytearray()
        self._requests = bytearray()
        self._seq = 0
        self._unsynced = False
        self._traps = _SIGNALS
        # The trap names besides signals that this shell has (asked before any command of the caller ran).
        probe, _ = self.run("\\trap - ERR 2>/dev/null && \\echo ERR; \\echo \"${BASH_VERSION:+DEBUG RETURN}\"",
                            timeout=30)
        self._traps = " ".join([_SIGNALS, *probe.split()])

    @property
    def alive(self) -> bool:
        try:
            return self._process.poll() is None
        except IsolationError:  # its monitor is gone: the host ended the sandbox
            return False

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
        seq = self._seq
        marker = secrets.token_hex(16).encode()
        redirect = "" if self.pty else " 2>&1"
        # The status is read before anything else runs, the marker asked for by number, printed after a
        # line break (the command's output need not end with one), and unset at once.
        self._process.write(_PREFIX.format(command=_quoted(command), redirect=redirect, traps=self._traps) + "\n"
                            + _TRAILER.format(seq=seq) + "\n")
        deadline = None if timeout is None else time.monotonic() + timeout
        # The command's output may be a flood: it is kept in a bytearray (appending is not a copy),
        # only its tail is kept, and only what is new is searched for the marker (a search from
        # the start each time would make a flood cost the host quadratic time).
        start = 0
        at = -1
        status: int | None = None
        while True:
            if at < 0:
                at = self._buffer.find(marker, start)
                start = at if at >= 0 else max(0, len(self._buffer) - len(marker))
            if at >= 0:
                if status is None:
                    status = self._answer(seq, marker)  # the shell reports right after printing the marker
                if status is not None:
                    break
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                self.interrupt()
                self._unsynced = True
                self._buffer = bytearray()
                raise TimeoutError(f"shell {self.name!r}: {command[:60]!r} did not finish within {timeout} s "
                                   "(it was interrupted)")
            # Past the marker only the channel matters: what comes on the output after it is the next run's.
            watched = [self._channel.fileno()] + ([self._process.stdout_fd] if at < 0 else [])
            readable = ready(watched, timeout=wait)
            if self._channel.fileno() in readable and at < 0 and status is None:
                status = self._answer(seq, marker)  # a request for the marker, or already the status
            if self._process.stdout_fd in readable:
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
        output = bytes(self._buffer[:at]).removesuffix(b"\n")  # the marker's own line break
        del self._buffer[:at + len(marker) + 1]
        return output.decode(errors="replace"), status

    def _answer(self, seq: int, marker: bytes) -> int | None:
        """Serve the shell's requests on the channel: a marker for this run's number (a value that ends
        nothing for an earlier, interrupted one); this run's status once it has come, else None."""
        try:
            data = self._channel.recv(4096, socket.MSG_DONTWAIT)
        except BlockingIOError:
            data = b"-"
        except OSError:
            data = b""
        if not data:
            raise IsolationError(f"shell {self.name!r} ended")
        if data != b"-":
            self._requests += data
        status = None
        while b"\n" in self._requests:
            line, _, rest = bytes(self._requests).partition(b"\n")
            self._requests = bytearray(rest)
            words = line.split()
            if len(words) == 2 and words[0] == b"marker":
                answer = marker if words[1] == str(seq).encode() else secrets.token_hex(16).encode()
                self._channel.sendall(answer + b"\n")
            elif len(words) == 3 and words[0] == b"status" and words[1] == marker:
                try:
                    status = int(words[2])
                except ValueError:
                    status = -1
        if len(self._requests) > 4096:  # only the shell writes here; a line this long is not one of its
            raise IsolationError(f"shell {self.name!r}: its status channel carried garbage")
        return status

    def interrupt(self) -> None:
        """SIGINT to what the shell is running (not the shell itself)."""
        self._process.signal(signal.SIGINT, descendants=True)

    def close(self) -> None:
        self._process.kill()
        self._process.close()
        self._channel.close()
