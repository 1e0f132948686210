"""Run the integration tests in a VM with a real kernel, and report them as
ordinary pytest results on the host.

Where the host has no device-mapper (or no root), every test marked
`integration` is replaced on the host by a stand-in item with the same node
id. The first stand-in to run boots the VMs (Debian's kernel under qemu via
virtme-ng), which run all selected integration tests with pytest and write
one JSON line per test phase to a shared directory: the stock kernel's VMs for
most tests, a newer (backports) kernel's for the tests of NEWER_KERNEL_FILES. Each stand-in then
reports its own test's outcome, traceback and captured output.

Integration tests run directly on the host instead when it has
device-mapper, runs as root and CSI_LOCAL_TEST_ON_HOST=1 is set.
A missing harness (no qemu, no vng, no kernel) fails the tests; it never skips.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
IN_VM_ENV = "CSI_LOCAL_IN_VM"
RESULTS_ENV = "CSI_LOCAL_VM_RESULTS"
SELECT_ENV = "CSI_LOCAL_VM_SELECT"
COSTS_LOG_ENV = "CSI_LOCAL_VM_COSTS_LOG"
# The thread that boots and watches the VMs while the host's tests run.
VM_THREAD = "csi-local-vms"


def host_can_run_integration() -> tuple[bool, str]:
    if os.environ.get(IN_VM_ENV) == "1":
        return True, "inside the test VM"
    if os.environ.get("CSI_LOCAL_TEST_ON_HOST") != "1":
        return False, "CSI_LOCAL_TEST_ON_HOST is not set"
    if os.geteuid() != 0:
        return False, "not root"
    if not os.path.exists("/dev/mapper/control"):
        return False, "host kernel has no device-mapper"
    return True, "host has device-mapper and root, and CSI_LOCAL_TEST_ON_HOST=1"


# The VM kernels. Debian's bookworm-backports kernels carry "+deb" in their
# version (6.12.95+deb12-amd64), the stock bookworm ones do not (6.1.0-56-amd64).
# The stock kernel, which boots every integration test but those of
# NEWER_KERNEL_FILES, is $CSI_LOCAL_VM_KERNEL, else the newest installed kernel
# without "+deb"; the newer kernel is $CSI_LOCAL_VM_NEWER_KERNEL, else the newest
# installed one with "+deb". Installed means DIR/VER/boot/vmlinuz-VER with
# DIR/VER/lib/modules/VER/modules.dep, DIR being $CSI_LOCAL_VM_KERNEL_DIR or
# /var/lib/csi-local-vm (scripts/install-vm-kernel [--backports]): never the
# host's /boot, where update-grub would take them for boot entries. virtme-ng
# takes a kernel's modules from beside its vmlinuz.
KERNEL_ENV = "CSI_LOCAL_VM_KERNEL"
KERNEL_DIR_ENV = "CSI_LOCAL_VM_KERNEL_DIR"
DEFAULT_KERNEL_DIR = "/var/lib/csi-local-vm"
NEWER_KERNEL_ENV = "CSI_LOCAL_VM_NEWER_KERNEL"
BACKPORTS_MARK = "+deb"

# Test files whose tests boot the newer kernel: LVM can snapshot a frozen file
# system only there; and the lifecycle again, the newer end of the kernel range.
NEWER_KERNEL_FILES = {"tests/integration/test_group_snapshots.py",
                      "tests/integration/test_newer_kernel.py"}


def _version_key(ver: str) -> list[tuple[int, int, str]]:
    """Natural order: 6.1.0-56 after 6.1.0-9, 6.12 after 6.1."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.findall(r"\d+|\D+", ver)]


def kernel_dir() -> str:
    return os.environ.get(KERNEL_DIR_ENV) or DEFAULT_KERNEL_DIR


def modules_of(path: str) -> str:
    """The modules directory virtme-ng finds for the vmlinuz at PATH: VER under
    lib/modules of the tree that holds its boot/."""
    ver = os.path.basename(path).removeprefix("vmlinuz-")
    root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    return os.path.join(root, "lib", "modules", ver)


def _usable(path: str) -> bool:
    return os.path.exists(path) and os.path.exists(os.path.join(modules_of(path), "modules.dep"))


def installed_kernels() -> list[str]:
    """DIR/VER/boot/vmlinuz-VER paths that have their modules, newest first."""
    paths = [p for p in glob.glob(os.path.join(kernel_dir(), "*", "boot", "vmlinuz-*"))
             if _usable(p)]
    return sorted(paths, key=lambda p: _version_key(os.path.basename(p)), reverse=True)


def _from_env(env: str) -> str | None:
    wanted = os.environ.get(env)
    if not wanted:
        return None
    if not _usable(wanted):
        raise HarnessMissing(f"{env}={wanted}: no such kernel, or no {modules_of(wanted)}")
    return wanted


