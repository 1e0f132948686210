"""The sanity suite passes an honest plugin and catches each deliberate defect of the fake.

Runs ``python -m sanity`` as a subprocess against tests/sanity_selftest/fakeplugin.py. Needs
root, mount, loop devices and mkfs.ext4, hence ``integration`` (runs in the test VM).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).resolve().parent / "fakeplugin.py"
START_TIMEOUT = 180.0  # the VM runs without KVM: starting Python there can be slow
TOOLS = ("mount", "umount", "losetup", "mkfs.ext4", "resize2fs", "blockdev", "cp")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO / "src"), str(REPO)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _mounts_under(path: Path) -> list[str]:
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo", encoding="utf-8") as fh:
        points = [line.split()[4] for line in fh]
    return [p for p in points if p == real or p.startswith(real + "/")]


def _loops_of(path: Path) -> list[str]:
    out = subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=True).stdout
    return [line.split(":")[0] for line in out.splitlines() if str(path) in line]


@dataclass
class Fake:
    workdir: Path
    endpoint: str
    proc: subprocess.Popen[bytes]


@dataclass
class Run:
    rc: int
    output: str
    seconds: float
    failing: list[str]
    total: int


def _wait_for_socket(path: Path, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        assert proc.poll() is None, (
            f"fake plugin exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
        if path.exists():
            with socket.socket(socket.AF_UNIX) as s:
                try:
                    s.connect(str(path))
                    return
                except OSError:
                    pass
        time.sleep(0.1)
    ps = subprocess.run(["ps", "-eo", "pid,stat,etime,time,args"], capture_output=True,
                        text=True, check=False).stdout
    pytest.fail(f"fake plugin did not listen within {START_TIMEOUT}s; its log:\n"
                f"{log.read_text(errors='replace')}\nprocesses:\n{ps}")


@pytest.fixture
def start_fake() -> Iterator[Callable[..., Fake]]:
    for tool in TOOLS:
        assert shutil.which(tool), f"{tool} is needed for the sanity self-tests"
    assert os.geteuid() == 0, "the sanity self-tests need root (mount, losetup)"
    started: list[Fake] = []

    def start(broken: str = "") -> Fake:
        workdir = Path(tempfile.mkdtemp(prefix="sanity-self-"))
        sock = workdir / "csi.sock"
        cmd = [sys.executable, str(FAKE), "--endpoint", f"unix://{sock}",
               "--workdir", str(workdir / "data")]
        if broken:
            cmd += ["--break", broken]
        with open(workdir / "fake.log", "wb") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=log, stderr=log,
                                    stdin=subprocess.DEVNULL)
        fake = Fake(workdir, f"unix://{sock}", proc)
        started.append(fake)
        t0 = time.monotonic()
        _wait_for_socket(sock, proc, workdir / "fake.log")
        print(f"fake plugin (break={broken or 'none'}) listening after "
              f"{time.monotonic() - t0:.1f}s")
        return fake

    yield start
    for fake in started:
        if fake.proc.poll() is None:
            fake.proc.send_signal(signal.SIGTERM)
            try:
                fake.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                fake.proc.kill()
                fake.proc.wait()
        for point in sorted(_mounts_under(fake.workdir), key=len, reverse=True):
            subprocess.run(["umount", "-l", point], check=False)
        for dev in _loops_of(fake.workdir):
            subprocess.run(["losetup", "-d", dev], check=False)
        shutil.rmtree(fake.workdir, ignore_errors=True)


def run_sanity(fake: Fake, *extra: str) -> Run:
    junit = fake.workdir / "junit.xml"
    cmd = [sys.executable, "-m", "sanity", "--endpoint", fake.endpoint,
           "--volume-size", "32M", "--expand-size", "64M",
           "--staging-dir", str(fake.workdir / "staging"),
           "--mount-dir", str(fake.workdir / "mount"),
           "--junit-xml", str(junit), *extra]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=900, check=False)
    seconds = time.monotonic() - t0
    output = proc.stdout + proc.stderr
    assert junit.exists(), f"no JUnit XML written:\n{output[-3000:]}"
    root = ET.parse(junit).getroot()
    cases = list(root.iter("testcase"))
    failing = [c.get("name", "") for c in cases
               if c.find("failure") is not None or c.find("error") is not None]
    leftovers = _mounts_under(fake.workdir / "staging") + _mounts_under(fake.workdir / "mount")
    assert not leftovers, f"the sanity run left mounts behind: {leftovers}"
    print(f"\nsanity run {' '.join(extra) or '(full)'}: rc={proc.returncode} "
          f"{len(cases)} test cases, {len(failing)} failing, {seconds:.1f}s")
    return Run(proc.returncode, output, seconds, failing, len(cases))


def test_honest_plugin_passes_full_suite(start_fake: Callable[..., Fake]) -> None:
    fake = start_fake()
    mutable = fake.workdir / "mutable.yaml"
    mutable.write_text("tier: gold\n")  # the fake's one mutable parameter
    run = run_sanity(fake, "--volume-mutable-parameters", str(mutable))
    assert run.rc == 0, f"sanity failed on the honest fake: {run.failing}\n{run.output[-6000:]}"
    assert not run.failing
    assert run.total >= 80, f"only {run.total} test cases ran"
    assert "CSI sanity summary" in run.output
    assert "passed: " in run.output and "failed: 0" in run.output


BREAKS = {
    # break name: (-k selection for a quick run, substring of a test that must fail)
    "required-field": ("test_missing_required_field and CreateVolume",
                       "CreateVolume.volume_capabilities]"),
    "retry-id": ("test_create_volume_repeated", "test_create_volume_repeated"),
    "leak-mount": ("test_unstage_leaves_no_mount", "test_unstage_leaves_no_mount"),
    "wrong-restore": ("test_restore_snapshot_data", "test_restore_snapshot_data"),
    "cbt-ignores-offset": ("test_metadata_resume", "test_metadata_resume"),
    "cbt-misses-range": ("test_allocated_exact", "test_allocated_exact"),
    "cbt-max-results": ("test_metadata_max_results_one", "test_metadata_max_results_one"),
    "cbt-delta-allocated": ("test_delta_exact", "test_delta_exact"),
    "group-not-idempotent": ("test_create_group_snapshot_repeated",
                             "test_create_group_snapshot_repeated"),
    # The full request carries a staging path: only the bare one shows the order.
    "modify-unknown": ("test_modify_with_an_unknown",
                       "test_modify_with_an_unknown_mutable_parameter_is_invalid"),
    "field-order": ("test_missing_required_field and NodePublishVolume",
                    "test_missing_required_field_bare[NodePublishVolume.volume_capability]"),
}


@pytest.mark.parametrize("broken", sorted(BREAKS))
def test_sanity_detects_defect(broken: str, start_fake: Callable[..., Fake]) -> None:
    selection, expected = BREAKS[broken]
    fake = start_fake(broken)
    run = run_sanity(fake, "-k", selection)
    assert run.rc != 0, f"sanity passed a plugin with defect {broken}:\n{run.output[-4000:]}"
    assert any(expected in name for name in run.failing), (
        f"defect {broken}: expected a failing test matching {expected!r}, "
        f"failing: {run.failing}\n{run.output[-4000:]}")
    assert "failed: 0" not in run.output

