"""The driver of ``Sandbox.python``: runs inside the sandbox, in the sandbox's own ``python3``.

The host passes this file's text with ``python3 -c`` and a random boundary as
its argument; it imports nothing of isolate and runs on Python 3.7 and later.

* Requests come in on stdin as started, which the driver moves to a private,
  close-on-exec descriptor before any user code runs; the code's fd 0 is
  /dev/null.
* The code's fds 1 and 2 are the host's own pipes: what it (or a child)
  writes goes there as it is, and stays there for the host even if the
  interpreter dies the next instant.
* The driver starts isolated (``-I``: no PYTHON* variables, no site or user
  customisation, nothing of the working directory), and makes itself
  non-dumpable (``PR_SET_DUMPABLE`` 0) before it takes a request: another
  process of the sandbox, of the same uid, could otherwise reopen its pipes
  through /proc/PID/fd and write requests of its own. Then it adds what
  ``python3 -c`` would have on sys.path (the working directory,
  ``PYTHONPATH``, the user's site-packages), for the user's code.
* Each run's result (JSON: id, value repr, error) goes on the descriptor 3
  the host gave (one end of a socket pair), moved at once to a private,
  close-on-exec descriptor: no other process of the sandbox holds it, and a
  socket cannot be reopened through /proc (a pipe can). It comes in chunks
  ``BOUNDARY ID MORE|END LENGTH\n DATA`` under the run's random boundary.
  The result is written after the run's output was flushed into the stdout
  pipe, so the host has the whole output once it has the result. Code that
  runs in this process (the user's, or what it imports) can change the
  driver itself and so forge results; no other process can.

Per request: restore fds 0-2 and ``sys.std*`` (the previous run may have
closed or replaced them), run the code in one persistent namespace (the last
expression's value is kept, as a REPL does), flush, send the result. SIGINT
raises KeyboardInterrupt only while the user's code runs; between runs it is
ignored.
"""

from __future__ import annotations

import sys

# The workspace is on sys.path for the user's code (as with ``python3 -c``, see _user_paths), but a file
# named json.py or ast.py there must not replace the modules this driver uses (-I leaves it out; a
# Python that ignored -I would not).
if sys.path and sys.path[0] == "":
    del sys.path[0]

import ast
import builtins
import fcntl
import inspect
import json
import linecache
import os
import signal
import traceback
import types
from typing import Any

#: Caps on what one result carries (the host refuses larger results).
VALUE_LIMIT = 1 << 20
MESSAGE_LIMIT = 1 << 20
TRACEBACK_LIMIT = 256 << 10
REQUEST_LIMIT = 64 << 20
#: The largest chunk of a result (the host refuses larger ones).
PIPE_BUF = 4096

_RUNNING = [False]
_STATE: dict[str, Any] = {}


def _private(fd: int) -> int:
    """A close-on-exec copy of fd numbered high, away from the fds user code tends to close."""
    try:
        new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 512)
    except OSError:
        new = os.dup(fd)  # non-inheritable too
    return new


def _send(boundary: bytes, number: int, payload: bytes) -> None:
    """The payload to the host on the result channel, in chunks of at most PIPE_BUF bytes."""
    fd = _STATE["res"]
    view = memoryview(payload)
    while True:
        head = b"%s %d " % (boundary, number)
        room = PIPE_BUF - len(head) - 16
        piece, view = view[:room], view[room:]
        chunk = head + (b"more" if view else b"end") + b" %d\n" % len(piece) + bytes(piece)
        while chunk:
            chunk = chunk[os.write(fd, chunk):]
        if not view:
            return


def _read_exact(fd: int, n: int) -> bytes:
    parts = []
    while n > 0:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise EOFError
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


def _read_request() -> dict[str, Any]:
    fd = _STATE["ctl_in"]
    header = b""
    while not header.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte or len(header) > 24:
            raise EOFError
        header += byte
    size = int(header)
    if not 0 <= size <= REQUEST_LIMIT:
        raise EOFError
    request = json.loads(_read_exact(fd, size).decode())
    if not isinstance(request, dict):
        raise EOFError
    return request


def _on_sigint(signum: int, frame: Any) -> None:
    if _RUNNING[0]:
        raise KeyboardInterrupt


