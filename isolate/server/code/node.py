"""The TypeScript and JavaScript contexts: one Node.js realm (``driver.js``; ``driver.py``'s protocol).

Top-level declarations stay from cell to cell, as in Node's REPL; a cell's
last expression is its result (a promise's, once it settles). TypeScript is
transpiled by the sandbox's own ``typescript`` module: types are removed, not
checked (as ``ts-node --transpile-only`` does), so only a syntax error stops a
cell before it runs; its top-level ``const`` and ``let`` become ``var``, so
that a cell run again may declare its names again (JavaScript keeps Node's
REPL rule: a name declared with them cannot be). The driver runs from ``node
-e``: no file is written.

A context of a kept sandbox keeps its realm past the server (``start_kept``;
the top of ``driver.js`` says how): each server connects a relay to it
(``RELAY``), and only what that driver sends on its connection reaches the
host's channel, as the kept Python driver's answers do (``python.py``).
"""

from __future__ import annotations

from importlib import resources

from ...kept.sandbox import Sandbox
from ...model.errors import CommandNotFoundError
from .driver import HELLO_TIMEOUT, Driver, unavailable
from .python import socket_path

SOURCE = resources.files(__package__).joinpath("driver.js").read_text(encoding="utf-8")
HINTS = {
    "javascript": "it needs node (Node.js 16 or later) inside the sandbox (Debian: apt-get install nodejs)",
    "typescript": "it needs node (Node.js 16 or later) and the typescript module inside the sandbox "
                  "(Debian: apt-get install nodejs node-typescript; or npm install -g typescript)",
}


# The relay: the host's channel (descriptor 3) and pipes on one side, the kept driver's connection on the other.
# It interrupts first what the driver may still run for the last server (a cell busy on the CPU reads no
# connection's end): the driver takes a SIGINT between cells as nothing.
RELAY = r'''
'use strict';
const fs = require('fs');
const net = require('net');
const place = process.argv[1];
let driver = 0;
const interrupt = () => {
  if (Number.isSafeInteger(driver) && driver > 1) {
    try {
      process.kill(driver, 'SIGINT');
    } catch (error) {
      // gone
    }
  }
};
try {
  driver = Number(fs.readFileSync(place.replace(/\.sock$/, '.pid'), 'ascii').trim());
} catch (error) {
  driver = 0;
}
if (process.argv[2] !== 'fresh') {
  interrupt();  // a context's first relay has no cell of an earlier server to stop (a late SIGINT would stop its first)
}
process.on('SIGINT', interrupt);  // the host's interrupt, passed on
process.on('SIGUSR1', () => {});
const channel = new net.Socket({ fd: 3, readable: true, writable: true });
const conn = net.connect(place);
conn.on('error', (error) => {
  process.stderr.write(`isolate: the context's interpreter is gone (${error.code})\n`);
  process.exit(1);
});
conn.on('close', () => process.exit(0));
channel.on('data', (chunk) => conn.write(chunk));
channel.on('end', () => process.exit(0));
channel.on('error', () => process.exit(0));
const writeAll = (fd, data) => {
  while (data.length) {
    try {
      data = data.subarray(fs.writeSync(fd, data));
    } catch (error) {
      if (error.code !== 'EAGAIN') {
        return;
      }
    }
  }
};
let pending = Buffer.alloc(0);
let hello = true;
conn.on('data', (chunk) => {
  pending = Buffer.concat([pending, chunk]);
  while (pending.length >= 5) {
    const size = pending.readUInt32BE(1);
    if (pending.length < 5 + size) {
      break;
    }
    const kind = String.fromCharCode(pending[0]);
    const body = pending.subarray(5, 5 + size);
    pending = pending.subarray(5 + size);
    if (kind === 'o' || kind === 'e') {
      writeAll(kind === 'o' ? 1 : 2, body);  // before the answer that follows: the host has it with the answer
    } else if (kind === 'c') {
      if (hello) {
        hello = false;
        const said = /^hello ([0-9]{1,9})\n$/.exec(body.toString('latin1'));
        driver = said === null ? 0 : Number(said[1]);
      }
      channel.write(body);
    }
  }
});
'''


def _heap(box: Sandbox) -> list[str]:
    # V8 sizes its heap to the host's memory, not the sandbox's (it sees no cgroup inside): under a memory
    # limit, half of it. A cell past it still ends the driver (V8's heap exhaustion is fatal), but with its
    # cause on stderr, and before the kernel's OOM killer picks a victim among the sandbox's processes.
    memory = box.policy.limits.value("memory")
    return [] if memory is None else [f"--max-old-space-size={max(16, int(memory) // 2 >> 20)}"]


def start(box: Sandbox, language: str) -> Driver:
    return Driver(box, ["node", *_heap(box), "-e", SOURCE, "--", language], {}, language, HINTS[language])


def start_kept(box: Sandbox, language: str, context_id: str) -> None:
    """Start a kept driver (see the top of ``driver.js``); a relay then connects to it (``connect``)."""
    try:
        done = box.exec(["node", *_heap(box), "-e", SOURCE, "--", language, "--kept", socket_path(context_id)],
                        timeout=HELLO_TIMEOUT)
    except CommandNotFoundError as exc:
        raise unavailable(language, str(exc), HINTS[language]) from None
    if done.returncode != 0:
        raise unavailable(language, (done.stderr.strip().splitlines() or ["it ended without a word"])[-1],
                          HINTS[language])


def connect(box: Sandbox, language: str, context_id: str, fresh: bool = False) -> Driver:
    """A relay to the kept driver of the context: its hello names the driver (``Driver.said_pid``). Not ``fresh``
    (a later server's), it first interrupts a cell the driver may still run for the last server."""
    return Driver(box, ["node", "-e", RELAY, socket_path(context_id), *(["fresh"] if fresh else [])], {}, language,
                  HINTS[language])
