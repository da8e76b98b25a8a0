"""Adapters that let agent frameworks use isolate (each needs its extra: isolate[mcp], ...)."""
