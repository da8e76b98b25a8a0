// The TypeScript and JavaScript code contexts' driver: one Node.js realm, one cell at a time.
//
// Cells and answers travel on descriptor 3, a socket the host handed over and
// no other process of the sandbox holds (a socket cannot be reopened through
// /proc). A cell is "<length>\n<UTF-8 source>"; its answer is one line of JSON
// ({"count", "result", "error"}), written once the cell's output is flushed.
// Cells run as scripts of this realm (vm.runInThisContext), so a top-level
// declaration stays for the next cell, as in Node's REPL; the value of a
// cell's last expression is its result. TypeScript is transpiled by the
// sandbox's own `typescript` module (types are removed, not checked: a type
// error does not stop a cell, as with ts-node --transpile-only).
//
// Kept (a context of a kept sandbox, issue 38): `-- LANGUAGE --kept PATH` starts a second driver in a
// session of its own (`--kept-driver PATH`) that outlives the command, and so the server: it listens on
// PATH, a socket of the sandbox's private /tmp, and serves one host at a time. Node cannot take a
// descriptor from another process, so each server's relay (node.py's RELAY) connects there and carries
// the protocol over that connection: from the driver, frames (a kind byte, a 4-byte big-endian length,
// the bytes) of the cell's output ("o", "e") and of the channel ("c": the hello, then the answers); to
// it, the cells as they are. A host gone mid-cell interrupts the cell (the next relay sends SIGINT first
// too, for a cell still running on the CPU), and what that cell writes afterwards goes to no host.
'use strict';
// SIGUSR1 would open Node's inspector on 127.0.0.1:9229, where any process of the sandbox that reaches
// loopback could run code in this realm and answer for the driver: a listener of ours keeps it shut.
process.on('SIGUSR1', () => {});
const net = require('net');
const path = require('path');
const util = require('util');
const vm = require('vm');

const [language, mode = '', place = ''] = process.argv.slice(1);  // node -e SOURCE -- LANGUAGE [MODE PATH]
let ts = null;
if (language === 'typescript') {
  const where = ['/usr/share/nodejs', '/usr/lib/node_modules', '/usr/local/lib/node_modules',
    ...(process.env.NODE_PATH || '').split(path.delimiter).filter(Boolean)];
  for (const dir of where) {
    try {
      ts = require(path.join(dir, 'typescript'));
      break;
    } catch (error) {
      // not there: the next place
    }
  }
  if (ts === null) {
    process.stderr.write('isolate: the typescript context needs the typescript module inside the sandbox ' +
      '(apt-get install node-typescript, or npm install -g typescript)\n');
    process.exit(3);
  }
}
// What a cell sees as a script of this realm: require and module, as in the REPL.
globalThis.require = require;
globalThis.module = module;
globalThis.exports = module.exports;
// Between cells SIGINT does nothing; during one it stops the cell: a running script through vm's
// breakOnSigint, a promise the cell's value awaits through interruptCell (no script runs then).
let interruptCell = null;
process.on('SIGINT', () => {
  if (interruptCell !== null) {
    interruptCell();
  }
});


// A cell's top-level const and let become var: a cell run again (a notebook's way), or one that failed
// after its declaration, may declare the same name again; a realm's lexical names could never be.
function redeclarable() {
  return (file) => ts.factory.updateSourceFile(file, file.statements.map((statement) => (
    ts.isVariableStatement(statement) && (statement.declarationList.flags & ts.NodeFlags.BlockScoped)
      ? ts.factory.updateVariableStatement(statement, statement.modifiers,
        ts.factory.createVariableDeclarationList(statement.declarationList.declarations, ts.NodeFlags.None))
      : statement)));
}

function transpile(code) {
  if (ts === null) {
    return code;
  }
  const output = ts.transpileModule(code, {
    reportDiagnostics: true,
    compilerOptions: { target: ts.ScriptTarget.ES2022, module: ts.ModuleKind.CommonJS, esModuleInterop: true },
    transformers: { before: [redeclarable] },
  });
  const errors = (output.diagnostics || []).filter((d) => d.category === ts.DiagnosticCategory.Error);
  if (errors.length) {
    const error = new SyntaxError(errors.map((d) => ts.flattenDiagnosticMessageText(d.messageText, '\n')).join('\n'));
    error.name = 'TSError';
    throw error;
  }
  return output.outputText;
}

// A stack's lines down to the cell's own frames: what the driver and vm add below them is not the cell's.
function cellFrames(stack) {
  const lines = stack.split('\n');
  const end = lines.findIndex((line) => /^\s+at .*(node:vm|\[eval\]|sigintHandlersWrap)/.test(line));
  return end < 0 ? lines : lines.slice(0, end);
}

async function run(code) {
  let result = null;
  let error = null;
  try {
    let value = vm.runInThisContext(transpile(code), { filename: '<cell>', breakOnSigint: true });
    if (value !== null && typeof value === 'object' && typeof value.then === 'function') {
      const settling = value;  // a cell whose value is a promise answers with what it settles to
      value = await new Promise((resolve, reject) => {
        interruptCell = () => reject(new Error('Script execution was interrupted by `SIGINT`'));
        settling.then(resolve, reject);
      }).finally(() => {
        interruptCell = null;
      });
    }
    if (value !== undefined) {
      result = util.inspect(value);
    }
  } catch (thrown) {
    const isError = thrown instanceof Error || (thrown !== null && typeof thrown === 'object' && 'stack' in thrown);
    error = {
      ename: isError ? String(thrown.name) : typeof thrown,
      evalue: isError ? String(thrown.message) : util.inspect(thrown),
      traceback: isError && thrown.stack ? cellFrames(String(thrown.stack)) : [],
    };
  }
  return { result, error };
}