def find_kernel() -> str:
    """The stock kernel, for every integration test but NEWER_KERNEL_FILES'."""
    wanted = _from_env(KERNEL_ENV)
    if wanted:
        return wanted
    for path in installed_kernels():
        if BACKPORTS_MARK not in os.path.basename(path):
            return path
    raise HarnessMissing(
        f"no stock kernel for the test VM: need {kernel_dir()}/VER/boot/vmlinuz-VER with "
        "its lib/modules/VER and "
        f'no "{BACKPORTS_MARK}" in VER (scripts/install-vm-kernel installs Debian\'s), '
        f"or set {KERNEL_ENV}"
    )


def find_newer_kernel() -> str:
    """The newer (backports) kernel, for the tests of NEWER_KERNEL_FILES."""
    wanted = _from_env(NEWER_KERNEL_ENV)
    if wanted:
        return wanted
    for path in installed_kernels():
        if BACKPORTS_MARK in os.path.basename(path):
            return path
    raise HarnessMissing(
        f"no newer kernel for the test VM, for the tests of "
        f"{', '.join(sorted(NEWER_KERNEL_FILES))}: need {kernel_dir()}/VER/boot/vmlinuz-VER "
        f'with its lib/modules/VER and "{BACKPORTS_MARK}" in '
        "VER (scripts/install-vm-kernel --backports installs Debian's backports kernel), "
        f"or set {NEWER_KERNEL_ENV}"
    )


def needs_newer_kernel(nodeid: str) -> bool:
    return nodeid.split("::")[0] in NEWER_KERNEL_FILES


class HarnessMissing(Exception):
    pass


def find_vng() -> str:
    local = Path(sys.executable).parent / "vng"
    found = str(local) if local.exists() else shutil.which("vng")
    if not found:
        raise HarnessMissing("vng (virtme-ng) is not installed: pip install virtme-ng")
    if not shutil.which("qemu-system-x86_64"):
        raise HarnessMissing("qemu-system-x86_64 is missing: apt-get install qemu-system-x86")
    return found


def say(config: pytest.Config, text: str) -> None:
    """Write a line to the terminal even while a test's output is captured."""
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    capman = config.pluginmanager.get_plugin("capturemanager")
    if terminal is None:
        return
    if capman is None:
        terminal.write_line(text)
        return
    with capman.global_and_fixture_disabled():
        terminal.write_line(text)



# What each test costs in the VM, measured: seconds of its setup, call and
# teardown in one emulated CPU's VM, as the last full run wrote them
# (COSTS_OUT, merged into the committed table by `python -m tests.harness.vm
# --update-costs`). The shards are packed by these figures so that the VMs
# finish together; a test not yet measured costs the median of its file's
# measured tests, else the median of all.
COSTS_FILE = Path(__file__).with_name("vm_costs.json")
COSTS_ENV = "CSI_LOCAL_VM_COSTS"
COSTS_OUT = Path("/var/tmp/csi-local-vm-costs.json")
# Seconds from a VM's start to its first test (boot, modules, pytest's
# collection), measured: a guest that queues behind another pays it again.
BOOT_SECONDS = 90.0
# The heavy host tests (`heavy_host`: the power cut's VM, the quick start's
# fresh install, the image build), measured in the fresh-clone run of
# 202b52c: 229 + 133 + 88 s and some 30 s of their fixtures. They take the
# first VM slot that frees, so the shards are packed with this much on one.
HEAVY_HOST_SECONDS = 480.0

# Settings of the guest's tests that a caller may give on the host.
FORWARDED_ENV = ("CSI_LOCAL_CBT_BENCH_MIB", "CSI_LOCAL_WALK_STEPS", "CSI_LOCAL_WALK_SEED",
                 "CSI_LOCAL_WALK_PROGRESS", "CSI_LOCAL_LVM_ROOTS", "CSI_LOCAL_VERSIONS_STEPS",
                 "CSI_LOCAL_EARLIER")


def load_costs(path: Path = COSTS_FILE) -> dict[str, float]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.get("seconds", {}).items()}


def committed_costs() -> Costs:
    """The cost table the packing and the budget read (CSI_LOCAL_VM_COSTS, else
    the committed one)."""
    return Costs(load_costs(Path(os.environ.get(COSTS_ENV) or COSTS_FILE)))


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


