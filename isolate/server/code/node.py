"""The TypeScript and JavaScript contexts: one Node.js realm (``driver.js``; ``driver.py``'s protocol).

Top-level declarations stay from cell to cell, as in Node's REPL; a cell's
last expression is its result (a promise's, once it settles). TypeScript is
transpiled by the sandbox's own ``typescript`` module: types are removed, not
checked (as ``ts-node --transpile-only`` does), so only a syntax error stops a
cell before it runs; its top-level ``const`` and ``let`` become ``var``, so
that a cell run again may declare its names again (JavaScript keeps Node's
REPL rule: a name declared with them cannot be). The driver runs from ``node
-e``: no file is written.
"""

from __future__ import annotations

from importlib import resources

from ...kept.sandbox import Sandbox
from .driver import Driver

SOURCE = resources.files(__package__).joinpath("driver.js").read_text(encoding="utf-8")
HINTS = {
    "javascript": "it needs node (Node.js 16 or later) inside the sandbox (Debian: apt-get install nodejs)",
    "typescript": "it needs node (Node.js 16 or later) and the typescript module inside the sandbox "
                  "(Debian: apt-get install nodejs node-typescript; or npm install -g typescript)",
}


def start(box: Sandbox, language: str) -> Driver:
    # V8 sizes its heap to the host's memory, not the sandbox's (it sees no cgroup inside): under a memory
    # limit, half of it. A cell past it still ends the driver (V8's heap exhaustion is fatal), but with its
    # cause on stderr, and before the kernel's OOM killer picks a victim among the sandbox's processes.
    memory = box.policy.limits.value("memory")
    heap = [] if memory is None else [f"--max-old-space-size={max(16, int(memory) // 2 >> 20)}"]
    return Driver(box, ["node", *heap, "-e", SOURCE, "--", language], {}, language, HINTS[language])
