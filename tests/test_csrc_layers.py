"""The C files of csrc/ call each other in one direction only: no two files (nor a longer ring) call
back into each other.

A file that calls a function of another file that calls it back cannot be read, tested or moved on
its own (the native CLI's plan reader once called main's file for its trace). This test reads the
sources, not the objects: no compiler, a few milliseconds. The parser is deliberately small:

- comments, string and character literals and preprocessor lines are removed first (a call named in
  a comment, a string or a macro's body is no call);
- a function definition is a ``name(...) {`` at file scope (attributes after the parameters are
  skipped), ``static`` when that word starts its declaration;
- in a body (and in a ``= {...}`` initializer at file scope), every identifier that is not a member
  (after ``.`` or ``->``) and names a function counts: called or taken by address, as qsort's
  comparator or a signal handler. A name defined in the same file is that file's own; otherwise it
  is the one non-static definition of that name in another file.

What it does not see: a call hidden in a macro, or through a pointer stored under another name.
``python tests/test_csrc_layers.py [DIR]`` prints the graph's cycles of any directory of C files.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "csrc"

# Comments, then literals: one left-to-right scan, so "/*" inside a string is no comment and a quote
# inside a comment no string.
_LEXEMES = re.compile(
    r"""(?P<comment>/\*.*?\*/|//[^\n]*)|(?P<string>"(?:\\.|[^"\\\n])*")|(?P<char>'(?:\\.|[^'\\\n])*')""",
    re.S,
)
_DIRECTIVE = re.compile(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", re.M)
_TOKEN = re.compile(r"[A-Za-z_]\w*|\d[\w.]*|\S")
_KEYWORDS = frozenset(
    "if else while for do switch case default return break continue goto sizeof typeof __typeof__ "
    "_Alignof alignof _Static_assert __attribute__ __extension__ asm __asm__ static extern const "
    "volatile register inline __inline__ restrict __restrict struct union enum typedef void char short "
    "int long float double signed unsigned _Bool".split()
)

Edges = dict[str, dict[str, set[str]]]


def strip(source: str) -> str:
    """The source without comments, literals and preprocessor lines (a literal becomes an empty one)."""

    def blank(match: re.Match[str]) -> str:
        if match.lastgroup == "comment":
            return " " if match.group().startswith("/*") else ""
        return '""' if match.lastgroup == "string" else "' '"

    return _DIRECTIVE.sub("", _LEXEMES.sub(blank, source))


def _matching(tokens: list[str], close: int, opening: str, closing: str) -> int:
    """The index of the bracket that opens the one closing at ``close``."""
    depth = 0
    for i in range(close, -1, -1):
        if tokens[i] == closing:
            depth += 1
        elif tokens[i] == opening:
            depth -= 1
            if depth == 0:
                return i
    raise ValueError("unbalanced brackets")


def _function_name(tokens: list[str], brace: int) -> int | None:
    """Where the name of the function whose body opens at ``brace`` (at file scope) is, or None."""
    i = brace - 1
    while i >= 0 and tokens[i] == ")":
        opening = _matching(tokens, i, "(", ")")
        before = tokens[opening - 1] if opening > 0 else ""
        if before == "(" and opening > 1 and tokens[opening - 2] == "__attribute__":
            i = opening - 3  # int f(void) __attribute__((x)) {
            continue
        if before == "__attribute__":
            i = opening - 2
            continue
        return opening - 1 if before.isidentifier() and before not in _KEYWORDS else None
    return None


def _is_static(tokens: list[str], name_at: int) -> bool:
    i = name_at - 1
    while i >= 0 and tokens[i] not in (";", "}"):
        if tokens[i] == "static":
            return True
        i -= 1
    return False


def parse(source: str) -> tuple[dict[str, bool], list[tuple[str, list[str]]]]:
    """A file's definitions (name: static) and its bodies (owner, the names used in them)."""
    tokens = _TOKEN.findall(strip(source))
    definitions: dict[str, bool] = {}
    bodies: list[tuple[str, list[str]]] = []
    i = 0
    while i < len(tokens):
        if tokens[i] != "{":
            if tokens[i] == "}":
                raise ValueError("unbalanced braces")
            i += 1
            continue
        end = _closing(tokens, i, "{", "}")
        name_at = _function_name(tokens, i)
        if name_at is not None:
            definitions[tokens[name_at]] = _is_static(tokens, name_at)
            bodies.append((tokens[name_at], _used_names(tokens[i + 1 : end])))
        elif i > 0 and tokens[i - 1] == "=":
            bodies.append(("<file scope>", _used_names(tokens[i + 1 : end])))
        i = end + 1
    return definitions, bodies


def _closing(tokens: list[str], opening: int, open_: str, close: str) -> int:
    """The index of the bracket that closes the one opening at ``opening``."""
    depth = 0
    for i in range(opening, len(tokens)):
        if tokens[i] == open_:
            depth += 1
        elif tokens[i] == close:
            depth -= 1
            if depth == 0:
                return i
    raise ValueError("unbalanced brackets")


def prototypes(source: str) -> list[str]:
    """The functions a header declares at file scope (not function pointers, not struct members)."""
    tokens = _TOKEN.findall(strip(source))
    names: list[str] = []
    statement: list[str] = []
    depth = 0
    for token in tokens:
        depth += (token == "{") - (token == "}")
        if token == ";" and depth == 0:
            i = 0
            while "{" not in statement and i < len(statement):
                if statement[i] == "(" and i > 0 and statement[i - 1] == "__attribute__":
                    i = _closing(statement, i, "(", ")") + 1
                    continue
                if statement[i] == "(":
                    before = statement[i - 1] if i > 0 else ""
                    if before.isidentifier() and before not in _KEYWORDS:
                        names.append(before)
                    break
                i += 1
            statement = []
        else:
            statement.append(token)
    return names


def _used_names(body: list[str]) -> list[str]:
    names = []
    for k, token in enumerate(body):
        if not token.isidentifier() or token in _KEYWORDS:
            continue
        if k > 0 and (body[k - 1] == "." or (body[k - 1] == ">" and k > 1 and body[k - 2] == "-")):
            continue  # a member, not a function
        names.append(token)
    return names


def call_graph(sources: dict[str, str]) -> Edges:
    """file -> other file -> the functions of the other file it calls (or takes the address of)."""
    parsed = {name: parse(text) for name, text in sources.items()}
    exported: dict[str, list[str]] = {}
    for file, (definitions, _) in parsed.items():
        for function, static in definitions.items():
            if not static:
                exported.setdefault(function, []).append(file)
    edges: Edges = {}
    for file, (definitions, bodies) in parsed.items():
        for _, names in bodies:
            for name in names:
                owners = exported.get(name, [])
                if name in definitions or len(owners) != 1:
                    continue  # its own, not a function, or main (one per program)
                edges.setdefault(file, {}).setdefault(owners[0], set()).add(name)
    return edges


def cycles(edges: Edges) -> list[list[str]]:
    """One cycle through each strongly connected group of two or more files (Tarjan), as a list of
    files whose last calls the first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(edges.get(node, {})):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    nodes = sorted(set(edges) | {succ for targets in edges.values() for succ in targets})
    for node in nodes:
        if node not in index:
            visit(node)
    return [_ring(edges, group) for group in sorted(groups)]


def _ring(edges: Edges, group: list[str]) -> list[str]:
    """The shortest way from the group's first file back to itself, inside the group."""
    start = group[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for succ in sorted(edges.get(node, {})):
            if succ == start:
                return paths[node]
            if succ in group and succ not in paths:
                paths[succ] = paths[node] + [succ]
                queue.append(succ)
    raise AssertionError("a strongly connected group without a ring")


def describe(edges: Edges, ring: list[str]) -> str:
    """'a.c -> b.c (f, g) -> a.c (h)': each step with the functions it calls."""
    steps = [ring[0]]
    for here, there in zip(ring, ring[1:] + ring[:1], strict=True):
        steps.append(f"{there} ({', '.join(sorted(edges[here][there]))})")
    return " -> ".join(steps)


def read_sources(directory: Path, patterns: Iterable[str] = ("*.c", "*.h")) -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for pattern in patterns for p in sorted(directory.glob(pattern))}


# ------------------------------------------------------------------------------------------ tests


def test_no_c_file_calls_back_into_one_that_calls_it() -> None:
    edges = call_graph(read_sources(CSRC))
    # The parser sees the calls that matter: the CLI runs the core's spawn.
    assert "iso_spawn" in edges.get("cli.c", {}).get("spawn.c", set()), edges.get("cli.c")
    found = [describe(edges, ring) for ring in cycles(edges)]
    assert not found, "C files of csrc/ that call each other:\n  " + "\n  ".join(found)


def test_every_function_the_internal_headers_declare_is_defined_once() -> None:
    """The definition finder, checked against the prototypes of cli.h, steps.h and isolate.h: a parser
    that missed definitions would find no cycle either."""
    sources = read_sources(CSRC, ("*.c",))
    defined: dict[str, list[str]] = {}
    for file, text in sources.items():
        for function, static in parse(text)[0].items():
            if not static:
                defined.setdefault(function, []).append(file)
    for header in ("cli.h", "steps.h", "isolate.h"):
        declared = prototypes((CSRC / header).read_text(encoding="utf-8"))
        assert len(declared) > 5, (header, declared)
        for function in declared:
            assert len(defined.get(function, [])) == 1, (header, function, defined.get(function))


A_C = """\
#include "b.h" /* b_helper() in a comment is no call */
#define CALLS_B() b_helper()
static const char *text = "a_start(); b_helper()";
static int local(int x) { return x + 1; }
int a_start(void) __attribute__((unused));
int a_start(void)
{
    // b_helper();
    struct s v; v.b_member = 1; v.b_helper = 2; (&v)->b_helper = 3;
    char c = '"'; (void)c;
    return local(2);
}
"""
B_C = """\
static int local(int x) { return x; }  /* a static of the same name: no edge */
void b_helper(void) __attribute__((noreturn));
void __attribute__((noreturn)) b_helper(void) { for (;;) local(0); }
int b_main(void) { qsort(0, 0, 0, a_start); return 0; }
"""


def test_the_parser_ignores_comments_strings_macros_and_members() -> None:
    edges = call_graph({"a.c": A_C, "b.c": B_C})
    assert edges == {"b.c": {"a.c": {"a_start"}}}, edges
    assert cycles(edges) == []


def test_a_ring_of_files_is_found_and_named() -> None:
    sources = {"a.c": A_C.replace("return local(2);", "b_helper();"), "b.c": B_C, "c.c": "int c(void) { return 0; }"}
    edges = call_graph(sources)
    assert cycles(edges) == [["a.c", "b.c"]]
    assert describe(edges, ["a.c", "b.c"]) == "a.c -> b.c (b_helper) -> a.c (a_start)"
    three = {"x.c": "void x(void) { y(); }", "y.c": "void y(void) { z(); }", "z.c": "void z(void) { x(); }"}
    edges = call_graph(three)
    assert [describe(edges, ring) for ring in cycles(edges)] == ["x.c -> y.c (y) -> z.c (z) -> x.c (x)"]


if __name__ == "__main__":
    directory = Path(sys.argv[1]) if len(sys.argv) > 1 else CSRC
    graph = call_graph(read_sources(directory))
    rings = cycles(graph)
    for ring in rings:
        print(describe(graph, ring))
    sys.exit(1 if rings else 0)
