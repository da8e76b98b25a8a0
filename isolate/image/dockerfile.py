"""Dockerfiles, built by isolate's builder (build.py): ``Image.from_dockerfile(path, context)``.

The file is split into instructions by ``dockerfile-parse`` (line continuations,
comments, the ``escape`` directive; ``pip install 'isolate[images]'``); each is
then read here. Taken: ``FROM`` (``AS`` stages, ``scratch``), ``RUN`` (shell
and exec form; ``--mount=type=cache``: build.CacheMount), ``COPY``
(``--from=STAGE|IMAGE``, ``--chown``, ``--chmod``: owners.py), ``ADD``
(local files, and local tar archives, extracted; ``--chown``, ``--chmod``), ``ENV``, ``ARG``, ``WORKDIR``, ``USER``,
``LABEL``, ``EXPOSE``, ``CMD``, ``ENTRYPOINT``, ``SHELL``. Any other
instruction, and any flag not named here, is refused before anything is
built, with its name and line. ``$VAR``, ``${VAR}``, ``${VAR:-word}`` and
``${VAR:+word}`` are expanded from ARG and ENV where Docker expands them (not
in RUN, CMD, ENTRYPOINT: their shell does; a RUN has the ARGs as its
environment).

Sources of COPY and ADD are the context's, read beneath it with
``.dockerignore`` honoured (context.py). ADD of a URL is refused (a build
reaches no network but its RUN steps' policy).
"""

from __future__ import annotations

import functools
import io
import json
import os
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import IO, Any

from ..model.errors import IsolationError
from ..model.files import read_input_file
from . import Image
from .build import Build, BuildError, CacheMount, DockerfileError, Stats, _existing
from .context import Chown, IgnorePattern, _archive_layer, _copy_layer, _is_archive, ignore_rules
from .export import LayerBlob, write_copy
from .owners import parse_chmod, parse_chown
from .store import Store

SUPPORTED = ("FROM", "RUN", "COPY", "ADD", "ENV", "ARG", "WORKDIR", "USER", "LABEL", "EXPOSE", "CMD", "ENTRYPOINT",
             "SHELL")
_VAR = re.compile(r"\\\$|\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?:(:[-+])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")
MAX_DOCKERFILE = 1 << 20


@dataclass(frozen=True)
class Instruction:
    name: str
    line: int  # 1-based
    value: str
    where: str

    def fail(self, why: str) -> DockerfileError:
        return DockerfileError(f"{self.where}:{self.line}: {self.name}: {why}")

    def json_form(self) -> list[str] | None:
        text = self.value.strip()
        if not text.startswith("["):
            return None
        try:
            parsed = json.loads(text)
        except ValueError:
            return None  # Docker takes it as the shell form then
        except RecursionError:
            raise self.fail("the JSON form is nested too deep") from None
        if not isinstance(parsed, list) or not all(isinstance(p, str) for p in parsed):
            raise self.fail("the JSON form must be a list of strings")
        return parsed


@dataclass
class Stage:
    name: str | None
    base: Instruction
    body: list[Instruction] = field(default_factory=list)


def parse(path: str) -> list[Instruction]:
    """The instructions of the Dockerfile at ``path`` (comments left out); unsupported ones refused."""
    try:
        from dockerfile_parse import DockerfileParser
    except ImportError:
        raise IsolationError("Dockerfiles need dockerfile-parse: pip install 'isolate[images]'") from None
    try:
        # The context may be a directory a sandbox wrote: a FIFO there never hangs the build, a device is not read.
        data = read_input_file(path, limit=MAX_DOCKERFILE)
    except OSError as exc:
        raise DockerfileError(f"{path}: {exc.strerror}") from None
    except ValueError:
        raise DockerfileError(f"{path}: past {MAX_DOCKERFILE} bytes: refused") from None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DockerfileError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    parser = DockerfileParser(fileobj=io.BytesIO(data))
    out = []
    where = os.path.basename(path)
    for item in parser.structure:
        name = str(item["instruction"]).upper()
        if name == "COMMENT":
            continue
        instruction = Instruction(name, int(item["startline"]) + 1, str(item["value"]), where)
        if name not in SUPPORTED:
            raise instruction.fail(f"not supported by isolate's builder (it builds {', '.join(SUPPORTED)})")
        out.append(instruction)
    if not out or out[0].name not in ("FROM", "ARG"):
        raise DockerfileError(f"{where}: the first instruction must be FROM (or ARG before it)")
    return out


