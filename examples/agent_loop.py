"""An agent loop in a kept sandbox: run, read, edit, re-run, review the diff, commit.

What it shows
    ``isolate.Sandbox`` with a workspace copied from a project directory (here a
    throw-away one made in a temporary directory). The "agent" (plain code
    standing in for a model) runs the project's tests, reads the failing file,
    fixes it with ``replace_text``, writes a note with ``write_file``, runs the
    tests again, then looks at ``diff()`` and commits the workspace to a
    separate output directory. The project itself is never written: every
    command and edit happens in the sandbox's private copy (no network, writes
    only in the workspace, /tmp and its home; as root, the commands run as
    uid 65534).

How to run
    python examples/agent_loop.py          # Linux, isolate installed; root or not

It prints each step and ends with "committed: ...".
"""

from __future__ import annotations

import os
import sys
import tempfile

import isolate

CALC = '''\
def add(a, b):
    return a - b
'''

TESTS = '''\
from calc import add

assert add(2, 3) == 5, f"add(2, 3) gave {add(2, 3)}"
print("tests passed")
'''


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="agent-loop-") as tmp:
        project = os.path.join(tmp, "project")
        os.makedirs(os.path.join(project, ".git"))  # stands for what an agent should not see
        for name, text in (("calc.py", CALC), ("test_calc.py", TESTS)):
            with open(os.path.join(project, name), "w") as handle:
                handle.write(text)

        # No write grant besides the workspace (the default would also grant the current directory).
        policy = isolate.Policy(write=())
        workspace = isolate.Workspace(project, exclude=(".git",))
        with isolate.Sandbox(policy, workspace=workspace) as sb:
            # 1. Look around, and run the tests: they fail. (-B: no __pycache__ in the workspace, so the
            # diff below holds only the agent's changes, and no stale .pyc of the same size and second.)
            print("files:", sorted(e.path for e in sb.list_dir()))
            first = sb.exec(["python3", "-B", "test_calc.py"])
            print(f"tests: exit {first.returncode}: {first.stderr.strip().splitlines()[-1]}")

            # 2. Read the code and fix it, as the program sees its files.
            source = sb.read_file("calc.py")
            print("calc.py says:", source.splitlines()[1].strip())
            sb.replace_text("calc.py", "a - b", "a + b", count=1)
            sb.write_file("NOTES.md", "fixed add(): it subtracted\n")

            # 3. Run them again: every command of the sandbox sees the same files (and /tmp, and processes).
            second = sb.exec(["python3", "-B", "test_calc.py"])
            print(f"tests: exit {second.returncode}: {second.stdout.strip()}")
            who = sb.exec("id -u; pwd").stdout.split()  # a string runs under /bin/sh -c
            print("ran as uid", who[0], "in", who[1])
            if second.returncode != 0:
                return 1

            # 4. Review and commit: the project stays as it was, out/ gets the result.
            changes = sb.diff()
            print("diff: added", changes.added, "modified", changes.modified, "deleted", changes.deleted)
            out = os.path.join(tmp, "out")
            os.mkdir(out)
            sb.commit(target_dir=out)

        with open(os.path.join(project, "calc.py")) as handle:
            print("project calc.py unchanged:", handle.read() == CALC)
        with open(os.path.join(out, "calc.py")) as handle:
            fixed = "a + b" in handle.read()
        print("committed:", sorted(os.listdir(out)), "fixed" if fixed else "NOT FIXED")
        return 0 if fixed else 1


if __name__ == "__main__":
    sys.exit(main())
