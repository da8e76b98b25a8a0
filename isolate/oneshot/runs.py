"""One-shot runs: ``isolate.run``, and which backend runs a policy.

``run`` is ``subprocess.run`` in a sandbox: the native backend's ``Popen``
(isolate/backends/native/popen.py) where it can enforce the whole policy,
else the Docker backend where an engine can, else a refusal naming each
reason (``choose_backend``).
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

from ..backends import native
from ..backends.native.popen import Popen
from ..model.errors import UnsupportedError
from ..model.policy import Policy
from ..model.report import Report


class CompletedProcess(subprocess.CompletedProcess):  # type: ignore[type-arg]
    """subprocess.CompletedProcess plus ``report``."""

    def __init__(self, args: Any, returncode: int, stdout: Any = None, stderr: Any = None,
                 report: Report | None = None) -> None:
        super().__init__(args, returncode, stdout, stderr)
        self.report = report if report is not None else Report()


def run(
    args: Any,
    *,
    policy: Policy | None = None,
    input: Any = None,
    capture_output: bool = False,
    timeout: float | None = None,
    check: bool = False,
    **kwargs: Any,
) -> CompletedProcess:
    """``subprocess.run`` in a sandbox; the result carries ``report``.

    The backend is chosen by ``policy.backend``: ``native``, ``docker``, or
    ``auto`` (native when it can enforce the whole policy, else Docker when an
    engine answers, else ``UnsupportedError`` naming each reason).
    """
    policy = policy if policy is not None else Policy()
    backend = choose_backend(policy)
    if backend == "docker":
        from ..backends import docker

        result = docker.run(args, policy=policy, input=input, capture_output=capture_output, timeout=timeout,
                            check=False, **kwargs)
        completed = CompletedProcess(result.args, result.returncode, result.stdout, result.stderr,
                                     getattr(result, "report", None))
        if policy.backend == "auto":
            completed.report.warnings.append(auto_docker_note(policy))
    else:
        if input is not None:
            if kwargs.get("stdin") is not None:
                raise ValueError("stdin and input arguments may not both be used.")
            kwargs["stdin"] = subprocess.PIPE
        if capture_output:
            if kwargs.get("stdout") is not None or kwargs.get("stderr") is not None:
                raise ValueError("stdout and stderr arguments may not be used with capture_output.")
            kwargs["stdout"] = subprocess.PIPE
            kwargs["stderr"] = subprocess.PIPE
        with Popen(args, policy=policy, **kwargs) as process:
            try:
                stdout, stderr = process.communicate(input, timeout=timeout)
            except subprocess.TimeoutExpired as exc:
                process.kill()
                exc.stdout, exc.stderr = process.communicate()
                raise
            except BaseException:
                process.kill()
                raise
            retcode = process.poll()
            assert retcode is not None
        completed = CompletedProcess(process.args, retcode, stdout, stderr, process.report)
    if check and completed.returncode:
        raise subprocess.CalledProcessError(completed.returncode, completed.args, completed.stdout,
                                            completed.stderr)
    return completed


def auto_docker_note(policy: Policy) -> str:
    """What a run of backend "auto" says when Docker ran it: which backend, and why."""
    return "backend auto chose Docker: " + "; ".join(native.unsupported_reasons(policy))


def choose_backend(policy: Policy) -> str:
    """'native' or 'docker' for this policy on this host; raises UnsupportedError when neither will do."""
    if policy.backend == "native":
        return "native"
    if policy.backend == "docker":
        return "docker"
    reasons = native.unsupported_reasons(policy)
    if not reasons or (policy.best_effort and not native.image_refusal(policy)):
        return "native"
    try:
        from ..backends import docker
    except ImportError as exc:
        docker_reason = f"the Docker backend is not available ({exc})"
    else:
        usable, docker_reason = docker.available()
        if usable:
            refused = docker.unsupported_reasons(policy, docker.engine_info())
            if not refused:
                return "docker"
            docker_reason = "; ".join(f"{name}: {why}" for name, why in refused.items())
    from ..kernel import hostinfo

    if hostinfo.container() and not os.environ.get("DOCKER_HOST"):
        # Inside a container, "start dockerd" is no way out: say what is.
        raise UnsupportedError("the native backend cannot enforce this policy: " + "; ".join(reasons))
    raise UnsupportedError(
        "the native backend cannot enforce this policy: " + "; ".join(reasons)
        + f"; and Docker cannot take over: {docker_reason}"
    )


__all__ = ["CompletedProcess", "Popen", "choose_backend", "run"]
