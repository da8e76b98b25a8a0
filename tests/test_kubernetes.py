"""deploy/: the manifests against Kubernetes' schemas, and the image in containers that mirror the pod.

What is checked here, and what only a cluster can check, is in docs/kubernetes.md. The
schema checks run everywhere. The image checks build deploy/Dockerfile on the Debian 12
image that tests/container_image.sh imports (nothing is pulled; pip reads the wheels of
../shared/vm/build.sh, the network is off) and skip, saying why, without it.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "kubernetes"
PROFILE = K8S / "seccomp-isolate.json"
CRD_SCHEMA = Path(__file__).resolve().parent / "schemas" / "kuberay-raycluster-v1.json"
#: The oldest release with every field the manifests use (appArmorProfile: 1.30), and the newest bundled.
VERSIONS = ("1.30.0", "1.37.0")
EXTRA = "the schemas come with kubernetes-validate: pip install -e '.[deploy-test]'"


def manifests() -> list[tuple[str, dict[str, Any]]]:
    yaml = pytest.importorskip("yaml", reason=EXTRA)
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def pod_templates(cluster: dict[str, Any]) -> list[dict[str, Any]]:
    spec = cluster["spec"]
    return [spec["headGroupSpec"]["template"]] + [group["template"] for group in spec["workerGroupSpecs"]]


def raycluster() -> dict[str, Any]:
    [cluster] = [doc for _, doc in manifests() if doc["kind"] == "RayCluster"]
    return cluster


def k8s_validate(doc: dict[str, Any], version: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason=EXTRA)
    kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError naming the path


@pytest.mark.parametrize("version", VERSIONS)
def test_core_manifests_and_the_pod_templates_validate_strictly(version: str) -> None:
    core = [(name, doc) for name, doc in manifests() if "/" not in doc["apiVersion"] or doc["apiVersion"] == "apps/v1"]
    assert [doc["kind"] for _, doc in core] == ["DaemonSet"]
    for _, doc in core:
        k8s_validate(doc, version)
    # A RayCluster is a custom resource: its pod templates are core PodTemplateSpecs,
    # checked as the template of a PodTemplate (strict: an unknown or misspelt field fails).
    for n, template in enumerate(pod_templates(raycluster())):
        k8s_validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"t{n}"},
                      "template": template}, version)


def strict(schema: Any) -> Any:
    """The CRD schema with unknown fields refused (the API server prunes them; a typo should fail here)."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [strict(item) for item in schema]
    return schema


def test_raycluster_validates_against_kuberays_crd() -> None:
    jsonschema = pytest.importorskip("jsonschema", reason=EXTRA)
    schema = strict(json.loads(CRD_SCHEMA.read_text()))
    cluster = raycluster()
    jsonschema.validate(cluster, schema)
    broken = json.loads(json.dumps(cluster))
    broken["spec"]["workerGroupSpecs"][0]["replica"] = 2  # misspelt: the check is not vacuous
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_pods_hold_together_as_the_api_server_requires() -> None:
    """Rules of the API server's validation that no schema states, and the profile's name on the node."""
    # KubeRay wants rayVersion to be the Ray of the image: the Dockerfile's default base.
    base = next(line for line in (ROOT / "deploy" / "Dockerfile").read_text().splitlines()
                if line.startswith("ARG BASE="))
    assert base == f"ARG BASE=rayproject/ray:{raycluster()['spec']['rayVersion']}-py311"
    installer = next(doc for _, doc in manifests() if doc["kind"] == "DaemonSet")
    command = " ".join(installer["spec"]["template"]["spec"]["initContainers"][0]["command"])
    for template in pod_templates(raycluster()):
        spec = template["spec"]
        assert spec["hostUsers"] is False  # procMount Unmasked is refused without it
        seccomp = spec["securityContext"]["seccompProfile"]
        assert seccomp["type"] == "Localhost"
        assert f"/host/{seccomp['localhostProfile']}" in command  # what the installer writes
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context["procMount"] == "Unmasked" and context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"] and "add" not in context["capabilities"]
            assert "privileged" not in context


