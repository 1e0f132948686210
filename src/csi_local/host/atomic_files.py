"""Atomic file replacement, for the state file, the page-token key and the
host volume plugin's installed files: a reader (or a process restarted after
kill -9 at any point) sees the old file or the new one, never a part."""

from __future__ import annotations

import contextlib
import os
import threading


def write_atomic(path: str, text: str, mode: int = 0o600) -> None:
    """Replace `path` with `text`: temp file, fsync, rename, fsync of the directory."""
    directory = os.path.dirname(path) or "."
    tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    sync_directory(directory)


def sync_directory(directory: str) -> None:
    """fsync a directory: a name made, renamed or removed in it survives a crash."""
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
