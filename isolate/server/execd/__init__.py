"""A sandbox's execution API (``/sandboxes/{id}/port/44772/...``): ping, commands, files, directories, sessions.

Each route reaches one sandbox: the request carries that sandbox's access
token (``X-EXECD-ACCESS-TOKEN``, handed out by the endpoints call) or the
server's API key. Every file operation goes through ``isolate.Sandbox``'s
file methods, so every path is resolved inside the sandbox, as the program."""

from __future__ import annotations

from .routes import routes

__all__ = ["routes"]
