"""The test VM's kernels are found where scripts/install-vm-kernel puts them
(DIR/VER/boot/vmlinuz-VER beside DIR/VER/lib/modules/VER), never in /boot."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.harness import vm


def _kernel(root: Path, ver: str, modules: bool = True) -> str:
    boot = root / ver / "boot"
    boot.mkdir(parents=True)
    (boot / f"vmlinuz-{ver}").write_bytes(b"")
    if modules:
        mods = root / ver / "lib" / "modules" / ver
        mods.mkdir(parents=True)
        (mods / "modules.dep").write_text("")
    return str(boot / f"vmlinuz-{ver}")


@pytest.fixture
def kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(vm.KERNEL_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(vm.KERNEL_ENV, raising=False)
    monkeypatch.delenv(vm.NEWER_KERNEL_ENV, raising=False)
    return tmp_path


def test_the_stock_and_newer_kernels_come_from_the_kernel_directory(kernels: Path) -> None:
    old = _kernel(kernels, "6.1.0-9-amd64")
    new = _kernel(kernels, "6.1.0-56-amd64")
    backports = _kernel(kernels, "6.12.95+deb12-amd64")
    _kernel(kernels, "6.1.0-99-amd64", modules=False)
    assert vm.installed_kernels() == [backports, new, old]
    assert vm.find_kernel() == new
    assert vm.find_newer_kernel() == backports
    assert vm.modules_of(new) == str(kernels / "6.1.0-56-amd64/lib/modules/6.1.0-56-amd64")


def test_a_kernel_in_boot_alone_is_not_taken(kernels: Path) -> None:
    with pytest.raises(vm.HarnessMissing, match=re.escape(str(kernels))):
        vm.find_kernel()


def test_a_kernel_named_in_the_environment_needs_its_modules_beside_it(
        kernels: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lone = _kernel(kernels, "6.1.0-1-amd64", modules=False)
    monkeypatch.setenv(vm.KERNEL_ENV, lone)
    with pytest.raises(vm.HarnessMissing, match=re.escape("lib/modules/6.1.0-1-amd64")):
        vm.find_kernel()


def test_shards_are_packed_by_measured_cost_with_a_queued_guest_counted() -> None:
    costs = vm.Costs({"t/a.py::x": 600.0, "t/a.py::y": 100.0, "t/a.py::z": 200.0,
                      "t/b.py::p": 300.0})
    # Not measured: the median of its file's tests (200), else of all (250).
    assert costs.of("t/a.py::new") == 200.0
    assert costs.of("t/c.py::new") == 250.0
    ids = ["t/a.py::x", "t/a.py::y", "t/a.py::z", "t/b.py::p", "t/c.py::new"]
    groups = vm.shard(ids, 2, costs)
    loads = sorted(sum(costs.of(n) for n in g) for g in groups)
    assert loads == [700.0, 750.0]
    # A guest of 500 s queued behind the first slot: that slot gets less.
    first, second = vm.shard(ids, 2, costs, preload=[500.0])
    assert sum(costs.of(n) for n in first) + 500.0 <= sum(costs.of(n) for n in second) + 250.0
    assert sorted(first + second) == sorted(ids)
    # Each group keeps the collection's order.
    assert all(g == sorted(g, key=ids.index) for g in (first, second))


def test_the_committed_cost_table_is_measured_seconds_of_integration_tests() -> None:
    seconds = vm.load_costs()
    assert seconds, "tests/harness/vm_costs.json is missing or empty"
    assert all(n.startswith(("tests/integration/", "tests/sanity_selftest/")) for n in seconds)
    assert all(0 < s < 3600 for s in seconds.values())


BUDGET_COSTS = {"t/a.py::cheap": 10.0, "t/a.py::mid": 40.0, "t/a.py::dear": 500.0,
                "t/b.py::one": 60.0, "t/b.py::two": 70.0, "t/c.py::only": 300.0,
                "t/d.py::sanity": 900.0}


@pytest.mark.parametrize(("budget", "core", "kept", "deep"), [
    # Everything fits: everything runs, in the collection's order.
    (2000.0, set(), set(BUDGET_COSTS), set()),
    # Cost times rank: a.py's second test counts 80, b.py's second 140.
    (120.0, set(), {"t/a.py::cheap", "t/a.py::mid", "t/b.py::one"}, set()),
    # One check of each file before a second of any: c.py's only test (300) before
    # a.py's second and b.py's second (which the weights alone put first).
    (400.0, set(), {"t/a.py::cheap", "t/b.py::one", "t/c.py::only"}, set()),
    # A test too dear for what is left leaves room for cheaper ones after it.
    # (sanity, 900 at its turn, does not fit; a.py's dear, 500 and later, does).
    (1000.0, set(), set(BUDGET_COSTS) - {"t/d.py::sanity"}, set()),
    # A core test runs whatever its cost, and counts against the budget.
    (950.0, {"t/d.py::sanity"}, {"t/d.py::sanity", "t/a.py::cheap", "t/a.py::mid"}, set()),
    (100.0, {"t/d.py::sanity"}, {"t/d.py::sanity"}, set()),
    # A deep test is left to the full run whatever the budget, core or not.
    (2000.0, {"t/d.py::sanity"}, set(BUDGET_COSTS) - {"t/c.py::only", "t/d.py::sanity"},
     {"t/c.py::only", "t/d.py::sanity"}),
])
def test_the_readme_command_runs_the_tests_that_fit_its_vm_budget(
        budget: float, core: set[str], kept: set[str], deep: set[str]) -> None:
    ids = list(BUDGET_COSTS)
    run, left = vm.within_budget(ids, vm.Costs(dict(BUDGET_COSTS)), budget, core, deep)
    assert set(run) == kept
    assert sorted(run + left) == sorted(ids)
    assert run == [n for n in ids if n in run]  # the collection's order


@pytest.mark.parametrize(("value", "budget"), [
    ("", vm.DEFAULT_BUDGET), ("full", None), ("0", None), ("1200", 1200.0)])
def test_the_budget_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch, value: str,
                                               budget: float | None) -> None:
    monkeypatch.setenv(vm.BUDGET_ENV, value)
    assert vm.budget_from_env() == budget


def test_a_timed_out_vm_is_killed_with_everything_it_started(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vng runs qemu as its child: killing vng alone left qemu running. The
    VM starts in a session of its own, and a timeout kills that whole group."""
    started: dict[str, object] = {}
    killed: list[tuple[int, int]] = []

    class FakeVng:
        pid = 4242

        def __init__(self, argv: list[str], **kwargs: object) -> None:
            started.update(kwargs)

        def poll(self) -> int | None:
            return None

        def wait(self) -> int:
            return -9

    monkeypatch.setattr(subprocess, "Popen", FakeVng)
    monkeypatch.setattr(os, "killpg", lambda pid, sig: killed.append((pid, sig)))
    guest = vm.Guest(0, ["tests/integration/test_x.py::t"], tmp_path, "kernel")
    guest.start("vng", False, "1")
    assert started.get("start_new_session") is True
    assert guest.poll(deadline=time.monotonic() + 60) == (False, None)
    assert killed == []
    assert guest.poll(deadline=0.0) == (True, None)
    assert killed == [(4242, signal.SIGKILL)]


