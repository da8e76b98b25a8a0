"""Images, natively: ``python -m benchmarks.images [--rounds N]`` (not yet a section of ``python -m benchmarks``).

With a busybox-static ``scratch`` image built here (tests/imagekit.py's) in a
store of its own:

- ``isolate-run --image IMG -- /bin/true`` against ``isolate-run -- /bin/true``
  (whole processes, interleaved, the binary's plans warm), and ``docker run
  --rm`` / ``podman run --rm`` of the same image where they are installed;
- a kept sandbox from the image, create + first exec + close, against one
  from the host's root;
- a pull from Debian's docker-registry on loopback (pushed with skopeo), its
  wall time and the pulling process's peak RSS, where both are installed;
- disk added by N kept sandboxes of the image (their writes aside): the store
  and the state directory before and after.

Writes ``results/images.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from ._stats import summary_ms

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _kit() -> Any:
    sys.path.insert(0, os.path.join(REPO, "tests"))
    import imagekit

    return imagekit


def _timed(argv: list[str], cwd: str) -> float:
    started = time.perf_counter()
    subprocess.run(argv, cwd=cwd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def _du(path: str) -> int:
    total = 0
    for root, dirs, files in os.walk(path):
        for name in files + dirs:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def measure(rounds: int, tmp: str) -> dict[str, Any]:
    import isolate
    from isolate.image import Image, Store

    kit = _kit()
    store = os.path.join(tmp, "store")
    os.environ["ISOLATE_IMAGE_STORE"] = store
    kit.oci_layout(os.path.join(tmp, "oci"), [kit.busybox_layer()], ref="bench:1", Env=["PATH=/bin"])
    image = Image.load(os.path.join(tmp, "oci"), store=Store(store))
    binary = os.path.join(os.path.dirname(sys.executable), "isolate-run")
    work = os.path.join(tmp, "work")
    os.mkdir(work, 0o755)
    os.chmod(tmp, 0o755)
    variants = {"host root": [binary, "--", "/bin/true"], "image": [binary, "--image", image.reference, "--",
                                                                    "/bin/true"]}
    for tool in ("docker", "podman"):
        if shutil.which(tool) and subprocess.run([tool, "info"], capture_output=True).returncode == 0:
            variants[f"{tool} run --rm"] = [tool, "run", "--rm", "busybox", "/bin/true"]
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for argv in variants.values():
        _timed(argv, work)  # warm: plans cached, images present
    for _ in range(rounds):
        order = list(variants.items())
        random.shuffle(order)
        for key, argv in order:
            samples[key].append(_timed(argv, work))
    results: dict[str, Any] = {"image": image.reference, "cli": {k: summary_ms(v) for k, v in samples.items()}}
    cli = results["cli"]
    results["cli"]["image_over_host"] = round(cli["image"]["median_ms"] / cli["host root"]["median_ms"], 3)

    kept: dict[str, list[float]] = {"host root": [], "image": []}
    policies = {"host root": isolate.Policy(backend="native"),
                "image": isolate.Policy(image=image.reference, backend="native")}
    for i in range(rounds + 2):
        for key, policy in policies.items():
            started = time.perf_counter()
            with isolate.Sandbox(policy=policy) as box:
                box.exec(["true"])
            if i >= 2:
                kept[key].append(time.perf_counter() - started)
    results["kept_create_exec_close"] = {k: summary_ms(v) for k, v in kept.items()}

    from isolate.kernel.places import state_dir

    n = 100 if rounds >= 20 else 10
    before = _du(store) + _du(state_dir())
    boxes = [isolate.Sandbox(policy=policies["image"]) for _ in range(n)]
    try:
        for box in boxes:
            box.start()
            box.exec(["true"])
        during = _du(store) + _du(state_dir())
    finally:
        for box in boxes:
            box.close()
    results["disk_per_sandbox_bytes"] = {"n": n, "added_each": (during - before) // n}
    results["pull"] = _pull(tmp)
    return results


def _pull(tmp: str) -> dict[str, Any]:
    registry, skopeo = shutil.which("docker-registry"), shutil.which("skopeo")
    if not registry or not skopeo:
        return {"skipped": "docker-registry and skopeo are not installed"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = os.path.join(tmp, "registry.yml")
    with open(config, "w") as handle:
        handle.write(f"version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: "
                     f"{tmp}/registry\nhttp:\n  addr: 127.0.0.1:{port}\n")
    server = subprocess.Popen([registry, "serve", config], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        subprocess.run([skopeo, "copy", "--quiet", "--dest-tls-verify=false", f"oci:{tmp}/oci:bench:1",
                        f"docker://127.0.0.1:{port}/bench/busybox:1"], check=True, capture_output=True,
                       env=dict(os.environ, HOME=tmp))
        code = ("import resource, sys, time; from isolate.image import Image, Store; t = time.perf_counter(); "
                f"Image.pull('127.0.0.1:{port}/bench/busybox:1', store=Store(sys.argv[1])); "
                "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
        done = subprocess.run([sys.executable, "-c", code, os.path.join(tmp, "pulled")], check=True,
                              capture_output=True, text=True)
        seconds, peak = done.stdout.split()
        return {"image_mb": round(_du(os.path.join(tmp, "oci")) / 1e6, 2), "seconds": round(float(seconds), 3),
                "peak_rss_mib": round(int(peak) / 1024, 1)}
    finally:
        server.kill()
        server.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.images")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="isolate-bench-images-", dir="/var/tmp") as tmp:
        results = measure(args.rounds, tmp)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "images.json"), "w") as handle:
        json.dump(results, handle, indent=2)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
