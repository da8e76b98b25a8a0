"""The Python context: the sandbox's own ``python3`` running a small driver (``driver.py``'s protocol).

Each cell runs in one namespace; the value of a last bare expression is the
cell's result, as in a notebook. The driver starts with ``-I`` (a file of the
workspace never replaces a module of its own) and makes itself non-dumpable,
so no other process of its uid takes its channel through ``pidfd_getfd``.
"""

from __future__ import annotations

from ...kept.sandbox import Sandbox
from ...model.errors import CommandNotFoundError
from ..keep import CONTEXT_ID
from .driver import HELLO_TIMEOUT, Driver, unavailable

DRIVER = r'''
import sys
if sys.path and sys.path[0] == "":  # started with -I; a file of the workspace never replaces a module of ours
    del sys.path[0]
import ast, ctypes, fcntl, json, os, signal, socket, traceback
# Non-dumpable: another process of this uid cannot take the channel through pidfd_getfd or ptrace.
if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
    sys.exit("isolate: the code context's driver cannot make itself non-dumpable; it does not start")
held = []  # the channel, and the kept driver's sockets: a child a cell forks (without exec) keeps none
def forget():
    for fd in held:
        try:
            os.close(fd)
        except OSError:
            pass
    os.close(0)
os.register_at_fork(after_in_child=forget)
sys.path[0:0] = ["", *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]  # as python3 -c has
try:
    import site
    if os.path.isdir(site.getusersitepackages()):
        site.addsitedir(site.getusersitepackages())
except Exception:
    pass
namespace = {"__name__": "__main__"}
count = 0
state = {"cell": False}
def watch(channel, done):
    """A kept driver's host gone mid-cell (its server killed): the cell is interrupted, the next host's waits."""
    import select
    poller = select.poll()
    poller.register(channel, select.POLLRDHUP)
    while not done:
        if poller.poll(200) and not done:
            if state["cell"]:
                os.kill(os.getpid(), signal.SIGINT)
            return
def serve(channel, kept):
    global count
    sock = socket.socket(fileno=channel)
    cells = sock.makefile("rb")  # holds the socket: it stays open
    os.write(channel, b"hello\n")  # before any cell: the host takes answers from this process only
    done = []
    if kept:
        import threading
        threading.Thread(target=watch, args=(channel, done), daemon=True).start()
    try:
        while True:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            header = cells.readline(24)
            if not header.endswith(b"\n"):
                break
            code = cells.read(int(header)).decode("utf-8", "replace")
            count += 1
            result = error = None
            try:
                state["cell"] = True
                signal.signal(signal.SIGINT, signal.default_int_handler)
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
            finally:
                state["cell"] = False
                signal.signal(signal.SIGINT, signal.SIG_IGN)
            sys.stdout.flush()
            sys.stderr.flush()
            answer = (json.dumps({"count": count, "result": result, "error": error}) + "\n").encode()
            while answer:
                answer = answer[os.write(channel, answer):]
    except (OSError, ValueError):
        pass  # the host went away mid-answer
    finally:
        done.append(True)
        cells.close()
        sock.close()
if sys.argv[1:2] != ["--kept"]:
    channel = fcntl.fcntl(3, fcntl.F_DUPFD_CLOEXEC, 512)  # private: no cell or child of one gets it as 3
    os.close(3)
    held.append(channel)
    serve(channel, False)
    sys.exit(0)
# Kept: this process lives on past the command that started it (and so past the server), listening at a
# socket of the sandbox's private /tmp; each host in turn connects a relay there that hands it the host's
# channel and output pipes (SCM_RIGHTS), and the namespace carries on from host to host.
ready_r, ready_w = os.pipe()
if os.fork() != 0:
    os.close(ready_w)
    said = os.read(ready_r, 4096)
    sys.exit(0 if said == b"ok" else "isolate: the kept code context did not start: " + said.decode(errors="replace"))
os.close(ready_r)
os.setsid()
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):  # before the listener: 0 is free here (the fork closed it), and is not the listener's
    os.dup2(null, fd)
try:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.unlink(sys.argv[2])
    except FileNotFoundError:
        pass
    os.umask(0o077)
    listener.bind(sys.argv[2])
    listener.listen(4)  # after the fork: SO_PEERCRED then names this process to a relay
except OSError as exc:
    os.write(ready_w, str(exc).encode())
    os._exit(1)
held.append(listener.fileno())
os.write(ready_w, b"ok")
os.close(ready_w)
while True:
    try:
        conn, _ = listener.accept()
    except KeyboardInterrupt:
        continue
    held.append(conn.fileno())
    try:
        _, ancdata, _, _ = conn.recvmsg(1, socket.CMSG_SPACE(3 * 4))
        fds = []
        for level, kind, blob in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += list(memoryview(blob).cast("i")[: len(blob) // 4])
        if len(fds) == 3:
            os.dup2(fds[1], 1)
            os.dup2(fds[2], 2)
            channel = fcntl.fcntl(fds[0], fcntl.F_DUPFD_CLOEXEC, 512)
            held.append(channel)
            serve(channel, True)
            held.remove(channel)
        for fd in fds:
            os.close(fd)
    except (OSError, ValueError, KeyboardInterrupt):
        pass
    finally:
        os.dup2(null, 1)
        os.dup2(null, 2)
        held.remove(conn.fileno())
        conn.close()
'''


RELAY = r'''
import array, os, signal, socket, struct, sys
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    conn.connect(sys.argv[1])
except OSError as exc:
    sys.exit(f"isolate: the context's interpreter is gone ({exc.strerror})")
driver = struct.unpack("iII", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
signal.signal(signal.SIGINT, lambda *_: os.kill(driver, signal.SIGINT))  # the host's interrupt, passed on
conn.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [3, 1, 2]))])
null = os.open(os.devnull, os.O_RDWR)
os.close(3)
for fd in (1, 2):
    os.dup2(null, fd)
while conn.recv(1):  # until the driver lets this host go (or ends)
    pass
'''
HINT = "it needs python3 (3.7 or later) inside the sandbox"


def start(box: Sandbox) -> Driver:
    return Driver(box, ["python3", "-I", "-u", "-c", DRIVER], {"PYTHONUNBUFFERED": "1"}, "python", HINT)


def socket_path(context_id: str) -> str:
    """Where a kept context's driver listens: the sandbox's private /tmp, named by the context's id alone."""
    if not CONTEXT_ID.fullmatch(context_id):
        raise ValueError(f"not a context id: {context_id[:64]!r}")
    return f"/tmp/.isolate-code-{context_id}.sock"


def start_kept(box: Sandbox, context_id: str) -> None:
    """Start a kept driver (see the module's docstring); a relay then connects to it (``connect``)."""
    try:
        done = box.exec(["python3", "-I", "-u", "-c", DRIVER, "--kept", socket_path(context_id)],
                        env={"PYTHONUNBUFFERED": "1"}, timeout=HELLO_TIMEOUT)
    except CommandNotFoundError as exc:
        raise unavailable("python", str(exc), HINT) from None
    if done.returncode != 0:
        raise unavailable("python", (done.stderr.strip().splitlines() or ["it ended without a word"])[-1], HINT)


def connect(box: Sandbox, context_id: str) -> Driver:
    """A relay to the kept driver of the context: the driver takes this server's channel and pipes."""
    return Driver(box, ["python3", "-I", "-c", RELAY, socket_path(context_id)], {}, "python", HINT)
