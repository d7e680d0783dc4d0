"""Writes that fail (disk full, read-only file system, a path below a file) as one line a user can act on.

A full disk or an unwritable directory is not a bug in the trainer: the user has to make room or choose
another path. Each write of a run goes through `writing(what, path)`, which turns the `OSError` into a
`RunWriteError` naming the path, what was being written and how much space is free there; at start-up
(`startup_write_error`) the same message is a ConfigError, since nothing of the run was written yet.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from typing import Iterator

from respo_jax.training.config import ConfigError

# errno values that mean "this place cannot take the write", as opposed to a bug
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR,
                 errno.EEXIST, errno.EISDIR, errno.EFBIG, errno.EIO, errno.ENAMETOOLONG, errno.ELOOP}


class RunWriteError(RuntimeError):
    """A write of a running run failed (a run failure: exit status 1); the message is one line."""


def free_space(path: str) -> str:
    """'<n> MiB free' on the file system holding `path` (its nearest existing parent), or 'free space
    unknown' when none can be asked."""
    folder = os.path.abspath(path)
    while folder and not os.path.isdir(folder):
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    try:
        usage = shutil.disk_usage(folder)
    except OSError:
        return "free space unknown"
    return f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB on {folder}"


def is_write_error(err: BaseException) -> bool:
    """True for an OSError that says the place cannot be written (full, read-only, not a directory)."""
    return isinstance(err, OSError) and err.errno in _WRITE_ERRNOS


def describe(err: OSError, what: str, path: str) -> str:
    """'cannot write <what> to <path>: <reason> (<free space>)' — one line."""
    reason = err.strerror or type(err).__name__
    where = err.filename if isinstance(err.filename, str) and err.filename else path
    return f"cannot write {what} to {where}: {reason} [errno {err.errno}] ({free_space(where)})"


@contextlib.contextmanager
def writing(what: str, path: str, after: str = "") -> Iterator[None]:
    """Turns an OSError of the writes inside into a RunWriteError: `what` was being written to `path`;
    `after` is appended to the message (e.g. which checkpoint is kept)."""
    try:
        yield
    except OSError as err:
        if not is_write_error(err):
            raise
        raise RunWriteError(describe(err, what, path) + (f"; {after}" if after else "")) from None


def startup_write_error(err: OSError, key: str, path: str) -> ConfigError:
    """The ConfigError (exit status 2) for a path found unwritable at start-up (nothing written yet)."""
    return ConfigError(f"{key}={path!r}: {describe(err, 'the run directory', path)}; choose a writable "
                       "directory")
