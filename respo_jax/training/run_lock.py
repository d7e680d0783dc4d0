"""One writer per output directory: an exclusive advisory lock held for a command's whole run.

Training, the sweep's cells and evaluation each write a directory that two processes must never write
together (two logs would interleave, two checkpoint writers collide). `RunLock.acquire` takes an
exclusive `flock` on `<dir>/.lock`; the kernel drops it when the process exits, however it exits, so a
`kill -9` never leaves a stale lock behind. A second writer is refused at once, in one line naming the
holder (its pid, host and command, written into the lock file by the holder), before it writes anything.

Why `flock` and not a pid file: a pid file outlives a killed process and has to be judged stale by
guessing; the kernel's lock is exactly as long-lived as the process holding it. The holder removes the
lock file when it releases the lock (a process that opened the old file meanwhile sees that and opens the
new one), so a finished run leaves no `.lock`; one a kill left behind is only a file, not a lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time

from respo_jax.training.config import ConfigError
from respo_jax.training.write_errors import startup_write_error

LOCK_FILE = ".lock"


class RunLockedError(ConfigError):
    """Another live process holds the directory's lock (a start-up refusal: exit status 2)."""


class RunLock:
    """An exclusive lock on a directory, held from `acquire` until `release` (or the process's end).

    `acquire(directory, what)` creates the directory when it is missing; `release(remove_if_created=True)`
    then removes it again if nothing but the lock file was written into it, so a refused start leaves
    nothing behind.
    """

    def __init__(self, directory: str, handle, created: bool):
        self.directory, self._handle, self._created = directory, handle, created
        self.path = os.path.join(directory, LOCK_FILE)

    @classmethod
    def acquire(cls, directory: str, what: str, key: str = "run.out_dir") -> "RunLock":
        """Locks `directory` for `what` (e.g. "training", "evaluation"); RunLockedError if it is held, a
        ConfigError naming `key` when the directory cannot be created or written (read-only, full, a
        path below a file, a name too long, a symlink loop, a pseudo-file system such as /proc): the
        lock file is the run's first write, so it probes the directory."""
        created = not os.path.isdir(directory)
        path = os.path.join(directory, LOCK_FILE)
        try:
            os.makedirs(directory, exist_ok=True)
            while True:
                handle = open(path, "a+", encoding="utf-8")
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    handle.seek(0)
                    holder = _describe(handle.read())
                    handle.close()
                    raise RunLockedError(f"{directory!r} is being written by another process ({holder}); "
                                         "wait for it to finish or choose another output directory") from None
                except BaseException:
                    handle.close()
                    raise
                if _same_file(handle, path):
                    break
                handle.close()  # a holder removed the file between our open and our lock: take the new one
            try:
                handle.seek(0)
                handle.truncate()
                handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "what": what,
                                         "command": " ".join(sys.argv),
                                         "since": time.strftime("%Y-%m-%d %H:%M:%S")}))
                handle.flush()
            except BaseException:
                handle.close()
                raise
        except OSError as err:  # any: a path too long, under a pseudo-file system, a symlink loop, ...
            if created and os.path.isdir(directory) and not os.listdir(directory):
                os.rmdir(directory)
            raise startup_write_error(err, key, directory) from None
        return cls(directory, handle, created)

    def release(self, remove_if_created: bool = False) -> None:
        """Drops the lock and removes the lock file (while still holding it, so no other process can
        be holding it). With `remove_if_created`, a directory that `acquire` created and that holds
        nothing else is removed as well (a refused start leaves no trace)."""
        if self._handle is None:
            return
        try:
            if _same_file(self._handle, self.path):
                os.remove(self.path)
            if remove_if_created and self._created and not os.listdir(self.directory):
                os.rmdir(self.directory)
        except OSError:
            pass  # the lock itself goes with the descriptor; a leftover file is harmless
        finally:
            self._handle.close()  # closing the descriptor releases the flock
            self._handle = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.release(remove_if_created=exc_type is not None)


def _same_file(handle, path: str) -> bool:
    """True when `path` still names the file open in `handle` (a releasing holder removes it)."""
    try:
        return os.path.samestat(os.fstat(handle.fileno()), os.stat(path))
    except FileNotFoundError:
        return False


def _describe(text: str) -> str:
    """A one-line description of the holder from the lock file's JSON (best effort)."""
    try:
        info = json.loads(text)
        return (f"{info.get('what', 'a run')}, pid {info.get('pid')} on {info.get('host')} since "
                f"{info.get('since')}: {info.get('command', '')}")
    except (ValueError, AttributeError):
        return "a process that has not yet described itself"
