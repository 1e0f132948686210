"""What the fakes of tests/unit/fakes share: sizes, device numbers, the
simulated failure, argv parsing."""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

from csi_local.host.runner import Output, Result

GiB = 1 << 30
MiB = 1 << 20
DM_MAJOR = 253
LOOP_MAJOR = 7
DEVTMPFS = (0, 5)  # devtmpfs's own (anonymous) device numbers, as mountinfo shows them
HOST_FS = (0, 30)  # the file system tmp_path lives on, for binds of unmounted directories
_VFS_FLAGS = frozenset({"ro", "rw", "nosuid", "nodev", "noexec", "noatime", "nodiratime",
                        "relatime", "strictatime"})
_MIN_FS = {"xfs": 300 * MiB, "btrfs": 114 * MiB}
_WRONG_FS = ("mount: {t}: wrong fs type, bad option, bad superblock on {d}, missing codepage "
             "or helper program, or other error.")


class _Runs(Protocol):
    def run(self, argv: Sequence[str], *, ok_codes: Sequence[int] = (0,),
            input: str | bytes | None = None, timeout: float | None = None) -> Result: ...


class WholeOutputStreams:
    """Runner.stream for a fake Runner: its `run`'s whole output (or its
    CommandError, on entry), served as a binary file."""

    @contextlib.contextmanager
    def stream(self: _Runs, argv: Sequence[str], *, timeout: float | None = None
               ) -> Iterator[Output]:
        yield io.BytesIO(self.run(argv, timeout=timeout).stdout.encode())


class _Fail(Exception):
    """A simulated non-zero exit; run() turns it into a Result or CommandError."""

    def __init__(self, rc: int, stderr: str, stdout: str = "") -> None:
        super().__init__(stderr)
        self.rc, self.stderr, self.stdout = rc, stderr, stdout


def _options(argv: Sequence[str], valued: Iterable[str],
             flags: Iterable[str] = ()) -> tuple[dict[str, list[str]], list[str]]:
    """Split argv[1:] into {option: [values]} and positionals; unknown options
    are not simulated."""
    valued, flags = set(valued), set(flags)
    opts: dict[str, list[str]] = {}
    pos: list[str] = []
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg in valued and i + 1 < len(argv):
            opts.setdefault(arg, []).append(argv[i + 1])
            i += 1
        elif arg in flags:
            opts.setdefault(arg, []).append("")
        elif arg.startswith("-"):
            raise AssertionError(f"FakeHost does not simulate option {arg!r} in {argv!r}")
        else:
            pos.append(arg)
        i += 1
    return opts, pos


def _size(text: str, argv: Sequence[str]) -> int:
    m = re.fullmatch(r"(\d+)([bBkmgt]?)", text)
    if not m:
        raise AssertionError(f"FakeHost does not simulate size {text!r} in {argv!r}")
    shift = {"b": 0, "B": 0, "k": 10, "": 20, "m": 20, "g": 30, "t": 40}[m.group(2)]
    return int(m.group(1)) << shift


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def _one(pos: list[str], argv: Sequence[str], n: int = 1) -> list[str]:
    if len(pos) != n:
        raise AssertionError(f"FakeHost expects {n} operand(s) in {argv!r}")
    return pos
