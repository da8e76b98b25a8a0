"""``isolate-run serve``'s code contexts beyond Python and bash: Java (JShell), TypeScript and JavaScript
(Node.js), Go; through the real code-interpreter SDK (``code_interpreter``), as upstream's e2e suites drive
them, and the refusal of a language whose toolchain the sandbox lacks. The server runs as in
tests/test_server.py.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import test_server as base

pytest.importorskip("code_interpreter", reason="the code-interpreter SDK is missing: pip install "
                    "'isolate[server-test]'")

from code_interpreter import CodeInterpreterSync
from code_interpreter.models.code import SupportedLanguage
from opensandbox import SandboxSync
from opensandbox.config import ConnectionConfigSync
from opensandbox.exceptions import SandboxException

import isolate
from isolate.server.code import CodeContext
from isolate.server.models import ApiError


def needs(*tools: str) -> None:
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not on this host (CI installs them: "
                    "apt-get install default-jdk-headless nodejs node-typescript golang-go)")


server = base.server  # the suite's server, started once for this module


@pytest.fixture(scope="module")
def interpreter(server: base.Server) -> Iterator[CodeInterpreterSync]:
    sandbox = SandboxSync.create("ubuntu", connection_config=ConnectionConfigSync(domain=server.domain,
                                                                                  api_key=base.KEY))
    try:
        # No Jupyter behind this server: its strict health check (a Jupyter port) is skipped.
        yield CodeInterpreterSync.create(sandbox=sandbox, skip_health_check=True)
    finally:
        sandbox.kill()
        sandbox.close()


def stdout(execution: object) -> list[str]:
    """The execution's stdout, as the server streams it: a message a line."""
    return [m.text for m in execution.logs.stdout]  # type: ignore[attr-defined]


def interrupted_after(interpreter: CodeInterpreterSync, context: object, code: str) -> tuple[object, float]:
    """Run ``code`` (which does not end by itself) and interrupt it after a second: its execution, and
    how long the run took."""
    def stop() -> None:
        time.sleep(1)
        interpreter.codes.interrupt(context.id)  # type: ignore[attr-defined]

    stopper = threading.Thread(target=stop)
    started = time.monotonic()
    stopper.start()
    execution = interpreter.codes.run(code, context=context)  # type: ignore[arg-type]
    stopper.join()
    return execution, time.monotonic() - started


def test_java_context_keeps_snippets_and_names_errors_as_ijava(interpreter: CodeInterpreterSync) -> None:
    needs("java")
    context = interpreter.codes.create_context(SupportedLanguage.JAVA)
    assert context.language == "java"
    r = interpreter.codes.run('System.out.println("Hello from Java!");\nint result = 2 + 2;\n'
                              'System.out.println("2 + 2 = " + result);\nresult', context=context)
    assert (stdout(r), [x.text for x in r.result], r.error) == (["Hello from Java!", "2 + 2 = 4"], ["4"], None)
    # State stays: an import, a method, a variable of an earlier cell.
    r = interpreter.codes.run("import java.util.*;\nint twice(int n) { return 2 * n; }\n"
                              "List<Integer> numbers = Arrays.asList(1, 2, 3);\ntwice(result) + numbers.size()",
                              context=context)
    assert [x.text for x in r.result] == ["11"] and r.error is None
    r = interpreter.codes.run("int x = 10 / 0; // ArithmeticException", context=context)
    assert (r.error.name, r.error.value) == ("EvalException", "java.lang.ArithmeticException: / by zero")
    r = interpreter.codes.run("int y = notDeclared;", context=context)
    assert r.error.name == "CompilationException" and "cannot find symbol" in r.error.value
    r, took = interrupted_after(interpreter, context, "while (true) { Thread.sleep(10); }")
    assert r.error is not None and took < 20
    r = interpreter.codes.run("numbers.get(2) * 10", context=context)
    assert [x.text for x in r.result] == ["30"]


