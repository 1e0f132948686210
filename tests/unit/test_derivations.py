"""host/derivations.py: how many key derivations run at once, from the
cgroup's memory limit (fake /proc and /sys trees), and Crypt holding a slot
around each derivation."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from csi_local.host import derivations
from csi_local.host.crypt import Crypt, Key
from csi_local.host.derivations import (
    DERIVATION_PEAK_BYTES,
    PLUGIN_RESERVE_BYTES,
    DerivationSlots,
    memory_limit,
    slot_count,
)
from csi_local.host.runner import Result
from tests.unit.fakes.common import WholeOutputStreams

MiB = 1 << 20


def tree(root: Path, cgroup: str, files: dict[str, str]) -> str:
    """A fake root: /proc/self/cgroup's text, and files under /sys/fs/cgroup."""
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    for rel, text in files.items():
        path = root / "sys/fs/cgroup" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root)


def test_cgroup_v2_limit_of_the_process_s_own_cgroup(tmp_path: Path) -> None:
    root = tree(tmp_path, "0::/kubepods/pod1/ctr\n", {
        "kubepods/memory.max": "max\n",
        "kubepods/pod1/memory.max": "max\n",
        "kubepods/pod1/ctr/memory.max": f"{256 * MiB}\n",
        "memory.max": "",  # the root cgroup has none
    })
    assert memory_limit(root) == 256 * MiB
    # The shipped limit (256 MiB): one derivation at a time, whatever the CPUs.
    assert slot_count(256 * MiB, 8) == 1


def test_cgroup_v2_an_ancestor_s_lower_limit_counts(tmp_path: Path) -> None:
    root = tree(tmp_path, "0::/kubepods/pod1/ctr\n", {
        "kubepods/pod1/memory.max": f"{512 * MiB}\n",
        "kubepods/pod1/ctr/memory.max": "max\n",
    })
    assert memory_limit(root) == 512 * MiB
    assert slot_count(512 * MiB, 8) == (512 * MiB - PLUGIN_RESERVE_BYTES) // \
        DERIVATION_PEAK_BYTES == 5


def test_cgroup_v2_in_a_cgroup_namespace(tmp_path: Path) -> None:
    """A container with a cgroup namespace sees itself as "/" and its own
    limit at the mount's top."""
    root = tree(tmp_path, "0::/\n", {"memory.max": f"{1024 * MiB}\n"})
    assert memory_limit(root) == 1024 * MiB


def test_cgroup_v2_max_is_no_limit_and_the_cpus_bound_it(tmp_path: Path) -> None:
    root = tree(tmp_path, "0::/system.slice/nomad.service\n", {
        "system.slice/nomad.service/memory.max": "max\n",
        "system.slice/memory.max": "max\n",
    })
    assert memory_limit(root) is None
    assert slot_count(None, 4) == 4
    assert slot_count(None, 0) == 1
    assert slot_count(64 << 30, 2) == 2  # plenty of memory: no more than the CPUs


def test_cgroup_v1_limit(tmp_path: Path) -> None:
    root = tree(tmp_path, "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n", {
        "memory/docker/abc/memory.limit_in_bytes": f"{1024 * MiB}\n",
        "memory/memory.limit_in_bytes": "9223372036854771712\n",  # v1's "unlimited"
    })
    assert memory_limit(root) == 1024 * MiB
    assert slot_count(1024 * MiB, 64) == 12
    unlimited = tree(tmp_path / "u", "4:memory:/\n", {
        "memory/memory.limit_in_bytes": "9223372036854771712\n"})
    assert memory_limit(unlimited) is None


def test_no_cgroup_files_is_no_limit(tmp_path: Path) -> None:
    assert memory_limit(str(tmp_path)) is None
    assert memory_limit(tree(tmp_path / "x", "0::/gone\n", {})) is None


def test_a_tiny_limit_still_lets_one_derivation_run() -> None:
    assert slot_count(64 * MiB, 4) == 1


class Blocking(WholeOutputStreams):
    """A Runner whose cryptsetup calls wait until released, counting how many
    run at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0
        self.release = threading.Event()

    def run(self, argv: Sequence[str], *, ok_codes: Sequence[int] = (0,),
            input: str | bytes | None = None, timeout: float | None = None) -> Result:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        self.release.wait(10)
        with self.lock:
            self.running -= 1
        return Result(tuple(argv), 0, "", "")


def test_at_most_the_slots_derive_at_once() -> None:
    runner = Blocking()
    crypt = Crypt(runner, slots=DerivationSlots(2))
    calls = [lambda: crypt.format("/dev/a", Key("k")),
             lambda: crypt.open("/dev/b", "b", Key("k")),
             lambda: crypt.verify("/dev/c", Key("k")),
             lambda: crypt.resize("d", Key("k")),
             lambda: crypt.open("/dev/e", "e", Key("k"))]
    threads = [threading.Thread(target=c) for c in calls]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while runner.running < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # a third, were it let in, would be running by now
    assert runner.running == 2
    runner.release.set()
    for t in threads:
        t.join(10)
    assert runner.most == 2 and runner.running == 0


def test_a_resize_without_a_key_derives_nothing_and_takes_no_slot() -> None:
    runner = Blocking()
    runner.release.set()
    slots = DerivationSlots(1)
    with slots.hold():  # every slot taken: a keyless resize does not wait for one
        Crypt(runner, slots=slots).resize("d", None)
    assert runner.most == 1


def test_crypt_uses_the_process_s_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    held: list[str] = []

    class Spy(DerivationSlots):
        @contextlib.contextmanager
        def hold(self) -> Iterator[None]:
            held.append("slot")
            with super().hold():
                yield

    monkeypatch.setattr(derivations, "_shared", Spy(1))
    runner = Blocking()
    runner.release.set()
    Crypt(runner).open("/dev/a", "a", Key("k"))
    assert held == ["slot"]
