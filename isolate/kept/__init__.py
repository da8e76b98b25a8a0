"""The kept sandbox: ``isolate.Sandbox`` and what lives in one.

``sandbox`` (the sandbox: commands, files, diff and commit, pause, attach; create_many),
``pool`` (warm sandboxes, never handed out twice), ``hostfiles`` (upload, download
and commit: the host's side of files that cross),
``shell`` (persistent shells, framed out of band), ``interpreter`` with its
``_pydriver`` (a persistent Python, ``Sandbox.python()``), ``snapshots``
(``isolate.Snapshot``: snapshot, restore, fork, on overlay layers) and
``merge`` (``isolate.merge``: branches merged three-way into a new sandbox).

May import: the model, the kernel mechanisms and the backends. The command
line, the agent layer and the server import it.
"""