def test_typescript_and_javascript_contexts(interpreter: CodeInterpreterSync) -> None:
    needs("node")
    ts = interpreter.codes.create_context(SupportedLanguage.TYPESCRIPT)
    r = interpreter.codes.run("interface Person { name: string; age: number }\n"
                              "const person: Person = { name: 'John', age: 30 };\n"
                              "const numbers: number[] = [1, 2, 3, 4, 5];\n"
                              "console.log(`Person: ${person.name}, Age: ${person.age}`);\n"
                              "numbers.reduce((a: number, b: number) => a + b, 0)", context=ts)
    assert (stdout(r), [x.text for x in r.result], r.error) == (["Person: John, Age: 30"], ["15"], None)
    r = interpreter.codes.run("person.age + numbers.length", context=ts)  # declarations stay
    assert [x.text for x in r.result] == ["35"]
    # A cell run again declares its names again (top-level const and let become var).
    r = interpreter.codes.run("const person: Person = { name: 'Ann', age: 40 };\nperson.age", context=ts)
    assert ([x.text for x in r.result], r.error) == (["40"], None)
    r = interpreter.codes.run("Promise.resolve(person.name.toUpperCase())", context=ts)
    assert [x.text for x in r.result] == ["'ANN'"]
    r = interpreter.codes.run("throw new Error('ts-runtime-error');", context=ts)
    assert (r.error.name, r.error.value) == ("Error", "ts-runtime-error")
    r = interpreter.codes.run("let broken: number = ;", context=ts)
    assert r.error.name == "TSError"
    r, took = interrupted_after(interpreter, ts, "while (true) {}")
    assert r.error is not None and took < 20
    assert [x.text for x in interpreter.codes.run("person.age", context=ts).result] == ["40"]

    js = interpreter.codes.create_context(SupportedLanguage.JAVASCRIPT)
    r = interpreter.codes.run("const os = require('os');\nlet n = 6;\nconsole.log(os.platform());\nn * 7",
                              context=js)
    assert (stdout(r), [x.text for x in r.result]) == (["linux"], ["42"])
    # The JavaScript context is a realm of its own: the TypeScript context's names are not in it.
    r = interpreter.codes.run("typeof person", context=js)
    assert [x.text for x in r.result] == ["'undefined'"]


def test_go_context_builds_and_runs_each_cell(interpreter: CodeInterpreterSync) -> None:
    needs("go")
    go = interpreter.codes.create_context(SupportedLanguage.GO)
    r = interpreter.codes.run('package main\nimport "fmt"\nfunc calculate(numbers []int) int {\n'
                              '    sum := 0\n    for _, n := range numbers { sum += n }\n    return sum\n}\n'
                              'func main() {\n    fmt.Println("Sum:", calculate([]int{1, 2, 3, 4, 5}))\n}',
                              context=go)
    assert (stdout(r), r.error) == (["Sum: 15"], None)
    # No package clause: package main is added. A file the program writes stays for the next cell.
    r = interpreter.codes.run('import "os"\nfunc main() { os.WriteFile("go-was-here", []byte("yes"), 0o644) }',
                              context=go)
    assert r.error is None
    r = interpreter.codes.run('import ("fmt"; "os")\nfunc main() { b, _ := os.ReadFile("go-was-here"); '
                              'fmt.Print(string(b)); os.Exit(3) }', context=go)
    assert stdout(r) == ["yes"] and r.error is not None and r.error.value == "1"  # go run's status for exit 3
    r = interpreter.codes.run("package main\nfunc main() {\n    undeclaredVariable++\n}", context=go)
    assert r.error is not None
    assert "undefined: undeclaredVariable" in "".join(m.text for m in r.logs.stderr)


