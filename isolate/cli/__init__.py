"""The command line: ``isolate-run`` and its subcommands.

``flags`` (the parser and the policy the flags describe; runs nothing, so
the agent layer's ``wrap`` shares it), ``main`` (running a command, the
report, the exit status), ``plan`` (the plans the native ``isolate-run``
binary replays), ``sandbox`` (``isolate-run sandbox ...``), ``doctor``.
``python -m isolate.cli`` runs the Python CLI.

The outermost layer: it may import every other (``serve`` starts the
server); nothing imports it but ``flags``.
"""
