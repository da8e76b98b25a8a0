"""Images, natively: the ``images`` section of ``python -m benchmarks`` (alone: ``python -m benchmarks.images``).

With busybox-static ``scratch`` images built here (tests/imagekit.py's), in a
store of their own, and loaded into Docker and Podman where they answer (the
same images: ``docker load`` / ``podman load`` of the same archives):

- ``isolate-run --image IMG -- /bin/true`` against ``isolate-run -- /bin/true``
  (whole processes, interleaved, the binary's plans warm), ``docker run --rm``
  and ``podman run --rm`` of the same image;
- a kept sandbox from the image: create + first exec (the goal: at most
  15 ms), then its close, against one from the host's root;
- a pull from Debian's docker-registry on loopback (pushed with skopeo) of
  the Debian 12 + python3 image (tests/imagekit.py's, mmdebstrap; the busybox
  one in a quick run or where it cannot be built), into cold stores: its wall
  time and the pulling process's peak RSS (its children's too: it starts
  none unless a credential helper is named), against ``podman pull`` (a new
  ``--root`` each), ``docker pull`` and ``skopeo copy`` of the same image,
  where they answer (``--pull-only`` measures this alone; ``--pull-zstd``
  adds the same image with its layer recompressed with zstd, at level 3 and
  with a 128 MiB window as ``zstd --long=27`` makes it: the peak of each);
- disk added by N kept sandboxes of the image (their writes aside): the store
  and the state directory before and after;
- an eval-shaped run: 50 tasks over 10 images (each task starts a sandbox
  from its image, writes a file, runs a short test of it, closes), isolate
  natively against isolate's Docker backend: whole wall time and per task.
  (The eval images are busybox ones, so the test is a shell's, not Python's.)

Writes ``results/images.json`` when run alone (merged into what is there).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from ._stats import summary_ms

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVAL_IMAGES, EVAL_TASKS = 10, 50
#: A task of the eval-shaped run: write a file, then test what it holds.
TASK = ["sh", "-c", "echo 42 > /tmp/answer && test \"$(cat /tmp/answer)\" = 42"]


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


def engines(with_docker: bool) -> tuple[list[str], dict[str, str]]:
    """The container engines that answer (docker, podman), and why each other one is left out."""
    found, skipped = [], {}
    for tool in ("docker", "podman"):
        if tool == "docker" and not with_docker:
            skipped[tool] = "Docker left out (--no-docker)"
        elif not shutil.which(tool):
            skipped[tool] = f"no {tool} command (bash benchmarks/setup-peers.sh)"
        elif subprocess.run([tool, "info"], capture_output=True, timeout=60).returncode != 0:
            skipped[tool] = f"{tool} does not answer (tests/docker_env.sh starts dockerd)"
        else:
            found.append(tool)
    return found, skipped


def run_argv(tool: str, cwd: str) -> list[str] | None:
    """``TOOL run --rm`` as it works on this host (podman: its default runtime, else runc with explicit limits),
    up to the image; None when no way works."""
    base = ["run", "--rm", "--pull=never", "--network=none"]
    tries = [[tool, *base]]
    if tool == "podman" and shutil.which("runc"):
        tries.append([tool, "--runtime", str(shutil.which("runc")), *base, "--ulimit", "nofile=1024:1024",
                      "--ulimit", "nproc=4096:4096"])
    for argv in tries:
        if subprocess.run([*argv, engine_name(tool, "bench:1"), "/bin/true"], cwd=cwd, capture_output=True,
                          timeout=120).returncode == 0:
            return argv
    return None


def engine_name(tool: str, name: str) -> str:
    """The name an engine gave an image ``docker load`` / ``podman load`` loaded as ``name``."""
    return f"localhost/{name}" if tool == "podman" else name


def _make_images(tmp: str, tools: list[str]) -> list[str]:
    """bench:1 and the eval images, in isolate's store and in each engine; their references."""
    from isolate.image import Image, Store

    kit = _kit()
    store = Store(os.environ["ISOLATE_IMAGE_STORE"])
    base = kit.busybox_layer()
    refs = []
    for i, name in enumerate(["bench:1", *(f"bench-eval-{n}:1" for n in range(EVAL_IMAGES))]):
        layers = [base] if i == 0 else [base, kit.layer([{"name": f"task-{i}", "data": f"{i}\n".encode()}])]
        kit.oci_layout(os.path.join(tmp, f"oci-{i}"), layers, ref=name, Env=["PATH=/bin"])
        refs.append(Image.load(os.path.join(tmp, f"oci-{i}"), store=store).reference)
        archive = os.path.join(tmp, f"saved-{i}.tar")
        kit.docker_archive(archive, layers, tag=name, Env=["PATH=/bin"])
        for tool in tools:
            _load(tool, archive)
    return refs