class Costs:
    """Each test's measured seconds, with the fallbacks for one not measured."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds = seconds
        by_file: dict[str, list[float]] = {}
        for nodeid, secs in seconds.items():
            by_file.setdefault(nodeid.split("::")[0], []).append(secs)
        self.file_median = {f: _median(v) for f, v in by_file.items()}
        self.median = _median(list(seconds.values())) if seconds else 30.0

    def of(self, nodeid: str) -> float:
        if nodeid in self.seconds:
            return self.seconds[nodeid]
        return self.file_median.get(nodeid.split("::")[0], self.median)


def shard(nodeids: list[str], count: int, costs: Costs,
          preload: list[float] | None = None) -> list[list[str]]:
    """Split tests into `count` groups that finish together by measured cost
    (longest first, each to the least loaded group); `preload` is what a
    group's slot already has to run besides (a guest queued behind it)."""
    groups: list[list[str]] = [[] for _ in range(max(1, count))]
    load = list(preload or [])[:len(groups)]
    load += [0.0] * (len(groups) - len(load))
    for n in sorted(nodeids, key=lambda n: -costs.of(n)):
        i = load.index(min(load))
        groups[i].append(n)
        load[i] += costs.of(n)
    return [sorted(g, key=nodeids.index) for g in groups if g]


BUDGET_ENV = "CSI_LOCAL_VM_BUDGET"
# The README's test command runs the integration tests whose measured costs
# fit in this many seconds of VM time (both VMs together, the newer kernel's
# guest included), so that CI ends within 40 minutes on 2 cores. Measured:
# 4,500 s of the table took 3,696 s of CI in a fresh-clone run, the heavy
# host tests after the last VM; with them on the first slot that frees,
# 2,700 s comes to some 37 minutes (the table packed as `shard` packs it,
# scaled by what that run took over its own packing's estimate: 1.13); the
# fresh-clone runs of 3cce9e1 at 2,700 s took 25 and 30 minutes. 3,300 s:
# the same tests, three upgrade tests (535 s) and one more (at 3,200 s: 33 minutes;
# the fresh-clone run of c665176: 31 minutes). With one test of each file first
# (`within_budget`) and the table refreshed from that run (csi-sanity's mount mode
# 674 s, not 1,158), 3,500 s took 40 minutes (6838b15: the VMs 1,918 and 1,779 s
# against 1,748 and 1,645 planned, the heavy host tests 442 s after them); the
# table refreshed again from that run, 3,150 s.
# CSI_LOCAL_VM_BUDGET=full runs every one (CONTRIBUTING, "Deep runs").
DEFAULT_BUDGET = 3150.0


def vm_slots() -> int:
    """How many VMs run at once: one a core, two at most (CSI_LOCAL_VM_SHARDS)."""
    return max(1, int(os.environ.get("CSI_LOCAL_VM_SHARDS", str(min(2, os.cpu_count() or 1)))))


def budget_from_env() -> float | None:
    """Seconds of VM time for the integration tests, or None: run them all."""
    value = os.environ.get(BUDGET_ENV, "").strip().lower()
    if value in ("full", "all", "0", "none"):
        return None
    return float(value) if value else DEFAULT_BUDGET


def within_budget(nodeids: list[str], costs: Costs, budget: float, core: set[str],
                  deep: frozenset[str] | set[str] = frozenset()
                  ) -> tuple[list[str], list[str]]:
    """(the tests to run, the tests left out): never a `deep` one, every `core` test, then
    one check of each file before a second of any (each file's cheapest, cheapest file
    first, each taken while it fits: a file is a feature, and a run that left out all of
    the crash or freeze tests to fit more of the controller's checked nothing of them),
    then the others in order of their cost times their rank in their file by cost (a
    file's second cheapest counts twice, its third three times, ...), each taken while
    it fits. Cheap tests come first, so the most checks fit; the rank spreads them over
    the files. The choice depends only on the tests and the committed cost table."""
    taken = [n for n in nodeids if n in core and n not in deep]
    spent = sum(costs.of(n) for n in taken)
    chosen = set(taken)
    by_file: dict[str, list[str]] = {}
    for n in nodeids:
        if n not in core and n not in deep:
            by_file.setdefault(n.split("::")[0], []).append(n)
    ranked = {f: sorted(tests, key=lambda n: (costs.of(n), n)) for f, tests in by_file.items()}
    covered = {n.split("::")[0] for n in chosen}
    firsts = sorted((tests[0] for f, tests in ranked.items() if f not in covered),
                    key=lambda n: (costs.of(n), n))
    for n in firsts:
        if spent + costs.of(n) <= budget:
            chosen.add(n)
            spent += costs.of(n)
    weighted: list[tuple[float, str]] = []
    for tests in ranked.values():
        for rank, n in enumerate(tests, start=1):
            weighted.append((costs.of(n) * rank, n))
    for _, n in sorted(weighted):
        if n not in chosen and spent + costs.of(n) <= budget:
            chosen.add(n)
            spent += costs.of(n)
    return [n for n in nodeids if n in chosen], [n for n in nodeids if n not in chosen]


