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
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
IN_VM_ENV = "CSI_LOCAL_IN_VM"
RESULTS_ENV = "CSI_LOCAL_VM_RESULTS"
SELECT_ENV = "CSI_LOCAL_VM_SELECT"


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
# system only there.
NEWER_KERNEL_FILES = {"tests/integration/test_group_snapshots.py"}


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



# Rough cost of one test, in tens of seconds of the VM's time as measured in CI,
# keyed by node ID prefix (the longest match wins; a plain integration test costs
# DEFAULT_WEIGHT), so that the VMs finish together.
WEIGHTS = {
    "tests/integration/test_sanity_csi_local.py": 113,
    "tests/integration/test_sanity_csi_local.py::test_sanity_against_csi_local[block]": 30,
    "tests/sanity_selftest/test_sanity_detects.py": 3,
    "tests/integration/test_bench.py": 60,
    "tests/integration/test_bench_fill.py": 10,
    "tests/integration/test_doctor_lvm_view.py": 8,
    "tests/integration/test_metadata_area.py": 10,
    "tests/integration/test_changed_blocks.py": 7,
    "tests/integration/test_crash.py": 8,
    "tests/integration/test_dhv_clones.py": 7,
    "tests/integration/test_group_refusal.py": 7,
    "tests/integration/test_group_snapshots.py": 5,
    "tests/integration/test_pool_guard.py": 7,
    "tests/integration/test_status.py": 9,
    "tests/integration/test_device_classes.py": 5,
    "tests/integration/test_dhv_classes.py": 6,
    "tests/integration/test_metadata_walk.py": 30,
    "tests/integration/test_mount_differential.py": 15,
    "tests/integration/test_metadata_outdated.py": 6,
    "tests/integration/test_encryption.py::"
    "test_an_encrypted_stage_fits_the_shipped_memory_limits": 20,
}
DEFAULT_WEIGHT = 3

# Settings of the guest's tests that a caller may give on the host.
FORWARDED_ENV = ("CSI_LOCAL_CBT_BENCH_MIB", "CSI_LOCAL_WALK_STEPS", "CSI_LOCAL_WALK_SEED",
                 "CSI_LOCAL_WALK_PROGRESS")


def weight(nodeid: str) -> int:
    keys = [k for k in WEIGHTS if nodeid == k or nodeid.startswith(k + "::")
            or nodeid.startswith(k + "[")]
    return WEIGHTS[max(keys, key=len)] if keys else DEFAULT_WEIGHT


def shard(nodeids: list[str], count: int) -> list[list[str]]:
    """Split tests into `count` groups of about equal estimated cost."""
    groups: list[list[str]] = [[] for _ in range(max(1, count))]
    cost = [0] * len(groups)
    for n in sorted(nodeids, key=lambda n: -weight(n)):
        i = cost.index(min(cost))
        groups[i].append(n)
        cost[i] += weight(n)
    return [sorted(g, key=nodeids.index) for g in groups if g]


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
        if REPO.is_relative_to("/tmp"):
            # The guest sees the host's root file system, but its /tmp is private.
            argv += ["--rodir", str(REPO)]
        argv += ["--", f"bash {work}/guest.sh"]
        with open(self.workdir / "console.log", "wb") as console:
            self.proc = subprocess.Popen(argv, stdout=console, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)

    def poll(self, deadline: float) -> tuple[bool, int | None]:
        """(finished, exit code); kills the VM once the deadline has passed."""
        assert self.proc is not None
        rc = self.proc.poll()
        if rc is not None:
            return True, rc
        if time.monotonic() < deadline:
            return False, None
        self.proc.kill()
        self.proc.wait()
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
        shards = max(1, int(os.environ.get("CSI_LOCAL_VM_SHARDS",
                                           str(min(2, os.cpu_count() or 1)))))
        cpus = os.environ.get("CSI_LOCAL_VM_CPUS", "1" if shards > 1 else "2")
        stock = [n for n in self.nodeids if not needs_newer_kernel(n)]
        newer = [n for n in self.nodeids if needs_newer_kernel(n)]
        plan: list[tuple[str, list[str]]] = []
        # The newer kernel's tests are few: one guest, queued behind the stock
        # shards, unless they are all there is to run.
        for nodeids, find, count in ((stock, find_kernel, shards),
                                     (newer, find_newer_kernel, 1 if stock else shards)):
            if not nodeids:
                continue
            try:
                kernel = find()
            except HarnessMissing as err:
                for n in nodeids:
                    self.errors[n] = f"integration harness missing: {err}"
                continue
            plan += [(kernel, group) for group in shard(nodeids, count)]
        if not plan:
            return
        guests = [
            Guest(i, group, Path(tempfile.mkdtemp(prefix="csi-local-vm-", dir="/var/tmp")), kernel)
            for i, (kernel, group) in enumerate(plan)
        ]
        # The guest cannot write bytecode back to the host; compile it here so
        # that every Python start inside the (emulated, slow) VM can use it.
        subprocess.run([sys.executable, "-m", "compileall", "-q", "src", "sanity", "tests",
                        "benchmarks"], cwd=REPO, check=False, capture_output=True)
        timeout = float(os.environ.get("CSI_LOCAL_VM_TIMEOUT", "4800"))
        started = time.monotonic()
        verbose = config.getoption("verbose") > 0
        waiting = list(guests)
        running: list[Guest] = []
        codes: dict[int, int | None] = {}
        seconds: dict[int, float] = {}

        def start_waiting() -> None:
            while waiting and len(running) < shards:
                g = waiting.pop(0)
                g.start(vng, verbose, cpus)
                running.append(g)
                after = f" (after {g.started - started:.1f}s in the queue)" if codes else ""
                say(config, f"\n[vm {g.index}] {os.path.basename(g.kernel)}: {len(g.nodeids)} "
                    f"integration test(s){after}; follow {g.workdir / 'pytest.log'}")

        start_waiting()
        for g in waiting:
            say(config, f"[vm {g.index}] {os.path.basename(g.kernel)}: {len(g.nodeids)} "
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
            say(config, f"[vm {g.index}] done in {seconds[g.index]:.1f}s (boot to tests: "
                f"{boot if boot is not None else '?'}s), exit {rc}, "
                f"{len({r['nodeid'] for r in reps})} test(s) reported")
            durations = g.durations()
            if durations:
                say(config, f"[vm {g.index}] slowest tests in the VM:\n{durations}")
        if problems:
            self.error = "; ".join(problems)
        else:
            for g in guests:
                shutil.rmtree(g.workdir, ignore_errors=True)

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
        if not self.vmrun.done:
            self.vmrun.run(self.config)
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


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    local, _why = host_can_run_integration()
    if local:
        return
    integration = [i for i in items if i.get_closest_marker("integration")]
    if not integration:
        return
    vmrun = VmRun([i.nodeid for i in integration])
    for index, item in enumerate(items):
        if item.get_closest_marker("integration"):
            assert item.parent is not None, item.nodeid  # a test always has its module
            # nodeid: keep the exact id, parametrisation included
            stand_in = VmItem.from_parent(item.parent, name=item.name, nodeid=item.nodeid,
                                          vmrun=vmrun)
            for marker in {m.name: m for m in item.iter_markers()}.values():
                stand_in.add_marker(marker.name)
            items[index] = stand_in