def test_a_language_whose_toolchain_the_sandbox_lacks_is_refused_with_the_way_out(
        interpreter: CodeInterpreterSync) -> None:
    # The JDK's and Go's homes and Debian's Node.js modules (the typescript module's) hidden under empty tmpfs.
    homes = {os.path.dirname(os.path.dirname(os.path.realpath(path)))
             for path in map(shutil.which, ("java", "go")) if path}
    modules = {path for path in ("/usr/share/nodejs", "/usr/lib/node_modules", "/usr/local/lib/node_modules")
               if os.path.isdir(path)}
    hidden = tuple(sorted(homes | modules))
    policy = isolate.Policy(tmpfs=(*isolate.Policy().tmpfs, *hidden))
    with isolate.Sandbox(policy) as box:
        for language, package in (("java", "default-jdk-headless"), ("typescript", "node-typescript"),
                                  ("go", "golang-go")):
            with pytest.raises(ApiError) as refused:
                CodeContext(box, language)
            assert refused.value.code == "UNSUPPORTED_LANGUAGE"
            assert f"the {language} context did not start: " in refused.value.message
            assert package in refused.value.message
        assert box.exec("echo alive").stdout == "alive\n"  # a refused context leaves the sandbox as it was
    # Through the API: the spec's error shape, the reason in its message.
    with pytest.raises(SandboxException) as refused_by_api:
        interpreter.codes.create_context("cobol")
    assert "is not served here" in str(refused_by_api.value)


def test_code_contexts_benchmark_runs() -> None:
    """benchmarks/code_contexts.py runs (one round, a Python and a Go context); its figures are not asserted."""
    needs("go")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        from benchmarks import code_contexts as bench
    finally:
        sys.path.pop(0)
    results = bench.run(1, 2, lambda message: None, ("python", "go"))
    assert results["python"]["start-host"]["n"] == 1 and results["python"]["cell-sandboxed"]["n"] == 2
    assert results["go"]["start-sandboxed"]["n"] == 1


# -- what a hostile cell, or another process of the sandbox, does to the host's side of a context ------

@pytest.fixture(scope="module")
def box() -> Iterator[isolate.Sandbox]:
    with isolate.Sandbox(isolate.Policy(network="loopback")) as sandbox:
        yield sandbox


def run_cell(context: CodeContext, code: str, emit_delay: float = 0.0,
             interrupt_after: float | None = None) -> tuple[dict[str, object] | None, bytes, float]:
    """Run a cell in a thread; its answer (None when the run did not end within 15 s), its output, the time."""
    answer: list[dict[str, object]] = []
    output = bytearray()

    def emit(kind: str, payload: object) -> None:
        if kind == "done":
            answer.append(payload)  # type: ignore[arg-type]
        else:
            output.extend(payload)  # type: ignore[arg-type]
            time.sleep(emit_delay)  # a client that reads at its own pace

    started = time.monotonic()
    runner = threading.Thread(target=context.run, args=(code, emit), daemon=True)
    runner.start()
    if interrupt_after is not None:
        time.sleep(interrupt_after)
        context.interrupt()
    runner.join(15)
    return (answer[0] if answer else None), bytes(output), time.monotonic() - started


def test_a_process_a_cell_leaves_writing_does_not_hold_the_cells_end(box: isolate.Sandbox) -> None:
    # Before: after the answer the host read the output until the pipe was empty, which writers the cell
    # left behind (and a client slower than them) never let happen: the run streamed on, for ever.
    context = CodeContext(box, "python")
    try:
        answer, _, took = run_cell(context, "import subprocess, time\n"
                                        "writers = [subprocess.Popen(['yes']) for _ in range(4)]\n"
                                        "time.sleep(0.5)\n1", emit_delay=0.005)
        assert answer is not None and answer["result"] == "1" and took < 5
    finally:
        context.close()


#: A cell that starts two sleeps, one in a session of its own, and gives their pids.
_LEAVES = {
    "python": "import subprocess\n"
              "a = subprocess.Popen(['sleep', '1000'])\n"
              "b = subprocess.Popen(['sleep', '1001'], start_new_session=True)\n"
              "f'{a.pid} {b.pid}'",
    "javascript": "const cp = require('child_process');\n"
                  "const a = cp.spawn('sleep', ['1000']);\n"
                  "const b = cp.spawn('sleep', ['1001'], { detached: true });\n"
                  "`${a.pid} ${b.pid}`",
}