@dataclass
class Guest:
    """One VM running one group of tests."""

    index: int
    nodeids: list[str]
    workdir: Path
    kernel: str
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0

    def start(self, vng: str, verbose: bool, cpus: str) -> None:
        self.started = time.monotonic()
        results = self.workdir / "results.jsonl"
        select = self.workdir / "select.txt"
        select.write_text("\n".join(self.nodeids) + "\n")
        inner = [
            sys.executable, "-m", "pytest", "-p", "tests.harness.vm_reporter",
            "-p", "no:cacheprovider", "-q", "-rA", "--durations=40",
            "--rootdir", str(REPO), *sorted({n.split("::")[0] for n in self.nodeids}),
        ]
        if verbose:
            inner.append("-v")
        env = {
            IN_VM_ENV: "1",
            RESULTS_ENV: str(results),
            COSTS_LOG_ENV: str(self.workdir / "costs.jsonl"),
            SELECT_ENV: str(select),
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
            "PATH": f"{Path(sys.executable).parent}:/usr/sbin:/usr/bin:/sbin:/bin",
        }
        env.update({k: os.environ[k] for k in FORWARDED_ENV if k in os.environ})
        work = shlex.quote(str(self.workdir))
        script = self.workdir / "guest.sh"
        script.write_text(
            "modprobe -a loop dm-mod dm-thin-pool dm-snapshot dm-crypt btrfs xfs 2>/dev/null || "
            "modprobe -a loop dm-mod dm-thin-pool dm-snapshot dm-crypt\n"
            f"echo BOOTED $(cut -d' ' -f1 /proc/uptime) > {work}/booted\n"
            f"cd {shlex.quote(str(REPO))}\n"
            + "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
            # The guest's pytest output goes to a file the host can follow live.
            + shlex.join(inner) + f" > {work}/pytest.log 2>&1\n"
        )
        # 3G: the VGs' sparse files, the plugins' logs and /etc's writes all
        # live in the guest's memory (tmpfs), half of it at most per file system.
        memory = os.environ.get("CSI_LOCAL_VM_MEMORY", "3G")
        argv = [
            vng, "-r", self.kernel, "--disable-kvm", "--user", "root", "--memory", memory,
            "--cpus", cpus, "--rwdir", str(self.workdir),
        ]
        # The emulated CPU: virtme-ng's default (`-cpu max`) unless set. A
        # probe VM measured a model without AVX faster under TCG at single
        # tools (`dd` of 2 GB from /dev/zero 13.5 s with max, 3.1 s with
        # Westmere; mkfs 3.7 s against 1.4 s), but 21 of the suite's own tests
        # took 595 s with Westmere against 379 s with max (some 475 s without
        # each VM's first start, which the max figures do not hold): max stays.
        model = os.environ.get("CSI_LOCAL_VM_CPU_MODEL")
        if model:
            argv += [f"--qemu-opts=-cpu {model}"]
        if REPO.is_relative_to("/tmp"):
            # The guest sees the host's root file system, but its /tmp is private.
            argv += ["--rodir", str(REPO)]
        argv += ["--", f"bash {work}/guest.sh"]
        with open(self.workdir / "console.log", "wb") as console:
            # A session of its own: `kill` ends vng and the qemu it started
            # together (killing vng alone left qemu running: a timed-out VM
            # kept both cores busy beside the next one, seen in CI).
            self.proc = subprocess.Popen(argv, stdout=console, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def kill(self) -> None:
        """SIGKILL the VM: vng and everything in its session (qemu)."""
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def poll(self, deadline: float) -> tuple[bool, int | None]:
        """(finished, exit code); kills the VM once the deadline has passed."""
        assert self.proc is not None
        rc = self.proc.poll()
        if rc is not None:
            return True, rc
        if time.monotonic() < deadline:
            return False, None
        self.kill()
        return True, None

    def console(self) -> str:
        text = ""
        for name in ("console.log", "pytest.log"):
            path = self.workdir / name
            if path.exists():
                text += f"--- VM {self.index} {name} ---\n" + path.read_text(errors="replace")
        return text

    def durations(self) -> str:
        """The guest pytest's --durations table, for the CI log."""
        log = self.workdir / "pytest.log"
        if not log.exists():
            return ""
        text = log.read_text(errors="replace")
        start = text.find("slowest ")
        if start < 0:
            return ""
        block = text[text.rfind("\n", 0, start) + 1:].split("\n\n", 1)[0]
        return "\n".join(block.splitlines()[:22])

    def boot_seconds(self) -> float | None:
        booted = self.workdir / "booted"
        return float(booted.read_text().split()[1]) if booted.exists() else None

    def costs(self) -> dict[str, float]:
        """Each test's seconds in this VM: its setup, call and teardown."""
        path = self.workdir / "costs.jsonl"
        spent: dict[str, float] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                    spent[row["nodeid"]] = spent.get(row["nodeid"], 0.0) + float(row["duration"])
                except (ValueError, KeyError, TypeError):
                    continue
        return spent

    def reports(self) -> list[dict[str, Any]]:
        results = self.workdir / "results.jsonl"
        if not results.exists():
            return []
        return [json.loads(line) for line in results.read_text().splitlines()]


@dataclass
class VmRun:
    nodeids: list[str]
    done: bool = False
    error: str | None = None
    reports: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # Why a test has no report, where that is known for the test itself.
    errors: dict[str, str] = field(default_factory=dict)
    console: str = ""
    total_seconds: float = 0.0
    # Per guest: the seconds it was planned to take, and what it took.
    planned: dict[int, float] = field(default_factory=dict)
    budget: list[str] = field(default_factory=list)
    guests: list[Guest] = field(default_factory=list)
    thread: threading.Thread | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    messages: list[str] = field(default_factory=list)
    started_at: float = 0.0
    wait_seconds: float = 0.0  # the main thread's, once the host's tests were done
    heavy_host: bool = False  # heavy host tests will take a VM slot as it frees
    busy_slots: int = 0  # VMs running or queued, seen from the main thread
    slots: int = 0
    # Seconds after the VMs' start: the host's light tests done, the heavy
    # ones started and done (wall clock, for the summary).
    light_done: float | None = None
    heavy_started: float | None = None
    heavy_done: float | None = None

    def say(self, config: pytest.Config, text: str) -> None:
        """Say it now from the main thread; from the VMs' thread, keep it for
        the main thread's next turn (between two host tests)."""
        if threading.current_thread() is threading.main_thread():
            say(config, text)
        else:
            with self.lock:
                self.messages.append(text)

    def flush(self, config: pytest.Config) -> None:
        with self.lock:
            messages, self.messages = self.messages, []
        for text in messages:
            say(config, text)

    def start(self, config: pytest.Config) -> None:
        """Boot the VMs in a thread of their own: the host's tests run while
        they do (their stand-ins come last), so that neither core idles."""
        if self.thread is not None or self.done:
            return

        def body() -> None:
            try:
                self.run(config)
            except Exception as err:  # reported by every stand-in
                self.error = f"the VM run failed: {err!r}"

        self.started_at = time.monotonic()
        # Every slot counts as busy until the VMs' thread says otherwise.
        self.slots = self.busy_slots = vm_slots()
        self.thread = threading.Thread(target=body, name=VM_THREAD, daemon=True)
        self.thread.start()

    def wait(self, config: pytest.Config) -> None:
        """Block until every VM has finished (running them here if no thread did)."""
        self.mark_light_done()  # the stand-ins come after every host test
        if self.thread is None and not self.done:
            self.started_at = time.monotonic()
            self.run(config)
        elif self.thread is not None and self.thread.is_alive():
            waited = time.monotonic()
            while self.thread.is_alive():
                self.thread.join(timeout=1.0)
                self.flush(config)
            self.wait_seconds += time.monotonic() - waited
        self.flush(config)

    def wait_for_slot(self, config: pytest.Config) -> None:
        """Block until a VM slot is free (no VM queued, fewer running than
        slots): a heavy host test then runs on the core a VM no longer uses,
        never beside as many VMs as there are cores."""
        self.mark_light_done()
        waited = time.monotonic()
        while (self.thread is not None and self.thread.is_alive()
               and self.busy_slots >= self.slots > 0):
            time.sleep(1.0)
            self.flush(config)
        self.wait_seconds += time.monotonic() - waited
        if self.heavy_started is None and self.started_at:
            self.heavy_started = time.monotonic() - self.started_at
            if self.thread is not None and self.thread.is_alive():
                self.say(config, f"\n[host] a VM slot is free after "
                         f"{self.heavy_started:.0f}s: the heavy host tests start")

    def mark_light_done(self) -> None:
        if self.light_done is None and self.started_at:
            self.light_done = time.monotonic() - self.started_at

    def mark_heavy_done(self) -> None:
        if self.started_at:
            self.heavy_done = time.monotonic() - self.started_at

    def stop(self) -> None:
        """Kill what still runs (the session ended early)."""
        for g in self.guests:
            if g.proc is not None and g.proc.poll() is None:
                g.kill()

    def run(self, config: pytest.Config) -> None:
        """Boot the VMs once, for every selected test: the stock kernel's shards in
        parallel, then the newer kernel's guest(s) as VMs finish, at most `shards`
        VMs at a time."""
        self.done = True
        try:
            vng = find_vng()
        except HarnessMissing as err:
            self.error = f"integration harness missing: {err}"
            return
        shards = vm_slots()
        cpus = os.environ.get("CSI_LOCAL_VM_CPUS", "1" if shards > 1 else "2")
        stock = [n for n in self.nodeids if not needs_newer_kernel(n)]
        newer = [n for n in self.nodeids if needs_newer_kernel(n)]
        costs = committed_costs()
        kernels: dict[str, str] = {}
        for name, nodeids, find in (("stock", stock, find_kernel),
                                    ("newer", newer, find_newer_kernel)):
            if not nodeids:
                continue
            try:
                kernels[name] = find()
            except HarnessMissing as err:
                for n in nodeids:
                    self.errors[n] = f"integration harness missing: {err}"
        plan: list[tuple[str, list[str]]] = []
        # The newer kernel's tests are few: one guest, queued behind the stock
        # shard packed lightest by the cost of that guest and its boot, unless
        # they are all there is to run.
        preload: list[float] = []
        if "newer" in kernels and "stock" in kernels:
            preload = [BOOT_SECONDS + sum(costs.of(n) for n in newer)]
        if self.heavy_host and "stock" in kernels:
            # The heavy host tests take the slot that frees first; with a guest
            # of the newer kernel on one, they are the other's.
            if len(preload) < shards:
                preload.append(HEAVY_HOST_SECONDS)
            else:
                preload[-1] += HEAVY_HOST_SECONDS
        if "stock" in kernels:
            plan += [(kernels["stock"], g) for g in shard(stock, shards, costs, preload)]
        if "newer" in kernels:
            count = 1 if "stock" in kernels else shards
            plan += [(kernels["newer"], g) for g in shard(newer, count, costs)]
        self.planned = {i: BOOT_SECONDS + sum(costs.of(n) for n in g)
                        for i, (_, g) in enumerate(plan)}
        if not plan:
            return
        guests = self.guests = [
            Guest(i, group, Path(tempfile.mkdtemp(prefix="csi-local-vm-", dir="/var/tmp")), kernel)
            for i, (kernel, group) in enumerate(plan)
        ]
        # The guest cannot write bytecode back to the host; compile it here so
        # that every Python start inside the (emulated, slow) VM can use it.
        subprocess.run([sys.executable, "-m", "compileall", "-q", "src", "sanity", "tests",
                        "benchmarks"], cwd=REPO, check=False, capture_output=True)
        # 70 minutes a VM at most: the VMs boot as the session starts and the
        # heavy host tests (some 15 minutes) run after them, so a hung or slow
        # shard is reported as such, with where the time went, inside CI's 90
        # minutes rather than CI being killed with no report.
        timeout = float(os.environ.get("CSI_LOCAL_VM_TIMEOUT", "4200"))
        started = time.monotonic()
        verbose = config.getoption("verbose") > 0
        waiting = list(guests)
        running: list[Guest] = []
        codes: dict[int, int | None] = {}
        seconds: dict[int, float] = {}

        self.slots = shards

        def start_waiting() -> None:
            while waiting and len(running) < shards:
                g = waiting.pop(0)
                g.start(vng, verbose, cpus)
                running.append(g)
                after = f" (after {g.started - started:.1f}s in the queue)" if codes else ""
                self.say(config, f"\n[vm {g.index}] {os.path.basename(g.kernel)}: {len(g.nodeids)} "
                    f"integration test(s){after}; follow {g.workdir / 'pytest.log'}")
            self.busy_slots = len(waiting) + len(running)

        start_waiting()
        for g in waiting:
            self.say(config, f"[vm {g.index}] {os.path.basename(g.kernel)}: {len(g.nodeids)} "
                f"integration test(s), queued until a VM finishes")
        while waiting or running:
            start_waiting()
            for g in list(running):
                # Each VM's timeout counts from its own start.
                finished, rc = g.poll(g.started + timeout)
                if finished:
                    codes[g.index] = rc
                    seconds[g.index] = time.monotonic() - g.started
                    running.remove(g)
            self.busy_slots = len(waiting) + len(running)
            time.sleep(0.5)
        self.total_seconds = time.monotonic() - started
        problems = []
        for g in guests:
            rc = codes[g.index]
            reps = g.reports()
            for rep in reps:
                self.reports.setdefault(rep["nodeid"], []).append(rep)
            self.console += g.console()
            problem = None
            if rc is None:
                problem = f"VM {g.index} did not finish within {timeout:.0f}s"
            elif not reps:
                problem = f"VM {g.index} exited {rc} without running any test"
            if problem:
                problems.append(problem)
                for n in g.nodeids:
                    self.errors[n] = problem
            boot = g.boot_seconds()
            self.say(config, f"[vm {g.index}] done in {seconds[g.index]:.1f}s (boot to tests: "
                f"{boot if boot is not None else '?'}s), exit {rc}, "
                f"{len({r['nodeid'] for r in reps})} test(s) reported")
            durations = g.durations()
            if durations:
                self.say(config, f"[vm {g.index}] slowest tests in the VM:\n{durations}")
        self.account(guests, seconds)
        if problems:
            self.error = "; ".join(problems)
        else:
            for g in guests:
                shutil.rmtree(g.workdir, ignore_errors=True)

    def account(self, guests: list[Guest], seconds: dict[int, float]) -> None:
        """Where the VMs' time went (printed at the end of the session), and
        each test's measured cost, merged into COSTS_OUT for the next packing."""
        measured: dict[str, float] = {}
        for g in guests:
            spent = g.costs()
            measured.update(spent)
            by_file: dict[str, float] = {}
            for nodeid, secs in spent.items():
                name = nodeid.split("::")[0].removeprefix("tests/")
                by_file[name] = by_file.get(name, 0.0) + secs
            top = ", ".join(f"{name} {secs:.0f}s" for name, secs in
                            sorted(by_file.items(), key=lambda kv: -kv[1])[:6])
            boot = g.boot_seconds()
            self.budget.append(
                f"vm {g.index} ({os.path.basename(g.kernel).removeprefix('vmlinuz-')}): "
                f"{seconds.get(g.index, 0.0):.0f}s wall, "
                f"planned {self.planned.get(g.index, 0):.0f}s; "
                f"boot {boot if boot is not None else '?'}s, {len(spent)} tests "
                f"{sum(spent.values()):.0f}s: {top}")
        if not measured:
            return
        merged = load_costs()
        # A test of under 0.05 s is written as 0.1: the table holds no zero.
        merged.update({k: max(0.1, round(v, 1)) for k, v in measured.items()})
        try:
            COSTS_OUT.write_text(json.dumps({"seconds": dict(sorted(merged.items()))},
                                            indent=1) + "\n")
        except OSError:
            return
        self.budget.append(f"measured costs of {len(measured)} tests merged into {COSTS_OUT} "
                           f"(`python -m tests.harness.vm --update-costs` keeps them)")

    def console_tail(self, lines: int = 80) -> str:
        return "\n".join(self.console.splitlines()[-lines:])


class VmTestFailed(Exception):
    pass


class VmItem(pytest.Item):
    """Stands on the host for an integration test that runs in the VM."""

    def __init__(self, *, vmrun: VmRun, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.vmrun = vmrun

    def runtest(self) -> None:
        self.vmrun.wait(self.config)
        reports = self.vmrun.reports.get(self.nodeid)
        if not reports:
            why = (self.vmrun.errors.get(self.nodeid) or self.vmrun.error
                   or "the test did not report from the VM")
            raise VmTestFailed(f"{why}\n--- VM console (tail) ---\n{self.vmrun.console_tail()}")
        for rep in reports:
            for title, content in rep.get("sections", []):
                self.add_report_section(rep["when"], title.rsplit(" ", 1)[-1], content)
                if self.get_closest_marker("report") and "stdout" in title:
                    say(self.config, f"\n[{self.nodeid}]{content}")
        for rep in reports:
            if rep["outcome"] == "failed":
                raise VmTestFailed(f"[in VM, {rep['when']}]\n{rep['longrepr']}")
        for rep in reports:
            if rep["outcome"] == "skipped":
                pytest.skip(f"[in VM] {rep['longrepr']}")

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, VmTestFailed):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[os.PathLike[str] | str, int | None, str]:
        return self.path, None, f"[vm] {self.name}"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "integration: needs real LVM, mkfs and mount")
    config.addinivalue_line(
        "markers", "core: an integration test the README's command always runs, "
        "whatever its cost (CSI_LOCAL_VM_BUDGET)")
    config.addinivalue_line(
        "markers", "deep: an integration test only the full run takes, whatever the VM "
        "budget (it says why)")
    config.addinivalue_line(
        "markers", "heavy_host: boots a VM or builds an image on the host; runs once a VM "
        "slot is free, never beside as many VMs as there are cores")


