"""The policy model: pure data, and nothing that runs a thing.

``Policy`` (with ``Limits``, ``Mount``, ``Egress``), the units it is written
in, the egress allow-list's grammar, a kept sandbox's ``Workspace``, the
``Report`` of a run, and the exception tree rooted at ``IsolationError``.
Building or checking a policy reads at most the files it names (a profile,
a seccomp profile); it never loads the C core or starts a process.

May import: the standard library only (and its own modules). Everything
else in isolate may import it.
"""
