"""Where an inner layer calls out to an outer one: the outer one's entry, set by the package's public face.

``isolate/__init__.py`` sets each when the package is imported (before any of its modules can run), with a
function that imports its outer module only when called: the inner layer neither imports it nor loads it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: An image build's RUN step (isolate/image/build.py calls it): ``(image so far, step, its number, progress)``
#: -> the image with the step's layer. A step runs in a kept sandbox (isolate/kept/imagebuild.py).
run_build_step: Callable[..., Any] | None = None

#: ``isolate.merge`` of branches of which one is on a Ray cluster (isolate/kept/merge.py calls it), with
#: merge's own arguments: merged on one of the cluster's nodes (isolate/ray/merging.py).
merge_on_cluster: Callable[..., Any] | None = None

#: A code context of the server's kind driven on a Ray node (isolate/ray/host.py calls it for serve --ray):
#: ``(sandbox, language, context id)`` -> an isolate/server/code CodeContext.
code_context: Callable[..., Any] | None = None