def expand(text: str, values: Mapping[str, str]) -> str:
    """``$VAR``, ``${VAR}``, ``${VAR:-word}``, ``${VAR:+word}`` from values (unset: empty); ``\\$`` a dollar."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "\\$":
            return "$"
        name = match.group(1) or match.group(4)
        value = values.get(name, "")
        if match.group(2) == ":-":
            return value if value else match.group(3)
        if match.group(2) == ":+":
            return match.group(3) if value else ""
        return value

    return _VAR.sub(one, text)


def _pairs(instruction: Instruction, values: Mapping[str, str]) -> list[tuple[str, str]]:
    """KEY=VALUE words (ENV, LABEL, ARG), or the legacy ``ENV KEY VALUE``."""
    try:
        words = shlex.split(instruction.value, posix=True)
    except ValueError as exc:
        raise instruction.fail(str(exc)) from None
    if words and "=" not in words[0] and instruction.name == "ENV":
        key, _, rest = instruction.value.strip().partition(" ")
        return [(key, expand(rest.strip(), values))]
    out = []
    for word in words:
        key, sep, value = word.partition("=")
        if not key or (not sep and instruction.name != "ARG"):
            raise instruction.fail(f"{word!r} is not KEY=VALUE")
        out.append((key, expand(value, values) if sep else ""))
    return out


def _flags(instruction: Instruction, words: list[str], allowed: tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    flags: dict[str, str] = {}
    while words and words[0].startswith("--"):
        key, _, value = words.pop(0)[2:].partition("=")
        if key not in allowed:
            raise instruction.fail(f"the flag --{key} is not supported by isolate's builder")
        flags[key] = value
    return flags, words


_RUN_FLAG = re.compile(r"--(\S*)\s*")
_CACHE_KEYS = ("type", "target", "dst", "destination", "id", "sharing", "ro", "readonly")


def _run_flags(ins: Instruction, values: Mapping[str, str]) -> tuple[list[CacheMount], Instruction]:
    """RUN's flags, the words before its command: ``--mount=type=cache,...`` taken, any other refused (none is
    left for the shell to read as its command); the instruction without them."""
    text = ins.value.lstrip()
    caches = []
    while (match := _RUN_FLAG.match(text)) is not None:
        key, _, value = match.group(1).partition("=")
        if key != "mount":
            raise ins.fail(f"the flag --{key} is not supported by isolate's builder (it takes --mount=type=cache)")
        caches.append(_cache_mount(ins, expand(value, values)))
        text = text[match.end():]
    return caches, Instruction(ins.name, ins.line, text, ins.where)


def _cache_mount(ins: Instruction, spec: str) -> CacheMount:
    """``type=cache,target=DIR[,id=ID][,sharing=shared][,ro]``: other types and options refused."""
    fields: dict[str, str] = {}
    for part in spec.split(","):
        key, sep, value = part.strip().partition("=")
        key = key.lower()
        if key not in _CACHE_KEYS:
            raise ins.fail(f"--mount: the option {key!r} is not supported by isolate's builder (it takes type=cache, "
                           "target, id, sharing=shared, ro)")
        fields[key] = value if sep else "true"
    kind = fields.get("type", "bind")
    if kind != "cache":
        raise ins.fail(f"--mount=type={kind}: not supported by isolate's builder (it takes type=cache)")
    if fields.get("sharing", "shared") != "shared":
        raise ins.fail(f"--mount: sharing={fields['sharing']} is not supported by isolate's builder (only shared)")
    target = fields.get("target") or fields.get("dst") or fields.get("destination") or ""
    readonly = fields.get("ro", fields.get("readonly", "false")).lower()
    if readonly not in ("true", "false"):
        raise ins.fail(f"--mount: ro={readonly!r} is neither true nor false")
    try:
        return CacheMount(target, fields.get("id", ""), readonly == "true")
    except BuildError as exc:
        raise ins.fail(f"--mount: {exc}") from None


# -- building ---------------------------------------------------------------------------------


def from_dockerfile(path: str | os.PathLike[str], context: str | os.PathLike[str], *,
                    build_args: Mapping[str, str] | None = None, target: str | None = None,
                    reference: str | None = None, store: Store | None = None, progress: IO[str] | None = None,
                    stats: Stats | None = None, network: Any = None) -> Image:
    """Build the Dockerfile at ``path`` over ``context`` (its last stage, or ``target``); kept as ``reference``.
    ``network``: the network of every RUN (a Policy's: "none" by default, "host", or an ``isolate.Egress``)."""
    path, context = os.fspath(path), os.path.realpath(os.fspath(context))
    if not os.path.isdir(context):
        raise DockerfileError(f"{context}: the build context must be a directory")
    instructions = parse(path)
    store = store or Store()
    given = dict(build_args or {})
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for instruction in instructions:
        if instruction.name == "FROM":
            words = expand(instruction.value, global_args).split()
            _, words = _flags(instruction, words, ("platform",))
            if len(words) not in (1, 3) or (len(words) == 3 and words[1].upper() != "AS"):
                raise instruction.fail("expected FROM IMAGE [AS NAME]")
            stages.append(Stage(words[2].lower() if len(words) == 3 else None,
                                Instruction("FROM", instruction.line, words[0], instruction.where)))
        elif not stages:
            if instruction.name != "ARG":
                raise instruction.fail("only ARG may come before the first FROM")
            for key, value in _pairs(instruction, global_args):
                global_args[key] = given.get(key, value)
        else:
            stages[-1].body.append(instruction)
    if target is not None:
        names = [s.name for s in stages]
        if target.lower() not in names:
            raise DockerfileError(f"{os.path.basename(path)}: no stage named {target!r}")
        stages = stages[:names.index(target.lower()) + 1]
    rules = ignore_rules(context)
    built: dict[str, Image] = {}
    image: Image | None = None
    for number, stage in enumerate(stages):
        last = number == len(stages) - 1
        image = _build_stage(stage, built, store, context, rules, given, global_args,
                             reference if last else None, progress, stats, network)
        built[str(number)] = image
        if stage.name:
            built[stage.name] = image
    assert image is not None
    return image


def _base(stage: Stage, built: Mapping[str, Image], store: Store) -> Image:
    name = stage.base.value
    if name.lower() in built:
        return built[name.lower()]
    if name == "scratch":
        return scratch(store)
    found = Image.find(name, store)
    return found if found is not None else Image.pull(name, store=store)


def scratch(store: Store) -> Image:
    """The empty image (``FROM scratch``)."""
    import hashlib
    import time

    from .archive import host_platform

    os_, arch = host_platform()
    data = json.dumps({"architecture": arch, "os": os_, "config": {},
                       "rootfs": {"type": "layers", "diff_ids": []}}, separators=(",", ":"), sort_keys=True).encode()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    store.put_blob(data, digest, "scratch: config")
    record = {"reference": "localhost/isolate-build:scratch", "digest": digest, "config_digest": digest, "layers": [],
              "config": {"env": [], "working_dir": "", "user": "", "entrypoint": [], "cmd": []}, "size": 0,
              "created": time.time()}
    store.write_record(record)
    return Image._from_record(record, store)


def _build_stage(stage: Stage, built: Mapping[str, Image], store: Store, context: str,
                 rules: list[tuple[bool, IgnorePattern]], given: Mapping[str, str], global_args: Mapping[str, str],
                 reference: str | None, progress: IO[str] | None, stats: Stats | None, network: Any) -> Image:
    base = _base(stage, built, store)
    build = Build(base, store=store)
    env = base.config.environment()
    args: dict[str, str] = {}
    shell: list[str] = ["/bin/sh", "-c"]
    workdir = base.config.working_dir or "/"

    def values() -> dict[str, str]:
        return {**args, **env}

    for ins in stage.body:
        what = f"{ins.where}:{ins.line}: {ins.name}"
        if ins.name == "RUN":
            caches, ins = _run_flags(ins, values())
            argv = ins.json_form()
            build = build.run(argv if argv is not None else ins.value, env=args, shell=shell, network=network,
                              caches=caches)
        elif ins.name in ("CMD", "ENTRYPOINT"):
            argv = ins.json_form()
            build = build.config(**{"Cmd" if ins.name == "CMD" else "Entrypoint":
                                    argv if argv is not None else [*shell, ins.value]})
        elif ins.name == "SHELL":
            argv = ins.json_form()
            if not argv:
                raise ins.fail("SHELL takes the JSON form: SHELL [\"executable\", \"parameters\"]")
            shell = argv
        elif ins.name == "ENV":
            pairs = _pairs(ins, values())
            env.update(pairs)
            build = build.env(**dict(pairs))
        elif ins.name == "ARG":
            for key, default in _pairs(ins, values()):
                args[key] = given.get(key, global_args.get(key, default) if not default else default)
        elif ins.name == "WORKDIR":
            path = expand(ins.value.strip(), values())
            workdir = os.path.normpath(os.path.join(workdir, path))
            build = build.layer(_workdir_layer(workdir), what).workdir(workdir)
        elif ins.name == "USER":
            build = build.user(expand(ins.value.strip(), values()))
        elif ins.name == "LABEL":
            labels = dict(_pairs(ins, values()))
            build = build.config(Labels={**_current(build, base, "Labels"), **labels})
        elif ins.name == "EXPOSE":
            ports: dict[str, dict[str, Any]] = {}
            for word in expand(ins.value, values()).split():
                port, _, proto = word.partition("/")
                if not port.isdigit() or not 0 < int(port) < 65536 or proto not in ("", "tcp", "udp"):
                    raise ins.fail(f"{word!r} is not PORT[/tcp|/udp]")
                ports[f"{int(port)}/{proto or 'tcp'}"] = {}
            build = build.config(ExposedPorts={**_current(build, base, "ExposedPorts"), **ports})
        elif ins.name in ("COPY", "ADD"):
            build = _copy(ins, build, built, store, context, rules, values(), what)
    return build.build(reference, progress=progress, stats=stats)


def _current(build: Build, base: Image, key: str) -> dict[str, Any]:
    """A dict field of the config as the steps so far leave it (Labels, ExposedPorts)."""
    value: dict[str, Any] = {}
    raw = base.store.get_blob(base.id, "config")
    parsed = json.loads(raw).get("config") or {}
    if isinstance(parsed.get(key), dict):
        value.update(parsed[key])
    for step in build.steps:
        if step.kind == "config":
            for name, given in step.args:
                if name == key and isinstance(given, dict):
                    value = dict(given)
    return value


def _workdir_layer(workdir: str) -> Callable[[Image, str], LayerBlob]:
    """WORKDIR makes its directory when the image lacks it (a layer of just that; empty when it is there)."""

    def make(image: Image, out: str) -> LayerBlob:
        return write_copy([], workdir, out, into=True, what="WORKDIR",
                          existing=functools.partial(_existing, image.lower_dirs()))

    return make


def _copy(ins: Instruction, build: Build, built: Mapping[str, Image], store: Store, context: str,
          rules: list[tuple[bool, IgnorePattern]], values: Mapping[str, str], what: str) -> Build:
    json_words = ins.json_form()
    try:
        words = json_words if json_words is not None else shlex.split(ins.value, posix=True)
    except ValueError as exc:
        raise ins.fail(str(exc)) from None
    flags, words = _flags(ins, list(words), ("from", "chown", "chmod") if ins.name == "COPY" else ("chown", "chmod"))
    chown = parse_chown(expand(flags["chown"], values), what) if "chown" in flags else None
    mode = parse_chmod(expand(flags["chmod"], values), what) if "chmod" in flags else None
    words = [expand(w, values) for w in words]
    if len(words) < 2:
        raise ins.fail("expected SOURCE... DESTINATION")
    *sources, destination = words
    if "from" in flags:
        name = expand(flags["from"], values)
        source_image = built.get(name.lower())
        if source_image is None:
            source_image = Image.find(name, store) or Image.pull(name, store=store)
        return build.layer(_from_image(source_image, sources, destination, what, chown, mode),
                           f"{what} --from={name}")
    for source in sources:
        if re.match(r"^[a-z][a-z0-9+.-]*://", source) or source.startswith("git@"):
            raise ins.fail(f"{source!r}: a URL; isolate's builder copies local files only")
    if ins.name == "ADD" and len(sources) == 1 and _is_archive(context, sources[0], what):
        return build.layer(_archive_layer(context, sources[0], destination, what, chown, mode),
                           f"{what} {sources[0]}")
    return build.layer(_copy_layer(context, sources, destination, what, rules, chown, mode),
                       f"{what} {' '.join(sources)}")


def _from_image(image: Image, sources: list[str], destination: str, what: str, chown: Chown | None = None,
                mode: int | None = None) -> Callable[[Image, str], LayerBlob]:
    """COPY --from: a path of another image (a stage): from the layer that shows it, when one layer holds it all."""
    from .view import _find

    def make(target_image: Image, out: str) -> LayerBlob:
        lowers = image.lower_dirs()
        roots = []
        for source in sources:
            rel = os.path.normpath(source).lstrip("/")
            if rel.startswith(".."):
                raise DockerfileError(f"{what}: {source!r}: refused (..)")
            found, holder = _find(lowers, rel)
            if found is None or holder is None:
                raise DockerfileError(f"{what}: {source!r} is not in {image.reference} (or lies behind a link)")
            if found == "dir" and sum(os.path.isdir(os.path.join(layer, rel)) for layer in lowers) > 1:
                raise DockerfileError(f"{what}: {source!r} is a directory spread over several layers of "
                                      f"{image.reference}: not supported yet (copy its files)")
            roots.append((holder, rel))
        layers = {holder for holder, _ in roots}
        if len(layers) != 1:
            raise DockerfileError(f"{what}: its sources lie in several layers of {image.reference}: one COPY each")
        return _copy_layer(layers.pop(), [rel for _, rel in roots], destination, what, [], chown, mode)(
            target_image, out)

    return make


__all__ = ["DockerfileError", "from_dockerfile", "parse"]
