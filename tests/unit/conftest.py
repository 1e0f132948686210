"""Unit tests: pure logic only. Any real subprocess is an error here."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from csi_local.errors import CommandError
from csi_local.host.runner import Result
from csi_local.nodestate.state_file import StateStore
from csi_local.storage.committed_vg import CommittedMetadata
from tests.harness.vm import VM_THREAD
from tests.unit import servicers
from tests.unit.fakes.common import WholeOutputStreams
from tests.unit.servicers import READS


class RealProcessForbidden(AssertionError):
    pass


@pytest.fixture(autouse=True)
def no_subprocesses(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def refuse(*args: object, **kwargs: object) -> None:
        raise RealProcessForbidden(f"unit tests must not start processes: {args!r}")

    # The test VMs boot in a thread of the harness's own while the unit tests
    # run (tests/harness/vm.py): its processes are no unit test's, so the guard
    # lets that one thread through. The patch is of the class, seen by every
    # thread.
    real_execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def execute_child(self: subprocess.Popen[Any], *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == VM_THREAD:
            return real_execute_child(self, *args, **kwargs)
        refuse(*args, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", execute_child)
    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(os, "execve", refuse)
    monkeypatch.setattr(os, "posix_spawn", refuse)
    yield


@pytest.fixture(autouse=True)
def close_state_stores(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A StateStore holds its directory's lock file open for the life of its
    process, one per plugin. A test makes one or more of its own: close them
    when it ends, or the suite leaks a descriptor per test, past the 1,024
    that protoc's plugin runner (test_stubs) can watch before it aborts."""
    opened: list[StateStore] = []
    init = StateStore.__init__

    def tracked(self: StateStore, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        opened.append(self)

    monkeypatch.setattr(StateStore, "__init__", tracked)
    yield
    for store in opened:
        store.close()


@pytest.fixture(autouse=True)
def no_commit_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    """CommittedMetadata.check reads a VG up to `attempts` times, pausing between
    reads for LVM to commit a change to each PV in turn. Where the reader
    cannot read a PV (a fake host's PVs not listed, a missing VG, a runner
    with no PV at all), every status, doctor or metrics report would wait out
    those pauses in real time: the reads are still made, without the wait."""
    kwdefaults = CommittedMetadata.check.__kwdefaults__
    assert kwdefaults is not None and "pause" in kwdefaults
    monkeypatch.setitem(kwdefaults, "pause", 0.0)


@pytest.fixture(autouse=True)
def no_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    """An fsync costs milliseconds on a real disk and proves nothing here: no unit
    test can observe durability (the crash tests in the VM kill -9 real writers).
    The descriptor must still be an open one."""
    def fsync(fd: int) -> None:
        os.fstat(fd)  # EBADF as fsync would

    monkeypatch.setattr(os, "fsync", fsync)


@dataclass
class FakeRunner(WholeOutputStreams):
    """Records argv and replays canned results keyed by the argv's first words."""

    replies: dict[tuple[str, ...], list[Result | CommandError]] = field(default_factory=dict)
    calls: list[tuple[str, ...]] = field(default_factory=list)

    def on(self, prefix: Sequence[str], stdout: str = "", rc: int = 0, stderr: str = "") -> None:
        key = tuple(prefix)
        reply: Result | CommandError
        if rc == 0:
            reply = Result(key, 0, stdout, stderr)
        else:
            reply = CommandError(key, rc, stdout, stderr)
        self.replies.setdefault(key, []).append(reply)

    def run(self, argv: Sequence[str], *, ok_codes: Sequence[int] = (0,),
            input: str | bytes | None = None, timeout: float | None = None) -> Result:
        call = tuple(str(a) for a in argv)
        self.calls.append(call)
        for n in range(len(call), 0, -1):
            queue = self.replies.get(call[:n])
            if queue:
                reply = queue.pop(0) if len(queue) > 1 else queue[0]
                if isinstance(reply, CommandError):
                    if reply.returncode in ok_codes:
                        return Result(call, reply.returncode, reply.stdout, reply.stderr)
                    raise reply
                return reply
        raise AssertionError(f"unexpected command {call}")


@pytest.fixture
def runner() -> FakeRunner:
    return FakeRunner()


@pytest.fixture(params=READS)
def reads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The test once with every node reading the committed metadata, once
    with every read an `lvs` (servicers.READ_PATH): a servicer table passes
    on both of the plugin's ways to read LVM. A table module opts in with
    `pytestmark = pytest.mark.usefixtures("reads")`."""
    path: str = request.param
    monkeypatch.setattr(servicers, "READ_PATH", path)
    return path
