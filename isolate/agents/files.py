"""File tools for an agent that stay beneath a root and never follow a link."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from ..kept.sandbox import Sandbox
from ..kernel.beneath import make_beneath, open_beneath
from ..kernel.tree import _open_file
from ..model.errors import IsolationError, PolicyError
from ..model.files import write_all

# -- file tools for an agent ----------------------------------------------------------------------------------

#: The largest file read() returns (an agent's context is small; read a part with execute_command instead).
DEFAULT_MAX_BYTES = 1 << 20


class ToolError(IsolationError):
    """A file tool refused or failed; the message is written for the agent (what, why, what to do)."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path


@runtime_checkable
class AgentFiles(Protocol):
    """The file tools an agent gets: paths are relative to ``root`` (or absolute beneath it)."""

    root: str

    def read(self, path: str) -> str: ...

    def write(self, path: str, content: str) -> str: ...

    def edit(self, path: str, old: str, new: str, *, replace_all: bool = False) -> str: ...

    def ls(self, path: str = ".") -> list[str]: ...


def _components(path: str, root: str) -> list[str]:
    """path's components below root ('.' and empty ones dropped, '..' kept); an absolute path must lie under root."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise ToolError(f"{path!r} is not a path; give a path relative to {root}", str(path))
    rel = path
    if path.startswith("/"):
        norm = os.path.normpath(path)
        if norm != root and not norm.startswith(root.rstrip("/") + "/"):
            raise ToolError(f"{path}: outside the workspace {root}; use a path relative to it", path)
        rel = path[len(root):] if path.startswith(root) else norm[len(root):]
    return [p for p in rel.split("/") if p not in ("", ".")]


def _beneath(parts: list[str], path: str, root: str) -> list[str]:
    """parts with each '..' applied; one that would climb above root is refused."""
    out: list[str] = []
    for part in parts:
        if part == "..":
            if not out:
                raise ToolError(f"{path}: '..' leads out of the workspace {root}; stay inside it", path)
            out.pop()
        else:
            out.append(part)
    return out


def _link_refused(path: str) -> ToolError:
    return ToolError(f"{path}: a symbolic link is on the way; the file tools never follow links "
                     "(use the path it points to, if that lies in the workspace)", path)


@contextlib.contextmanager
def _tool_errors(op: str, path: str) -> Iterator[None]:
    """OSError and friends as one line an agent can act on."""
    try:
        yield
    except ToolError:
        raise
    except FileNotFoundError:
        raise ToolError(f"{op} {path}: no such file or directory (ls its directory to see what is there)",
                        path) from None
    except IsADirectoryError:
        raise ToolError(f"{op} {path}: is a directory (ls it instead)", path) from None
    except NotADirectoryError:
        raise ToolError(f"{op} {path}: a component of the path is not a directory", path) from None
    except PermissionError:
        raise ToolError(f"{op} {path}: permission denied (the sandbox's policy does not allow it)", path) from None
    except UnicodeDecodeError:
        raise ToolError(f"{op} {path}: not UTF-8 text (a binary file; inspect it with a command)", path) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _link_refused(path) from None
        if exc.errno == errno.EROFS:
            raise ToolError(f"{op} {path}: read-only here (the sandbox's policy does not let the program write "
                            "there)", path) from None
        if exc.errno == errno.EFBIG:
            raise ToolError(f"{op} {path}: larger than the read limit; look at a part of it with a command",
                            path) from None
        raise ToolError(f"{op} {path}: {exc.strerror or exc}", path) from None
    except IsolationError as exc:
        raise ToolError(f"{op} {path}: {exc}", path) from None


def _replaced(text: str, old: str, new: str, path: str, replace_all: bool) -> tuple[str, int]:
    if not isinstance(old, str) or not old:
        raise ToolError(f"edit {path}: old must be the non-empty text to replace", path)
    found = text.count(old)
    if found == 0:
        raise ToolError(f"edit {path}: the old text does not occur in the file; read it and copy the text "
                        "exactly (whitespace included)", path)
    if found > 1 and not replace_all:
        raise ToolError(f"edit {path}: the old text occurs {found} times; include more context so it is unique, "
                        "or pass replace_all=True", path)
    return text.replace(old, new), found


class SandboxFiles:
    """File tools over a running ``Sandbox``, confined to ``root`` (default: its workspace).

    The sandbox's file methods already resolve every path inside the
    sandbox, as the program, so nothing here can reach further than the
    program itself. On top, the tools keep the agent beneath ``root``: an
    absolute path elsewhere, or a ``..`` above it, is refused, and so is a
    path through a link (each component is checked without following links
    before the operation; a program that swaps one in meanwhile reaches only
    what it may reach anyway).
    """

    def __init__(self, sandbox: Sandbox, root: str | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.sandbox = sandbox
        root = root if root is not None else sandbox.workspace.target
        if not isinstance(root, str) or not os.path.isabs(root):
            raise PolicyError(f"root {root!r}: an absolute path inside the sandbox", "root")
        self.root = os.path.normpath(root)
        self.max_bytes = max_bytes

    def _resolve(self, path: str, op: str) -> str:
        parts = _beneath(_components(path, self.root), path, self.root)
        current = self.root
        for part in parts:
            current = f"{current.rstrip('/')}/{part}"
            with _tool_errors(op, path):
                try:
                    info = self.sandbox.stat(current, follow_symlinks=False)
                except FileNotFoundError:
                    return f"{self.root.rstrip('/')}/{'/'.join(parts)}"  # the rest does not exist yet
            if stat.S_ISLNK(info.mode):
                raise _link_refused(path)
        return current

    def read(self, path: str) -> str:
        target = self._resolve(path, "read")
        with _tool_errors("read", path):
            return str(self.sandbox.read_file(target, limit=self.max_bytes))

    def write(self, path: str, content: str) -> str:
        target = self._resolve(path, "write")
        data = content.encode()
        with _tool_errors("write", path):
            self.sandbox.write_file(target, data)
        return f"wrote {len(data)} bytes to {path}"

    def edit(self, path: str, old: str, new: str, *, replace_all: bool = False) -> str:
        target = self._resolve(path, "edit")
        with _tool_errors("edit", path):
            text, found = _replaced(str(self.sandbox.read_file(target, limit=self.max_bytes)), old, new, path,
                                    replace_all)
            self.sandbox.write_file(target, text)
        return f"replaced {found} occurrence{'s' if found > 1 else ''} in {path}"

    def ls(self, path: str = ".") -> list[str]:
        target = self._resolve(path, "ls")
        with _tool_errors("ls", path):
            entries = self.sandbox.list_dir(target)
        return sorted(e.path + ("/" if e.type == "dir" else "@" if e.type == "link" else "") for e in entries)


class HostFiles:
    """File tools over a plain host directory (no sandbox), never leaving it.

    The root is opened once; each path is walked from that descriptor by
    openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS) (kernel/beneath.py, which
    walks component by component where the kernel lacks it), the last
    component opened ``O_NOFOLLOW | O_NONBLOCK`` (a link anywhere is refused,
    a FIFO is not waited on); ``..`` above the root is refused. A file is
    written through a new temporary file renamed into place, so a link
    planted at its name is replaced, never written through.
    """

    def __init__(self, root: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.root = os.path.realpath(os.fspath(root))  # the caller's own choice of directory: links in it are fine
        try:
            self._fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise PolicyError(f"HostFiles: {self.root}: {exc.strerror}", "root") from None
        self.max_bytes = max_bytes

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> HostFiles:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def _walk(self, parts: list[str], path: str, create: bool = False) -> int:
        """A new descriptor of the directory that parts name beneath the root, reached through no link (the
        kernel's walk, kernel/beneath.py); with ``create``, each missing directory made (the umask applies)."""
        if self._fd < 0:
            raise ToolError("the file tools were closed", path)
        rel = "/".join(parts)
        try:
            return make_beneath(self._fd, rel) if create else open_beneath(self._fd, rel or ".")
        except OSError as exc:
            if exc.errno == errno.EXDEV:
                raise ToolError(f"{path}: '..' leads out of the workspace {self.root}; stay inside it", path) from None
            if exc.errno == errno.ELOOP:
                raise _link_refused(path) from None
            raise

    def _split(self, path: str, op: str) -> tuple[int, str]:
        """(descriptor of the parent directory, last component) of a file path."""
        parts = _components(path, self.root)
        if not parts or parts[-1] == "..":
            raise ToolError(f"{op} {path}: is a directory (ls it instead)", path)
        return self._walk(parts[:-1], path, create=op == "write"), parts[-1]

    def read(self, path: str) -> str:
        return self._read(path, "read")

    def _read(self, path: str, op: str) -> str:
        with _tool_errors(op, path):
            parent, name = self._split(path, op)
            try:
                info = os.stat(name, dir_fd=parent, follow_symlinks=False)
                if stat.S_ISLNK(info.st_mode):
                    raise _link_refused(path)
                if stat.S_ISDIR(info.st_mode):
                    raise IsADirectoryError(errno.EISDIR, "is a directory")
                try:
                    fd = _open_file(parent, name)  # O_NOFOLLOW | O_NONBLOCK, and a regular file only
                except OSError as exc:
                    if exc.errno == errno.EINVAL:
                        raise ToolError(f"{op} {path}: not a regular file (a FIFO, socket or device)", path) from None
                    raise
            finally:
                os.close(parent)
            try:
                if os.fstat(fd).st_size > self.max_bytes:
                    raise OSError(errno.EFBIG, "larger than the read limit")
                chunks, total = [], 0
                while chunk := os.read(fd, min(1 << 20, self.max_bytes + 1 - total)):
                    chunks.append(chunk)
                    total += len(chunk)
                    if total > self.max_bytes:
                        raise OSError(errno.EFBIG, "larger than the read limit")
            finally:
                os.close(fd)
            return b"".join(chunks).decode()

    def write(self, path: str, content: str) -> str:
        data = content.encode()
        self._write(path, data, "write")
        return f"wrote {len(data)} bytes to {path}"

    def _write(self, path: str, data: bytes, op: str) -> None:
        with _tool_errors(op, path):
            parent, name = self._split(path, op)
            try:
                try:
                    info = os.stat(name, dir_fd=parent, follow_symlinks=False)
                except FileNotFoundError:
                    info = None
                if info is not None and stat.S_ISLNK(info.st_mode):
                    raise _link_refused(path)
                if info is not None and stat.S_ISDIR(info.st_mode):
                    raise IsADirectoryError(errno.EISDIR, "is a directory")
                if info is not None and not stat.S_ISREG(info.st_mode):
                    raise ToolError(f"{op} {path}: not a regular file (a FIFO, socket or device)", path)
                temp = f".{name[:200]}.agent-{secrets.token_hex(4)}"
                out = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666,
                              dir_fd=parent)
                try:
                    write_all(out, data)
                    if info is not None:  # keep the file's permissions, never a set-id bit
                        os.fchmod(out, stat.S_IMODE(info.st_mode) & 0o777)
                    os.close(out)
                    out = -1
                    # rename replaces a link planted meanwhile (never follows it) and fails on a directory.
                    os.rename(temp, name, src_dir_fd=parent, dst_dir_fd=parent)
                except BaseException:
                    if out >= 0:
                        os.close(out)
                    with contextlib.suppress(OSError):
                        os.unlink(temp, dir_fd=parent)
                    raise
            finally:
                os.close(parent)

    def edit(self, path: str, old: str, new: str, *, replace_all: bool = False) -> str:
        text, found = _replaced(self._read(path, "edit"), old, new, path, replace_all)
        self._write(path, text.encode(), "edit")
        return f"replaced {found} occurrence{'s' if found > 1 else ''} in {path}"

    def ls(self, path: str = ".") -> list[str]:
        with _tool_errors("ls", path):
            fd = self._walk(_components(path, self.root), path)
            try:
                out = []
                for name in os.listdir(fd):
                    try:
                        mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
                    except FileNotFoundError:
                        continue
                    out.append(name + ("/" if stat.S_ISDIR(mode) else "@" if stat.S_ISLNK(mode) else ""))
                return sorted(out)
            finally:
                os.close(fd)


def agent_files(target: Sandbox | str | os.PathLike[str], *, root: str | None = None,
                max_bytes: int = DEFAULT_MAX_BYTES) -> SandboxFiles | HostFiles:
    """File tools over a sandbox (beneath ``root``, default its workspace) or over a host directory."""
    if isinstance(target, Sandbox):
        return SandboxFiles(target, root, max_bytes=max_bytes)
    if root is not None:
        raise TypeError("root= is for a sandbox; for a host directory, give the directory itself")
    return HostFiles(target, max_bytes=max_bytes)
