"""The package's layers: arrows run from the outer layers in, and no import goes in a circle.

Every import of every module is read (at the top of a file or inside a
function: a late import is still an arrow), and each module is placed in
its layer by its name. The layers, innermost first, are those the packages'
docstrings state; ``isolate/__init__.py`` is the public face and may import
any of them, while no module inside imports it back.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "isolate")

#: (module prefix, layer): the longest matching prefix places a module.
LAYERS = (
    ("isolate._version", 0), ("isolate._build", 0), ("isolate.model", 0),  # _build: the cffi build script
    ("isolate._native", 1), ("isolate._core", 1), ("isolate.kernel", 1), ("isolate.egress", 1), ("isolate.image", 1),
    ("isolate.backends", 2),
    ("isolate.oneshot", 3), ("isolate.kept", 3),
    ("isolate.cli.flags", 4),
    ("isolate.agents", 5), ("isolate.integrations", 5), ("isolate.ray", 5),
    ("isolate.server", 6),
    ("isolate.cli", 7),
)
#: Packages of one layer that stay apart (neither imports the other).
APART = ({"isolate.kernel", "isolate.egress"}, {"isolate.oneshot", "isolate.kept"},
         {"isolate.agents", "isolate.integrations", "isolate.ray"})


def _modules() -> dict[str, str]:
    out = {}
    for directory, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                module = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[module.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _imports(module: str, path: str) -> set[str]:
    """The isolate modules ``module`` imports (a name imported from a package counts as its submodule
    when it is one, else as the package)."""
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "isolate")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] != "isolate":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in MODULES or sub == "isolate._native" else base)
    found.discard(module)
    return found


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _late_calls_of_own_parts(module: str, path: str) -> set[str]:
    """The package's own submodules that a package's face (its ``__init__``) imports only inside functions (or
    for type checking alone): a class of the face calling out to its own parts when a method runs
    (``Image.push`` to ``image.push``, which names ``Image``). Such a call cannot meet a module half made, so
    it is no circle; every other import, late or not, is an arrow of the circle test as of the layers'."""
    if not path.endswith("__init__.py"):
        return set()
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    def type_only(node: ast.stmt) -> bool:
        return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"

    top = set()
    for node in tree.body:
        for inner in ast.walk(node):
            if isinstance(inner, ast.ImportFrom) and not isinstance(node, (ast.FunctionDef, ast.ClassDef)) \
                    and not type_only(node):
                top.update(f"{module}.{alias.name}" for alias in inner.names if inner.level == 1)
                if inner.level == 1 and inner.module:
                    top.add(f"{module}.{inner.module}")
    late = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or \
                (isinstance(node, ast.stmt) and type_only(node)):
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom) and inner.level == 1 and inner.module:
                    late.add(f"{module}.{inner.module}")
    return {target for target in late - top if target in MODULES}


#: The graph the circle test walks: GRAPH without a face's late calls of its own parts.
CIRCLE_GRAPH = {module: GRAPH[module] - _late_calls_of_own_parts(module, path) for module, path in MODULES.items()}


def _layer(module: str) -> tuple[str, int]:
    prefix, layer = max(((p, n) for p, n in LAYERS if module == p or module.startswith(p + ".")),
                        key=lambda item: len(item[0]), default=("", -1))
    return prefix, layer


def test_every_module_has_a_layer() -> None:
    assert [m for m in MODULES if m != "isolate" and _layer(m)[1] < 0] == []


def test_arrows_run_from_the_outer_layers_in() -> None:
    wrong = []
    for module, imported in GRAPH.items():
        if module == "isolate":
            continue
        home, layer = _layer(module)
        for target in imported:
            if target == "isolate":
                wrong.append(f"{module} imports the package's public face")
                continue
            there, target_layer = _layer(target)
            if target_layer > layer:
                wrong.append(f"{module} (layer {layer}) imports {target} (layer {target_layer})")
            elif any({home, there} == pair for pair in APART):
                wrong.append(f"{module} imports {target}: {home} and {there} stay apart")
    assert wrong == []


def _cycle() -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        stack.append(module)
        for target in sorted(CIRCLE_GRAPH.get(module, ())):
            if state.get(target) == 1:
                return [*stack[stack.index(target):], target]
            if target in CIRCLE_GRAPH and not state.get(target):
                found = visit(target)
                if found:
                    return found
        stack.pop()
        state[module] = 2
        return None

    for module in sorted(CIRCLE_GRAPH):
        if not state.get(module):
            found = visit(module)
            if found:
                return found
    return None


def test_no_import_goes_in_a_circle() -> None:
    cycle = _cycle()
    assert cycle is None, " -> ".join(cycle or [])


@pytest.mark.parametrize("package", sorted(m for m, p in MODULES.items() if p.endswith("__init__.py")))
def test_each_package_says_what_it_is(package: str) -> None:
    tree = ast.parse(open(MODULES[package], encoding="utf-8").read())
    assert ast.get_docstring(tree), f"{package} has no docstring"


def test_every_package_is_installed() -> None:
    # pyproject lists the packages setuptools installs: one left out is missing from every real install
    # (the editable install of a checkout would not show it).
    import tomllib

    with open(os.path.join(os.path.dirname(ROOT), "pyproject.toml"), "rb") as handle:
        listed = set(tomllib.load(handle)["tool"]["setuptools"]["packages"])
    packages = {m for m, p in MODULES.items() if p.endswith("__init__.py")}
    assert packages - listed == set()


#: Modules that run inside a sandbox, in its own python3, and import nothing of isolate: their own fork hooks.
_OWN_PROCESS = {"isolate.kept._pydriver"}


def test_one_mechanism_resets_state_in_a_forked_child() -> None:
    # model/forks.py frees every module-level lock and runs every reset in a forked child, in one order; a
    # module with a register_at_fork of its own (kernel/netns.py's) ran beside it, in an order of its own.
    own = []
    for module, path in MODULES.items():
        if module in _OWN_PROCESS or module == "isolate.model.forks":
            continue
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
            if isinstance(node, ast.Attribute) and node.attr == "register_at_fork":
                own.append(f"{module}:{node.lineno}")
    assert own == []
