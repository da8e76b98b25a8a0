"""``isolate-run``: run a command in a sandbox from the shell.

Exit status: the command's own; 128+N when it died of signal N; 125 when
isolate-run itself failed (bad option, a protection that cannot be enforced,
setup error), with one line on stderr; 126 when the command cannot be
executed; 127 when it is not found. No traceback ever reaches the user.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from ..model.errors import CommandNotExecutableError, CommandNotFoundError, IsolationError, PolicyError, SetupError
from ..model.policy import Policy
from ..model.report import Report, ReportTarget
from ..model.units import format_size
from . import startup
from .flags import CliError, build_parser, policy_from_args, refuse_empty

EXIT_SETUP = 125
EXIT_CANNOT_EXECUTE = 126
EXIT_NOT_FOUND = 127
#: After SIGTERM/SIGHUP, how long the program may take before the sandbox is killed.
TERM_GRACE_SECONDS = 2.0


def _kill_sandbox(process: Any) -> None:
    try:
        process.kill()
    except OSError:
        pass


def explain(policy: Policy, command: Sequence[str]) -> str:
    """What would run, and which mechanism enforces each part."""
    from ..backends import native
    from ..oneshot import runs as popen

    lines = [f"command: {' '.join(command) if command else '(none given)'}"]
    backend = popen.choose_backend(policy)
    lines.append(f"backend: {backend}")
    lines.extend(explain_paths(policy, command))
    lines.append("policy:")
    lines.extend("  " + line for line in policy.to_toml().splitlines())
    if backend == "native":
        prepared = native.prepare(policy, list(command) or ["true"])
        try:
            lines.append("enforced by:")
            for key, value in prepared.enforced.items():
                lines.append(f"  {key}: {json.dumps(value)}")
            for warning in prepared.warnings:
                lines.append(f"warning: {warning}")
        finally:
            prepared.discard()
    return "\n".join(lines)


def explain_paths(policy: Policy, command: Sequence[str]) -> list[str]:
    """Each granted path as given and as resolved on the host, the home, the working directory,
    the PATH the program gets and where the command resolves."""
    from ..backends import native
    from ..model.policy import DEFAULT_READ

    cwd = os.getcwd()
    lines = ["paths (as given -> on the host):"]
    granted: list[str] = []
    image = None
    if policy.image is not None:
        from ..image import Image

        image = Image.find(policy.image)
        lines.append(f"  image {policy.image} -> " + (f"{image.reference} ({image.short_id}, {len(image.layers)} "
                                                      "layers): the root, read-only under a private upper layer"
                                                      if image else "not in the image store"))
    for kind, paths in (("read", policy.read), ("write", policy.write)):
        if image is not None and kind == "read" and policy.read == DEFAULT_READ:
            lines.append("  read  (the host's system directories: not shown, the image is the system)")
            continue
        for path in paths:
            absolute = os.path.normpath(os.path.join(cwd, os.path.expanduser(path)))
            if not os.path.exists(absolute):
                lines.append(f"  {kind:5} {path} (absent here: skipped)")
                continue
            real = os.path.realpath(absolute)
            granted += [absolute, real]
            shown = path if path == absolute else f"{path} = {absolute}"
            lines.append(f"  {kind:5} {shown}" + (f" -> {real}" if real != absolute else ""))
    for path in policy.tmpfs:
        lines.append(f"  tmpfs {path} (private, empty)")
    if policy.home is not None:
        kind = "a private tmpfs" if policy.namespaces else "a kept directory private to the program's uid"
        lines.append(f"  home  {policy.home} ({kind}; HOME points at it)")
        for name in policy.home_files:
            source = os.path.join(os.path.expanduser("~"), name)
            lines.append(f"  home-file {source} -> {os.path.join(policy.home, os.path.basename(name))} (read-only)")
    lines.append(f"  cwd   {policy.cwd or cwd}")
    if image is not None:
        from ..image import view

        search = policy.env.get("PATH") or image.config.environment().get("PATH") or native.DEFAULT_PATH
        lines.append(f"  PATH  {search}")
        if command:
            program = command[0]
            places = [program] if "/" in program else [f"{d}/{program}" for d in search.split(":") if d]
            found = next((p for p in places if view.kind(image.lower_dirs(), p)), None)
            lines.append(f"  command {program} -> "
                         + (f"{found} (in the image)" if found else "not found in the image"))
        return lines
    search = policy.env.get("PATH") or native.reduced_path(os.environ.get("PATH", native.DEFAULT_PATH), granted)
    lines.append(f"  PATH  {search}")
    if command:
        program = command[0]
        found = program if "/" in program else native.which(program, search)
        lines.append(f"  command {program} -> {found or 'not found inside the sandbox'}")
    return lines


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _number(value: float) -> str:
    return f"{value:g}"


def limit_message(policy: Policy, report: Report) -> str | None:
    """The one line that says which limit ended the run (None: no limit did)."""
    limits = policy.limits
    memory, wall, cpu = limits.value("memory"), limits.value("wall_seconds"), limits.value("cpu_seconds")
    fsize, pids = limits.value("file_size"), limits.value("pids")
    if report.status == "memory":
        size = format_size(int(memory)) if memory is not None else "(set by best effort)"
        return f"killed: memory limit {size} reached"
    if report.status == "timeout" and wall is not None:
        return f"killed: wall-clock limit {_number(wall)} s"
    if report.status == "cpu":
        return f"killed: CPU time limit {_number(cpu)} s reached" if cpu is not None else "killed: CPU time limit"
    if report.status == "file-size":
        size = format_size(int(fsize)) if fsize is not None else "RLIMIT_FSIZE"
        return f"killed: file size limit {size} reached (SIGXFSZ)"
    if "pids" in report.limits_reached and pids is not None and report.status != "ok":
        return f"pids limit {int(pids)} reached: a fork or thread creation failed inside the sandbox"
    return None


def _say_limit(policy: Policy, report: Report) -> None:
    message = limit_message(policy, report)
    if message:
        print(f"isolate-run: {message}", file=sys.stderr)


def run_command(policy: Policy, command: list[str], report_target: ReportTarget | None) -> int:
    from ..oneshot import runs as popen

    backend = popen.choose_backend(policy)
    if backend == "docker":
        status = startup.release()  # the Docker client stops as it always did
        if status is not None:
            return status
        result = popen.run(command, policy=policy)
        report = result.report
        for warning in report.warnings:
            print(f"isolate-run: warning: {warning}", file=sys.stderr)
        _say_limit(policy, report)
        if report_target:
            report_target.write(report)
        return _exit_status(result.returncode)

    # The handlers go in before the sandbox starts: a signal sent as soon as the program runs (or
    # while it starts) is the program's, never isolate-run's own death with the sandbox left behind.
    started: list[popen.Popen] = []
    pending: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        if not started:
            pending.append(signum)
            return
        process = started[0]
        try:
            process.send_signal(signum)
        except (ProcessLookupError, OSError):
            pass
        if signum in (signal.SIGTERM, signal.SIGHUP):
            # isolate-run is going away: a program that ignores the signal
            # gets a grace period, then the whole sandbox is killed.
            timer = threading.Timer(TERM_GRACE_SECONDS, _kill_sandbox, (process,))
            timer.daemon = True
            timer.start()

    previous = {}
    for signum in startup.SIGNALS:
        if signal.getsignal(signum) != signal.SIG_IGN:  # ignored at the start: the program's stays ignored too
            previous[signum] = signal.signal(signum, forward)
    # One that came before (during the planning): the run ends here, nothing started (startup.py).
    status = startup.stopped()
    if status is not None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        return status
    try:
        process = popen.Popen(command, policy=policy)
        started.append(process)
        for early in pending:
            forward(early, None)
        for warning in process.warnings:
            print(f"isolate-run: warning: {warning}", file=sys.stderr)
        returncode = process.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    report = process.report or Report()
    _say_limit(policy, report)
    if returncode != 0:
        for line in denial_hints(report, policy):
            print(f"isolate-run: {line}", file=sys.stderr)
    if report_target:
        report_target.write(report)
    return _exit_status(returncode)


def denial_hints(report: Report, policy: Policy) -> list[str]:
    """One line for the first refused network destination, the first refused unix socket and, when
    denials are traced, the first refused file access."""
    from .why import file_hint, first_file_denial

    lines: list[str] = []
    entry = first_file_denial(report.denied)
    if entry is not None:
        lines.append(file_hint(entry, policy))
    network = policy.network if isinstance(policy.network, str) else "none"
    for entry in report.denied:
        mechanism = entry.get("mechanism")
        if mechanism == "egress" and not any(line.startswith("egress") for line in lines):
            what = entry.get("host") or entry.get("address") or "?"
            port = f":{entry['port']}" if entry.get("port") else ""
            lines.append(f"egress to {_printable(str(what))}{port} was refused: {_printable(str(entry.get('reason')))}")
        elif mechanism == "network" and not any(line.startswith("the network") for line in lines):
            host = entry["address"]
            where = f"[{host}]:{entry['port']}" if ":" in host else f"{host}:{entry['port']}"
            what = "off" if network == "none" else "loopback only"
            lines.append(f"the network is {what} (--net {network}): connect to {where} was refused; "
                         "allow it with --net host")
        elif mechanism == "unix-socket" and not any(line.startswith("unix socket") for line in lines):
            if entry.get("path"):
                # The program chose the path: nothing in it may reach the terminal as a control sequence.
                path = _printable(entry["path"])
                lines.append(f"unix socket {path} is outside the writable paths (--net {network}): "
                             f"connect was refused; allow it with --unix-socket {path}")
            else:
                lines.append(f"unix socket: AF_UNIX datagram sockets are refused under --net {network} on this "
                             "kernel (no Landlock ABI 9); use stream sockets, or --net host")
    return lines


def _printable(text: str) -> str:
    """What the program chose, with nothing in it that reaches the terminal as a control sequence."""
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)


def _setup_error_report(target: ReportTarget | None, error: Exception) -> None:
    if not target or not target.pending:
        return
    report = Report(status="setup-error", exit_code=None)
    report.error = {"type": type(error).__name__, "message": str(error)}
    if isinstance(error, SetupError):
        report.error.update({"step": error.step, "errno": error.errno, "detail": error.detail})
    try:
        target.write(report)
    except IsolationError as exc:
        print(f"isolate-run: {exc}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args and args[0] in ("doctor", "sandbox", "image", "learn", "serve"):
            # They stop by a signal as they always did (startup.py records them for a run only).
            status = startup.release()
            if status is not None:
                return status
        if args and args[0] == "doctor":
            from .doctor import doctor_main

            return doctor_main(args[1:])
        if args and args[0] == "sandbox":
            from .sandbox import sandbox_main

            return sandbox_main(args[1:])
        if args and args[0] == "image":
            from .image import image_main

            return image_main(args[1:])
        if args and args[0] == "learn":
            return _learn(args[1:])
        if args and args[0] == "serve":
            from ..server import serve_main

            return serve_main(args[1:])
        return _main(args)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except BrokenPipeError:
        return EXIT_SETUP
    except Exception as exc:  # never a traceback for a CLI user (unless ISOLATE_DEBUG asks for one)
        # What the parsers and checks missed (a RecursionError of deep input, a ValueError of a value no
        # check saw) is still one line naming its kind, and isolate-run's own exit status.
        if os.environ.get("ISOLATE_DEBUG"):
            import traceback

            traceback.print_exc()
        print(f"isolate-run: unexpected {type(exc).__name__}: {_printable(str(exc))[:500]} (ISOLATE_DEBUG=1 shows "
              "where; please report it)", file=sys.stderr)
        return EXIT_SETUP


def _explain_report(path: str) -> int:
    """``isolate-run --explain --report REPORT.json`` (no command): each refusal of a finished run, and the
    flag that grants it."""
    from .why import explain_report

    try:
        lines = explain_report(path)
    except ValueError as exc:
        print(f"isolate-run: explain: {exc}", file=sys.stderr)
        return EXIT_SETUP
    for line in lines or ["nothing was refused"]:
        print(line)
    return 0


def _learn(args: list[str]) -> int:
    from .learn import learn_main

    try:
        return learn_main(args)
    except (CliError, PolicyError, IsolationError) as exc:
        print(f"isolate-run: learn: {exc}", file=sys.stderr)
        return EXIT_SETUP
    except OSError as exc:
        print(f"isolate-run: learn: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
        return EXIT_SETUP


def _main(args: list[str]) -> int:
    report_target: ReportTarget | None = None
    if not startup.received and signal.getsignal(signal.SIGTERM) is not startup._record:
        startup.record()  # not through the native binary's boot script: from here
    try:
        options = build_parser().parse_args(args)
        refuse_empty(options)
        if options.explain and options.report and not options.command:
            return _explain_report(options.report)  # after a run: its report explained
        if options.report and not options.explain:
            # Opened before anything runs: the program may replace the path's
            # directory by a link while it runs; the report goes where the
            # directory was when isolate-run started.
            report_target = ReportTarget(options.report)
        command = list(options.command)
        if command and command[0] == "--":
            command = command[1:]
        policy = policy_from_args(options)
        if options.explain:
            print(explain(policy, command))
            return 0
        if not command:
            raise CliError("no command given: isolate-run [OPTIONS] -- COMMAND [ARG...]")
        return run_command(policy, command, report_target)
    except CommandNotFoundError as exc:
        print(f"isolate-run: {exc.strerror}", file=sys.stderr)
        _setup_error_report(report_target, exc)
        return EXIT_NOT_FOUND
    except CommandNotExecutableError as exc:
        print(f"isolate-run: {exc.strerror}", file=sys.stderr)
        _setup_error_report(report_target, exc)
        return EXIT_CANNOT_EXECUTE
    except (CliError, PolicyError, IsolationError) as exc:
        print(f"isolate-run: {exc}", file=sys.stderr)
        _setup_error_report(report_target, exc)
        return EXIT_SETUP
    except OSError as exc:
        print(f"isolate-run: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
        _setup_error_report(report_target, exc)
        return EXIT_SETUP
    finally:
        if report_target:
            report_target.close()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
