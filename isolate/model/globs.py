"""Globs over relative paths, matched a name at a time (``Sandbox.glob``, the server's file search, a
``.dockerignore``).

``*`` and ``?`` stay within a name; a ``**`` name spans directories (any
number of them, none included; at the end, one or more names); ``**``
within a name is a ``*``. Matched as one regular expression, each ``*`` was
``[^/]*`` and each ``**/`` ``(?:.*/)?``, and both backtracked: ``*a*a*a*a*a*a*b``
over a name of 120 a's for minutes (a server's request thread), a run of
``**/`` over a path 30 directories deep for ever (a build's context may be a
directory a sandbox wrote). Here each name of the pattern is fnmatch's
expression, which never crosses a ``/`` and does not backtrack through its
stars, and the path's names are read once, left to right, with the set of
pattern names reached so far: at most (pattern names) steps per name.
"""

from __future__ import annotations

import fnmatch
import re


class PathGlob:
    """``below``: a path below one the pattern matches matches too (a ``.dockerignore`` leaves it out with it)."""

    def __init__(self, pattern: str, *, below: bool = False) -> None:
        parts = pattern.split("/")
        # "**/**" is "**": a run of them is one.
        self.parts = [p for i, p in enumerate(parts) if not (p == "**" and i > 0 and parts[i - 1] == "**")]
        self.names = [None if p == "**" else re.compile(fnmatch.translate(p.replace("**", "*"))) for p in self.parts]
        self.below = below

    def _closure(self, reached: set[int]) -> set[int]:
        """With each ``**`` that is not the last name also matched by no name at all."""
        out = set(reached)
        for i in sorted(reached):
            while i < len(self.parts) - 1 and self.names[i] is None:
                i += 1
                out.add(i)
        return out

    def match(self, rel: str) -> bool:
        done = len(self.parts)
        reached = self._closure({0})
        for name in rel.split("/"):
            if self.below and done in reached:
                return True
            following: set[int] = set()
            for i in reached:
                if i == done:
                    continue  # the pattern ended before the path
                pattern = self.names[i]
                if pattern is None:  # **: this name, and maybe more (the last one: at least this one)
                    following.update((i, i + 1) if i == done - 1 else (i,))
                elif pattern.match(name) is not None:
                    following.add(i + 1)
            reached = self._closure(following)
            if not reached:
                return False
        return done in reached