def test_seccomp_profile_is_the_runtime_default_plus_what_isolate_needs() -> None:
    profile = json.loads(PROFILE.read_text())
    # Plain OCI fields only: containerd and CRI-O read a Localhost profile as an OCI
    # LinuxSeccomp, and would ignore Docker's conditional "includes"/"excludes" (applying
    # every rule unconditionally).
    assert set(profile) == {"defaultAction", "defaultErrnoRet", "architectures", "syscalls"}
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
    for rule in profile["syscalls"]:
        assert set(rule) <= {"names", "action", "args"} and rule["action"] == "SCMP_ACT_ALLOW"
    allowed = {name for rule in profile["syscalls"] if not rule.get("args") for name in rule["names"]}
    needs = {"unshare", "clone", "clone3", "mount", "umount2", "pivot_root", "sethostname", "open_tree",
             "move_mount", "mount_setattr", "fsopen", "fsconfig", "fsmount", "landlock_create_ruleset",
             "landlock_add_rule", "landlock_restrict_self", "seccomp", "pidfd_open", "pidfd_getfd", "close_range"}
    assert needs <= allowed, needs - allowed
    # Still refused, as by the runtime's default: the kernel's wider doors.
    refused = {"bpf", "perf_event_open", "kexec_load", "init_module", "finit_module", "delete_module",
               "keyctl", "add_key", "request_key", "userfaultfd", "io_uring_setup", "open_by_handle_at",
               "reboot", "swapon", "acct", "syslog", "iopl", "ioperm", "settimeofday", "clock_settime"}
    assert not refused & allowed, refused & allowed


def test_advice_inside_a_pod_names_the_pods_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    from isolate.kernel import cgroup, hostinfo

    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    hostinfo.container.cache_clear()
    try:
        assert hostinfo.container() == "kubernetes"
        assert "hostUsers: false" in hostinfo.userns_advice(errno.EPERM)
        assert "procMount: Unmasked" in hostinfo.proc_mount_advice()
        assert "resources.limits" in cgroup.delegation_hint([])
    finally:
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
        hostinfo.container.cache_clear()
    assert "resources.limits" not in cgroup.delegation_hint([])


# -- the image ------------------------------------------------------------------------------

BASE = os.environ.get("ISOLATE_K8S_BASE", "isolate-test:debian12")
WHEELS = Path(os.environ.get("ISOLATE_VM_CACHE", "/var/cache/isolate-vm")) / "wheels"
IMAGE = "isolate-test:k8s"
#: A pod's environment always holds it: isolate's advice then names the pod's fields.
POD_ENV = ["-e", "KUBERNETES_SERVICE_HOST=10.96.0.1", "-e", "HOME=/tmp"]
#: A pod as deploy/kubernetes/raycluster.yaml makes it, in `docker run` flags: runAsUser,
#: allowPrivilegeEscalation false, capabilities drop ALL, procMount Unmasked, seccomp Localhost.
#: (hostUsers: false has no per-container Docker flag: it is not mirrored.)
POD = ["-u", "1000", "--security-opt", "no-new-privileges", "--cap-drop", "ALL"]
UNMASKED = ["--security-opt", "systempaths=unconfined"]
LOCALHOST = ["--security-opt", f"seccomp={PROFILE}"]


def _why_not() -> str | None:
    if not shutil.which("docker"):
        return "no docker client"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    if info.returncode != 0:
        if "permission denied" in info.stderr:
            return "this user may not use the Docker engine's socket"
        last = (info.stderr.strip().splitlines() or ["?"])[-1]
        return f"no Docker engine answers ({last}; bash tests/docker_env.sh starts one)"
    if subprocess.run(["docker", "image", "inspect", BASE], capture_output=True).returncode != 0:
        return f"no base image {BASE} (bash tests/container_image.sh imports it, after ../shared/vm/build.sh)"
    if not WHEELS.is_dir():
        return f"no wheels in {WHEELS} for an offline build (../shared/vm/build.sh makes them)"
    return None


