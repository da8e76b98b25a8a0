"""An image build's RUN step in a kept sandbox: the image layer builds images but runs nothing, and calls
this through ``isolate.model.hooks.run_build_step`` (set by the package's public face).
"""

from __future__ import annotations

import os
from typing import IO, Any

from ..image import Image
from ..image.build import BuildError, Step
from ..model.policy import Mount, Policy
from .commit import commit_image
from .sandbox import Sandbox


def run_step(image: Image, step: Step, number: int, progress: IO[str] | None) -> Image:
    """An image build's RUN step: a kept sandbox of ``image`` with nothing of the host granted runs it, and
    its writes become the step's layer (isolate/image/build.py)."""
    fields: dict[str, Any] = {"image": image.reference, "backend": "native", "write": (), "env": dict(step.env)}
    if os.geteuid() != 0:
        # As the caller, not the image's User through its subordinate ids: the step's layer is read back, and
        # a subordinate id's files would be the caller's to read neither there nor in the store.
        fields["uid"] = os.geteuid()
    if step.network is not None:
        fields["network"] = step.network
    if step.mounts:
        fields["binds"] = tuple(Mount(m.host_dir(image.store), m.target, "ro" if m.readonly else "rw")
                                for m in step.mounts)
    box = Sandbox(Policy(**fields), image_upper="disk")
    # The step owns the image's files, as Docker's RUN is the image's root: a regular caller's store holds
    # their files anyway; a root caller's are shown as the program's through an idmapped mount.
    box._impl.image_as_owner = True  # type: ignore[attr-defined]
    with box:
        result = box.exec(list(step.args), cwd=image.config.working_dir or "/")
        if progress is not None:
            progress.write(result.stdout)
            progress.write(result.stderr)
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
            raise BuildError(f"step {number} ({step.what}): exit status {result.returncode}"
                             + (f": {' | '.join(tail)[:400]}" if tail else ""))
        return commit_image(box, None, history=step.what, config={})

