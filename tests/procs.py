"""Processes as /proc shows them (Linux), for the tests that kill some; processes started as a
terminal would start them, for the tests that interrupt some; code run at the start of a child."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator

# Run before the command it is given: Ctrl-C (SIGINT) back to its default disposition, as a terminal
# starts a command. A test run started in the background (`nohup make test &`, a CI runner without job
# control) ignores SIGINT, and an ignored signal stays ignored across fork and exec.
_SIGINT_DEFAULT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                   "os.execvp(sys.argv[1], sys.argv[1:])")


def _stat(pid: int) -> list[str]:
    return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # (after the command name)


def children(pid: int) -> set[int]:
    """The processes whose parent is `pid`."""
    found = set()
    for entry in filter(str.isdigit, (p.name for p in pathlib.Path("/proc").iterdir())):
        try:
            if int(_stat(int(entry))[1]) == pid:
                found.add(int(entry))
        except OSError:
            continue
    return found


def alive(pid: int) -> bool:
    """Running, or able to (not ended, and not a zombie waiting to be reaped)."""
    try:
        return _stat(pid)[0] != "Z"
    except OSError:
        return False


def run_bounded(args: list[str], seconds: float, hung: str, stderr: int = subprocess.PIPE) -> tuple[str, str]:
    """(stdout, stderr) of a fresh process in a session of its own; past `seconds`, its whole group is
    killed and an AssertionError says `hung` (what it means that the process never ended)."""
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
    try:
        return process.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise AssertionError(hung) from None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str, processes: int, *args: str, timeout: float = 300) -> None:
    """`script args` in `processes` torchrun processes on 127.0.0.1 (gloo), the repository importable;
    an AssertionError with the end of their output if any fails."""
    import sys

    repo = pathlib.Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "MASTER_ADDR": "127.0.0.1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(processes),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), script, *args]
    done = subprocess.run(command, env=env, cwd=repo, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def end_process_group() -> None:
    """The end of a torchrun process's script: without it, gloo's threads may still hold work when the
    interpreter is torn down, and the process aborts at exit ("terminate called without an active
    exception", pytorch#190489)."""
    import torch.distributed

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def interruptible(args: list[str], **popen: object) -> subprocess.Popen:
    """`subprocess.Popen(args, **popen)` of a command that Ctrl-C (SIGINT) interrupts as at a terminal,
    however this test run was started."""
    return subprocess.Popen([sys.executable, "-c", _SIGINT_DEFAULT, *args], **popen)  # type: ignore[call-overload]


@contextlib.contextmanager
def ctrl_c_as_at_a_terminal() -> Iterator[None]:
    """While inside, in this process: SIGINT raises KeyboardInterrupt (Python's own handler, as in a
    run started at a terminal), and processes started inside do not ignore it; then it is as before."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def with_startup_code(env: dict[str, str], folder: pathlib.Path, code: str) -> dict[str, str]:
    """`env` for a Python child whose every process (its pool or cluster workers included: they inherit
    the environment) runs `code` at startup: a `sitecustomize` module in `folder`, first on PYTHONPATH.
    How a test holds a child's work at a point of its own choosing, without waiting on the clock."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(  # (Python would go on without it, and the test mean nothing)
        f"try:\n{textwrap.indent(code, '    ')}\nexcept BaseException:\n    import os, traceback\n"
        f"    traceback.print_exc()\n    os._exit(70)\n")
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH", "")]))}
