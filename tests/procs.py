"""Processes as /proc shows them (Linux), for the tests that kill some."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess


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
