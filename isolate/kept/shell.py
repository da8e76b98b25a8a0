"""A persistent shell in a kept sandbox: ``cd``, variables and functions persist between runs.

The framing is out of band. The shell gets, as its descriptor 3, one end of a socket pair that only it
and this driver hold: each command line runs with descriptor 3 closed (``3>&-``), a socket cannot be
reopened through ``/proc/PID/fd``, and the default seccomp filter refuses ``pidfd_getfd``. The shell
keeps a saved copy meanwhile (at 10 or so, to restore descriptor 3 after), which bash's and busybox
ash's redirections can name and a subshell forked then keeps: reports count only from the shell's own
pid (SO_PASSCRED, ``PeerChannel``), so such a holder can take a marker (the run times out) but never
report a run. The command's own builtins run in the shell's process, though: in bash and busybox ash they
can read the saved copy and answer later runs themselves, which no framing can prevent (``trusted_results``
is False there; dash's syntax names no descriptor past 9). Before the command, the driver
puts the run's marker (a random value, sent there and nowhere else) on that socket, where it waits
unread; after the command the shell reads it, prints it on the output (where the command's output
ends) and reports the exit status on the socket with it and the run's number. No output of any process
can end, truncate or fake a run: it would need the marker, which exists only in the socket, the driver
and, from the moment the command has ended, the shell's memory. A run that times out is interrupted
(SIGINT to what the shell runs, not the shell); an interactive shell then drops the rest of its input,
maybe after its framing read the marker, maybe before: the driver keeps the markers that may still wait
unread, in order, and the next run first synchronises on a run of its own with a fresh marker behind
them. The socket keeps the order, so a framing always reads the oldest marker left: the report names
it, and the ones before it are gone.
"""

from __future__ import annotations

import os
import secrets
import select
import signal
import socket
import termios
import time
from typing import Any

from ..backends.native.commands import wait_seconds
from ..kernel.fdwait import poll_millis
from ..kernel.peerchannel import PeerChannel
from ..model.errors import IsolationError

#: Every signal a trap can be set on (KILL and STOP take none), and EXIT (0): a trap a command set is reset after
#: its run. EXIT's above all: a shell that exits puts its redirections back first, so its EXIT trap runs with the
#: channel open, where it read the marker of the run that ended the shell (a later command's ``exit``, or a
#: failure under ``set -e``) and reported that run itself.
_SIGNALS = " ".join(str(n) for n in range(0, 65) if n not in (9, 19))

#: What runs the command, on one line with it. Before the command, ``command`` loses any function of that
#: name (``unset`` is a POSIX special builtin, which no function can shadow in dash, busybox ash or bash in
#: POSIX mode: ``POSIXLY_CORRECT`` set, an assignment, turns bash's on whatever ``set +o posix`` did). The
#: command is a quoted string for ``command eval``: a syntax error is its status (2), not the end of the
#: shell, and no text of it can close the framing. After it, still with the channel (descriptor 3) closed,
#: the status is kept as the positional parameter ``$1`` (``set`` is a special builtin too; no command can
#: make a parameter read-only, as it can a variable, whose assignment then fails in an interactive shell and
#: leaves the value it chose), and every trap the command set is reset, so no trap (a signal's, or bash's
#: ``DEBUG``/``RETURN``/``ERR``) runs while the shell holds the channel; printing options (``-x``, ``-v``)
#: end too, as they would print the marker. ``{reset}``: that reset, as text until the shell has it in a
#: read-only variable of its own (set before any command of the caller ran), then that variable's ``eval``.
_PREFIX = "{{ POSIXLY_CORRECT=y; \\unset -f command; \\command eval {command}; \\set -- \"$?\"; {reset}; }} 3>&-"
_RESET = "\\set +vx; \\trap - {traps}"

#: What follows, on its own line, with the run's number as ``$2``: it calls only what no earlier command can
#: redefine (``echo``, ``printf`` and ``read`` lose their functions first; every name is quoted with a
#: backslash, which no alias matches). Kept in a read-only variable too once the shell has it.
_TRAILER = ("\\unset -f echo printf read; IFS= \\read -r __isolate_m <&3; "
            "\\echo \"$__isolate_m $2 $1\" >&3; \\printf '\\n%s\\n' \"$__isolate_m\"; \\unset __isolate_m")