def _restore_stdio() -> None:
    """Fds 0-2 and sys.std* as at start, whatever the previous run did to them."""
    for fd, want in ((0, _STATE["null"]), (1, _STATE["out"]), (2, _STATE["err"])):
        try:
            same = os.path.sameopenfile(fd, want)
        except OSError:
            same = False
        if not same:
            os.dup2(want, fd)
    sys.stdin, sys.stdout, sys.stderr = _STATE["stdin"], _STATE["stdout"], _STATE["stderr"]
    signal.signal(signal.SIGINT, _on_sigint)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr, _STATE["stdout"], _STATE["stderr"]):
        try:
            stream.flush()
        except BaseException:  # a closed or broken stream of the user's: nothing to flush
            pass


def _user_traceback(exc: BaseException) -> types.TracebackType | None:
    """The traceback without this driver's frames (the exec call above, the SIGINT handler below)."""
    kept = []
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_globals is not globals():
            kept.append(tb)
        tb = tb.tb_next
    for i, item in enumerate(kept):
        item.tb_next = kept[i + 1] if i + 1 < len(kept) else None
    return kept[0] if kept else None


def _clip(text: str, limit: int, tail: bool = False) -> str:
    if len(text) <= limit:
        return text
    return "[...]\n" + text[-limit:] if tail else text[:limit] + "[...]"


def _describe(exc: BaseException) -> dict[str, str]:
    name = type(exc).__name__
    try:
        message = str(exc)
    except BaseException as inner:  # a __str__ of the user's that raises
        message = f"<str() of the exception raised {type(inner).__name__}>"
    try:
        if isinstance(exc, SyntaxError):
            text = "".join(traceback.format_exception_only(type(exc), exc))
        else:
            text = "".join(traceback.format_exception(type(exc), exc, _user_traceback(exc)))
    except BaseException as inner:
        text = f"<the traceback could not be formatted: {type(inner).__name__}>"
    return {"type": str(name), "message": _clip(str(message), MESSAGE_LIMIT),
            "traceback": _clip(str(text), TRACEBACK_LIMIT, tail=True)}


#: ``await`` at the top level of a run, as in Jupyter (Python 3.8 and later).
_TOP_LEVEL_AWAIT = getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0)


def _await(result: Any) -> Any:
    """The value of code compiled with top-level await: a coroutine is run on one loop kept for all runs."""
    if not inspect.iscoroutine(result):
        return result
    import asyncio  # only for code that awaits: it costs the others nothing

    loop = _STATE.get("loop")
    if loop is None or loop.is_closed():
        loop = _STATE["loop"] = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    return loop.run_until_complete(result)


