"""The lvm shell against real LVM: the commands that change a VG run in one
`lvm` kept running, with the exit codes and messages a process would give,
the same timeout, and a new shell after one hangs, dies or loses its framing."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import signal
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from csi_local.errors import CommandError, StorageError
from csi_local.host.runner import ProcessRunner
from csi_local.storage.lvm import LogicalVolume, Lvm
from csi_local.storage.lvm_config import profile_dir
from csi_local.storage.lvm_shell import LvmShell, use_lvm_shell

from .conftest import LoopVG, make_vg, run

pytestmark = pytest.mark.integration
MiB = 1 << 20


@pytest.fixture
def shell_runner() -> Iterator[ProcessRunner]:
    runner = ProcessRunner()
    use_lvm_shell(runner, lambda: profile_dir(runner))
    yield runner
    runner.close()


def _shell(runner: ProcessRunner) -> LvmShell:
    assert isinstance(runner.shell, LvmShell)
    return runner.shell


def _sizes(vg: LoopVG) -> dict[str, tuple[int, str]]:
    out = run("lvs", "--noheadings", "--units", "b", "--nosuffix", "--separator", "|",
              "-o", "lv_name,lv_size,lv_tags", vg.name).stdout
    got = {}
    for ln in out.splitlines():
        name, size, tags = ln.strip().split("|")
        got[name] = (int(size), tags)
    return got


def test_changes_run_in_one_shell_with_the_outcomes_of_processes(
        vg: LoopVG, shell_runner: ProcessRunner) -> None:
    shell = _shell(shell_runner)
    assert shell.start(), shell.disabled
    pid = shell.pid
    lvm = Lvm(shell_runner, vg.name, vg.pool)
    plain = Lvm(ProcessRunner(), vg.name, vg.pool)

    lv = lvm.create_thin("s1", 64 * MiB, ["csi-local.t=1"], read_back=False)
    assert _sizes(vg)["s1"] == (64 * MiB, "csi-local.t=1")
    lvm.extend_to(lv, 128 * MiB)
    lvm.add_tags("s1", ["b=2"])
    lvm.delete_tags("s1", ["csi-local.t=1"])
    assert _sizes(vg)["s1"] == (128 * MiB, "b=2")

    # A failure: the same exit code and message as the same command as a process.
    errors = []
    for which in (lvm, plain):
        with pytest.raises(CommandError) as info:
            which.create_thin("s1", 64 * MiB, [], read_back=False)
        errors.append(info.value)
    assert errors[0].returncode == errors[1].returncode == 5
    assert errors[0].stderr.strip() == errors[1].stderr.strip()
    assert 'Logical Volume "s1" already exists' in errors[0].stderr

    # The "already gone" rule reads the shell's message as it reads lvremove's.
    assert lvm.remove("s1") is True
    assert lvm.remove("s1") is False
    assert "s1" not in _sizes(vg)
    # Every one of those ran in the one shell started at first.
    assert (shell.ran, shell.started, shell.pid) == (7, 1, pid)


def test_the_idle_shell_holds_no_device_open(vg: LoopVG, shell_runner: ProcessRunner) -> None:
    lvm = Lvm(shell_runner, vg.name, vg.pool)
    lvm.create_thin("s2", 64 * MiB, [], read_back=False)
    pid = _shell(shell_runner).pid
    assert pid is not None
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with_path = os.path.realpath(f"/proc/{pid}/fd/{fd}")
        if with_path.startswith("/dev/"):
            assert not stat.S_ISBLK(os.stat(with_path).st_mode), with_path
    # The new LV is not open: the plugin can format, wipe or remove it.
    info = run("dmsetup", "info", "--noheadings", "-c", "-o", "open",
               f"{vg.name}-s2").stdout.strip()
    assert info == "0"
    assert lvm.remove("s2") is True


def test_a_long_line_of_tags_reaches_lvm_whole(vg: LoopVG, shell_runner: ProcessRunner) -> None:
    tags = [f"t{i}=" + "x" * 1000 for i in range(7)]  # a line of about 7.3 KB
    lvm = Lvm(shell_runner, vg.name, vg.pool)
    lvm.create_thin("s3", 64 * MiB, tags, read_back=False)
    assert _shell(shell_runner).ran == 1
    assert sorted(_sizes(vg)["s3"][1].split(",")) == sorted(tags)


def test_a_hung_command_times_out_and_the_next_runs_in_a_new_shell(
        vg: LoopVG, shell_runner: ProcessRunner) -> None:
    shell = _shell(shell_runner)
    assert shell.start()
    first = shell.pid
    lvm = Lvm(shell_runner, vg.name, vg.pool)
    # LVM's own VG lock, held by another process: lvcreate waits for it.
    lock = os.open(f"/run/lock/lvm/V_{vg.name}", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        started = time.monotonic()
        with pytest.raises(CommandError) as info:
            shell_runner.run(["lvcreate", "--yes", "--thin", f"{vg.name}/{vg.pool}",
                              "--virtualsize", "64m", "--name", "s4"], timeout=3)
        assert info.value.timed_out and "timed out after 3s" in info.value.stderr
        assert time.monotonic() - started < 30
    finally:
        os.close(lock)
    assert first is not None and not psutil.pid_exists(first)  # killed and reaped
    assert shell.pid is None
    lvm.create_thin("s5", 64 * MiB, [], read_back=False)
    assert "s5" in _sizes(vg) and "s4" not in _sizes(vg)
    assert shell.started == 2 and shell.pid not in (None, first)


def test_a_shell_killed_between_commands_is_replaced(
        vg: LoopVG, shell_runner: ProcessRunner) -> None:
    lvm = Lvm(shell_runner, vg.name, vg.pool)
    lvm.create_thin("s6", 64 * MiB, [], read_back=False)
    shell = _shell(shell_runner)
    pid = shell.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the shell did not die"
        time.sleep(0.1)
    assert lvm.remove("s6") is True  # sent to a new shell, never lost
    assert shell.started == 2 and shell.ran == 2


def _fake_lvm(tmp_path: Path, body: str) -> str:
    exe = tmp_path / "lvm"
    exe.write_text(f"#!{sys.executable}\n{body}")
    exe.chmod(0o755)
    return str(exe)


_FAKE = """
import json, os, sys
report = os.fdopen(int(os.environ["LVM_REPORT_FD"]), "w")
def status(name, code):
    return {"log_type": "status", "log_context": "shell", "log_object_type": "cmd",
            "log_object_name": name, "log_ret_code": str(code), "log_message": ""}
