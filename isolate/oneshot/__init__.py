"""One-shot runs: ``isolate.run``, ``isolate.Popen``, ``policy.preexec_fn``.

``runs`` chooses the backend for a policy and runs a command to its end;
``preexec`` applies a policy in a child that ``subprocess`` forked.

May import: the model, the kernel mechanisms and the backends. The command
line, the agent layer and the server import it.
"""