def _execute(code: str, number: int) -> str | None:
    """Run code in the namespace; the repr of its last expression's value (None: no value)."""
    filename = f"<python-input-{number}>"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    tree = ast.parse(code, filename, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        expression = tree.body.pop()
        assert isinstance(expression, ast.Expr)
        last = ast.Expression(expression.value)
    namespace = _STATE["namespace"]
    _await(eval(compile(tree, filename, "exec", flags=_TOP_LEVEL_AWAIT), namespace))
    if last is None:
        return None
    code_object = compile(last, filename, "eval", flags=_TOP_LEVEL_AWAIT)
    value = eval(code_object, namespace)
    if code_object.co_flags & inspect.CO_COROUTINE:
        value = _await(value)
    if value is None:
        return None
    builtins._ = value  # type: ignore[attr-defined]  # as the REPL does
    return _clip(repr(value), VALUE_LIMIT)


def _run(request: dict[str, Any]) -> dict[str, Any]:
    number = request.get("id")
    code = request.get("code")
    result: dict[str, Any] = {"id": number, "value": None, "error": None}
    if not isinstance(number, int) or not isinstance(code, str):
        result["error"] = {"type": "ValueError", "message": "malformed request", "traceback": ""}
        return result
    _restore_stdio()
    try:
        _RUNNING[0] = True
        try:
            result["value"] = _execute(code, number)
        except BaseException as exc:
            result["error"] = _describe(exc)
        finally:
            _RUNNING[0] = False
    except KeyboardInterrupt:
        # The interrupt came just as the code ended (between its end and the flag's reset).
        _RUNNING[0] = False
        result["value"] = None
        result["error"] = {"type": "KeyboardInterrupt", "message": "", "traceback": ""}
    return result


def _private_process() -> None:
    """PR_SET_DUMPABLE 0: other processes of this uid no longer open /proc/PID/fd, mem or environ of ours."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        failed = libc.prctl(4, 0, 0, 0, 0) != 0  # PR_SET_DUMPABLE
    except (ImportError, OSError, AttributeError):
        failed = True
    if failed:
        sys.stderr.write("isolate: the interpreter's driver cannot make itself non-dumpable (prctl through "
                         "ctypes), so other processes could write it requests; it does not start\n")
        sys.exit(1)


def _user_paths() -> None:
    """What ``python3 -c`` has on sys.path beyond an isolated start: the working directory, PYTHONPATH and
    the user's site-packages (its .pth files are read, as site does)."""
    sys.path[0:0] = ["", *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    try:
        import site

        user = site.getusersitepackages()
        if isinstance(user, str) and os.path.isdir(user):
            site.addsitedir(user)
    except Exception:  # a broken user site is the user's code's problem, not the driver's
        pass


def _forget_channels() -> None:
    for key in ("ctl_in", "res"):
        try:
            os.close(_STATE[key])
        except OSError:
            pass


def _boundary(value: Any) -> bytes:
    if not isinstance(value, str) or not 16 <= len(value) <= 64 or not value.isalnum() or not value.isascii():
        raise ValueError("not a boundary")
    return value.encode()


def main() -> None:
    _private_process()
    signal.signal(signal.SIGINT, _on_sigint)
    _STATE["pid"] = os.getpid()
    hello_boundary = _boundary(sys.argv[1] if len(sys.argv) > 1 else None)
    _STATE["ctl_in"] = _private(0)
    _STATE["res"] = _private(3)
    os.close(3)
    # A child the code forks (without exec) does not keep the driver's channels: it could read the next
    # run's request. (Its results would be dropped anyway: the host takes them from this process only.)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_forget_channels)
    null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    _STATE.update(null=_private(null), out=_private(1), err=_private(2))
    os.close(null)
    os.dup2(_STATE["null"], 0)
    for stream in (sys.stdout, sys.stderr):
        try:
            # UTF-8 whatever the sandbox's locale, and line by line as on a terminal (so that print's
            # lines and those of child processes come in the order they were written).
            reconfigure = stream.reconfigure  # type: ignore[union-attr]
            reconfigure(encoding="utf-8", errors="backslashreplace", line_buffering=True)
        except (AttributeError, ValueError):
            pass
    _STATE.update(stdin=sys.stdin, stdout=sys.stdout, stderr=sys.stderr)
    main_module = types.ModuleType("__main__")
    main_module.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main_module
    _STATE["namespace"] = main_module.__dict__
    _user_paths()
    version = ".".join(str(part) for part in sys.version_info[:3])
    hello = {"pid": os.getpid(), "python": version, "executable": sys.executable}
    _send(hello_boundary, 0, json.dumps(hello).encode())
    while True:
        try:
            request = _read_request()
            boundary = _boundary(request.get("boundary"))
        except (EOFError, ValueError, OSError):
            return  # the host hung up, or sent what is not a request
        result = _run(request)
        _flush()
        if os.getpid() != _STATE["pid"]:
            os._exit(0)  # a child the code forked came back here: it ends, as at the end of a script
        signal.signal(signal.SIGINT, _on_sigint)
        try:
            payload = json.dumps(result).encode("utf-8", "backslashreplace")
        except (TypeError, ValueError):
            payload = json.dumps({"id": result["id"], "value": None, "error": {
                "type": "ValueError", "message": "the result could not be encoded", "traceback": ""}}).encode()
        _send(boundary, result["id"] if isinstance(result["id"], int) else -1, payload)


#: The driver's exit status when its descriptors are gone while the host still listens (the code closed them).
CHANNEL_LOST = 121

if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:
        pass  # the host hung up
    except OSError:
        os._exit(CHANNEL_LOST)
    os._exit(0)  # not sys.exit: threads and atexit handlers of the user's code do not hold the end
