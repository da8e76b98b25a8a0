"""mkdocs hooks (mkdocs.yml: hooks): the CLI reference, generated from isolate-run's own parsers.

docs/cli.md holds one marker line per command, ``<!-- cli: isolate-run -->``, ``<!-- cli: isolate-run
sandbox -->`` and ``<!-- cli: isolate-run serve -->``; each is replaced, at build time, by the command's
usage, description, every option with its metavar, choices and help, and its epilog, read from the
argparse parser the command itself uses. A missing marker or an unknown one fails the build. The
benchmark figure (benchmarks/results/spawn.png) is added to the site as img/spawn.png.
Subcommands' own -h/--help rows are left out (every command has one).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = re.compile(r"^<!-- cli: (?P<command>[a-z -]+?) -->$", re.M)
FIGURE = ("img/spawn.png", os.path.join(ROOT, "benchmarks", "results", "spawn.png"))


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Each documented command and its parser: the only place that names where the parsers live."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)  # this checkout's isolate, not another install's
    os.environ["COLUMNS"] = "100"  # argparse wraps usage lines to it: the same page on every terminal
    try:
        from isolate.cli.flags import build_parser
        from isolate.cli.sandbox import _parser as sandbox_parser
        from isolate.server import build_parser as serve_parser
    except ImportError as exc:
        raise PluginError(f"docs/hooks.py: cannot import isolate-run's parsers ({exc}); if the CLI's modules "
                          "moved, name them again in parsers()") from exc

    return {"isolate-run": build_parser(), "isolate-run sandbox": sandbox_parser(),
            "isolate-run serve": serve_parser()}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _invocation(action: argparse.Action) -> str:
    if not action.option_strings:
        name = action.metavar or action.dest
        return f"`{name} ...`" if action.nargs in (argparse.REMAINDER, "+", "*") else f"`{name}`"
    if action.nargs == 0:
        return ", ".join(f"`{option}`" for option in action.option_strings)
    metavar = action.metavar or (f"{{{','.join(map(str, action.choices))}}}" if action.choices
                                 else action.dest.upper())
    return ", ".join(f"`{option} {metavar}`" for option in action.option_strings)


def _meaning(action: argparse.Action) -> str:
    text = (action.help or "").strip()
    if isinstance(action, argparse._VersionAction):
        text = text or "print the version and exit"
    if action.choices and action.metavar and not isinstance(action.choices, dict):
        text += f" (one of: {', '.join(f'`{c}`' for c in action.choices)})"
    if action.nargs == argparse.ONE_OR_MORE:
        text += " (one or more)"
    elif isinstance(action, argparse._AppendAction):
        text += " (repeatable)" if "repeatable" not in text else ""
    return _cell(text) or "&nbsp;"


def _options(parser: argparse.ArgumentParser, top: bool) -> list[str]:
    lines: list[str] = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if a.help != argparse.SUPPRESS and not isinstance(a, argparse._SubParsersAction)
                   and (top or not isinstance(a, argparse._HelpAction))]
        if not actions:
            continue
        lines += ["", f"*{group.title}*", "", "| option | meaning |", "|---|---|"]
        lines += [f"| {_invocation(a)} | {_meaning(a)} |" for a in actions]
    return lines


def _usage(parser: argparse.ArgumentParser) -> list[str]:
    usage = parser.format_usage().strip().removeprefix("usage: ")
    return ["```text", usage, "```"]


def reference(command: str, parser: argparse.ArgumentParser) -> str:
    lines = _usage(parser)
    if parser.description:
        lines += ["", parser.description]
    lines += _options(parser, top=True)
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help for choice in action._choices_actions}
        for name, sub in action.choices.items():
            lines += ["", f"#### `{command} {name}`", "", _cell(helps.get(name) or ""), ""]
            lines += _usage(sub)
            lines += _options(sub, top=False)
    if parser.epilog:
        lines += ["", "```text", parser.epilog.rstrip(), "```"]
    return "\n".join(lines) + "\n"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if page.file.src_uri != "cli.md":
        return markdown
    known = parsers()
    found = [m.group("command") for m in MARKER.finditer(markdown)]
    if sorted(found) != sorted(known):
        raise PluginError(f"docs/cli.md: markers {found}; expected one each for {sorted(known)}")
    return MARKER.sub(lambda m: reference(m.group("command"), known[m.group("command")]), markdown)


def on_files(files: Files, config: Any) -> Files:
    uri, path = FIGURE
    if not os.path.isfile(path):
        raise PluginError(f"{path}: missing (python -m benchmarks writes it)")
    files.append(File.generated(config, uri, abs_src_path=path))
    return files