def _load(tool: str, archive: str) -> None:
    """``TOOL load`` of the archive; tried again once (podman's storage lock can be held by another podman of
    this machine, which its load reports as exit 125), then failing with what the tool said."""
    for attempt in range(2):
        done = subprocess.run([tool, "load", "-q", "-i", archive], capture_output=True, text=True, timeout=300)
        if done.returncode == 0:
            return
        if attempt == 0:
            time.sleep(2.0)
    said = (done.stderr.strip() or done.stdout.strip()).splitlines()[-3:]
    raise RuntimeError(f"{tool} load {os.path.basename(archive)} failed ({done.returncode}): {' | '.join(said)}")


@contextlib.contextmanager
def image_store(store: str) -> Iterator[str]:
    """isolate's image store at ``store`` for this process while the block runs (ISOLATE_IMAGE_STORE)."""
    saved = os.environ.get("ISOLATE_IMAGE_STORE")
    os.environ["ISOLATE_IMAGE_STORE"] = store
    try:
        yield store
    finally:
        if saved is None:
            os.environ.pop("ISOLATE_IMAGE_STORE", None)
        else:
            os.environ["ISOLATE_IMAGE_STORE"] = saved


def measure(rounds: int, tmp: str, with_docker: bool = True,
            log: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    with image_store(os.path.join(tmp, "store")) as store:
        return _measure(rounds, tmp, store, with_docker, log)


def _measure(rounds: int, tmp: str, store: str, with_docker: bool, log: Callable[[str], None]) -> dict[str, Any]:
    import isolate

    tools, skipped = engines(with_docker)
    log(f"images: engines {', '.join(tools) or 'none'}" + "".join(f"; {k}: {v}" for k, v in skipped.items()))
    refs = _make_images(tmp, tools)
    image = refs[0]
    binary = os.path.join(os.path.dirname(sys.executable), "isolate-run")
    work = os.path.join(tmp, "work")
    os.mkdir(work, 0o755)
    os.chmod(tmp, 0o755)
    results: dict[str, Any] = {"image": image, "engines": tools, "skipped": skipped, "rounds": rounds}

    log(f"images: isolate-run, {rounds} interleaved rounds")
    variants = {"host root": [binary, "--", "/bin/true"], "image": [binary, "--image", image, "--", "/bin/true"]}
    for tool in list(tools):
        # Never a pull: the image is the one loaded here (podman names a loaded image localhost/NAME).
        argv = run_argv(tool, work)
        if argv is None:
            tools.remove(tool)
            skipped[tool] = f"`{tool} run` fails on this host with every runtime tried"
            continue
        if tool == "podman" and "--runtime" in argv:
            results["podman_runtime"] = ("runc, with explicit nofile/nproc limits: crun refuses this host's hybrid "
                                         "cgroups, and both runtimes fail raising the limits podman asks by default")
        variants[f"{tool} run --rm"] = [*argv, engine_name(tool, "bench:1"), "/bin/true"]
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for argv in variants.values():
        _timed(argv, work)  # warm: plans cached, images present
    for _ in range(rounds):
        order = list(variants.items())
        random.shuffle(order)
        for key, argv in order:
            samples[key].append(_timed(argv, work))
    cli: dict[str, Any] = {k: summary_ms(v) for k, v in samples.items()}
    cli["image_over_host"] = round(cli["image"]["median_ms"] / cli["host root"]["median_ms"], 3)
    for tool in tools:
        cli[f"image_over_{tool}"] = round(cli["image"]["median_ms"] / cli[f"{tool} run --rm"]["median_ms"], 4)
    results["cli"] = cli

    log(f"images: kept sandboxes, {rounds} rounds")
    policies = {"host root": isolate.Policy(backend="native"), "image": isolate.Policy(image=image, backend="native")}
    first: dict[str, list[float]] = {"host root": [], "image": []}
    close: dict[str, list[float]] = {"host root": [], "image": []}
    for i in range(rounds + 2):
        for key, policy in policies.items():
            started = time.perf_counter()
            box = isolate.Sandbox(policy=policy).start()
            box.exec(["true"])
            ready = time.perf_counter()
            box.close()
            if i >= 2:
                first[key].append(ready - started)
                close[key].append(time.perf_counter() - ready)
    results["kept"] = {"create_first_exec": {k: summary_ms(v) for k, v in first.items()},
                       "close": {k: summary_ms(v) for k, v in close.items()}}
    results["kept"]["goal_15ms_met"] = results["kept"]["create_first_exec"]["image"]["median_ms"] <= 15.0

    from isolate.kernel.places import state_dir

    n = 100 if rounds >= 20 else 10
    log(f"images: disk of {n} kept sandboxes")
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

    results["pull"] = _pull(tmp, tools, log, debian=rounds >= 10)
    results["eval"] = _eval(refs[1:], tools, log)
    return results


def _eval(refs: list[str], tools: list[str], log: Callable[[str], None]) -> dict[str, Any]:
    """EVAL_TASKS tasks over the images, one after another: natively, then with isolate's Docker backend."""
    import isolate

    out: dict[str, Any] = {"tasks": EVAL_TASKS, "images": len(refs), "task": " ".join(TASK)}
    backends = ["native"] + (["docker"] if "docker" in tools else [])
    if "docker" not in tools:
        out["docker"] = {"skipped": "Docker does not answer, or was left out"}
    for backend in backends:
        log(f"images: eval-shaped run, {EVAL_TASKS} tasks over {len(refs)} images, backend {backend}")
        times = []
        started = time.perf_counter()
        for task in range(EVAL_TASKS):
            ref = refs[task % len(refs)]
            began = time.perf_counter()
            with isolate.Sandbox(policy=isolate.Policy(image=ref, backend=backend)) as box:
                result = box.exec(TASK)
                if result.returncode != 0:
                    raise RuntimeError(f"eval task {task} on {ref} ({backend}): exit {result.returncode}")
            times.append(time.perf_counter() - began)
        out[backend] = {"wall_s": round(time.perf_counter() - started, 3), "per_task": summary_ms(times)}
    if "docker" in backends:
        out["native_over_docker"] = round(out["native"]["wall_s"] / out["docker"]["wall_s"], 4)
    return out


PULL_ROUNDS = 3


def _pull_layout(tmp: str, debian: bool) -> tuple[str, str, str, str | None]:
    """The image the pulls measure: the Debian + python one (tests/imagekit.py's, built when missing and this
    caller can) when ``debian``, else a busybox one of its own (a layer no store or engine holds yet); its OCI
    layout, its ref there, a name for it, and why the Debian image is not the one (None when it is)."""
    kit = _kit()
    why = None if debian else "a quick run (fewer than 10 rounds): the busybox image"
    if debian:
        layout = kit.debian_layout(build=kit.debian_why() is None)
        if layout is not None:
            return layout, kit.DEBIAN_REF, "debian-python:12", None
        why = f"no Debian + python image: {kit.debian_why() or 'its cache is unsafe'}"
    with open("/bin/busybox", "rb") as handle:
        busybox = handle.read()
    layer = kit.layer([{"name": "bin", "type": "dir"}, {"name": "bin/busybox", "data": busybox, "mode": 0o755},
                       {"name": "pull-marker", "data": os.urandom(16).hex().encode()}])
    kit.oci_layout(os.path.join(tmp, "oci-pull"), [layer], ref="pull:1", Env=["PATH=/bin"])
    return os.path.join(tmp, "oci-pull"), "pull:1", "busybox:1", why


#: The zstd variants ``--pull-zstd`` adds: (name, level, window log or None for the level's own).
ZSTD_VARIANTS = (("zstd", 3, None), ("zstd-long", 3, 27))


def _zstd_layout(layout: str, ref: str, tmp: str, level: int, window_log: int | None) -> str:
    """A copy of the one-layer OCI layout ``layout`` whose layer is recompressed with zstd (streamed: never held
    whole), under the same ref; the config (its diff id) is the same."""
    import hashlib

    import zstandard

    with open(os.path.join(layout, "index.json")) as handle:
        index = json.load(handle)
    entry = next(m for m in index["manifests"] if m.get("annotations", {}).get("org.opencontainers.image.ref.name")
                 == ref)
    blobs = os.path.join(layout, "blobs", "sha256")
    with open(os.path.join(blobs, entry["digest"].split(":")[1])) as handle:
        manifest = json.load(handle)
    (layer,) = manifest["layers"]
    out = os.path.join(tmp, f"oci-zstd-{level}-{window_log}")
    os.makedirs(os.path.join(out, "blobs", "sha256"))
    params = zstandard.ZstdCompressionParameters.from_level(
        level, **({"window_log": window_log, "enable_ldm": True} if window_log else {}))
    packed = os.path.join(out, "layer")
    sha = hashlib.sha256()
    with open(os.path.join(blobs, layer["digest"].split(":")[1]), "rb") as raw, \
            gzip.GzipFile(fileobj=raw) as source, open(packed, "wb") as target:
        writer = zstandard.ZstdCompressor(compression_params=params).stream_writer(target, closefd=False)
        while chunk := source.read(1 << 20):
            writer.write(chunk)
        writer.flush(zstandard.FLUSH_FRAME)
    with open(packed, "rb") as handle:
        while chunk := handle.read(1 << 20):
            sha.update(chunk)
    digest = sha.hexdigest()
    os.rename(packed, os.path.join(out, "blobs", "sha256", digest))
    manifest["layers"] = [dict(layer, digest=f"sha256:{digest}", size=os.path.getsize(os.path.join(
        out, "blobs", "sha256", digest)), mediaType="application/vnd.oci.image.layer.v1.tar+zstd")]
    config = manifest["config"]["digest"].split(":")[1]
    shutil.copyfile(os.path.join(blobs, config), os.path.join(out, "blobs", "sha256", config))
    data = json.dumps(manifest).encode()
    manifest_digest = hashlib.sha256(data).hexdigest()
    with open(os.path.join(out, "blobs", "sha256", manifest_digest), "wb") as handle:
        handle.write(data)
    with open(os.path.join(out, "index.json"), "w") as handle:
        json.dump({"schemaVersion": 2, "manifests": [dict(entry, digest=f"sha256:{manifest_digest}", size=len(data))]},
                  handle)
    shutil.copyfile(os.path.join(layout, "oci-layout"), os.path.join(out, "oci-layout"))
    return out


def _peer_pull(argv: list[str]) -> float | str:
    started = time.perf_counter()
    ran = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if ran.returncode != 0:
        return f"failed: {(ran.stderr.strip().splitlines() or ['?'])[-1][:200]}"
    return time.perf_counter() - started


def _pull(tmp: str, tools: list[str], log: Callable[[str], None], debian: bool = True,
          rounds: int = PULL_ROUNDS, zstd: bool = False) -> dict[str, Any]:
    """Pulls from Debian's docker-registry on loopback, every one into a cold store: isolate's (a new store
    each, in a process of its own: its wall time, its peak RSS and its children's), ``podman pull`` (a new
    --root each), ``docker pull`` (the image removed after each) and ``skopeo copy`` to an OCI directory,
    interleaved, ``rounds`` rounds; medians. ``zstd``: the same image with its layer recompressed
    (ZSTD_VARIANTS) pulled by isolate and podman in the same rounds, under ``"zstd"`` and ``"zstd-long"``."""
    registry, skopeo = shutil.which("docker-registry"), shutil.which("skopeo")
    if not registry or not skopeo:
        return {"skipped": "docker-registry and skopeo are not installed"}
    kit = _kit()
    layout, ref, name, why = _pull_layout(tmp, debian)
    variants = {"": layout}
    if zstd:
        for variant, level, window_log in ZSTD_VARIANTS:
            variants[variant] = _zstd_layout(layout, ref, tmp, level, window_log)
    with kit.loopback_registry(tmp, registry) as address:
        remotes = {variant: f"{address}/bench/{name}{'-' + variant if variant else ''}" for variant in variants}
        for variant, path in variants.items():
            # As made: without --preserve-digests skopeo pushes a blob the registry holds of the same diff id in
            # place of the layer (its blob info cache knows the gzip one): the zstd variants were the gzip layer.
            kit.push(skopeo, f"{path}:{ref}", remotes[variant], tmp, ["--preserve-digests"], timeout=600)
        remote = remotes[""]
        log(f"images: pulls of {name} ({', '.join(v or 'as built' for v in variants)}) from the loopback registry, "
            f"{rounds} rounds")
        # The process's own peak is its VmHWM: its ru_maxrss starts at this harness's peak (kept across the fork
        # and exec), which a harness that recompressed a layer or ran sandboxes before holds (164 MiB here).
        code = ("import resource, sys, time; from isolate.image import Image, Store; t = time.perf_counter(); "
                "Image.pull(sys.argv[1], store=Store(sys.argv[2])); took = time.perf_counter() - t; "
                "peak = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:')); "
                "print(took, peak, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
        keys = ["isolate", "skopeo", *tools, *(f"{who}:{v}" for v in variants if v
                                               for who in ("isolate", *(["podman"] if "podman" in tools else [])))]
        samples: dict[str, list[float]] = {key: [] for key in keys}
        peaks: dict[str, list[tuple[int, int]]] = {key: [] for key in keys if key.startswith("isolate")}
        failed: dict[str, str] = {}
        for _ in range(rounds):
            # Short: podman refuses a --runroot past 50 characters.
            cold = tempfile.mkdtemp(prefix="isolate-pull-", dir="/tmp")
            order = list(keys)
            random.shuffle(order)
            for n, key in enumerate(order):
                who, _, variant = key.partition(":")
                if who == "isolate":
                    done = subprocess.run([sys.executable, "-c", code, remotes[variant],
                                           os.path.join(cold, f"isolate-{n}")], check=True, capture_output=True,
                                          text=True)
                    seconds, peak, children = done.stdout.split()
                    samples[key].append(float(seconds))
                    peaks[key].append((int(peak), int(children)))
                    continue
                if who == "skopeo":
                    argv = [skopeo, "copy", "--quiet", "--src-tls-verify=false", f"docker://{remote}",
                            f"oci:{cold}/skopeo:x"]
                elif who == "podman":  # a store of its own, nothing of the image in it
                    argv = ["podman", "--root", f"{cold}/podman{n}", "--runroot", f"{cold}/prun{n}", "pull", "-q",
                            "--tls-verify=false", remotes[variant]]
                else:
                    argv = [who, "pull", "-q", remote]
                took = _peer_pull(argv)
                if isinstance(took, str):
                    failed[key] = took
                else:
                    samples[key].append(took)
                if who == "docker":
                    subprocess.run(["docker", "rmi", remote], capture_output=True, timeout=60)
                if who == "podman":
                    subprocess.run(["podman", "--root", f"{cold}/podman{n}", "--runroot", f"{cold}/prun{n}",
                                    "system", "reset", "-f"], capture_output=True, timeout=120)
            shutil.rmtree(cold, ignore_errors=True)
        out: dict[str, Any] = {"image": name, "image_mb": round(_du(layout) / 1e6, 2), "rounds": rounds,
                               "isolate_s": round(statistics.median(samples["isolate"]), 3),
                               "isolate_peak_rss_mib": round(max(p for p, _ in peaks["isolate"]) / 1024, 1),
                               "isolate_children_peak_rss_mib": round(max(c for _, c in peaks["isolate"]) / 1024, 1)}
        if why:
            out["why_not_debian"] = why
        for key, values in samples.items():
            if key != "isolate" and ":" not in key and values:
                out[f"{key}_s"] = round(statistics.median(values), 3)
                out[f"isolate_over_{key}"] = round(out["isolate_s"] / out[f"{key}_s"], 3)
        for key, text in failed.items():
            out[f"{key}_failed"] = text
        if "podman_s" in out:
            out["goal_at_most_podman_met"] = out["isolate_s"] <= out["podman_s"]
        out["goal_peak_rss_100mb_met"] = max(p for p, _ in peaks["isolate"]) * 1024 <= 100e6
        for variant in (v for v in variants if v):
            one: dict[str, Any] = {"image_mb": round(_du(variants[variant]) / 1e6, 2),
                                   "isolate_s": round(statistics.median(samples[f"isolate:{variant}"]), 3),
                                   "isolate_peak_rss_mib": round(max(p for p, _ in peaks[f"isolate:{variant}"]) / 1024,
                                                                 1)}
            if samples.get(f"podman:{variant}"):
                one["podman_s"] = round(statistics.median(samples[f"podman:{variant}"]), 3)
                one["isolate_over_podman"] = round(one["isolate_s"] / one["podman_s"], 3)
            out[variant] = one
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.images")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--no-docker", action="store_true")
    parser.add_argument("--pull-only", action="store_true", help="measure the pulls alone (of the Debian image)")
    parser.add_argument("--pull-rounds", type=int, default=PULL_ROUNDS,
                        help="interleaved rounds of pulls (their medians; more where the host's load varies)")
    parser.add_argument("--pull-zstd", action="store_true",
                        help="with --pull-only: the image's layer recompressed with zstd too (level 3, and --long=27)")
    args = parser.parse_args(argv)
    log: Callable[[str], None] = lambda m: print(m, file=sys.stderr)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="isolate-bench-images-", dir="/var/tmp") as tmp:
        if args.pull_only:
            tools, _skipped = engines(not args.no_docker)
            results = {"pull": _pull(tmp, tools, log, rounds=args.pull_rounds, zstd=args.pull_zstd)}
        else:
            results = measure(args.rounds, tmp, not args.no_docker, log=log)
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, "images.json")
    try:  # merged into the figures there: a partial run keeps the others
        with open(path) as handle:
            merged = {**json.load(handle), **results}
    except (FileNotFoundError, ValueError):
        merged = results
    with open(path, "w") as handle:
        json.dump(merged, handle, indent=2)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