@pytest.mark.parametrize(("language", "kept"), [("python", False), ("python", True), ("javascript", True)],
                         ids=["ends-with-server", "kept", "kept-javascript"])
def test_the_processes_a_cell_leaves_end_with_its_context(box: isolate.Sandbox, language: str, kept: bool) -> None:
    # Before: a kept Python context's interpreter (a process of the sandbox, in a session of its own) was killed
    # alone, and what its cells had started ran on after the context's deletion: a child of its own, and one in
    # a session of its own. A kept JavaScript context's realm (issue 38) is such a process too.
    if language == "javascript":
        needs("node")
    context = CodeContext(box, language, kept=kept)
    assert context.kept == kept
    try:
        answer, _, _ = run_cell(context, _LEAVES[language])
        assert answer is not None, "the cell did not end"
        pids = str(answer["result"]).strip("'").split()
        assert len(pids) == 2
    finally:
        context.close()
    deadline = time.monotonic() + 10
    while True:
        left = box.exec(["sh", "-c", " ".join(f"kill -0 {pid} 2>/dev/null && echo {pid};" for pid in pids)])
        if not left.stdout.strip() or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left.stdout.strip(), f"still running after the context's deletion: {left.stdout.split()}"


_REUSED_PID = r"""
import os, signal, sys, time
from isolate.server.code.proctree import end_with_descendants

driver = os.fork()
if driver == 0:
    time.sleep(60)
    os._exit(0)
pidfd = os.pidfd_open(driver)
os.kill(driver, signal.SIGKILL)  # a cell ended its interpreter; the server still holds its pidfd and pid
os.waitpid(driver, 0)
with open("/proc/sys/kernel/ns_last_pid", "w") as f:  # the pid taken again, by a process of no sandbox
    f.write(str(driver - 1))
r, w = os.pipe()
other = os.fork()
if other == 0:
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    os.write(w, str(child).encode())
    _, status = os.waitpid(child, 0)
    os._exit(os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0)
assert other == driver, (other, driver)
child = int(os.read(r, 32))
end_with_descendants(pidfd, driver)
time.sleep(0.2)
try:
    os.kill(child, signal.SIGTERM)  # ours, when the server left it alone
except ProcessLookupError:
    pass
_, status = os.waitpid(other, 0)
print(os.WEXITSTATUS(status))
"""


def test_ending_a_context_whose_interpreter_ended_kills_no_process_that_took_its_pid() -> None:
    # Before: the context's end walked the children of its interpreter's pid number with no check that the
    # number was still the interpreter's: a cell that ended its interpreter (its pid free, taken again by any
    # process of the host; pid_max may be 32768) made the server stop and SIGKILL that process's children.
    # A PID namespace of the test's own sets which process takes the pid (ns_last_pid).
    import subprocess

    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is missing")
    run = subprocess.run(["unshare", "-Urpf", "--mount-proc", sys.executable, "-c", _REUSED_PID],
                         capture_output=True, text=True, timeout=60)
    if run.returncode != 0 and "unshare" in run.stderr:
        pytest.skip(f"no user and PID namespace here: {run.stderr.strip()}")
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [str(15)], "the child of the process that took the interpreter's pid was " \
        f"killed by the server (signal {run.stdout.strip()}), not left to its owner"


def test_a_driver_that_ends_leaving_its_channel_held_ends_the_cell(box: isolate.Sandbox) -> None:
    # Before: the channel never came to its end (a child held it), and the run waited until close().
    context = CodeContext(box, "python")
    try:
        answer, _, _ = run_cell(context, "import os, sys, subprocess\n"
                                   "channel = sys._getframe(1).f_globals['channel']\n"
                                   "os.set_inheritable(channel, True)\n"
                                   "subprocess.Popen(['sleep', '1000'], pass_fds=(channel,))\nos._exit(0)")
        assert answer is not None and answer["error"]["ename"] == "ContextDied"  # type: ignore[index]
    finally:
        context.close()


