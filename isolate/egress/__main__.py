"""``python -m isolate.egress``: a mediator as a process of its own (kept sandboxes).

Descriptors it inherits (numbers given on the command line):

- ``--rules-fd N``: the rules, as ``isolate.egress.rules_to_json`` writes them, read to EOF;
- ``--dns-fd N``: the DNS server's UDP socket; ``--listen-fd N`` (repeated): the TCP listeners;
- ``--control-fd N`` (optional): a stream socket. A line ``summary`` is answered with the summary
  as one line of JSON; ``stop`` (or EOF) stops the mediator, which writes the final summary
  as one line of JSON before it exits;
- ``--query-fd N`` (optional): a stream socket whose lines ``summary`` are answered as on the control
  socket; its EOF stops nothing (the process that asks may end before the sandbox);
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m isolate.egress", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rules-fd", type=int, required=True)
    parser.add_argument("--dns-fd", type=int, required=True)
    parser.add_argument("--listen-fd", type=int, action="append", default=[])
    parser.add_argument("--control-fd", type=int)
    parser.add_argument("--query-fd", type=int)
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
    if query is not None:
        poller.register(query, select.POLLIN)
    pending = b""
    asked = b""
    try:
        running = True
        while running:
            for fd, _ in poller.poll():
                if query is not None and fd == query.fileno():
                    data = query.recv(4096)
                    if not data:
                        poller.unregister(query)
                        query.close()
                        query = None
                        continue
                    asked = (asked + data)[-4096:]
                    while b"\n" in asked:
                        line, _, asked = asked.partition(b"\n")
                        if line.strip() == b"summary":
                            _write_line(query, mediator.summary())
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