_VMRUN = pytest.StashKey[VmRun]()
_LEFT_OUT = pytest.StashKey[tuple[list[str], list[str], float, "Costs"]]()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    local, _why = host_can_run_integration()
    if local:
        return
    integration = [i for i in items if i.get_closest_marker("integration")]
    if not integration:
        return
    budget = budget_from_env()
    # Only the whole suite is budgeted (the README's command: no paths given);
    # tests named on the command line all run.
    if budget is not None and config.args_source == pytest.Config.ArgsSource.TESTPATHS:
        costs = committed_costs()
        core = {i.nodeid for i in integration if i.get_closest_marker("core")}
        deep = {i.nodeid for i in integration if i.get_closest_marker("deep")}
        kept, left = within_budget([i.nodeid for i in integration], costs, budget, core, deep)
        if left:
            out = set(left)
            dropped = [i for i in items if i.nodeid in out]
            config.hook.pytest_deselected(items=dropped)
            items[:] = [i for i in items if i.nodeid not in out]
            integration = [i for i in integration if i.nodeid not in out]
            config.stash[_LEFT_OUT] = (kept, left, budget, costs)
    vmrun = config.stash[_VMRUN] = VmRun(
        [i.nodeid for i in integration],
        heavy_host=any(i.get_closest_marker("heavy_host") for i in items))
    for index, item in enumerate(items):
        if item.get_closest_marker("integration"):
            assert item.parent is not None, item.nodeid  # a test always has its module
            # nodeid: keep the exact id, parametrisation included
            stand_in = VmItem.from_parent(item.parent, name=item.name, nodeid=item.nodeid,
                                          vmrun=vmrun)
            for marker in {m.name: m for m in item.iter_markers()}.values():
                stand_in.add_marker(marker.name)
            items[index] = stand_in
    # The host's light tests run while the VMs do; then the host tests that
    # boot a VM or build an image (`heavy_host`), each once a VM slot is free
    # (`pytest_runtest_setup`): beside as many test VMs as cores they starved
    # them until LVM commands hit their timeouts (an `lvs` of 1,100 LVs past
    # 120 s, seen in a run), and after every VM they left a core idle while
    # the last shard ran. The stand-ins come last.
    def rank(item: pytest.Item) -> int:
        if isinstance(item, VmItem):
            return 2
        return 1 if item.get_closest_marker("heavy_host") else 0

    items.sort(key=rank)  # stable: each group keeps the collection's order


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> None:
    vmrun = session.config.stash.get(_VMRUN, None)
    if vmrun is not None and not session.config.option.collectonly:
        vmrun.start(session.config)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    vmrun = item.config.stash.get(_VMRUN, None)
    if vmrun is not None and item.get_closest_marker("heavy_host"):
        vmrun.wait_for_slot(item.config)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    vmrun = item.config.stash.get(_VMRUN, None)
    if vmrun is not None:
        if item.get_closest_marker("heavy_host"):
            vmrun.mark_heavy_done()
        vmrun.flush(item.config)