#: The read-only variables that hold the reset and the trailer (a command can neither change nor unset them).
_RESET_VAR, _TRAILER_VAR = "__isolate_r", "__isolate_t"


def _quoted(text: str) -> str:
    """``text`` as one single-quoted shell word (the same in every POSIX shell)."""
    return "'" + text.replace("'", "'\\''") + "'"


#: Markers of an earlier host's an adopted shell looks past at most (each a run that host started, or sent the
#: marker of, and did not see end: one, as a host runs one command at a time).
_STALE_MARKERS = 8

#: The room for a chunk of a long command (quoted) in a line of at most PIPE_BUF bytes (see Shell._lines).
_ROOM = select.PIPE_BUF - 64
#: The most variables a long command's chunks go in (their names, twice, fit in its last line).
_GROUPS = 48

#: What the first run after an unfinished one runs first: it unsets the variables of a long command's chunks (see
#: Shell._lines) that an earlier run set and never evaluated, its last line never sent (a deadline came, or its
#: host was killed, between its chunks). Their names are random, so they are listed (bash's ``compgen``, else
#: ``set``: dash, busybox ash) and only names of that exact form are unset; read a line at a time from a here-document
#: (no word splitting: a command may have changed IFS), in the shell itself (no pipeline's subshell).
_CHUNK_NAME = "__isolate_" + "[0-9a-f]" * 12 + "_[0-9]"
_FORGET = ("while IFS= \\read -r __isolate_v; do __isolate_v=${__isolate_v%%=*}; "
           f"case $__isolate_v in {_CHUNK_NAME}|{_CHUNK_NAME}[0-9]) \\unset \"$__isolate_v\" 2>/dev/null;; esac; done "
           "<<__isolate_eof\n$(\\command compgen -v __isolate_ 2>/dev/null; case ${BASH_VERSION-} in '') \\set;; esac)"
           "\n__isolate_eof\n\\unset __isolate_v")

#: The most output one run keeps (its tail); what a command floods beyond is dropped as it comes.
OUTPUT_LIMIT = 16 << 20


