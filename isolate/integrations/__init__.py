"""Adapters that let agent and evaluation frameworks use isolate (each needs its extra: isolate[mcp], ...)."""