def test_a_context_closed_during_a_run_leaves_its_descriptors_to_the_run(box: isolate.Sandbox) -> None:
    # Before: close() closed the descriptors a run still polled; the server's next pipes took their numbers,
    # and the run read another stream's data as the cell's output.
    context = CodeContext(box, "python")
    first = threading.Event()
    release = threading.Event()
    got: list[tuple[str, object]] = []

    def emit(kind: str, payload: object) -> None:
        got.append((kind, payload))
        if kind == "stdout" and not first.is_set():
            first.set()
            release.wait(10)  # a slow client: the run is held here while the context is closed

    runner = threading.Thread(target=context.run, args=("print('first', flush=True)\nimport time\n"
                                                        "while True: time.sleep(1)", emit), daemon=True)
    runner.start()
    assert first.wait(10)
    context.close()
    pipes = [os.pipe() for _ in range(8)]
    try:
        for _, w in pipes:
            os.write(w, b"another stream\n")
        release.set()
        runner.join(10)
        assert not runner.is_alive()
        assert b"another stream" not in b"".join(p for k, p in got if k != "done")  # type: ignore[misc]
        assert got[-1][0] == "done"
    finally:
        for r, w in pipes:
            os.close(r)
            os.close(w)


def test_a_go_cell_ends_with_its_program_whatever_it_leaves_running(box: isolate.Sandbox) -> None:
    # Before: the run waited for the end of the pipes, which a child the program left (deaf to SIGINT)
    # held for ever, past interrupt() and close().
    needs("go")
    context = CodeContext(box, "go")
    try:
        answer, output, _ = run_cell(context, 'import ("fmt"; "os"; "os/exec")\nfunc main() {\n'
                                     '    c := exec.Command("sh", "-c", "trap \\"\\" INT; exec sleep 1000")\n'
                                     '    c.Stdout = os.Stdout\n    c.Start()\n    fmt.Println("started")\n}')
        assert answer is not None and answer["error"] is None and output == b"started\n"
    finally:
        context.close()
    with pytest.raises(RuntimeError):  # a run that waited for the lock starts nothing after close()
        context._engine.run("func main() {}", lambda kind, payload: None)


@pytest.mark.parametrize("kept", [False, True], ids=["ends-with-server", "kept"])
def test_javascript_interrupt_stops_an_awaited_promise(box: isolate.Sandbox, kept: bool) -> None:
    # Kept (issue 38): the interrupt goes to the relay, which passes it on to the realm it is connected to.
    needs("node")
    context = CodeContext(box, "javascript", kept=kept)
    assert context.kept == kept
    try:
        answer, _, _ = run_cell(context, "new Promise(() => {})", interrupt_after=0.5)
        assert answer is not None and "interrupted" in answer["error"]["evalue"]  # type: ignore[index]
        answer, output, _ = run_cell(context, "console.error('to stderr'); 6 * 7")
        assert answer is not None and answer["result"] == "42" and output == b"to stderr\n"
    finally:
        context.close()


FIND_DRIVER = ("for p in /proc/[0-9]*; do case \"$(tr '\\0' ' ' < $p/cmdline 2>/dev/null)\" in {}) "
               "echo ${{p#/proc/}};; esac; done")


#: The Java driver's command line (a shell pattern).
JAVA_DRIVER = "java\\ *DisableAttachMechanism*"


def driver_pid(box: isolate.Sandbox, command_line: str) -> str:
    """The pid, inside the sandbox, of the one process whose command line matches (a shell pattern)."""
    pids = box.exec(["sh", "-c", FIND_DRIVER.format(command_line)]).stdout.split()
    assert len(pids) == 1, pids
    return pids[0]


def test_no_other_process_opens_the_node_inspector_of_a_context(box: isolate.Sandbox) -> None:
    # Before: SIGUSR1 from any process of the sandbox opened the inspector on loopback, from where it ran
    # code in the driver's realm (and answered for it).
    needs("node")
    context = CodeContext(box, "javascript")
    try:
        assert box.exec(["kill", "-USR1", driver_pid(box, "node\\ *-e*")]).returncode == 0
        time.sleep(0.5)
        answer, _, _ = run_cell(context, "String(require('inspector').url())")
        assert answer is not None and answer["result"] == "'undefined'"
    finally:
        context.close()


