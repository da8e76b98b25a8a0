"""The Python context: the sandbox's own ``python3`` running a small driver (``driver.py``'s protocol).

Each cell runs in one namespace; the value of a last bare expression is the
cell's result, as in a notebook. The driver starts with ``-I`` (a file of the
workspace never replaces a module of its own) and makes itself non-dumpable,
so no other process of its uid takes its channel through ``pidfd_getfd``.
"""

from __future__ import annotations

from ...kept.sandbox import Sandbox
from .driver import Driver

DRIVER = r'''
import sys
if sys.path and sys.path[0] == "":  # started with -I; a file of the workspace never replaces a module of ours
    del sys.path[0]
import ast, ctypes, fcntl, json, os, signal, socket, traceback
# Non-dumpable: another process of this uid cannot take the channel through pidfd_getfd or ptrace.
if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
    sys.exit("isolate: the code context's driver cannot make itself non-dumpable; it does not start")
channel = fcntl.fcntl(3, fcntl.F_DUPFD_CLOEXEC, 512)  # private: no cell or child of one gets it as 3
os.close(3)
def forget():  # a child a cell forks (without exec) keeps neither the channel nor the standard input
    os.close(channel)
    os.close(0)
os.register_at_fork(after_in_child=forget)
cells = socket.socket(fileno=channel).makefile("rb")  # holds the socket: it stays open
os.write(channel, b"hello\n")  # before any cell: the host takes answers from this process only
sys.path[0:0] = ["", *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]  # as python3 -c has
try:
    import site
    if os.path.isdir(site.getusersitepackages()):
        site.addsitedir(site.getusersitepackages())
except Exception:
    pass
namespace = {"__name__": "__main__"}
count = 0
while True:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    header = cells.readline(24)
    if not header.endswith(b"\n"):
        break
    code = cells.read(int(header)).decode("utf-8", "replace")
    count += 1
    result = error = None
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        tree = ast.parse(code, "<cell>", "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, "<cell>", "exec"), namespace)
        if last is not None:
            value = eval(compile(last, "<cell>", "eval"), namespace)
            if value is not None:
                result = repr(value)
    except BaseException as exc:
        error = {"ename": type(exc).__name__, "evalue": str(exc),
                 "traceback": traceback.format_exception(type(exc), exc, exc.__traceback__)}
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.stdout.flush()
    sys.stderr.flush()
    answer = (json.dumps({"count": count, "result": result, "error": error}) + "\n").encode()
    while answer:
        answer = answer[os.write(channel, answer):]
'''


def start(box: Sandbox) -> Driver:
    return Driver(box, ["python3", "-I", "-u", "-c", DRIVER], {"PYTHONUNBUFFERED": "1"}, "python",
                  "it needs python3 (3.7 or later) inside the sandbox")
