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
'use strict';
// SIGUSR1 would open Node's inspector on 127.0.0.1:9229, where any process of the sandbox that reaches
// loopback could run code in this realm and answer for the driver: a listener of ours keeps it shut.
process.on('SIGUSR1', () => {});
const net = require('net');
const path = require('path');
const util = require('util');
const vm = require('vm');

const language = process.argv[process.argv.length - 1];  // node -e SOURCE -- LANGUAGE
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

const channel = new net.Socket({ fd: 3, readable: true, writable: true });
let pending = Buffer.alloc(0);
let count = 0;
let running = false;

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

async function next() {
  if (running) {
    return;
  }
  running = true;
  for (;;) {
    const newline = pending.indexOf(10);
    if (newline < 0 || newline > 20) {
      if (newline > 20 || pending.length > 20) {
        process.exit(2);  // not a length: the channel is not the host's
      }
      break;
    }
    const length = Number(pending.subarray(0, newline).toString('ascii'));
    if (!Number.isSafeInteger(length) || length < 0) {
      process.exit(2);
    }
    if (pending.length < newline + 1 + length) {
      break;
    }
    const code = pending.subarray(newline + 1, newline + 1 + length).toString('utf8');
    pending = pending.subarray(newline + 1 + length);
    count += 1;
    const { result, error } = await run(code);
    // The cell's output first: the host has it all with the answer.
    await new Promise((resolve) => process.stdout.write('', resolve));
    await new Promise((resolve) => process.stderr.write('', resolve));
    await new Promise((resolve) => channel.write(JSON.stringify({ count, result, error }) + '\n', resolve));
  }
  running = false;
}

channel.on('data', (chunk) => {
  pending = Buffer.concat([pending, chunk]);
  next();
});
channel.on('end', () => process.exit(0));
channel.on('error', () => process.exit(0));
if (require('inspector').url() !== undefined) {
  process.exit(2);  // opened before our SIGUSR1 listener was: this realm may not be the driver's alone
}
channel.write('hello\n');
