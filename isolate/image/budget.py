"""The memory a process's layer unpacks hold at once, bounded by design (not by each layer's size or count).

A pull's layers download and unpack side by side; what each holds at once is
fixed (a few chunks read ahead, its decompressor's state: unpack.py), except
for two things, bounded here for the whole process, whatever the number of
pulls, loads and builds under way in it:

- ``SLOTS``: how many layers unpack at once (``PARALLEL``). A layer takes one
  slot before its blob is opened and gives it back once it is unpacked; a
  zstd layer whose window is past ``SMALL_WINDOW`` (its decoder holds the
  whole window: up to 128 MiB, where zstd's ``--long`` or ``--ultra`` put
  it) takes every slot, so it unpacks alone;
- ``CONTENTS``: the bytes of small files read from the archives and not yet
  written (those parsed ahead, and those given the writing threads): a budget
  each file's bytes are taken from before it is read, and given back once it
  is written. Each unpack keeps an ``Account`` of what it took, and gives back
  all it still holds when it ends, whatever ended it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: Layers unpacked at once in one process (a registry's downloads among them).
PARALLEL = 4
#: The largest zstd window a layer may decode beside others (8 MiB: the least RFC 8878 asks every decoder to
#: take, and what level 19 uses); a larger one (up to MAX_WINDOW) is decoded alone.
SMALL_WINDOW = 8 << 20
#: zstd's own default bound on a window (its ZSTD_WINDOWLOG_LIMIT_DEFAULT, 2**27): a frame past it is refused.
MAX_WINDOW = 128 << 20
#: Bytes of small files read ahead and not yet written, for every unpack of the process together.
CONTENTS_BYTES = 8 << 20


class Slots:
    """``count`` slots, taken one at a time or all at once (nobody waits while holding any: no deadlock)."""

    def __init__(self, count: int) -> None:
        self.count = self.free = count
        self._changed = threading.Condition()

    def take(self, n: int) -> None:
        with self._changed:
            while self.free < n:
                self._changed.wait()
            self.free -= n

    def give(self, n: int) -> None:
        with self._changed:
            self.free += n
            self._changed.notify_all()


class Slot:
    """One layer's hold on ``Slots``: one slot, or every slot once ``alone()`` was called."""

    def __init__(self, slots: Slots) -> None:
        self.slots, self.held = slots, 0

    def alone(self) -> None:
        """Hold every slot: the one held is given back first, then all are waited for."""
        if self.held == self.slots.count:
            return
        self.slots.give(self.held)
        self.held = 0
        self.slots.take(self.slots.count)
        self.held = self.slots.count


@contextmanager
def slot(slots: Slots | None = None) -> Iterator[Slot]:
    """A slot of ``slots`` (the process's) held while the block runs."""
    slots = slots or SLOTS
    held = Slot(slots)
    slots.take(1)
    held.held = 1
    try:
        yield held
    finally:
        slots.give(held.held)


class Budget:
    """``total`` bytes, taken and given back (a take past ``total`` takes ``total``: it waits for all)."""

    def __init__(self, total: int) -> None:
        self.total = self.free = total
        self.lock = threading.Condition()

    def account(self) -> Account:
        return Account(self)


class Account:
    """What one unpack took from a ``Budget`` (every method may be called from any thread)."""

    def __init__(self, budget: Budget) -> None:
        self.budget, self.held = budget, 0

    def take(self, n: int, stopping: threading.Event | None = None) -> int:
        """Take n bytes (at most the budget's total), waiting while they are not free; what was taken (0 when
        ``stopping`` was set while it waited)."""
        n = min(max(n, 0), self.budget.total)
        with self.budget.lock:
            while self.budget.free < n:
                if stopping is not None and stopping.is_set():
                    return 0
                self.budget.lock.wait(0.05 if stopping is not None else None)
            self.budget.free -= n
            self.held += n
        return n

    def give(self, n: int) -> None:
        with self.budget.lock:
            n = min(n, self.held)
            self.held -= n
            self.budget.free += n
            self.budget.lock.notify_all()

    def close(self) -> None:
        """Give back all this account still holds."""
        self.give(self.held)


SLOTS = Slots(PARALLEL)
CONTENTS = Budget(CONTENTS_BYTES)
