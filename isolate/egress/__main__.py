"""``python -m isolate.egress``: a mediator as a process of its own (kept sandboxes).

Descriptors it inherits (numbers given on the command line):

- ``--rules-fd N``: the rules, as ``isolate.egress.rules_to_json`` writes them, read to EOF;
- ``--dns-fd N``: the DNS server's UDP socket; ``--listen-fd N`` (repeated): the TCP listeners;
- ``--control-fd N`` (optional): a stream socket. A line ``summary`` is answered with the summary
  as one line of JSON; ``stop`` (or EOF) stops the mediator, which writes the final summary
  as one line of JSON before it exits;
- ``--query-fd N`` (optional): a stream socket whose lines ``summary`` are answered as on the control
  socket; its EOF stops nothing (the process that asks may end before the sandbox);
- ``--query-listen-fd N`` (optional): a listening unix stream socket (bound in its user's private runtime
  directory, where a restarted server finds it by the sandbox's name): each connection of a process of
  the mediator's own user is a query socket as above;
- on a query socket, a line ``rules JSON`` (the rules as ``rules_to_json`` writes them) makes the mediator
  serve that allow-list from now on (``Mediator.update_rules``: the host rules only, on the ports listened
  at start), answered ``{"closed": N}`` or ``{"error": TEXT}``;
- ``--pidfd N`` (optional): a pidfd of the sandbox's process; the mediator stops when it exits;
- ``--ready-fd N`` (optional): written ``ready`` and closed once the mediator serves.

SIGTERM and SIGINT stop it too. The exit status is 0 after a stop, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import signal
import socket
import struct
import sys
from typing import Any

from ..model.errors import PolicyError
from . import Mediator, rules_from_json


def _read_all(fd: int) -> str:
    chunks = []
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks).decode()


def _write_line(sock: socket.socket | None, data: dict[str, Any]) -> None:
    if sock is None:
        return
    try:
        sock.sendall((json.dumps(data) + "\n").encode())
    except OSError:
        pass


#: Query connections served at once, and the longest line one may send (a rules line included).
MAX_QUERIES = 16
MAX_QUERY_LINE = 4 << 20


def _accept_own(listener: socket.socket) -> socket.socket | None:
    """A connection to the query listener, when its peer is a process of this user (else closed): the
    listener lies in the user's private runtime directory, and the peer's credentials say so again."""
    try:
        conn, _ = listener.accept()
    except OSError:
        return None
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _, uid, _ = struct.unpack("3i", creds)
    except OSError:
        uid = -1
    if uid != os.geteuid():
        conn.close()
        return None
    conn.settimeout(5.0)  # an answer is written whole or not at all: a peer that does not read is let go
    return conn


def _answer(sock: socket.socket, mediator: Mediator, line: bytes) -> None:
    """One query line: ``summary``, or ``rules JSON`` (a new allow-list)."""
    if line == b"summary":
        _write_line(sock, mediator.summary())
        return
    command, _, rest = line.partition(b" ")
    if command != b"rules":
        _write_line(sock, {"error": f"unknown command {command[:40].decode(errors='replace')!r}"})
        return
    try:
        closed = mediator.update_rules(rules_from_json(rest.decode()))
    except (PolicyError, UnicodeDecodeError) as exc:
        _write_line(sock, {"error": str(exc)})
        return
    _write_line(sock, {"closed": closed})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m isolate.egress", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rules-fd", type=int, required=True)
    parser.add_argument("--dns-fd", type=int, required=True)
    parser.add_argument("--listen-fd", type=int, action="append", default=[])
    parser.add_argument("--control-fd", type=int)
    parser.add_argument("--query-fd", type=int)
    parser.add_argument("--query-listen-fd", type=int)
    parser.add_argument("--pidfd", type=int)
    parser.add_argument("--ready-fd", type=int)
    parser.add_argument("--dns-port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--proxy-port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        rules = rules_from_json(_read_all(args.rules_fd))
        udp = socket.socket(fileno=args.dns_fd)
        listeners = [socket.socket(fileno=fd) for fd in args.listen_fd]
        control = socket.socket(fileno=args.control_fd) if args.control_fd is not None else None
        query = socket.socket(fileno=args.query_fd) if args.query_fd is not None else None
        query_listener = socket.socket(fileno=args.query_listen_fd) if args.query_listen_fd is not None else None
    except (OSError, PolicyError) as exc:
        print(f"python -m isolate.egress: {exc}", file=sys.stderr)
        return 2
    # A process of its own that waits with poll and epoll only: it may use its whole hard limit of
    # descriptors (the mediator takes a share of the soft one).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (OSError, ValueError):
            pass
    stop_r, stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    signal.set_wakeup_fd(stop_w)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)
    extra: dict[str, int] = {}
    if args.dns_port is not None:
        extra["dns_port"] = args.dns_port
    if args.proxy_port is not None:
        extra["proxy_port"] = args.proxy_port
    mediator = Mediator(rules, udp, listeners, **extra).start()
    if args.ready_fd is not None:
        try:
            os.write(args.ready_fd, b"ready\n")
            os.close(args.ready_fd)
        except OSError:
            pass
    poller = select.poll()
    poller.register(stop_r, select.POLLIN)
    if control is not None:
        poller.register(control, select.POLLIN)
    if args.pidfd is not None:
        poller.register(args.pidfd, select.POLLIN)
    # Query sockets by descriptor, each with what it sent of a line so far.
    queries: dict[int, tuple[socket.socket, bytes]] = {}
    if query is not None:
        queries[query.fileno()] = (query, b"")
        poller.register(query, select.POLLIN)
    if query_listener is not None:
        poller.register(query_listener, select.POLLIN)
    pending = b""
    try:
        running = True
        while running:
            for fd, _ in poller.poll():
                if query_listener is not None and fd == query_listener.fileno():
                    accepted = _accept_own(query_listener)
                    if accepted is not None and len(queries) < MAX_QUERIES:
                        queries[accepted.fileno()] = (accepted, b"")
                        poller.register(accepted, select.POLLIN)
                    elif accepted is not None:
                        accepted.close()
                    continue
                if fd in queries:
                    sock, asked = queries[fd]
                    try:
                        data = sock.recv(1 << 16)
                    except OSError:
                        data = b""
                    asked += data
                    while b"\n" in asked:
                        line, _, asked = asked.partition(b"\n")
                        _answer(sock, mediator, line.strip())
                    if not data or len(asked) > MAX_QUERY_LINE:
                        poller.unregister(fd)
                        del queries[fd]
                        sock.close()
                    else:
                        queries[fd] = (sock, asked)
                    continue
                if control is not None and fd == control.fileno():
                    data = control.recv(4096)
                    if not data:
                        running = False
                        break
                    pending += data
                    while b"\n" in pending:
                        line, _, pending = pending.partition(b"\n")
                        command = line.strip().decode(errors="replace")
                        if command == "summary":
                            _write_line(control, mediator.summary())
                        elif command == "stop":
                            running = False
                        else:
                            _write_line(control, {"error": f"unknown command {command[:40]!r}"})
                    if len(pending) > 4096:
                        pending = b""
                else:
                    running = False
    finally:
        mediator.close()
        _write_line(control, mediator.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