def test_no_other_process_attaches_to_the_jvm_of_a_context(box: isolate.Sandbox) -> None:
    # Before: jcmd (and an agent it loads) from any process of the sandbox reached the driver's JVM.
    needs("java", "jcmd")
    context = CodeContext(box, "java")
    try:
        attach = box.exec(["jcmd", driver_pid(box, JAVA_DRIVER), "VM.version"], timeout=30)
        assert attach.returncode != 0 and "OpenJDK" not in attach.stdout
    finally:
        context.close()


def test_no_other_process_replaces_the_source_of_a_java_driver(box: isolate.Sandbox) -> None:
    # Before: the launcher wrote the driver's source to a temporary directory of the sandbox's, and another
    # process of the same uid renamed its own source over it before the JVM read it: its code was the
    # driver, and answered for every cell. Now the JVM reads a sealed memfd of the host's as its stdin.
    needs("java")
    context = CodeContext(box, "java")
    try:
        source = f"/proc/{driver_pid(box, JAVA_DRIVER)}/fd/0"
        assert box.exec(["readlink", source]).stdout.startswith("/memfd:isolate-java-driver")
        assert "public final class IsolateDriver" in box.exec(["cat", source]).stdout  # read, from its start
        # Neither written nor truncated, through the driver's own descriptor or a new open of it.
        for attempt in (f"echo forged >> {source}", f"echo forged > {source}", f"truncate -s 0 {source}"):
            assert box.exec(["sh", "-c", attempt]).returncode != 0, attempt
        answer, _, _ = run_cell(context, "6 * 7")
        assert answer is not None and answer["result"] == "42"
    finally:
        context.close()


def test_a_java_cell_past_the_memory_limit_gets_an_outofmemoryerror_not_a_killed_driver() -> None:
    # Before: the JVM saw no cgroup inside the sandbox and sized its heap to the host's memory (5.8 GB here
    # under a 512 MB limit); a cell allocating past the limit had the whole driver killed.
    needs("java")
    policy = isolate.Policy(limits=isolate.Limits(memory="512M"), best_effort=True)
    with isolate.Sandbox(policy) as sandbox:
        context = CodeContext(sandbox, "java")
        try:
            answer, _, _ = run_cell(context, "var kept = new java.util.ArrayList<int[]>();\n"
                                             "for (int i = 0; i < 600; i++) kept.add(new int[1 << 18]);")  # 600 MiB
            assert answer is not None and "OutOfMemoryError" in answer["error"]["evalue"], answer  # type: ignore[index]
            answer, _, _ = run_cell(context, "kept = null; Runtime.getRuntime().maxMemory() <= 512L << 20")
            assert answer is not None and answer["result"] == "true", answer
        finally:
            context.close()


def test_a_node_cell_past_the_memory_limit_ends_the_driver_with_its_cause() -> None:
    # Before: V8 sized its heap to the host's memory, and the kernel's OOM killer ended the driver (or
    # another process of the sandbox) without a word. Now V8's heap is half the limit: its own error says why.
    needs("node")
    # 1 GiB: under an address-space limit (no cgroup) V8 needs that much reserved to start at all.
    policy = isolate.Policy(limits=isolate.Limits(memory="1G"), best_effort=True)
    with isolate.Sandbox(policy) as sandbox:
        context = CodeContext(sandbox, "javascript")
        try:
            answer, said, _ = run_cell(context, "var keep = [];\n"
                                          "for (let i = 0; i < 1200; i++) keep.push(new Array(1 << 17).fill(i));")
            assert b"out of memory" in said.lower() or b"oom" in said.lower(), said[-300:]
            assert answer is not None and answer["error"]["ename"] == "ContextDied"  # type: ignore[index]
        finally:
            context.close()