needs_image = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """deploy/Dockerfile built from this tree's files. Docker's cache reuses the layers
    while the files' contents are the same and rebuilds from the copy on when one changes."""
    context = tmp_path_factory.mktemp("k8s-context")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (context / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, context / name)
    shutil.copytree(WHEELS, context / ".wheels")
    old = subprocess.run(["docker", "image", "inspect", "-f", "{{.Id}}", IMAGE], capture_output=True, text=True)
    build = subprocess.run(
        ["docker", "build", "--network", "none", "-q", "-t", IMAGE, "-f", str(context / "deploy" / "Dockerfile"),
         "--build-arg", f"BASE={BASE}", "--build-arg", "PIP_OPTIONS=--no-index --find-links /src/.wheels",
         str(context)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    if old.returncode == 0 and old.stdout.strip() != build.stdout.strip():
        # The image this build replaced under the tag: nothing else refers to it.
        subprocess.run(["docker", "image", "rm", old.stdout.strip()], capture_output=True)
    yield IMAGE


def in_pod(image: str, flags: list[str], script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", "run", "--rm", "--network", "none", *POD_ENV, *POD, *flags, image,
                           "sh", "-c", script], capture_output=True, text=True, timeout=120)


def doctor(image: str, flags: list[str]) -> dict[str, tuple[bool, str]]:
    result = in_pod(image, flags, "isolate-run doctor --json")
    assert result.returncode == 0, result.stderr
    return {c["mechanism"]: (c["available"], c["detail"]) for c in json.loads(result.stdout)["checks"]}


@needs_image
def test_doctor_in_the_recommended_pod(image: str) -> None:
    checks = doctor(image, LOCALHOST + UNMASKED)
    for mechanism in ("landlock", "user-namespaces", "sandbox", "egress", "seccomp"):
        assert checks[mechanism][0], (mechanism, checks[mechanism])
    assert "inside a kubernetes container" in checks["user-namespaces"][1]
    cgroups_ok, cgroups = checks["cgroups"]
    assert not cgroups_ok and "read-only" in cgroups and "resources.limits" in cgroups
    assert "sudo" not in cgroups and "systemd-run" not in cgroups  # no way out that a pod has not


@needs_image
def test_a_sandbox_in_the_recommended_pod(image: str) -> None:
    script = ("python3 -c 'import isolate\n"
              "with isolate.Sandbox() as sb:\n"
              "    r = sb.exec(\"id -u; ls /; touch /usr/x 2>/dev/null || echo ro\")\n"
              "    print(r.returncode, *r.stdout.split(), *r.report.enforced[\"namespaces\"])'")
    result = in_pod(image, LOCALHOST + UNMASKED, script)
    assert result.returncode == 0, result.stderr
    words = result.stdout.split()
    assert words[:2] == ["0", "1000"] and "ro" in words
    assert "workspace" in words and "root" not in words and "opt" not in words  # a built root, not the pod's
    assert {"user", "mnt", "pid", "net"} <= set(words)


@needs_image
def test_runtime_default_seccomp_leaves_the_no_namespace_mode(image: str) -> None:
    checks = doctor(image, UNMASKED)  # seccompProfile RuntimeDefault, everything else as recommended
    available, detail = checks["user-namespaces"]
    assert not available and "seccomp profile blocks user namespaces" in detail
    assert "seccomp-isolate.json" in detail and "hostUsers: false" in detail and "--security-opt" not in detail
    assert checks["landlock"][0] and checks["seccomp"][0] and not checks["sandbox"][0]
    lighter = in_pod(image, UNMASKED, "mkdir /tmp/w && cd /tmp/w && isolate-run --no-namespaces -- "
                     "sh -c 'touch mine && echo made; touch /usr/x 2>/dev/null || echo refused'")
    assert lighter.returncode == 0, lighter.stderr
    assert lighter.stdout.split() == ["made", "refused"]


@needs_image
def test_masked_proc_is_refused_naming_procmount(image: str) -> None:
    checks = doctor(image, LOCALHOST)  # procMount Default
    assert checks["user-namespaces"][0]
    available, detail = checks["sandbox"]
    assert not available and "mount-proc" in detail
    assert "procMount: Unmasked" in detail and "hostUsers: false" in detail


@needs_image
def test_root_without_setid_capabilities_is_told_so(image: str) -> None:
    result = subprocess.run(["docker", "run", "--rm", "--network", "none", *POD_ENV, "--cap-drop", "ALL", *LOCALHOST,
                             *UNMASKED, image, "isolate-run", "doctor", "--json"], capture_output=True, text=True,
                            timeout=120)
    checks = {c["mechanism"]: c for c in json.loads(result.stdout)["checks"]}
    detail = checks["user-namespaces"]["detail"]
    assert not checks["user-namespaces"]["available"]
    assert "root without CAP_SETUID and CAP_SETGID" in detail and "runAsUser" in detail
    assert "seccomp profile may also block" in detail
