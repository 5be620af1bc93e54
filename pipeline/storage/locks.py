"""File locks between the processes of a node (`flock`), never inherited by a forked child.

An flock belongs to the open file, and `fork` gives the child a copy of every descriptor: a copy
keeps the lock held after its holder lets go, for as long as the child lives. A DataLoader forks
its workers from a process that may hold one (a shard being hashed for `verify="sha256"`, a
download into the cache): the worker that then asks for the same lock would wait forever. So a
descriptor is registered here while it may hold a lock, and a forked child closes its copies at
once (`os.register_at_fork`; only a descriptor that is still the file it was registered for, so an
entry left by a descriptor closed elsewhere never closes another file); letting go unlocks before
closing, which releases a copy too."""

from __future__ import annotations

import contextlib
import fcntl
import os

__all__ = ["close", "lock", "unlock"]

_HELD: dict[int, tuple[int, int]] = {}  # descriptors that may hold a lock, in this process: (device, inode) each


def lock(fd: int, *, shared: bool = False, wait: bool = True) -> bool:
    """Lock the file open at `fd` (exclusive unless `shared`); without `wait`, False if another holds it.
    Where the filesystem has no locks, the OSError propagates."""
    found = os.fstat(fd)
    _HELD[fd] = (found.st_dev, found.st_ino)  # (before the lock: a fork in between leaves the child nothing to hold)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        _HELD.pop(fd, None)
        return False
    except BaseException:
        _HELD.pop(fd, None)
        raise
    return True


def unlock(fd: int) -> None:
    """Let go of the lock at `fd` (and of any copy's: a forked child that kept one)."""
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    _HELD.pop(fd, None)  # (after the unlock: a fork in between gives the child an unlocked copy)


def close(fd: int) -> None:
    """Unlock and close `fd`."""
    unlock(fd)
    os.close(fd)


def _forked() -> None:
    """In a forked child: close the copies of the parent's locked descriptors (only the forking
    thread runs here, so the table is not changing)."""
    for fd, file in list(_HELD.items()):
        with contextlib.suppress(OSError):
            found = os.fstat(fd)
            if (found.st_dev, found.st_ino) == file:
                os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_forked)
