"""Signals during ``isolate-run``'s start-up: recorded, then looked at before the run starts.

A caller stops a run by a signal (``timeout``, a supervisor's SIGTERM, Ctrl-C).
One that comes before the program runs must end the run with nothing started
(no sandbox, no cgroup): the status 128+N, as the program's death of it would
give. Python's own dispositions did neither: SIGTERM killed the interpreter
wherever it was (a run's cgroup made by the planning was left behind), SIGINT
raised a KeyboardInterrupt's traceback out of an import.

So the signals are recorded from the first line (the native binary's boot
script records them before it imports isolate, and blocks them across its
execs: csrc/cli.c), and the start looks at the record at its checkpoints: before
it hands the plan back to the native binary, and before the sandbox starts.
Once the program runs, isolate.cli.main forwards them to it.

A signal ignored when isolate-run started is left alone throughout: not
recorded, not forwarded, and the program starts with it ignored (exec keeps
SIG_IGN; ``nohup isolate-run ...`` and a non-interactive shell's background
job rely on it).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterable
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

#: The signals received since record(), in their order.
received: list[int] = []


def _record(number: int, _frame: Any) -> None:
    received.append(number)


def record(early: Iterable[int] = ()) -> None:
    """Record the stopping signals from now on (``early``: those the boot script recorded before), and let
    those the native binary held back come."""
    for number in SIGNALS:
        if signal.getsignal(number) != signal.SIG_IGN:
            signal.signal(number, _record)
    received[0:0] = list(early)  # after the handlers: one that came meanwhile went to early
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def hold() -> None:
    """Block the signals across an exec of the native binary (it unblocks them once it catches them)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)


def release() -> int | None:
    """Python's own dispositions back (a subcommand, the Docker backend: they stop as they always did); the
    status of a signal that came meanwhile (see stopped), or None."""
    for number in SIGNALS:
        if signal.getsignal(number) != signal.SIG_IGN:
            signal.signal(number, signal.default_int_handler if number == signal.SIGINT else signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
    return stopped()


def stopped() -> int | None:
    """The exit status when a signal came before the program started (128+N of the first), after one line on
    stderr; None when none came."""
    if not received:
        return None
    number = received[0]
    print(f"isolate-run: {signal.Signals(number).name} before the program started: nothing was run",
          file=sys.stderr)
    return 128 + number
