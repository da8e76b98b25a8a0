"""Adapters that let agent and evaluation frameworks use ``isolate.Sandbox`` without glue.

Each adapter lives in its own module and imports its framework only there, so
the core install does not need any of them (install the matching extra, e.g.
``isolate[inspect]``).
"""
