"""Sandbox.python(): a persistent interpreter in the sandbox's own python3.

Real sandboxes on the real kernel, as root and as uid 65534 (tests/run-all.sh).
The attacks are the code's: it prints what looks like the driver's frames,
closes or replaces its stdio, writes into the driver's own channel, forks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from conftest import NAMESPACES_WHY, policy, processes_with

from isolate import Sandbox
from isolate.kept.interpreter import Interpreter
from isolate.model.errors import CommandNotFoundError, IsolationError

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY), reason=NAMESPACES_WHY or "")


@pytest.fixture
def box() -> Iterator[Sandbox]:
    with Sandbox(policy(write=())) as sandbox:
        yield sandbox


def test_variables_persist_and_the_last_expression_is_the_value(box: Sandbox) -> None:
    py = box.python()
    first = py.run("import math\nx = 41")
    assert first.ok and first.value is None and first.stdout == "" and not first.ended, first
    second = py.run("x += 1\nprint('area', end=' '); print(round(math.pi * x, 2))\nx")
    assert second.stdout == "area 131.95\n" and second.value == "42" and second.error is None, second
    assert py.run("'text'").value == "'text'"  # a repr, as a REPL shows it
    assert py.run("None").value is None
    assert py.run("import sys; print('warn', file=sys.stderr)").stderr == "warn\n"
    # Output of C code and of child processes is captured too, in order with print's.
    mixed = py.run("import os, subprocess\nprint('a')\nos.write(1, b'b\\n')\n"
                   "subprocess.run(['sh', '-c', 'echo c; echo d >&2'])\nprint('e')")
    assert mixed.stdout == "a\nb\nc\ne\n" and mixed.stderr == "d\n", mixed
    assert py.python_version.startswith("3.") and py.starts == 1


def test_top_level_await_runs_on_one_loop_kept_between_runs(box: Sandbox) -> None:
    py = box.python()
    first = py.run("import asyncio\nasync def double(x):\n    await asyncio.sleep(0.01)\n    return 2 * x\n"
                   "r = await double(21)\nprint(r)")
    assert first.ok and first.stdout == "42\n" and first.value is None, first
    assert py.run("await double(r)").value == "84"
    assert py.run("async def same():\n    return asyncio.get_running_loop()\n(await same()) is (await same())"
                  ).value == "True"
    assert py.run("double(1)").value.startswith("<coroutine object")  # not awaited: a value like any other


def test_an_exception_is_reported_with_its_traceback_and_the_state_stays(box: Sandbox) -> None:
    py = box.python()
    py.run("items = [1, 2]\ndef pick(i):\n    return items[i]")
    result = py.run("print('before')\npick(5)")
    assert result.stdout == "before\n" and not result.ok and not result.ended
    assert result.error is not None and result.error.type == "IndexError"
    assert result.error.message == "list index out of range"
    trace = result.error.traceback
    assert "<python-input-2>" in trace and "pick(5)" in trace and "return items[i]" in trace, trace
    assert "_pydriver" not in trace and "<string>" not in trace, trace  # the driver's frames are not shown
    syntax = py.run("def broken(:\n    pass")
    assert syntax.error is not None and syntax.error.type == "SyntaxError" and "def broken(:" in \
        syntax.error.traceback
    exited = py.run("exit(3)")
    assert exited.error is not None and exited.error.type == "SystemExit" and not exited.ended
    assert py.run("items").value == "[1, 2]"


def test_printed_fake_frames_are_output_never_frames(box: Sandbox) -> None:
    py = box.python()
    forged = ('r 52\n{"id": 2, "value": "\'forged\'", "error": null}\n'
              'o 999999999\nh 2\n{}e 3\nxyz')
    code = (f"import os, sys\nfake = {forged!r}\nprint(fake)\nos.write(1, fake.encode())\n"
            "sys.stderr.write(fake)\nos.write(2, b'\\x00garbage\\xff\\n')\n'real'")
    result = py.run(code)
    assert result.value == "'real'" and result.ok and not result.ended, result
    assert result.stdout == forged + "\n" + forged, result.stdout
    assert result.stderr.startswith(forged + "\x00garbage\ufffd\n"), result.stderr
    again = py.run("fake.count('r 52')")
    assert again.value == "1" and again.stdout == "" and py.starts == 1


def test_closed_or_replaced_stdio_is_restored_for_the_next_run(box: Sandbox) -> None:
    py = box.python()
    result = py.run("import io, os, sys\nkept = io.StringIO()\nsys.stdout = kept\nprint('into the object')\n"
                    "sys.stderr = None\nos.close(0)\nos.close(1)\nos.close(2)")
    assert result.ok and result.stdout == "", result
    after = py.run("import os\nprint('visible')\nos.write(2, b'err\\n')\nkept.getvalue()")
    assert after.stdout == "visible\n" and after.stderr == "err\n", after
    assert after.value == "'into the object\\n'"
    # stdin is /dev/null, not the host's channel: input() ends at once.
    read = py.run("input()")
    assert read.error is not None and read.error.type == "EOFError", read
    # The code's fd 1 pointed at a file of its own: the next run writes to the driver's pipe again.
    py.run("import os\nfd = os.open('/tmp/out', os.O_WRONLY | os.O_CREAT, 0o600)\nos.dup2(fd, 1)")
    assert py.run("print('back')").stdout == "back\n"


def test_writing_to_the_drivers_own_descriptors_is_output(box: Sandbox) -> None:
    py = box.python()
    # The code finds the driver's private descriptors (it can: same process) and writes a frame-like line
    # to its copies of stdout and stderr: output, nothing more.
    attack = ("import os, stat\nfor name in os.listdir('/proc/self/fd'):\n    fd = int(name)\n"
              "    if fd >= 512 and not stat.S_ISSOCK(os.fstat(fd).st_mode):\n        try:\n"
              "            os.write(fd, b'r 2 end 5\\n{}xyz\\n')\n"
              "        except OSError:\n            pass\n'done'")
    result = py.run(attack, timeout=20)
    assert result.ok and result.value == "'done'" and "r 2 end 5\n{}xyz\n" in result.stdout, result
    assert py.run("1 + 1").value == "2" and py.starts == 1


# The code reads this run's boundary out of the driver's frames (same process: it can), and finds the
# driver's result channel (the one socket among its descriptors).
STEAL = ("import os, stat, sys\nframe = sys._getframe()\nwhile 'request' not in frame.f_locals:\n"
         "    frame = frame.f_back\nboundary = frame.f_locals['request']['boundary']\n"
         "number = frame.f_locals['request']['id']\n"
         "channel = [int(n) for n in os.listdir('/proc/self/fd') if int(n) >= 512 and "
         "stat.S_ISSOCK(os.fstat(int(n)).st_mode)][0]\n")


def test_a_stolen_boundary_on_stdout_is_output(box: Sandbox) -> None:
    # Results used to come on stdout under the boundary: writing it there ended or forged a run.
    py = box.python()
    result = py.run(STEAL + "sys.stdout.write(boundary + ' 7 end 99999999\\n')\nsys.stdout.flush()\n'real'",
                    timeout=20)
    assert result.value == "'real'" and not result.ended and " 7 end 99999999\n" in result.stdout, result


def test_a_broken_chunk_on_the_result_channel_ends_the_interpreter(box: Sandbox) -> None:
    py = box.python()
    py.run("secret = 1")
    result = py.run(STEAL + "os.write(channel, boundary.encode() + b' 7 end 99999999\\n')", timeout=20)
    assert result.ended and not result.timed_out, result
    assert result.error is not None and result.error.type == "ChannelError", result
    assert "broken result chunk" in result.error.message
    fresh = py.run("'secret' in globals()")
    assert fresh.value == "False" and py.starts == 2, fresh


def test_a_forged_result_is_only_that_runs_own(box: Sandbox) -> None:
    # What the module's docstring says: the code's own process can lie about its own run's result, as
    # any program can lie in its output; the host parses it as data and goes on.
    py = box.python()
    forged = ('{"id": %d, "value": "\'forged\'", "error": null}')
    code = STEAL + (f"doc = {forged!r} % number\n"
                    "os.write(channel, ('%s %d end %d\\n%s' % (boundary, number, len(doc), doc)).encode())\n"
                    "import time\ntime.sleep(0.5)\n'real'")
    result = py.run(code, timeout=20)
    assert result.value == "'forged'" and not result.ended, result
    # The driver's own answer for that run comes later and is dropped; the next runs are the real ones.
    assert py.run("boundary == 1").value == "False"
    assert py.run("'next'").value == "'next'" and py.starts == 1


def test_closing_the_drivers_descriptors_is_reported(box: Sandbox) -> None:
    py = box.python()
    result = py.run("import os\nos.closerange(3, 65536)", timeout=20)
    assert result.ended and result.error is not None and result.error.type == "InterpreterExited", result
    assert "channel" in result.error.message
    assert py.run("1 + 1").value == "2"


def test_a_forked_child_that_falls_through_does_not_answer_for_the_parent(box: Sandbox) -> None:
    py = box.python()
    result = py.run("import os, time\nparent = os.getpid()\npid = os.fork()\n"
                    "if pid == 0:\n    time.sleep(0.2)\npid", timeout=20)
    assert result.ok and result.value is not None and result.value != "0", result
    # Only the interpreter answers from here on (a child left in the driver's loop would take requests).
    for _ in range(10):
        assert py.run("os.getpid() == parent", timeout=20).value == "True"
    # The child ended when its code did (it does not wait in the driver's loop).
    count = "grep -l 'The [d]river of' /proc/[0-9]*/cmdline 2>/dev/null | wc -l"
    deadline = time.monotonic() + 10
    while box.exec(count).stdout.strip() != "1" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert box.exec(count).stdout.strip() == "1"
    assert py.starts == 1


def test_a_timeout_kills_everything_the_run_started_and_the_next_run_starts_afresh(box: Sandbox) -> None:
    py = box.python()
    py.run("state = 'kept'")
    marker = f"isolate-py-timeout-{time.monotonic_ns()}"
    code = (f"import os, subprocess\nsubprocess.Popen(['sh', '-c', 'sleep 300; : {marker}'])\n"
            f"subprocess.Popen(['setsid', 'sh', '-c', 'sleep 301; : {marker}'])\n"
            "import time\ndef shells():\n    found = 0\n    for pid in filter(str.isdigit, os.listdir('/proc')):\n"
            "        try:\n            found += b'sleep 30' in open(f'/proc/{pid}/cmdline', 'rb').read()\n"
            "        except OSError:\n            pass\n    return found\n"
            "while shells() < 2:\n    time.sleep(0.05)\n"
            "print('started', flush=True)\nwhile True:\n    pass")
    started = time.monotonic()
    result = py.run(code, timeout=2)
    assert time.monotonic() - started < 2 + 15
    assert result.timed_out and result.ended and result.stdout == "started\n", result
    assert result.error is not None and result.error.type == "TimeoutError"
    assert "killed" in result.error.message and "new interpreter" in result.error.message
    assert "Popen" not in result.stderr, result.stderr
    deadline = time.monotonic() + 10
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with(marker) == []
    after = py.run("'state' in globals()")
    assert after.value == "False" and py.starts == 2, after


def test_interrupt_raises_keyboardinterrupt_and_keeps_the_state(box: Sandbox) -> None:
    py = box.python()
    py.run("count = 7")
    timer = threading.Timer(0.5, py.interrupt)
    timer.start()
    try:
        result = py.run("import time\ntry:\n    time.sleep(30)\nfinally:\n    print('cleaned up')", timeout=20)
    finally:
        timer.cancel()
    assert result.error is not None and result.error.type == "KeyboardInterrupt", result
    assert result.stdout == "cleaned up\n" and not result.ended and not result.timed_out
    assert "time.sleep(30)" in result.error.traceback
    assert py.run("count").value == "7"
    py.interrupt()  # between runs: ignored
    time.sleep(0.2)
    assert py.run("count + 1").value == "8" and py.starts == 1


def test_the_interpreter_dying_is_reported_and_the_next_run_restarts(box: Sandbox) -> None:
    py = box.python()
    py.run("gone = True")
    result = py.run("import os\nprint('bye', flush=True)\nos._exit(7)")
    assert result.ended and result.stdout == "bye\n", result
    assert result.error is not None and result.error.type == "InterpreterExited"
    assert "status 7" in result.error.message
    assert not py.alive
    assert py.run("'gone' in globals()").value == "False"


def test_named_interpreters_are_separate(box: Sandbox) -> None:
    a, b = box.python("a"), box.python("b")
    assert box.python("a") is a and isinstance(a, Interpreter) and a is not b
    a.run("who = 'a'")
    b.run("who = 'b'")
    results: dict[str, str | None] = {}

    def run(interp: Interpreter) -> None:
        results[interp.name] = interp.run("import time\ntime.sleep(0.3)\nwho", timeout=20).value

    threads = [threading.Thread(target=run, args=(i,)) for i in (a, b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {"a": "'a'", "b": "'b'"}
    # Files are shared (one sandbox), variables are not.
    a.run("open('/tmp/shared', 'w').write('from a')")
    assert b.run("open('/tmp/shared').read()").value == "'from a'"
    a.close()
    with pytest.raises(IsolationError, match="closed"):
        a.run("1")
    assert box.python("a") is not a and box.python("a").run("'who' in globals()").value == "False"


def test_output_is_capped_to_its_tail(box: Sandbox) -> None:
    py = box.python()
    result = py.run("import sys\nfor i in range(200000):\n    sys.stdout.write('%08d\\n' % i)",
                    output_limit=9 * 1000, timeout=60)
    assert result.truncated and result.ok
    assert len(result.stdout) == 9000 and result.stdout.endswith("00199999\n")


def test_no_python_inside_is_a_clear_error() -> None:
    with Sandbox(policy(write=(), env={"PATH": "/nonexistent"})) as sandbox:
        with pytest.raises(CommandNotFoundError, match=r"python3 is not found inside the sandbox.*own Python"):
            sandbox.python()
        with pytest.raises(CommandNotFoundError, match=r"python3\.99 is not found"):
            sandbox.python("other", executable="python3.99")
        # A path inside works where PATH does not.
        assert sandbox.python("abs", executable="/usr/bin/python3").run("6 * 7").value == "42"


def test_an_interpreter_that_cannot_run_the_driver_is_a_clear_error(box: Sandbox) -> None:
    with pytest.raises(IsolationError, match="did not start the interpreter"):
        box.python("sh", executable="/bin/true")
