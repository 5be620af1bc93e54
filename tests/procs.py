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
