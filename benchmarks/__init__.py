"""The isolate benchmark harness: ``python -m benchmarks [--quick]``.

It measures, on this machine and with what is installed here (it installs
nothing; ``benchmarks/setup-peers.sh`` installs the peers):

* spawn latency of ``/bin/true`` for isolate's entry points and for peer
  sandboxes (bubblewrap, unshare, firejail, nsjail, Docker), interleaved
  round-robin, from a small parent and from a parent holding 1 GiB;
* the cost of the seccomp filters on system calls inside the sandbox, and the
  slowdown of short real workloads;
* sandboxes started per second, and the memory a live sandbox costs the host.

Results go to ``benchmarks/results/latest.{md,json}`` and ``spawn.png``
(``--quick``: ``results/quick.{md,json}``, figures never asserted).
"""

from __future__ import annotations
