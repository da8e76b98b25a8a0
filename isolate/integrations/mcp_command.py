"""The ``isolate-mcp`` command: where the ``mcp`` extra is missing, it says so in one line (no traceback)."""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from .mcp_server import main as serve
    except ImportError as exc:
        print(f"isolate-mcp: the MCP server needs the mcp package, which is missing ({exc}); install the extra: "
              "pip install '.[mcp]' from isolate's checkout", file=sys.stderr)
        return 125
    return serve()