def test_heavy_host_tests_wait_for_a_free_vm_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """A heavy host test (a VM of its own, an image build) starts once a VM
    slot is free: not beside as many VMs as cores, and not after the last."""
    import threading

    run = vm.VmRun(["tests/integration/test_x.py::t"], heavy_host=True)
    run.started_at = time.monotonic()
    run.slots, run.busy_slots = 2, 2
    done = threading.Event()
    run.thread = threading.Thread(target=done.wait, args=(30,), daemon=True)
    run.thread.start()
    monkeypatch.setattr(vm, "say", lambda config, text: None)
    waited: list[float] = []
    def heavy_test() -> None:
        run.wait_for_slot(object())  # type: ignore[arg-type]
        waited.append(time.monotonic())

    t = threading.Thread(target=heavy_test)
    t.start()
    time.sleep(1.5)
    assert not waited  # both slots busy: it waits
    freed = time.monotonic()
    run.busy_slots = 1  # a VM finished and none is queued
    t.join(10)
    assert waited and waited[0] - freed < 3
    assert run.heavy_started is not None
    done.set()


def test_the_heavy_host_tests_count_on_one_slot_when_shards_are_packed() -> None:
    costs = vm.Costs({f"t/a.py::{i}": 100.0 for i in range(20)})
    ids = list(costs.seconds)
    first, second = vm.shard(ids, 2, costs, preload=[0.0, vm.HEAVY_HOST_SECONDS])
    # The slot that runs the heavy host tests gets that much less VM work.
    assert abs(100.0 * len(first) - (100.0 * len(second) + vm.HEAVY_HOST_SECONDS)) <= 100.0
    assert len(first) > len(second)


def test_where_the_time_went_says_when_the_host_tests_ran() -> None:
    """The summary's first line is wall clock after the VMs' start: when the
    light host tests were done and when the heavy ones ran, not the sum of
    their call durations (which left out their fixtures and the wait)."""
    run = vm.VmRun(["tests/integration/test_x.py::t"], heavy_host=True)
    run.total_seconds, run.wait_seconds = 1807.0, 1055.0
    run.light_done, run.heavy_started, run.heavy_done = 420.0, 1158.0, 1950.0
    assert vm.where_the_time_went(run) == (
        "VMs: 1807s from the first boot to the last exit; the host's light tests done at "
        "420s, the heavy ones from 1158s (a VM slot free) to 1950s; in all 1055s waiting "
        "for VMs")
    run.heavy_started = run.heavy_done = None
    assert "heavy" not in vm.where_the_time_went(run)
