"""``python -m benchmarks.crashes [--kills N] [--sandbox-kills M] [--seed S] [--out FILE]``: kills at random steps.

The driver of tests/test_server_crashes.py (tests/crashkit.py), for longer: N SIGKILLs of
``isolate-run serve`` at random points (a fixed seed) of two clients'
creates, deletes, snapshots, creates from snapshots, shared named volumes and
warm-pool takes, each followed by a start on the same state directory and the
check that every sandbox listed is whole and nothing of any other is left
(``isolate-run sandbox prune`` runs every tenth start); then M SIGKILLs of a
kept sandbox's init or exec server under a running server, which must let
that sandbox go whole. Needs the test extras (pytest, psutil). Writes
benchmarks/results/crashes.json (or FILE): the kills done, the time taken,
the mean start time, and the first failure if one was found (exit status 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.crashes")
    parser.add_argument("--kills", type=int, default=1000)
    parser.add_argument("--sandbox-kills", type=int, default=100)
    parser.add_argument("--seed", type=int, default=38)
    parser.add_argument("--seconds", type=float, default=float("inf"),
                        help="stop each part after this long, with the kills done (said in the result)")
    parser.add_argument("--out", default=os.path.join(RESULTS, "crashes.json"))
    options = parser.parse_args()
    sys.path.insert(0, os.path.join(REPO, "tests"))
    import crashkit as crashes

    result: dict[str, object] = {"seed": options.seed, "kills_asked": options.kills, "host_load": os.getloadavg(),
                                 "sandbox_kills_asked": options.sandbox_kills, "cpus": os.cpu_count()}
    failure = None
    started = time.monotonic()
    try:
        with crashes.world() as w:
            result["server_kills_checked"] = 0
            try:
                result["server"] = crashes.run_kills(w, options.kills, options.seed,
                                                     deadline=started + options.seconds)
            finally:
                result["server_kills_checked"] = w.kills_done
        result["server_seconds"] = round(time.monotonic() - started, 1)
        started = time.monotonic()
        with crashes.world(warm=False) as w:
            try:
                result["sandbox"] = crashes.run_sandbox_kills(w, options.sandbox_kills, options.seed,
                                                              deadline=started + options.seconds)
            finally:
                result["sandbox_kills_checked"] = w.kills_done
        result["sandbox_seconds"] = round(time.monotonic() - started, 1)
    except Exception:  # a leftover found: said, with what was done until then
        failure = traceback.format_exc()[-4000:]
    result["failure"] = failure
    with open(options.out, "w") as handle:
        json.dump(result, handle, indent=2)
    print(json.dumps(result, indent=2))
    return 1 if failure else 0


if __name__ == "__main__":
    sys.exit(main())