for line in sys.stdin:
    name = line.split()[0]
    rows = [status(name, 1)]
    if "lose-framing" in line:
        rows = [status("lvremove", 1)]
    if "two-documents" in line:
        report.write(json.dumps({"log": rows}) + "\\n")
    if "die" in line:
        sys.exit(9)
    report.write(json.dumps({"log": rows}) + "\\n")
    report.flush()
    if "exit-after" in line:
        sys.exit(0)
"""


def test_an_lvm_without_a_working_shell_leaves_commands_to_processes(tmp_path: Path) -> None:
    shell = LvmShell(ProcessRunner().env, lambda: _fake_lvm(tmp_path, "import sys; sys.exit(3)"),
                     lambda: str(tmp_path / "profile"))
    assert shell.run(["lvchange", "--addtag", "ok", "vg/v"], ["lvchange"], 30) is None
    assert shell.disabled is not None and "did not start" in shell.disabled
    assert shell.run(["lvchange", "--addtag", "ok", "vg/v"], ["lvchange"], 30) is None


@pytest.mark.parametrize(("tag", "why"), [
    ("lose-framing", "not the status of lvchange"),
    ("two-documents", "unexpected report output"),
    ("die", "exited (9) during lvchange"),
])
def test_a_shell_that_loses_its_framing_or_dies_fails_that_command_alone(
        tmp_path: Path, tag: str, why: str) -> None:
    shell = LvmShell(ProcessRunner().env, lambda: _fake_lvm(tmp_path, _FAKE),
                     lambda: str(tmp_path / "profile"))
    try:
        assert shell.run(["lvchange", "--addtag", "ok", "vg/v"], ["lvchange"], 30) == (0, "", "")
        first = shell.pid
        with pytest.raises(CommandError) as info:
            shell.run(["lvchange", "--addtag", tag, "vg/v"], ["lvchange"], 30)
        assert why in info.value.stderr
        assert shell.pid is None  # killed: never trusted with another command
        assert shell.run(["lvchange", "--addtag", "ok", "vg/v"], ["lvchange"], 30) == (0, "", "")
        assert shell.pid not in (None, first) and shell.disabled is None
    finally:
        shell.close()


def test_a_command_sent_to_a_shell_found_gone_goes_to_a_new_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from csi_local.storage import lvm_shell

    shell = LvmShell(ProcessRunner().env, lambda: _fake_lvm(tmp_path, _FAKE),
                     lambda: str(tmp_path / "profile"))
    try:
        assert shell.run(["lvchange", "--addtag", "exit-after", "vg/v"], ["lvchange"], 30) \
            == (0, "", "")
        assert shell._shell is not None
        first = shell._shell.proc.pid
        deadline = time.monotonic() + 30
        while psutil.Process(first).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the fake shell did not exit"
            time.sleep(0.05)
        # Gone, but not seen gone before the command is written: the write
        # fails (nobody reads the pipe), so the command never ran anywhere.
        monkeypatch.setattr(lvm_shell._Shell, "alive", lambda self: True)
        assert shell.run(["lvchange", "--addtag", "ok", "vg/v"], ["lvchange"], 30) == (0, "", "")
        assert shell.started == 2 and shell.ran == 2
    finally:
        shell.close()


def test_a_shell_that_cannot_start_leaves_commands_to_processes(
        vg: LoopVG, tmp_path: Path) -> None:
    # A profile directory that cannot be written (a read-only /etc).
    (tmp_path / "file").write_text("")
    runner = ProcessRunner()
    use_lvm_shell(runner, lambda: str(tmp_path / "file" / "profile"))
    lvm = Lvm(runner, vg.name, vg.pool)
    lvm.create_thin("s7", 64 * MiB, [], read_back=False)
    shell = _shell(runner)
    assert shell.disabled is not None and "cannot start it" in shell.disabled
    assert shell.ran == 0 and "s7" in _sizes(vg)
    assert lvm.remove("s7") is True
    runner.close()


def test_the_plugin_keeps_one_shell_and_can_do_without(plugin_factory: Any) -> None:
    with_shell = plugin_factory()
    without = plugin_factory("--lvm-shell=false")

    def shells(pid: int) -> list[psutil.Process]:
        deadline = time.monotonic() + 120
        while True:
            found = [c for c in psutil.Process(pid).children()
                     if c.name() == "lvm" and c.cmdline()[1:] == []]
            if found or time.monotonic() > deadline:
                return found
            time.sleep(0.5)

    assert len(shells(with_shell.proc.pid)) == 1
    assert [c for c in psutil.Process(without.proc.pid).children() if c.name() == "lvm"] == []


# Differential: the same changes through the plugin's runner with the lvm shell and
# with one process per command, on two fresh VGs of the same shape. -----------------

DIFF_VG = 512 * MiB  # a 128 MiB pool (25%), the rest free for the pool to grow into
THRESHOLD_PROFILE = "csi-local-test-threshold"


def _outcome(fn: Any) -> tuple[str, object]:
    """("ok", what it returned) or (the StorageError class the plugin raised, the exit
    code of a failed command, None for an error of the plugin's own)."""
    try:
        got = fn()
    except StorageError as err:
        return type(err).__name__, err.returncode if isinstance(err, CommandError) else None
    if isinstance(got, LogicalVolume):
        return "ok", (got.name, got.size)
    return "ok", got


def _changes(runner: ProcessRunner, vg: LoopVG) -> list[tuple[str, tuple[str, object]]]:
    """A sequence of changes and failures through the plugin's LVM layer, each
    step's outcome by name. Runs the same whatever the VG is called."""
    lvm = Lvm(runner, vg.name, vg.pool)
    steps: list[tuple[str, Any]] = []

    def step(name: str, fn: Any) -> None:
        steps.append((name, _outcome(fn)))

    step("create", lambda: lvm.create_thin("d-a", 64 * MiB, ["csi-local.t=1"],
                                           read_back=False))
    step("create-name-taken", lambda: lvm.create_thin("d-a", 32 * MiB, [], read_back=False))
    step("snapshot", lambda: lvm.snapshot("d-a", "d-s", ["k=s"], writable_volume=False,
                                          read_back=False, size=64 * MiB))
    step("clone", lambda: lvm.snapshot("d-a", "d-c", ["k=c"], writable_volume=True,
                                       read_back=False, size=64 * MiB))
    step("snapshot-name-taken", lambda: lvm.snapshot("d-a", "d-s", [], writable_volume=False,
                                                     read_back=False, size=64 * MiB))
    step("snapshot-of-missing-lv", lambda: lvm.snapshot("d-none", "d-x", [],
                                                        writable_volume=False))
    step("extend", lambda: lvm.extend_to(lvm.get("d-a"), 96 * MiB))
    step("add-tags", lambda: lvm.add_tags("d-a", ["b=2"]))
    step("delete-tags", lambda: lvm.delete_tags("d-a", ["csi-local.t=1"]))
    step("tags-of-missing-lv", lambda: lvm.add_tags("d-none", ["x=1"]))
    step("extend-missing-lv", lambda: lvm.extend_to(
        dataclasses.replace(lvm.get("d-a"), name="d-none"), 128 * MiB))
    step("remove-clone", lambda: lvm.remove("d-c"))
    step("remove-again", lambda: lvm.remove("d-c"))
    # No space: the pool cannot grow beyond the VG's free extents.
    step("pool-grow-no-space", lambda: lvm.extend_pool(data_bytes=2 * DIFF_VG))
    step("pool-metadata-grow-no-space",
         lambda: lvm.extend_pool(metadata_bytes=2 * DIFF_VG))
    step("pool-grow", lambda: lvm.extend_pool(data_bytes=8 * MiB))
    # A missing VG, and a missing pool in a VG that is there.
    gone = Lvm(runner, f"{vg.name}gone", vg.pool)
    step("create-vg-missing", lambda: gone.create_thin("d-b", 32 * MiB, [], read_back=False))
    step("snapshot-vg-missing", lambda: gone.snapshot("d-a", "d-x", [], writable_volume=False,
                                                      read_back=False, size=64 * MiB))
    step("extend-vg-missing", lambda: gone.extend_to(lvm.get("d-a"), 128 * MiB))
    step("tags-vg-missing", lambda: gone.add_tags("d-a", ["x=1"]))
    step("remove-vg-missing", lambda: gone.remove("d-a"))
    step("pool-grow-vg-missing", lambda: gone.extend_pool(data_bytes=8 * MiB))
    nopool = Lvm(runner, vg.name, "nopool")
    step("create-pool-missing", lambda: nopool.create_thin("d-b", 32 * MiB, [],
                                                           read_back=False))
    step("pool-grow-pool-missing", lambda: nopool.extend_pool(data_bytes=8 * MiB))
    # A pool over its limit: LVM makes no new thin volume in a pool filled past its
    # thin_pool_autoextend_threshold (here 50%, from a metadata profile on the pool).
    run("lvchange", "--metadataprofile", THRESHOLD_PROFILE, f"{vg.name}/{vg.pool}")
    run("dd", "if=/dev/urandom", f"of=/dev/{vg.name}/d-a", "bs=1M", "count=80",
        "oflag=direct", "status=none")
    step("create-pool-over-limit", lambda: lvm.create_thin("d-b", 32 * MiB, [],
                                                           read_back=False))
    step("clone-pool-over-limit", lambda: lvm.snapshot("d-a", "d-b", [], writable_volume=True,
                                                       read_back=False, size=96 * MiB))
    step("remove-in-full-pool", lambda: lvm.remove("d-s"))
    return steps


def _lvs(vg: LoopVG) -> set[tuple[str, ...]]:
    out = run("lvs", "-a", "--noheadings", "--units", "b", "--nosuffix", "--separator", "|",
              "-o", "lv_name,lv_size,lv_tags,pool_lv,origin,lv_attr,lv_metadata_size",
              vg.name).stdout
    return {tuple(x.strip() for x in ln.split("|")) for ln in out.splitlines() if ln.strip()}


def test_the_shell_and_processes_make_the_same_changes_and_failures() -> None:
    profiles = Path(profile_dir(ProcessRunner()))
    profiles.mkdir(parents=True, exist_ok=True)
    profile = profiles / f"{THRESHOLD_PROFILE}.profile"
    # Percent 0: dmeventd, where it runs, does not grow the pool behind the test's
    # back (it did, at its own pace, between the steps of the slower run).
    profile.write_text("activation {\n\tthin_pool_autoextend_threshold=50\n"
                       "\tthin_pool_autoextend_percent=0\n}\n")
    vgs = [make_vg(DIFF_VG, pool_percent=25), make_vg(DIFF_VG, pool_percent=25)]
    shell_runner, plain = ProcessRunner(), ProcessRunner()
    use_lvm_shell(shell_runner, lambda: profile_dir(shell_runner))
    try:
        assert _shell(shell_runner).start(), _shell(shell_runner).disabled
        started = time.monotonic()
        with_shell = _changes(shell_runner, vgs[0])
        shell_seconds = time.monotonic() - started
        started = time.monotonic()
        with_processes = _changes(plain, vgs[1])
        process_seconds = time.monotonic() - started
        print(f"\nthe same {len(with_shell)} steps: {shell_seconds:.1f}s with the shell "
              f"({_shell(shell_runner).ran} commands in it), {process_seconds:.1f}s as "
              "processes")
        for (name, a), (_, b) in zip(with_shell, with_processes, strict=True):
            print(f"  {name}: shell {a}, processes {b}")
        assert with_shell == with_processes
        # Each failure the test means to cause is a failure, the rest succeeded.
        outcomes = dict(with_processes)
        for name, (kind, _) in outcomes.items():
            failing = ("taken" in name or "missing" in name or "no-space" in name
                       or "over-limit" in name)
            assert (kind != "ok") == failing, (name, kind)
        assert outcomes["remove-again"] == ("ok", False)
        assert outcomes["remove-vg-missing"] == ("VolumeGroupMissing", None)
        shapes = [{(n.replace(vg.name, "VG"), *rest) for n, *rest in _lvs(vg)} for vg in vgs]
        assert shapes[0] == shapes[1]
        names = {row[0] for row in shapes[0]}
        assert "d-a" in names and not names & {"d-s", "d-c", "d-b"}, names
        # The shell ran the changes (not fallen back to processes); the other none.
        assert _shell(shell_runner).started == 1 and _shell(shell_runner).ran >= 20
        assert plain.shell is None
    finally:
        shell_runner.close()
        for vg in vgs:
            vg.destroy()
        profile.unlink(missing_ok=True)