// The host the cells come from: its bytes not yet read as cells, how to answer it, how to drop it.
let session = null;
let count = 0;
let running = false;

async function next() {
  if (running) {
    return;
  }
  running = true;
  for (;;) {
    const current = session;
    if (current === null) {
      break;
    }
    const newline = current.pending.indexOf(10);
    if (newline < 0 || newline > 20) {
      if (newline > 20 || current.pending.length > 20) {
        current.fail();  // not a length: the channel is not the host's
      }
      break;
    }
    const length = Number(current.pending.subarray(0, newline).toString('ascii'));
    if (!Number.isSafeInteger(length) || length < 0) {
      current.fail();
      break;
    }
    if (current.pending.length < newline + 1 + length) {
      break;
    }
    const code = current.pending.subarray(newline + 1, newline + 1 + length).toString('utf8');
    current.pending = current.pending.subarray(newline + 1 + length);
    count += 1;
    const { result, error } = await run(code);
    if (current === session) {  // a kept driver's host may have gone meanwhile: the answer is nobody's
      await current.answer(JSON.stringify({ count, result, error }) + '\n');
    }
  }
  running = false;
}

function serve() {
  const channel = new net.Socket({ fd: 3, readable: true, writable: true });
  session = {
    pending: Buffer.alloc(0),
    fail: () => process.exit(2),
    answer: async (text) => {
      // The cell's output first: the host has it all with the answer.
      await new Promise((resolve) => process.stdout.write('', resolve));
      await new Promise((resolve) => process.stderr.write('', resolve));
      await new Promise((resolve) => channel.write(text, resolve));
    },
  };
  channel.on('data', (chunk) => {
    session.pending = Buffer.concat([session.pending, chunk]);
    next();
  });
  channel.on('end', () => process.exit(0));
  channel.on('error', () => process.exit(0));
  channel.write('hello\n');
}

function frame(kind, data) {
  const head = Buffer.alloc(5);
  head[0] = kind.charCodeAt(0);
  head.writeUInt32BE(data.length, 1);
  return Buffer.concat([head, data]);
}

// A kept driver's output goes to its host of the moment, framed; with none, nowhere.
function divert(stream, kind) {
  stream.write = (chunk, encoding, callback) => {
    const done = typeof encoding === 'function' ? encoding : callback;
    const data = typeof chunk === 'string'
      ? Buffer.from(chunk, typeof encoding === 'string' ? encoding : 'utf8') : Buffer.from(chunk);
    if (session !== null && data.length) {
      session.sock.write(frame(kind, data));
    }
    if (typeof done === 'function') {
      process.nextTick(done);
    }
    return true;
  };
}

function keep() {
  const fs = require('fs');
  divert(process.stdout, 'o');
  divert(process.stderr, 'e');
  const waiting = [];
  const attach = () => {
    while (session === null && waiting.length) {
      const sock = waiting.shift();
      if (sock.destroyed) {
        continue;
      }
      const current = {
        sock,
        pending: Buffer.alloc(0),
        fail: () => sock.destroy(),
        answer: (text) => new Promise((resolve) => sock.write(frame('c', Buffer.from(text)), () => resolve())),
      };
      session = current;
      sock.on('data', (chunk) => {
        if (session === current) {
          current.pending = Buffer.concat([current.pending, chunk]);
          next();
        }
      });
      sock.on('close', () => {
        if (session === current) {
          session = null;
          if (interruptCell !== null) {
            interruptCell();  // its host is gone: the cell it asked for stops
          }
          attach();
        }
      });
      sock.write(frame('c', Buffer.from(`hello ${process.pid}\n`)));
    }
  };
  process.umask(0o077);
  try {
    fs.unlinkSync(place);
  } catch (error) {
    // none there
  }
  const listener = net.createServer((sock) => {
    sock.on('error', () => {});
    waiting.push(sock);
    attach();
  });
  listener.listen(place, () => {
    // Whom the next relay interrupts before it connects (see the top of this file).
    fs.writeFileSync(place.replace(/\.sock$/, '.pid'), `${process.pid}\n`);
  });
}

// Start the kept driver; end once it listens (its hello on PATH names it), or it ended.
function launch() {
  const keeper = require('child_process').spawn(process.execPath,
    [...process.execArgv, '--', language, '--kept-driver', place], { detached: true, stdio: 'ignore' });
  let listening = false;
  keeper.on('exit', (code, signal) => {
    if (!listening) {
      process.stderr.write(`isolate: the kept driver ended before it listened (${code === null ? signal : code})\n`);
      process.exit(1);
    }
  });
  const deadline = Date.now() + 50000;
  const attempt = () => {
    const probe = net.connect(place);
    let said = '';
    probe.on('data', (chunk) => {
      said += chunk.toString('latin1');  // its one frame: hello PID
      if (said.includes(`hello ${keeper.pid}\n`)) {
        listening = true;
        probe.destroy();
        process.exit(0);
      }
    });
    probe.on('error', () => {
      probe.destroy();
      if (Date.now() > deadline) {
        process.stderr.write('isolate: the kept driver did not listen in 50 s\n');
        process.exit(1);
      }
      setTimeout(attempt, 50);
    });
  };
  attempt();
}

if (require('inspector').url() !== undefined) {
  process.exit(2);  // opened before our SIGUSR1 listener was: this realm may not be the driver's alone
}
if (mode === '--kept') {
  launch();
} else if (mode === '--kept-driver') {
  keep();
} else {
  serve();
}