def pytest_sessionfinish(session: pytest.Session) -> None:
    vmrun = session.config.stash.get(_VMRUN, None)
    if vmrun is not None and vmrun.thread is not None and vmrun.thread.is_alive():
        vmrun.stop()


def where_the_time_went(vmrun: VmRun) -> str:
    """The session's first line of it, in wall-clock seconds after the VMs'
    start: when the host's light tests were done, when the heavy ones ran."""
    def at(mark: float | None) -> str:
        return "?" if mark is None else f"{mark:.0f}s"

    host = f"the host's light tests done at {at(vmrun.light_done)}"
    if vmrun.heavy_started is not None:
        host += (f", the heavy ones from {at(vmrun.heavy_started)} (a VM slot free) "
                 f"to {at(vmrun.heavy_done)}")
    return (f"VMs: {vmrun.total_seconds:.0f}s from the first boot to the last exit; "
            f"{host}; in all {vmrun.wait_seconds:.0f}s waiting for VMs")


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """Where the time went: the host's tests beside the VMs, and each VM."""
    vmrun = config.stash.get(_VMRUN, None)
    if vmrun is None or not vmrun.started_at:
        return
    terminalreporter.write_sep("=", "where the time went")
    terminalreporter.write_line(where_the_time_went(vmrun))
    for line in vmrun.budget:
        terminalreporter.write_line(line)
    left_out = config.stash.get(_LEFT_OUT, None)
    if left_out is not None:
        kept, left, budget, costs = left_out
        by_file: dict[str, int] = {}
        for n in left:
            by_file[n.split("::")[0]] = by_file.get(n.split("::")[0], 0) + 1
        terminalreporter.write_line(
            f"integration tests within the budget of {budget:.0f}s of VM time "
            f"({BUDGET_ENV}): {len(kept)} ({sum(costs.of(n) for n in kept):.0f}s measured); "
            f"left to the full run ({BUDGET_ENV}=full, CONTRIBUTING \"Deep runs\"): "
            f"{len(left)} ({sum(costs.of(n) for n in left):.0f}s)")
        for path, count in sorted(by_file.items()):
            terminalreporter.write_line(f"  left out: {count:3d} of {path}")


def _update_costs(argv: list[str]) -> int:
    """`python -m tests.harness.vm --update-costs [FILE]`: merge the costs the
    last run measured (FILE, default COSTS_OUT) into the committed table."""
    source = Path(argv[0]) if argv else COSTS_OUT
    fresh = load_costs(source)
    if not fresh:
        print(f"no measured costs in {source}", file=sys.stderr)
        return 1
    merged = {**load_costs(), **fresh}
    COSTS_FILE.write_text(json.dumps({"seconds": dict(sorted(merged.items()))}, indent=1) + "\n")
    print(f"{COSTS_FILE}: {len(fresh)} of {len(merged)} tests' costs from {source}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["--update-costs"]:
        print("usage: python -m tests.harness.vm --update-costs [FILE]", file=sys.stderr)
        sys.exit(2)
    sys.exit(_update_costs(sys.argv[2:]))
