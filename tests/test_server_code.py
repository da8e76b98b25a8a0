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


@pytest.fixture(scope="module")
def server() -> Iterator[base.Server]:
    srv = base.Server(*(() if base.limits_enforceable() else ("--best-effort",)))
    try:
        yield srv
    finally:
        srv.stop()


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