class Shell:
    """A persistent shell in a sandbox: ``run(command)`` returns (output, exit status); state persists."""

    def __init__(self, box: Any, name: str, pty: bool, argv: tuple[str, ...] = ("/bin/sh",),
                 detached: bool = False) -> None:
        """``detached``: the shell outlives this process (``Sandbox.spawn``'s ``detached``), so that another
        host can ``adopt`` it: its far ends must then be kept meanwhile (``ends``), or it reads the end of its
        input when this process ends."""
        # The framing's constant parts come in the environment, taken into read-only variables below (a line
        # that long is more than busybox ash's line editor takes at a terminal).
        env = {"PS1": "", "PS2": "", "TERM": "dumb", _RESET_VAR + "0": _RESET.format(traps=_SIGNALS),
               _TRAILER_VAR + "0": _TRAILER}
        ours, theirs = PeerChannel.pair()
        try:
            # Its stderr is its stdout (a terminal's are one anyway): no command needs a 2>&1 of its own.
            process = box.spawn(list(argv), env=env, pty=pty, fd3=theirs.fileno(), stderr_to_stdout=True,
                                detached=detached)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # the shell holds its own copy now
        self._attach(name, pty, process, ours)
        if pty:
            attrs = termios.tcgetattr(self._process.master_fd)
            # No echo of what the host types, and no byte of it special: with ISIG a ^C inside a quoted string
            # of a command was a SIGINT, and the shell parsed the rest of the line as code, outside the quotes
            # and the framing; IXON's ^S stopped the terminal's output for good; ICRNL made a CR a newline.
            attrs[0] &= ~(termios.ICRNL | termios.INLCR | termios.IGNCR | termios.IXON | termios.IXOFF
                          | termios.ISTRIP | termios.BRKINT)
            attrs[3] &= ~(termios.ECHO | termios.ICANON | termios.ISIG | termios.IEXTEN)
            attrs[1] &= ~termios.ONLCR
            self._raw = attrs
            self._set_raw()
        # The trap names besides signals that this shell has (asked before any command of the caller ran).
        probe, _ = self.run("\\trap - ERR 2>/dev/null && \\echo ERR; \\echo \"${BASH_VERSION:+DEBUG RETURN}\"",
                            timeout=30)
        extra = "".join(f" {name}" for name in probe.split() if name in ("ERR", "DEBUG", "RETURN"))
        # Then the framing's constant parts go into read-only variables, no longer exported: each run sends a
        # few bytes, not the whole text (bash reads a pipe a byte at a time).
        _, status = self.run(f'\\readonly {_RESET_VAR}="${_RESET_VAR}0{extra}" {_TRAILER_VAR}="${_TRAILER_VAR}0"; '
                             f"\\unset {_RESET_VAR}0 {_TRAILER_VAR}0", timeout=30)
        if status != 0:
            raise IsolationError(f"shell {self.name!r}: its framing could not be set up (status {status})")
        self._reset = f'\\eval "${_RESET_VAR}"'
        self._trailer = f'\\eval "${_TRAILER_VAR}"'
        self._probe_names()

    def _attach(self, name: str, pty: bool, process: Any, channel: socket.socket, peer: int | None = None) -> None:
        """The host's side: ``process`` (stdin_fd, stdout_fd, poll, signal, kill, close) and the channel."""
        self.name = name
        self.pty = pty
        self._process = process
        channel.setblocking(False)
        self._channel = channel
        # Reports count from the shell's own pid only (the kernel's word, see PeerChannel): while a command
        # runs the shell keeps the channel as a saved copy (its descriptor 3 restored after), which bash's and
        # busybox ash's redirections can name and a subshell forked then keeps for good.
        self._reader = PeerChannel(channel)
        self._reader.peer = peer
        os.set_blocking(process.stdout_fd, False)  # the host's end: read what is there, or wait
        # Its input too (a terminal's is its output's descriptor): a shell that reads no more (stopped by a process
        # of the sandbox, or busy) leaves a pipe full, and a blocking write would wait past any run's deadline.
        os.set_blocking(process.stdin_fd, False)
        # poll, not select: a host with many shells holds descriptors past FD_SETSIZE.
        self._poll_input = select.poll()
        self._poll_input.register(process.stdin_fd, select.POLLOUT)
        self._poll_output = select.poll()
        self._poll_output.register(process.stdout_fd, select.POLLIN)
        self._poll_both = select.poll()
        self._poll_both.register(process.stdout_fd, select.POLLIN)
        self._poll_both.register(channel.fileno(), select.POLLIN)
        self._buffer = bytearray()
        self._reports = bytearray()
        self._unwritten = bytearray()  # the rest of what a terminal took part of (see _write)
        self._waiting: list[bytes] = []  # markers sent that no report has named yet, oldest first
        self._seq = 0
        self._unsynced = False
        #: Markers of an earlier host's may wait unread (an adopted shell): see _report.
        self._stale = 0
        self._reset = _RESET.format(traps=_SIGNALS)
        self._trailer = _TRAILER

    def _set_raw(self) -> None:
        """The terminal's modes as the host set them (a command may have changed them: ``stty isig``)."""
        termios.tcsetattr(self._process.master_fd, termios.TCSANOW, self._raw)

    def _probe_names(self) -> None:
        # Whether a redirection can name a descriptor past 9 (bash, busybox ash; dash's syntax takes one digit):
        # such a shell's commands can reach the saved copy of the channel (see trusted_results).
        names, _ = self.run("(: 10</dev/null <&10 && \\echo FD10) 2>/dev/null", timeout=30)
        # Whether no command can open the shell's input pipe again through /proc/PID/fd/0 (a line it wrote there
        # would run after it, at the shell's top level, channel open): root's pipe, closed to every other uid,
        # is closed to the sandbox (never root, no capability); a host that is not root runs the sandbox as its
        # own uid, the pipe's owner.
        reopenable = False
        if not self.pty:
            pipe = os.fstat(self._process.stdin_fd)
            reopenable = pipe.st_uid != 0 or bool(pipe.st_mode & 0o077)
        #: Whether no earlier command can forge a later run's status or output. False in a shell whose
        #: redirections name descriptors past 9 (bash, busybox ash: Fedora's and Alpine's ``/bin/sh``): a
        #: command's builtins, run in the shell's own process, can read the run's marker from the saved copy of
        #: the channel, report the run ended, and stay in the shell to answer the next runs themselves. True in
        #: dash (Debian's and Ubuntu's ``/bin/sh``), unless, without a terminal, a command can open the shell's
        #: input pipe again (``/proc/PID/fd/0``: the sandbox runs as the host's own uid, a host that is not root):
        #: a line it writes there runs after it, at the shell's top level, and answers the next run. A status a
        #: grader must trust comes from ``Sandbox.exec``.
        self.trusted_results = "FD10" not in names and (self.pty or not reopenable)

    def ends(self) -> tuple[list[int], int]:
        """The host's ends (its input's, its output's, the channel's) and the shell's pid here, for a host that
        keeps them past itself (a detached shell's), so that another host can ``adopt`` the shell."""
        return [self._process.stdin_fd, self._process.stdout_fd, self._channel.fileno()], self._reader.peer or 0

    @classmethod
    def adopt(cls, name: str, process: Any, channel: socket.socket, peer: int) -> Shell:
        """A shell an earlier host started (detached) and kept the ends of (``ends``): ``process`` holds its input's
        and output's (stdin_fd, stdout_fd, poll, signal, kill, close), ``channel`` the channel's, ``peer`` its pid
        here. Its framing lives in the shell already. What the last host's last run left (a command still
        running, its output, markers no framing read) is interrupted now and dropped by the first run."""
        shell = cls.__new__(cls)
        shell._attach(name, False, process, channel, peer or None)
        shell._reset = f'\\eval "${_RESET_VAR}"'
        shell._trailer = f'\\eval "${_TRAILER_VAR}"'
        # Its runs are numbered apart from the last host's, whose reports may still come.
        shell._seq = secrets.randbits(31)
        # The last host may have sent markers that no framing read yet (its run's, and one whose command line it
        # did not write before it ended): a framing of ours that reads one of those is followed by another.
        shell._stale = _STALE_MARKERS
        shell._unsynced = True
        # Not asked again (that would be a run before the caller's): what the last host learnt is not kept.
        shell.trusted_results = False
        shell.interrupt()
        return shell

    @property
    def alive(self) -> bool:
        try:
            return self._process.poll() is None
        except IsolationError:  # its monitor is gone: the host ended the sandbox
            return False

    def run(self, command: str, timeout: float | None = 60.0) -> tuple[str, int]:
        """Run one command line; returns its output (stdout and stderr, as printed) and exit status."""
        timeout = wait_seconds(timeout, "timeout")
        if self._unsynced:
            self._exchange(_FORGET, 10.0, fresh=True)  # what an interrupted run left goes with it
            self._unsynced = False
        try:
            return self._exchange(command, timeout)
        except BaseException:
            # Whatever ended the run between its marker and its report (a timeout, the caller's interrupt, an
            # error of the host's), its output and report may still come: the next run synchronises first.
            self._unsynced = True
            raise

    def _exchange(self, command: str, timeout: float | None, fresh: bool = False) -> tuple[str, int]:
        self._seq += 1
        seq = self._seq
        if self.pty:
            self._set_raw()  # before each run: an earlier command may have made a byte special again
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            if fresh or not self._waiting:
                # The run's marker waits on the socket before the command is sent: the framing reads it
                # without a round trip. After an interrupted run, a fresh one goes behind what may be left.
                # 64 bits in 11 characters (the shell's read takes it a byte at a time, a system call each): a
                # run gets one guess, and 2**64 runs of 50 us each take 29 million years.
                self._send_marker()
            written = self._write(self._lines(command, seq), deadline)
        except BlockingIOError:
            raise IsolationError(f"shell {self.name!r}: its channel is full (no one reads its markers)") from None
        except OSError:
            raise IsolationError(f"shell {self.name!r} has ended") from None
        if not written:
            self._timed_out()
            raise TimeoutError(f"shell {self.name!r}: {command[:60]!r} did not finish within {timeout} s (the shell "
                               "read no more of its input)")
        # The command's output may be a flood: it is kept in a bytearray (appending is not a copy),
        # only its tail is kept, and only what is new is searched for the marker (a search from
        # the start each time would make a flood cost the host quadratic time).
        start = 0
        at = -1
        reported: tuple[bytes, int] | None = None
        stdout = self._process.stdout_fd
        while True:
            # Until the report, the channel and the output; after it, the output alone, where the marker
            # is printed right after the report (usually there already: read without a wait).
            if reported is None or at < 0:
                try:
                    chunk = os.read(stdout, 65536)
                except BlockingIOError:
                    chunk = None
                except OSError:
                    chunk = b""
                if chunk is not None:
                    if not chunk:
                        raise IsolationError(f"shell {self.name!r} ended")
                    self._buffer += chunk
                    excess = len(self._buffer) - OUTPUT_LIMIT
                    if excess > 0:
                        del self._buffer[:excess]
                        start = max(0, start - excess)
            if reported is None:
                reported = self._report(seq, deadline)
            if reported is not None:
                marker = reported[0]
                at = self._buffer.find(marker, start)
                if at >= 0:
                    break
                start = max(0, len(self._buffer) - len(marker))
            millis: int | None = None
            if deadline is not None:
                wait = deadline - time.monotonic()
                if wait <= 0:
                    self._timed_out()
                    raise TimeoutError(f"shell {self.name!r}: {command[:60]!r} did not finish within {timeout} "
                                       "s (it was interrupted)")
                millis = poll_millis(wait)
            (self._poll_output if reported is not None else self._poll_both).poll(millis)
        assert reported is not None
        output = bytes(self._buffer[:at]).removesuffix(b"\n")  # the marker's own line break
        del self._buffer[:at + len(reported[0]) + 1]
        return output.decode(errors="replace"), reported[1]

    def _lines(self, command: str, seq: int) -> list[bytes]:
        """What runs ``command`` as run ``seq``, in pieces of whole lines of at most ``PIPE_BUF`` bytes (see _write).
        A longer command goes in chunks, each line an assignment that appends one to a variable of this run's (its
        name random: no earlier command made it read-only; a variable per group of chunks, as each append copies
        the variable), then lines that evaluate the variables joined and unset them: the chunks of a command whose
        last piece never went are never run."""
        tail = f'\n\\set -- "$1" {seq}; {self._trailer}\n'
        whole = (_PREFIX.format(command=_quoted(command), reset=self._reset) + tail).encode()
        if len(whole) <= select.PIPE_BUF:
            return [whole]
        pieces: list[bytes] = []
        data, at = command.encode(), 0
        while at < len(data):
            piece = data[at:at + _ROOM]  # what fits in a line once quoted (a quote takes four bytes)
            while (over := len(piece) + 3 * piece.count(b"'") - _ROOM) > 0:
                piece = piece[:len(piece) - (over + 3) // 4]
            at += len(piece)
            pieces.append(piece.replace(b"'", b"'\\''"))
        per = -(-len(pieces) // _GROUPS)
        stem = f"__isolate_{secrets.token_hex(6)}_"
        names = [f"{stem}{group}" for group in range(-(-len(pieces) // per))]
        lines = [f"{names[i // per]}={'$' + names[i // per] if i % per else ''}'".encode() + piece + b"'\n"
                 for i, piece in enumerate(pieces)]
        joined = '"' + "".join("$" + name for name in names) + '"'
        return [*lines, (_PREFIX.format(command=joined, reset=self._reset) + f"\n\\unset {' '.join(names)}; "
                         + tail[1:]).encode()]

    def _write(self, lines: list[bytes], deadline: float | None) -> bool:
        """Write ``lines`` to the shell's input, each with one write(2), after the rest of one an earlier run began;
        False when the deadline came first (the lines not begun are dropped). Each is whole lines of at most
        ``PIPE_BUF`` bytes: a pipe takes such a write all or nothing, so the shell never holds part of a line, even
        when this host is killed mid-run (the next host adopts the shell, see ``adopt``). A terminal may take a
        part (this host's alone): its rest goes first later, as the shell reads whole lines."""
        fd = self._process.stdin_fd
        index = 0
        while self._unwritten or index < len(lines):
            data = self._unwritten or lines[index]
            try:
                count = os.write(fd, data)
            except BlockingIOError:
                count = 0
            except OSError:
                raise IsolationError(f"shell {self.name!r} has ended") from None
            if count:
                if self._unwritten:
                    del self._unwritten[:count]
                else:
                    self._unwritten = bytearray(data[count:])
                    index += 1
                continue
            millis: int | None = None
            if deadline is not None:
                wait = deadline - time.monotonic()
                if wait <= 0:
                    return False
                millis = poll_millis(wait)
            self._poll_input.poll(millis)
        return True

    def _timed_out(self) -> None:
        """A run's deadline came: what the shell runs is interrupted, the next run synchronises first."""
        self.interrupt()
        self._unsynced = True
        self._buffer = bytearray()

    def _send_marker(self) -> None:
        marker = secrets.token_urlsafe(8).encode()
        if self._channel.send(marker + b"\n") != len(marker) + 1:
            raise IsolationError(f"shell {self.name!r}: its channel is full (no one reads its markers)")
        self._waiting.append(marker)

    def _report(self, seq: int, deadline: float | None = None) -> tuple[bytes, int] | None:
        """Read the shell's reports on the channel: (marker, status) once this run's has come, else None.

        A report names the marker its framing read and the run it belongs to; the markers sent before
        that one were read by earlier framings (the socket keeps the order), so they are forgotten. A
        report of an earlier, interrupted run forgets its marker and ends nothing."""
        data = self._reader.read(4096)
        if data is None:
            return None  # nothing, or bytes of another process than the shell's (dropped)
        if not data:
            raise IsolationError(f"shell {self.name!r} ended")
        self._reports += data
        found = None
        while b"\n" in self._reports:
            line, _, rest = bytes(self._reports).partition(b"\n")
            self._reports = bytearray(rest)
            words = line.split()
            if len(words) == 3 and self._stale and words[1] == str(seq).encode() and words[0] not in self._waiting:
                # This run's framing read a marker an earlier host sent (an adopted shell's): ours waits behind
                # it, for one more framing.
                self._stale -= 1
                self._write([f'\\set -- 0 {seq}; {self._trailer}\n'.encode()], deadline)  # late: the run times out
                continue
            if len(words) != 3 or words[0] not in self._waiting:
                continue  # only the shell writes here: nothing else can name a marker
            self._stale = 0  # a marker of ours read: none of an earlier host's is left before it
            del self._waiting[:self._waiting.index(words[0]) + 1]
            if words[1] == str(seq).encode() and found is None:
                try:
                    found = (words[0], int(words[2]))
                except ValueError:
                    found = (words[0], -1)
        if len(self._reports) > 4096:  # only the shell writes here; a line this long is not one of its
            raise IsolationError(f"shell {self.name!r}: its status channel carried garbage")
        if found is None and not self._waiting:
            # An earlier run's framing read the last marker sent, ours (that run was interrupted, or its command
            # read its own marker first, or its host gave up on it): this run's framing waits for one more.
            self._send_marker()
        return found

    def interrupt(self) -> None:
        """SIGINT to what the shell is running (not the shell itself)."""
        self._process.signal(signal.SIGINT, descendants=True)

    def release(self) -> None:
        """Let go of a detached shell without ending it (another host adopts it: its ends must be kept)."""
        self._process.release()
        self._channel.close()

    def close(self) -> None:
        self._process.kill()
        self._process.close()
        self._channel.close()
