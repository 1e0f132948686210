"""`csi-local doctor`, check by check: a directory tree stands for /proc, /sys,
/dev and the configured paths, a FakeHost answers LVM's reports, a FakeRunner
answers lvmconfig, and a dict says which tools are installed."""

from __future__ import annotations

import io
import json
import os
import socket
from collections.abc import Iterator, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from csi_local.cli import build_parser
from csi_local.host.runner import Result
from csi_local.ops import doctor
from csi_local.ops.doctor import FAIL, OK, WARN, Check, Options, System
from csi_local.storage import vg_text
from csi_local.storage.committed_vg import CommittedMetadata
from csi_local.storage.lvm import Lvm, VgReport
from csi_local.storage.lvm_shell import PROFILE, PROFILE_NAME
from csi_local.storage.thin_mappings import MARK_PREFIX
from tests.unit.conftest import FakeRunner
from tests.unit.fakehost import FakeHost
from tests.unit.fakes.common import WholeOutputStreams
from tests.unit.test_x509 import cert as x509_cert
from tests.unit.test_x509 import dns as x509_dns
from tests.unit.test_x509 import extensions as x509_extensions
from tests.unit.test_x509 import ip as x509_ip
from tests.unit.test_x509 import pem as x509_pem
from tests.unit.test_x509 import san as x509_san
from tests.unit.test_x509 import tlv

ALL_TOOLS = (*doctor.LVM_TOOLS, *doctor.BASE_TOOLS,
             *(t for tools, _ in doctor.FS_TOOLS.values() for t in tools), "cryptsetup")
SETTINGS_ARGV = ("lvmconfig", "--type", "full", *doctor.LVM_SETTINGS)
PROFILE_DIR_ARGV = ("lvmconfig", "--type", "full", "config/profile_dir")
GOOD_SETTINGS = "udev_sync=1\nudev_rules=1\nmonitoring=0\n"
# `lvm version` of Debian 12's lvm2 on its 6.1 kernel
LVM_VERSION = """\
  LVM version:     2.03.16(2) (2022-05-18)
  Library version: 1.02.185 (2022-05-18)
  Driver version:  4.47.0
  Configuration:   ./configure --build=x86_64-linux-gnu --prefix=/usr
"""
MOUNTINFO = """\
21 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
22 21 0:5 / /dev rw,nosuid shared:2 - devtmpfs udev rw
30 21 8:2 / /var/lib/kubelet rw,relatime {opt}- ext4 /dev/sda2 rw
31 30 0:40 / /var/lib/kubelet/pods/x/volumes rw shared:9 - tmpfs tmpfs rw
"""


class Runner(WholeOutputStreams):
    """LVM's reports and dmsetup from a FakeHost, everything else (lvmconfig) from a
    FakeRunner."""

    def __init__(self, host: FakeHost, canned: FakeRunner) -> None:
        self.host, self.canned = host, canned

    def run(self, argv: Sequence[str], *, ok_codes: Sequence[int] = (0,),
            input: str | bytes | None = None, timeout: float | None = None) -> Result:
        if argv[0] in ("vgs", "lvs", "pvs", "dmsetup"):
            return self.host.run(argv, ok_codes=ok_codes)
        return self.canned.run(argv, ok_codes=ok_codes)


class Machine:
    """A node's files under `root`, its LVM and its tools, as doctor sees them."""

    def __init__(self, root: Path, runner: FakeRunner) -> None:
        self.root = root
        self.host = FakeHost()
        self.canned = runner
        self.tools = {t: f"/usr/sbin/{t}" for t in ALL_TOOLS}
        self.env: dict[str, str] = {}
        self.uid = os.geteuid()
        runner.on(["lvmconfig", "--version"],
                  "  LVM version:     2.03.16(2) (2022-05-18)\n  Library version: 1.02\n")
        runner.on(["lvm", "version"], LVM_VERSION)
        runner.on(SETTINGS_ARGV, GOOD_SETTINGS)
        runner.on(PROFILE_DIR_ARGV, 'profile_dir="/etc/lvm/profile"\n')
        self.write("proc/modules", "dm_thin_pool 36864 1 - Live 0x0\n"
                                   "dm_snapshot 53248 0 - Live 0x0\ndm_mod 184320 9 - Live 0x0\n"
                                   "dm_crypt 61440 0 - Live 0x0\n")
        self.write("proc/misc", "236 device-mapper\n 60 loop-control\n")
        self.write("dev/mapper/control", "")
        self.write("run/udev/control", "")
        self.write("proc/self/mountinfo", MOUNTINFO.format(opt="shared:7 "))
        (root / "var/lib/kubelet").mkdir(parents=True)
        (root / "var/lib/csi-local").mkdir(parents=True, mode=0o700)
        (root / "run/lock/csi-local").mkdir(parents=True, mode=0o700)

    def write(self, rel: str, text: str) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def system(self) -> System:
        return System(Runner(self.host, self.canned), str(self.root), root_uid=self.uid,
                      which=self.tools.get, env=self.env, host=self.host)

    def lvm(self) -> Lvm:
        return Lvm(self.host, "vg0", "pool0")

    def checks(self) -> dict[str, Check]:
        got = doctor.run_checks(self.system(), Options("vg0", "pool0", endpoint=ENDPOINT))
        return {c.name: c for c in got}


ENDPOINT = "unix:///s.sock"


@pytest.fixture
def m(tmp_path: Path, runner: FakeRunner) -> Iterator[Machine]:
    yield Machine(tmp_path / "root", runner)


@pytest.fixture
def listening(m: Machine) -> Iterator[None]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(m.root / "s.sock"))
        s.listen(64)  # never accepted: each check's connection waits in the backlog
        yield


def test_a_good_node_passes(m: Machine, listening: None) -> None:
    checks = m.checks()
    assert {c.status for c in checks.values()} == {OK}, [c for c in checks.values()
                                                         if c.status != OK]
    assert list(checks) == [
        "kernel module dm_thin_pool", "kernel module dm_snapshot", "device-mapper",
        "lvm tools", "tools", "xfs tools", "btrfs tools", "kernel module dm_crypt",
        "cryptsetup", "volume group vg0",
        "volume group vg0 metadata", "thin pool vg0/pool0",
        "volume group vg0 metadata area", "thin pool device IDs", "thin pool zeroing",
        "thin pool fill", "thin pool metadata snapshot", "lvm versions", "lvm.conf udev",
        "lvm.conf monitoring", "lvm shell profile", "state directory /var/lib/csi-local",
        "lock directory /run/lock/csi-local", "CSI socket",
        "mount propagation of /var/lib/kubelet"]
    assert checks["lvm tools"].message == \
        "/usr/sbin/lvm, LVM version: 2.03.16(2) (2022-05-18)"
    assert checks["volume group vg0"].message == "size 11.0 GiB, free 1016.0 MiB"
    assert checks["thin pool vg0/pool0"].message == "active, size 10.0 GiB"
    assert checks["CSI socket"].message == "/s.sock answers"
    assert "shared:7" in checks["mount propagation of /var/lib/kubelet"].message


def test_exit_code_output_and_json(m: Machine, listening: None) -> None:
    ns = build_parser().parse_args(["doctor", "--volume-group", "vg0", "--thin-pool", "pool0",
                                    "--endpoint", ENDPOINT])
    out = io.StringIO()
    assert doctor.run(m.system(), ns, out=out) == 0
    text = out.getvalue()
    assert text.splitlines()[0].startswith("ok    kernel module dm_thin_pool")
    assert text.endswith("25 checks: 0 failed, 0 warning(s); the node is ready\n")

    m.canned.replies[SETTINGS_ARGV] = []
    m.canned.on(SETTINGS_ARGV, "udev_sync=1\nudev_rules=1\nmonitoring=1\n")  # a warning
    out = io.StringIO()
    assert doctor.run(m.system(), ns, out=out) == 0
    assert "warn  lvm.conf monitoring" in out.getvalue()
    assert "1 warning(s); the node is ready" in out.getvalue()

    m.host.lvs["pool0"].active = False  # a failure
    out = io.StringIO()
    ns.json = True
    assert doctor.run(m.system(), ns, out=out) == 1
    got = json.loads(out.getvalue())
    assert got["ok"] is False and got["failures"] == 1 and got["warnings"] == 1
    pool = next(c for c in got["checks"] if c["name"] == "thin pool vg0/pool0")
    assert pool == {"name": "thin pool vg0/pool0", "status": "FAIL",
                    "message": "not active: no volume can be created or used",
                    "fix": "lvchange --activate y vg0/pool0"}

    ns.json = False
    out = io.StringIO()
    doctor.run(m.system(), ns, out=out)
    lines = out.getvalue().splitlines()
    i = next(i for i, x in enumerate(lines) if x.startswith("FAIL  thin pool vg0/pool0"))
    assert lines[i + 1].strip() == "fix: lvchange --activate y vg0/pool0"


def test_doctor_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CSI_LOCAL_VOLUME_GROUP", "vgx")
    monkeypatch.setenv("CSI_LOCAL_THIN_POOL", "poolx")
    monkeypatch.setenv("CSI_LOCAL_LOCK_DIR", "/l")
    monkeypatch.setenv("CSI_ENDPOINT", "unix:///e.sock")
    ns = build_parser().parse_args(["doctor", "--state-dir", "/s"])
    assert (ns.volume_group, ns.thin_pool, ns.state_dir, ns.lock_dir, ns.endpoint) == (
        "vgx", "poolx", "/s", "/l", "unix:///e.sock")
    monkeypatch.delenv("CSI_LOCAL_THIN_POOL")
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["doctor"])
    assert info.value.code == 2


# kernel and device-mapper ---------------------------------------------------------


def test_modules(m: Machine) -> None:
    sysm = m.system()
    m.write("proc/modules", "dm_mod 1 0 - Live 0x0\n")
    thin = doctor.check_module(sysm, "dm_thin_pool")
    assert (thin.status, thin.message) == (FAIL, "not loaded")
    assert thin.fix.startswith("modprobe dm-thin-pool")
    snap = doctor.check_module(sysm, "dm_snapshot", required=False)
    assert snap.status == WARN and snap.fix.startswith("modprobe dm-snapshot")
    (m.root / "sys/module/dm_thin_pool").mkdir(parents=True)
    assert doctor.check_module(sysm, "dm_thin_pool") == Check(
        "kernel module dm_thin_pool", OK, "built in")
    os.unlink(m.root / "proc/modules")  # no /proc/modules at all: a kernel without modules
    assert doctor.check_module(sysm, "dm_thin_pool").status == OK


def test_device_mapper(m: Machine) -> None:
    sysm = m.system()
    assert doctor.check_device_mapper(sysm).status == OK
    m.write("proc/misc", " 60 loop-control\n")
    got = doctor.check_device_mapper(sysm)
    assert got.status == FAIL and "no device-mapper driver" in got.message
    assert got.fix == "modprobe dm-mod on the host"
    (m.root / "sys/module/dm_mod").mkdir(parents=True)  # built in
    os.unlink(m.root / "dev/mapper/control")
    got = doctor.check_device_mapper(sysm)
    assert got.status == FAIL and "/dev/mapper/control is missing" in got.message


# tools ---------------------------------------------------------------------------


def test_lvm_tools(m: Machine) -> None:
    del m.tools["lvs"], m.tools["lvmconfig"]
    got = doctor.check_lvm_tools(m.system())
    assert got.status == FAIL and got.message == \
        "lvm is installed but lvs, lvmconfig missing (they are symlinks to lvm)"
    assert "ln -s lvm" in got.fix
    del m.tools["lvm"]
    got = doctor.check_lvm_tools(m.system())
    assert got.status == FAIL and got.fix.startswith("apt-get install lvm2")


def test_lvm_version_is_optional(m: Machine) -> None:
    m.canned.replies[("lvmconfig", "--version")] = []
    m.canned.on(["lvmconfig", "--version"], rc=3, stderr="boom")
    assert doctor.check_lvm_tools(m.system()) == Check("lvm tools", OK, "/usr/sbin/lvm")


def test_base_tools(m: Machine) -> None:
    del m.tools["mkfs.ext4"], m.tools["blkid"]
    got = doctor.check_tools(m.system())
    assert got == Check("tools", FAIL, "missing: blkid, mkfs.ext4",
                        "apt-get install e2fsprogs util-linux")


@pytest.mark.parametrize(("fs", "tool", "pkg"), [("xfs", "mkfs.xfs", "xfsprogs"),
                                                 ("btrfs", "btrfs", "btrfs-progs")])
def test_optional_fs_tools_warn(m: Machine, fs: str, tool: str, pkg: str) -> None:
    assert doctor.check_fs_tools(m.system(), fs).status == OK
    del m.tools[tool]
    got = doctor.check_fs_tools(m.system(), fs)
    assert got.status == WARN and f"{fs} volumes are unavailable" in got.message
    assert got.fix == f"apt-get install {pkg}"
    assert doctor.exit_code([got]) == 0


# LVM -------------------------------------------------------------------------------


def test_missing_volume_group(m: Machine, listening: None) -> None:
    m.host.vg_present = False
    checks = m.checks()
    vg = checks["volume group vg0"]
    assert (vg.status, vg.message) == (FAIL, "not found")
    assert "vgchange --activate y vg0" in vg.fix
    pool = checks["thin pool vg0/pool0"]
    assert pool.status == FAIL and "volume group cannot be read" in pool.message
    assert "thin pool zeroing" not in checks and "thin pool fill" not in checks
    assert doctor.exit_code(checks.values()) == 1


def test_unreadable_volume_group(m: Machine) -> None:
    m.host.fail_next(["vgs"], rc=5, stderr="  /run/lock/lvm/P_global: open failed: Permission "
                                           "denied\n")
    got = doctor.check_volume_group(m.lvm())
    assert got.status == FAIL and got.message.startswith("cannot be read: vgs exited 5")


def test_pool_missing_wrong_or_inactive(m: Machine) -> None:
    lvm = m.lvm()
    assert doctor.check_pool(lvm, lvm.report()).status == OK
    m.host.lvs["pool0"].active = False
    got = doctor.check_pool(lvm, lvm.report())
    assert got.status == FAIL and got.fix == "lvchange --activate y vg0/pool0"
    m.host.lvs["pool0"].kind = "thin"
    got = doctor.check_pool(lvm, lvm.report())
    assert got.status == FAIL and "is not a thin pool" in got.message
    del m.host.lvs["pool0"]
    got = doctor.check_pool(lvm, lvm.report())
    assert (got.status, got.message) == (FAIL, "not found")
    assert got.fix == "lvcreate --type thin-pool --extents 90%FREE --name pool0 vg0"


def test_pool_health(m: Machine) -> None:
    lvm = m.lvm()
    pool = lvm.report().find("pool0")
    assert pool is not None
    report = VgReport((replace(pool, health="failed"),), 4 << 20)
    got = doctor.check_pool(lvm, report)
    assert got.status == FAIL and got.message == "health is failed"
    assert "lvconvert --repair vg0/pool0" in got.fix


def test_inactive_pool_skips_fill(m: Machine, listening: None) -> None:
    m.host.lvs["pool0"].active = False
    checks = m.checks()
    assert checks["thin pool vg0/pool0"].status == FAIL
    assert "thin pool zeroing" in checks and "thin pool fill" not in checks


def test_zeroing_from_lv_attr(m: Machine) -> None:
    lvm = m.lvm()
    pool = lvm.report().find("pool0")
    assert pool is not None and pool.attr[7] == "z"
    assert doctor.check_zeroing(lvm, pool).status == OK
    off = replace(pool, attr=pool.attr[:7] + "-" + pool.attr[8:])
    got = doctor.check_zeroing(lvm, off)
    assert got.status == WARN and "data of deleted volumes" in got.message
    assert got.fix == "lvchange --zero y vg0/pool0"


@pytest.mark.parametrize(("data", "meta", "status", "words"), [
    (10.0, 5.0, OK, "data 10.0%, metadata 5.0% (high-water marks 90% and 90%)"),
    (91.0, 5.0, WARN, "above its high-water mark: data 91.0% full (limit 90%)"),
    (10.0, 95.5, WARN, "metadata 95.5% full"),
    (100.0, 5.0, FAIL, "out of data space"),
    (50.0, 100.0, FAIL, "out of metadata space"),
])
def test_fill(m: Machine, data: float, meta: float, status: str, words: str) -> None:
    pool = m.host.lvs["pool0"]
    pool.data_percent, pool.metadata_percent = data, meta
    lvm = m.lvm()
    report_pool = lvm.report().find("pool0")
    assert report_pool is not None
    got = doctor.check_fill(lvm, report_pool)
    assert got.status == status and words in got.message
    assert (got.fix != "") == (status != OK)


@pytest.mark.parametrize(("left", "status", "words"), [
    pytest.param(None, OK, "room for", id="empty"),
    pytest.param(0.15, WARN, "above 80%", id="above-80-percent"),
    pytest.param(0.0, FAIL, "new volumes and snapshots are refused", id="full"),
])
def test_metadata_area(m: Machine, left: float | None, status: str, words: str) -> None:
    """OK, a warning above 80 % of the largest text LVM writes, a failure
    when no further volume fits; the fix names pvcreate --metadatasize."""
    fvg = m.host.vgs["vg0"]
    limit = vg_text.max_text_size(fvg.mda_size)
    if left is not None:
        fvg.mda_padding += int(limit * (1 - left)) - fvg.mda_text
    lvm = m.lvm()
    got = doctor.check_metadata_area(lvm, lvm.report())
    assert got.status == status and words in got.message, got
    assert ("--metadatasize" in got.fix) == (status != OK)


def test_device_ids(m: Machine) -> None:
    lvm = m.lvm()
    assert doctor.check_device_ids(lvm, lvm.report()).status == OK
    m.host.add_lv("csi-v-x", 1 << 30)
    m.host.lv("csi-v-x").thin_id = (1 << 24) - 1
    got = doctor.check_device_ids(lvm, lvm.report())
    assert got.status == FAIL and "device ID 16777215" in got.message


# lvm.conf --------------------------------------------------------------------------


def settings(m: Machine, text: str, rc: int = 0) -> list[Check]:
    m.canned.replies[SETTINGS_ARGV] = []
    m.canned.on(SETTINGS_ARGV, text, rc=rc, stderr="Configuration node x not found")
    return doctor.check_lvm_settings(m.system())


def test_udev_settings(m: Machine) -> None:
    udev, _ = settings(m, GOOD_SETTINGS)
    assert udev.status == OK and udev.message.endswith("udev running")
    m.env["KUBERNETES_SERVICE_HOST"] = "10.0.0.1"  # in a container, both must be off
    udev, _ = settings(m, GOOD_SETTINGS)
    assert udev.status == WARN and "in a container" in udev.message
    assert "deploy/container/lvm.conf" in udev.fix
    udev, _ = settings(m, "udev_sync=0\nudev_rules=0\nmonitoring=0\n")
    assert udev.status == OK
    m.env.clear()
    m.write(".dockerenv", "")
    udev, _ = settings(m, "udev_sync=0\nudev_rules=1\nmonitoring=0\n")
    assert udev.status == WARN
    os.unlink(m.root / ".dockerenv")
    os.unlink(m.root / "run/udev/control")  # on a host without udevd, rules need it
    udev, _ = settings(m, "udev_sync=1\nudev_rules=1\nmonitoring=0\n")
    assert udev.status == WARN and "udev is not running" in udev.message
    udev, _ = settings(m, "udev_sync=0\nudev_rules=0\nmonitoring=0\n")
    assert udev.status == OK


def test_lvm_shell_profile(m: Machine) -> None:
    # Missing, in a directory the plugin can make: it writes it at start.
    got = doctor.check_lvm_shell(m.system())
    assert got.status == OK and "missing; the plugin writes it at start" in got.message
    m.write(f"etc/lvm/profile/{PROFILE_NAME}.profile", PROFILE)
    got = doctor.check_lvm_shell(m.system())
    assert got.status == OK and "present" in got.message
    m.write(f"etc/lvm/profile/{PROFILE_NAME}.profile", "log { report_command_log=0 }\n")
    assert "not this version's" in doctor.check_lvm_shell(m.system()).message
    # A profile directory configured elsewhere, under a file (a read-only
    # /etc reads the same): every LVM command will be a process.
    m.write("opt/lvm", "")
    m.canned.replies[PROFILE_DIR_ARGV] = []
    m.canned.on(PROFILE_DIR_ARGV, 'profile_dir="/opt/lvm/profile"\n')
    got = doctor.check_lvm_shell(m.system())
    assert got.status == WARN and "/opt/lvm/profile/" in got.message
    assert "ensure_profile('/opt/lvm/profile')" in got.fix and "--lvm-shell=false" in got.fix
    # lvmconfig failing: LVM's default directory is the one looked at.
    m.canned.replies[PROFILE_DIR_ARGV] = []
    m.canned.on(PROFILE_DIR_ARGV, rc=5, stderr="boom")
    got = doctor.check_lvm_shell(m.system())
    assert "/etc/lvm/profile/" in got.message


def test_monitoring(m: Machine) -> None:
    _, mon = settings(m, GOOD_SETTINGS)
    assert mon.status == OK and "--pool-autoextend-threshold-percent" in mon.message
    _, mon = settings(m, "udev_sync=1\nudev_rules=1\nmonitoring=1\n")
    assert mon.status == WARN and "dmeventd is not running" in mon.message
    assert "--pool-autoextend-threshold-percent" in mon.fix
    m.write("proc/412/comm", "dmeventd\n")
    _, mon = settings(m, "udev_sync=1\nudev_rules=1\nmonitoring=1\n")
    assert mon.status == OK and "dmeventd running" in mon.message


def test_lvmconfig_failure_warns(m: Machine) -> None:
    (got,) = settings(m, "", rc=5)
    assert got.status == WARN and got.message.startswith("lvmconfig failed")


def test_no_lvm_conf_means_lvm_defaults(m: Machine) -> None:
    """lvm2 2.03's `lvmconfig --type full` fails without any lvm.conf (seen in the
    test VM); the defaults then apply, printed commented out by --type default."""
    m.canned.replies[SETTINGS_ARGV] = []
    m.canned.on(SETTINGS_ARGV, rc=5, stderr="  Cannot clone NULL config node.\n  Failed to "
                "clone current config tree.\n")
    m.canned.on(["lvmconfig", "--type", "default", *doctor.LVM_SETTINGS],
                "# udev_sync=1\n# udev_rules=1\n# monitoring=1\n")
    assert doctor.read_lvm_settings(m.system()) == {"udev_sync": "1", "udev_rules": "1",
                                                    "monitoring": "1"}
    udev, mon = doctor.check_lvm_settings(m.system())
    assert udev.status == OK and mon.status == WARN


# directories, socket, propagation -------------------------------------------------------


def test_directories(m: Machine) -> None:
    sysm = m.system()
    ok = doctor.check_directory(sysm, "state directory", "/var/lib/csi-local", "--state-dir")
    assert ok == Check("state directory /var/lib/csi-local", OK, "mode 0700, owned by root")
    got = doctor.check_directory(sysm, "state directory", "/var/lib/new/deeper", "--state-dir")
    assert got.status == OK and "the plugin makes it" in got.message
    os.chmod(m.root / "var/lib/csi-local", 0o777)
    got = doctor.check_directory(sysm, "state directory", "/var/lib/csi-local", "--state-dir")
    assert got.status == FAIL and "world-writable (mode 0777)" in got.message
    assert got.fix == "chown root:root /var/lib/csi-local && chmod 0700 /var/lib/csi-local"
    m.uid = os.geteuid() + 1
    got = doctor.check_directory(m.system(), "lock directory", "/run/lock/csi-local",
                                 "--lock-dir")
    assert got.status == FAIL and f"owned by uid {os.geteuid()}, not root" in got.message
    os.symlink("/tmp", m.root / "run/lock/link")
    got = doctor.check_directory(sysm, "lock directory", "/run/lock/link", "--lock-dir")
    assert got.status == FAIL and "not a directory" in got.message
    m.write("run/file", "")
    got = doctor.check_directory(sysm, "lock directory", "/run/file/locks", "--lock-dir")
    assert got.status == FAIL and "cannot be made under /run/file" in got.message


def test_socket(m: Machine) -> None:
    sysm = m.system()
    got = doctor.check_socket(sysm, ENDPOINT)
    assert got.status == WARN and "the plugin is not running" in got.message
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(m.root / "s.sock"))  # bound, never listening: a stale socket
        got = doctor.check_socket(sysm, ENDPOINT)
        assert got.status == WARN and "nothing answers" in got.message
        s.listen(1)
        assert doctor.check_socket(sysm, ENDPOINT).status == OK
    m.write("f.sock", "")
    assert doctor.check_socket(sysm, "unix:///f.sock").status == FAIL
    got = doctor.check_socket(sysm, "tcp://1.2.3.4:5")
    assert got.status == FAIL and "unix:///absolute/path" in got.message


@pytest.mark.parametrize(("optional", "status"), [
    ("shared:7 ", OK), ("shared:7 master:1 ", OK), ("master:1 ", FAIL), ("", FAIL),
])
def test_kubelet_propagation(m: Machine, optional: str, status: str) -> None:
    m.write("proc/self/mountinfo", MOUNTINFO.format(opt=optional))
    got = doctor.check_propagation(m.system())
    assert got.status == status
    assert "on mount /var/lib/kubelet" in got.message  # the longest mount containing it
    if status == FAIL:
        assert "invisible to kubelet" in got.message
        assert "mount --make-rshared /" in got.fix and "Bidirectional" in got.fix


def test_kubelet_propagation_from_the_root_mount(m: Machine) -> None:
    m.write("proc/self/mountinfo", "21 1 8:1 / / rw - ext4 /dev/sda1 rw\n")
    got = doctor.check_propagation(m.system())
    assert got.status == FAIL and "on mount /, which is not shared (private)" in got.message


def test_no_kubelet_is_skipped(m: Machine) -> None:
    os.rmdir(m.root / "var/lib/kubelet")
    got = doctor.check_propagation(m.system())
    assert got.status == OK and "skipped" in got.message


def test_mountinfo_escapes() -> None:
    rows = doctor.parse_propagation("40 1 0:1 / /a\\040b rw shared:3 - tmpfs t rw\n")
    assert rows == [("/a b", ["shared:3"])]


# device classes ------------------------------------------------------------------------

CONFIG = "/etc/csi-local/classes.toml"
CLASSES = """\
default = "fast"

[classes.fast]
volume_group = "vg0"
thin_pool = "pool0"

[classes.big]
volume_group = "vg-hdd"
thin_pool = "pool"
"""


def class_checks(m: Machine) -> dict[str, Check]:
    got = doctor.run_checks(m.system(), Options(config=CONFIG, endpoint=ENDPOINT))
    return {c.name: c for c in got}


@pytest.fixture
def classes(m: Machine) -> Machine:
    m.write(CONFIG.lstrip("/"), CLASSES)
    m.host.add_vg("vg-hdd", pool="pool")
    return m


def test_every_class_is_checked(classes: Machine, listening: None) -> None:
    checks = class_checks(classes)
    assert {c.status for c in checks.values()} == {OK}, [c for c in checks.values()
                                                         if c.status != OK]
    lvm_part = list(checks)[list(checks).index("cryptsetup") + 1:
                            list(checks).index("lvm.conf udev")]
    assert lvm_part == [
        f"configuration file {CONFIG}",
        "class fast: volume group vg0", "class fast: volume group vg0 metadata",
        "class fast: thin pool vg0/pool0", "class fast: volume group vg0 metadata area",
        "class fast: thin pool device IDs",
        "class fast: thin pool zeroing", "class fast: thin pool fill",
        "class fast: thin pool metadata snapshot",
        "class big: volume group vg-hdd", "class big: volume group vg-hdd metadata",
        "class big: thin pool vg-hdd/pool", "class big: volume group vg-hdd metadata area",
        "class big: thin pool device IDs", "class big: thin pool zeroing",
        "class big: thin pool fill",
        "class big: thin pool metadata snapshot", "lvm versions"]
    assert checks[f"configuration file {CONFIG}"].message == \
        "2 device class(es): fast, big; default fast"
    assert checks["class big: thin pool vg-hdd/pool"].message == "active, size 10.0 GiB"


def test_a_class_whose_volume_group_is_missing(classes: Machine, listening: None) -> None:
    classes.host.set_vg_present("vg-hdd", False)
    checks = class_checks(classes)
    vg = checks["class big: volume group vg-hdd"]
    assert (vg.status, vg.message) == (FAIL, "not found")
    assert "vgchange --activate y vg-hdd" in vg.fix
    pool = checks["class big: thin pool vg-hdd/pool"]
    assert pool.status == FAIL and "volume group cannot be read" in pool.message
    assert "class big: thin pool fill" not in checks
    assert [c.status for n, c in checks.items() if n.startswith("class fast: ")] == [OK] * 8
    assert doctor.exit_code(checks.values()) == 1
    out = io.StringIO()
    ns = build_parser().parse_args(["doctor", "--config", CONFIG, "--endpoint", ENDPOINT])
    assert doctor.run(classes.system(), ns, out=out) == 1
    assert "FAIL  class big: volume group vg-hdd" in out.getvalue()


def test_a_class_pool_that_is_no_thin_pool(classes: Machine) -> None:
    classes.host.lv("pool", vg="vg-hdd").kind = "thin"
    check = class_checks(classes)["class big: thin pool vg-hdd/pool"]
    assert check.status == FAIL and "is not a thin pool" in check.message
    assert check.fix.startswith(f"give thin_pool of class big in {CONFIG} the name of a thin "
                                "pool")


def test_a_class_pool_that_is_full(classes: Machine) -> None:
    classes.host.lv("pool", vg="vg-hdd").data_percent = 100.0
    checks = class_checks(classes)
    assert checks["class big: thin pool fill"].status == FAIL
    assert checks["class fast: thin pool fill"].status == OK
    assert "vg-hdd/pool" in checks["class big: thin pool fill"].fix


@pytest.mark.parametrize(("text", "words"), [
    ('[classes.fast]\nvolume_group = "vg0"\n', f"{CONFIG}:1: class 'fast' needs thin_pool"),
    (None, "cannot read the configuration file"),
])
def test_a_bad_configuration_file_fails(m: Machine, listening: None, text: str | None,
                                        words: str) -> None:
    if text is not None:
        m.write(CONFIG.lstrip("/"), text)
    checks = class_checks(m)
    check = checks[f"configuration file {CONFIG}"]
    assert check.status == FAIL and words in check.message
    assert check.message.endswith("; no device class checked")
    assert not any(name.startswith("class ") for name in checks)
    assert "lvm.conf udev" in checks  # the other checks still run
    assert doctor.exit_code(checks.values()) == 1


def test_doctor_takes_the_configuration_file(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CSI_LOCAL_VOLUME_GROUP", "CSI_LOCAL_THIN_POOL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CSI_LOCAL_CONFIG", "/etc/c.toml")
    ns = build_parser().parse_args(["doctor"])
    assert (ns.config, ns.volume_group, ns.thin_pool) == ("/etc/c.toml", None, None)
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["doctor", "--volume-group", "vg0", "--thin-pool", "p"])
    assert info.value.code == 2


@pytest.mark.parametrize(("mark", "status", "says"), [
    (None, WARN, "held by another program (thin_dump, thin_delta, a backup tool), which "
                 "csi-local never releases"),
    ({"phase": "held", "root": 43}, WARN, "a metadata snapshot csi-local reserved is held"),
    ({"phase": "reserving", "root": None}, WARN, "csi-local may have reserved"),
])
def test_a_reserved_metadata_snapshot_is_reported_with_whose_it_is(
        m: Machine, listening: None, mark: dict[str, object] | None, status: str,
        says: str) -> None:
    pool = m.host.lvs["pool0"]
    pool.held, pool.held_root = True, 43
    if mark is not None:
        m.write(f"var/lib/csi-local/{MARK_PREFIX}vg0-pool0",
                json.dumps({"vg": "vg0", "pool": "pool0", **mark}))
    check = m.checks()["thin pool metadata snapshot"]
    assert check.status == status and says in check.message, check
    assert "changed-block reads" in check.message and "UNAVAILABLE" in check.message
    if mark is None or mark["phase"] != "held":
        assert "release_metadata_snap" in check.fix and "vg0-pool0-tpool" in check.fix
    else:
        assert "restart csi-local" in check.fix


def test_metadata_copies_that_disagree_are_a_warning_naming_the_pv(
        m: Machine, monkeypatch: pytest.MonkeyPatch) -> None:
    problem = "PV /dev/loop1 has outdated metadata of VG vg0 (seqno 8, newest 13)"
    asked: list[bool] = []

    def check(self: CommittedMetadata, vg: str, *, ask_lvm: bool = False) -> tuple[str, ...]:
        asked.append(ask_lvm)
        return (problem,) if vg == "vg0" else ()

    monkeypatch.setattr(CommittedMetadata, "check", check)
    got = m.checks()["volume group vg0 metadata"]
    assert (got.status, got.message) == (WARN, problem)
    assert "vgck --updatemetadata vg0" in got.fix
    assert asked == [True]  # LVM's own warnings too: pvs hides an outdated PV


# the plugin's LVM view against the host's (--host-lvm-dir) ----------------------

HOST_LVM = "/host/etc/lvm"
VIEW_ARGV = ("lvmconfig", "--type", "full", *doctor.VIEW_SETTINGS,
             "devices/use_devicesfile", "devices/devicesfile")
PVS_ARGV = ("pvs", "--readonly", "--reportformat", "json", "-o", "pv_name,vg_name")
ACCEPT_ALL = 'global_filter=["a|.*|"]\nfilter=["a|.*|"]\nsystem_id_source="none"\n' \
             'system_id=""\nuse_devicesfile={udf}\ndevicesfile="system.devices"\n'


def _pvs(**pvs: str) -> str:
    rows = [{"pv_name": f"/dev/{pv}", "vg_name": vg} for pv, vg in pvs.items()]
    return json.dumps({"report": [{"pv": rows}]})


class Views:
    """The plugin's LVM (a FakeRunner) and the host's (another, handed out for
    LVM_SYSTEM_DIR=<root>/host/etc/lvm), over a directory tree."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.plugin, self.host = FakeRunner(), FakeRunner()
        self.dirs: list[str] = []
        for d in ("etc/lvm", "host/etc/lvm"):
            (root / d).mkdir(parents=True)
            (root / d / "lvm.conf").write_text("devices {\n}\n")

    def answer(self, runner: FakeRunner, config: str, pvs: str, rc: int = 0) -> None:
        runner.on(VIEW_ARGV, config)
        runner.on(PVS_ARGV, pvs, rc=rc, stderr="  Cannot read devices" if rc else "")

    def host_runner(self, system_dir: str) -> FakeRunner:
        self.dirs.append(system_dir)
        return self.host

    def check(self) -> Check:
        system = System(self.plugin, str(self.root), lvm_runner=self.host_runner)
        return doctor.check_lvm_view(system, HOST_LVM)


@pytest.fixture
def views(tmp_path: Path) -> Views:
    return Views(tmp_path / "root")


def test_lvm_view_alike_is_ok(views: Views) -> None:
    """The image's use_devicesfile=1 without a devices file uses none, as the
    host's use_devicesfile=0 does: no difference."""
    views.answer(views.plugin, ACCEPT_ALL.format(udf=1), _pvs(sdb="vg0", sdc=""))
    views.answer(views.host, ACCEPT_ALL.format(udf=0), _pvs(sdb="vg0", sdc=""))
    got = views.check()
    assert got.status == OK, got
    assert got.message == (f"the same as the host's ({HOST_LVM}): 2 PV(s) in vg0; filters, "
                           "devices file (none) and system ID settings alike")
    # the host's view is LVM's with the host's directory (LVM_SYSTEM_DIR)
    assert views.dirs == [str(views.root / "host/etc/lvm")]
    assert views.host.calls == [VIEW_ARGV, PVS_ARGV]


def test_lvm_view_with_another_filter_names_setting_pv_and_vg(views: Views) -> None:
    views.answer(views.plugin, ACCEPT_ALL.format(udf=0), _pvs(sdb="vg0", sdc="data"))
    views.answer(views.host, ACCEPT_ALL.format(udf=0).replace(
        'filter=["a|.*|"]\nsystem', 'filter=["r|^/dev/sdc$|","a|.*|"]\nsystem'),
        _pvs(sdb="vg0"))
    got = views.check()
    assert got.status == WARN, got
    assert got.message == (
        f"the plugin's LVM and the host's ({HOST_LVM}) differ: devices/filter: plugin "
        '["a|.*|"], host ["r|^/dev/sdc$|","a|.*|"]; PV /dev/sdc (VG data) seen by the '
        "plugin only")
    assert "lvmlocal.conf of the ConfigMap csi-local-config" in got.fix
    assert doctor.exit_code([got]) == 0  # a warning, never a failure


def test_lvm_view_one_element_arrays_are_arrays(views: Views) -> None:
    """lvmconfig prints an array of one element as a string: the same value
    as the default's ["a|.*|"], and named as an array when it differs."""
    views.answer(views.plugin, ACCEPT_ALL.format(udf=0), _pvs(sdb="vg0"))
    views.answer(views.host, ACCEPT_ALL.format(udf=0).replace(
        'global_filter=["a|.*|"]', 'global_filter="a|.*|"'), _pvs(sdb="vg0"))
    assert views.check().status == OK
    views.host.replies.clear()
    views.answer(views.host, ACCEPT_ALL.format(udf=0).replace(
        'global_filter=["a|.*|"]', 'global_filter="r|^/dev/sdb$|"'), _pvs())
    assert views.check().message.endswith(
        'differ: devices/global_filter: plugin ["a|.*|"], host ["r|^/dev/sdb$|"]; '
        "PV /dev/sdb (VG vg0) seen by the plugin only")


def test_lvm_view_devices_file_and_system_id(views: Views) -> None:
    """The host uses its devices file, which the plugin's /etc/lvm/devices
    lacks; and the host has a system ID (lvmlocal), the plugin none: its VG is
    then the host's alone."""
    (views.root / "host/etc/lvm/devices").mkdir()
    (views.root / "host/etc/lvm/devices/system.devices").write_text("")
    views.answer(views.plugin, ACCEPT_ALL.format(udf=1), _pvs(sdb="vg0", sdc="vg1"))
    views.answer(views.host, ACCEPT_ALL.format(udf=1).replace(
        'system_id_source="none"\nsystem_id=""',
        'system_id_source="lvmlocal"\nsystem_id="node7"'), _pvs(sdb="vg0", sdd="vg1"))
    msg = views.check().message
    assert "devices file: plugin none, host devices/system.devices" in msg
    assert "global/system_id_source: plugin none, host lvmlocal" in msg
    assert "local/system_id: plugin (unset), host node7" in msg
    assert "PV /dev/sdc (VG vg1) seen by the plugin only" in msg
    assert "PV /dev/sdd (VG vg1) seen by the host only" in msg
    assert "devices/filter" not in msg


def test_lvm_view_a_pv_in_another_vg(views: Views) -> None:
    views.answer(views.plugin, ACCEPT_ALL.format(udf=0), _pvs(sdb="vg0"))
    views.answer(views.host, ACCEPT_ALL.format(udf=0), _pvs(sdb=""))
    got = views.check()
    assert got.status == WARN
    assert got.message.endswith("PV /dev/sdb: VG vg0 for the plugin, (none) for the host")


def test_lvm_view_without_the_hosts_directory_is_not_checked(views: Views) -> None:
    (views.root / "host/etc/lvm/lvm.conf").unlink()
    got = views.check()
    assert got.status == OK
    assert got.message.startswith(f"not checked: no lvm.conf in {HOST_LVM}")
    assert views.plugin.calls == views.host.calls == []


def test_lvm_view_of_the_same_directory_is_one_view(tmp_path: Path) -> None:
    """Bare metal (or --host-lvm-dir /etc/lvm): nothing to compare, no command."""
    (tmp_path / "etc/lvm").mkdir(parents=True)
    (tmp_path / "etc/lvm/lvm.conf").write_text("")
    plugin = FakeRunner()
    got = doctor.check_lvm_view(System(plugin, str(tmp_path)), "/etc/lvm")
    assert got == Check("lvm view of the host", OK, "/etc/lvm is this machine's /etc/lvm: "
                        "one view")
    assert plugin.calls == []


def test_lvm_view_lvm_failing_is_a_warning(views: Views) -> None:
    views.answer(views.plugin, ACCEPT_ALL.format(udf=0), _pvs(sdb="vg0"))
    views.answer(views.host, ACCEPT_ALL.format(udf=0), "", rc=5)
    got = views.check()
    assert got.status == WARN
    assert got.message == "not checked: pvs exited 5: Cannot read devices"


def test_lvm_view_is_checked_only_with_the_option(m: Machine, listening: None) -> None:
    """Without --host-lvm-dir (bare metal, Nomad) the check is not there."""
    assert not [n for n in m.checks() if n.startswith("lvm view")]
    system = m.system()
    got = doctor.run_checks(system, Options("vg0", "pool0", endpoint=ENDPOINT,
                                            host_lvm_dir="/host/etc/lvm"))
    assert [c for c in got if c.name == "lvm view of the host"] == [
        Check("lvm view of the host", OK, "not checked: no lvm.conf in /host/etc/lvm (the "
              "host's /etc/lvm is not mounted there, or the host has no LVM)")]


def test_doctor_takes_the_host_lvm_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    flags = ["doctor", "--volume-group", "vg0", "--thin-pool", "pool0"]
    assert build_parser().parse_args(flags).host_lvm_dir is None
    assert build_parser().parse_args(
        [*flags, "--host-lvm-dir", "/host/etc/lvm"]).host_lvm_dir == "/host/etc/lvm"
    monkeypatch.setenv("CSI_LOCAL_HOST_LVM_DIR", "/host/etc/lvm")
    assert build_parser().parse_args(flags).host_lvm_dir == "/host/etc/lvm"
    monkeypatch.setenv("CSI_LOCAL_HOST_LVM_DIR", "host/etc/lvm")
    with pytest.raises(SystemExit):
        build_parser().parse_args(flags)


# the snapshot-metadata sidecar's certificate (--snapshot-metadata-tls-cert) ------

TLS_CERT = "/etc/csi-snapshot-metadata/tls/tls.crt"
NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


SM_HOST = "csi-local-snapshot-metadata.csi-local.svc"  # of the shipped spec.address


def _cert_check(root: Path, now: datetime = NOW, *,
                address: str = doctor.SNAPSHOT_METADATA_ADDRESS) -> Check:
    system = System(FakeRunner(), str(root), clock=lambda: now)
    return doctor.check_tls_certificate(system, TLS_CERT, address=address)


def _write_cert(root: Path, not_before: str, not_after: str,
                names: Sequence[bytes] = (x509_dns(SM_HOST),)) -> None:
    """A certificate of these dates and subject alternative names (for the
    shipped address's host unless told)."""
    der = x509_cert(tlv(0x17, not_before.encode()) + tlv(0x17, not_after.encode()),
                    extensions=x509_extensions(x509_san(*names)) if names else b"")
    path = root / TLS_CERT[1:]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(x509_pem(der))


def test_tls_certificate_valid_expiring_expired(tmp_path: Path) -> None:
    _write_cert(tmp_path, "250601120000Z", "260801120000Z")
    assert _cert_check(tmp_path) == Check(
        "snapshot-metadata TLS certificate", OK,
        f"{TLS_CERT} for {SM_HOST}, valid until 2026-08-01 12:00:00 UTC (61 days)")
    got = _cert_check(tmp_path, datetime(2026, 7, 18, 12, 0, 1, tzinfo=UTC))
    assert (got.status, got.message) == (
        WARN, f"{TLS_CERT} expires on 2026-08-01 12:00:00 UTC, in 13 day(s)")
    assert "cert-manager" in got.fix
    # 14 days exactly is not yet "within 14 days"
    assert _cert_check(tmp_path, datetime(2026, 7, 18, 12, 0, tzinfo=UTC)).status == OK
    got = _cert_check(tmp_path, datetime(2026, 8, 1, 12, 0, tzinfo=UTC))
    assert (got.status, got.message) == (
        FAIL, f"{TLS_CERT} expired on 2026-08-01 12:00:00 UTC: backup clients refuse the "
        "sidecar")
    got = _cert_check(tmp_path, datetime(2025, 5, 1, tzinfo=UTC))
    assert (got.status, got.message.split(":")[0]) == (
        WARN, f"{TLS_CERT} is not valid before 2025-06-01 12")


def test_tls_certificate_must_be_for_the_address_clients_dial(tmp_path: Path) -> None:
    """Clients check the sidecar's certificate against the host of the
    SnapshotMetadataService's spec.address: one for other names is refused
    however valid its dates. The failure names the address and the names the
    certificate has."""
    _write_cert(tmp_path, "250601120000Z", "260801120000Z",
                [x509_dns("csi-local-snapshot-metadata"), x509_ip(b"\x0a\x00\x00\x07")])
    got = _cert_check(tmp_path)
    assert (got.status, got.message) == (FAIL, (
        f"{TLS_CERT} is not for {SM_HOST}, the host of the snapshot metadata address "
        f"{SM_HOST}:6443: its subject alternative names are "
        "DNS:csi-local-snapshot-metadata, IP:10.0.0.7, and backup clients that dial the "
        "address refuse the sidecar"))
    assert "dnsNames" in got.fix and "--snapshot-metadata-address" in got.fix
    # Another address, by IP or by a name a wildcard covers.
    assert _cert_check(tmp_path, address="10.0.0.7:6443").status == OK
    _write_cert(tmp_path, "250601120000Z", "260801120000Z", [x509_dns("*.backup.svc")])
    assert _cert_check(tmp_path, address="sm.backup.svc:443").message.startswith(
        f"{TLS_CERT} for sm.backup.svc, valid until")
    assert _cert_check(tmp_path).status == FAIL
    # No subject alternative names at all: the common name counts for no client.
    _write_cert(tmp_path, "250601120000Z", "260801120000Z", [])
    got = _cert_check(tmp_path)
    assert (got.status, "names are none, and" in got.message) == (FAIL, True)


def test_tls_certificate_missing_names_secret_and_fix(tmp_path: Path) -> None:
    """The overlay mounts the Secret optionally: without it the directory is
    empty and the file missing."""
    got = _cert_check(tmp_path)
    assert got.status == FAIL
    assert got.message == (f"{TLS_CERT} does not exist: the Secret "
                           "csi-local-snapshot-metadata-tls (key tls.crt) is missing, and the "
                           "snapshot-metadata sidecar cannot start")
    assert "cert-manager Certificate of docs/snapshot-metadata.md" in got.fix


def test_tls_certificate_unreadable_or_not_one(tmp_path: Path) -> None:
    path = tmp_path / TLS_CERT[1:]
    path.mkdir(parents=True)
    got = _cert_check(tmp_path)
    assert (got.status, got.message) == (FAIL, f"{TLS_CERT} cannot be read: Is a directory")
    path.rmdir()
    path.write_text("-----BEGIN PRIVATE KEY-----\nMIIB\n-----END PRIVATE KEY-----\n")
    got = _cert_check(tmp_path)
    assert (got.status, got.message) == (
        FAIL, f"{TLS_CERT} is not a PEM certificate: no PEM CERTIFICATE block")


def test_tls_certificate_is_checked_only_when_configured(m: Machine, listening: None) -> None:
    assert not [n for n in m.checks() if "TLS" in n]
    got = doctor.run_checks(m.system(), Options("vg0", "pool0", endpoint=ENDPOINT,
                                                 tls_cert=TLS_CERT))
    assert got[-1].name == "snapshot-metadata TLS certificate"
    assert got[-1].status == FAIL  # not in m's tree


def test_doctor_takes_the_snapshot_metadata_address(monkeypatch: pytest.MonkeyPatch,
                                                   m: Machine, listening: None) -> None:
    flags = ["doctor", "--volume-group", "vg0", "--thin-pool", "pool0"]
    assert build_parser().parse_args(flags).snapshot_metadata_address == f"{SM_HOST}:6443"
    monkeypatch.setenv("CSI_LOCAL_SNAPSHOT_METADATA_ADDRESS", "[fd00::7]:6443")
    assert build_parser().parse_args(flags).snapshot_metadata_address == "[fd00::7]:6443"
    for bad in ("sm.svc", ":6443", "sm.svc:http", "http://sm.svc:6443"):
        monkeypatch.setenv("CSI_LOCAL_SNAPSHOT_METADATA_ADDRESS", bad)
        with pytest.raises(SystemExit):
            build_parser().parse_args(flags)
    # run() hands it to the check: a certificate for fd00::7 only passes with it.
    now = datetime.now(UTC)
    _write_cert(m.root, f"{now - timedelta(days=1):%y%m%d%H%M%S}Z",
                f"{now + timedelta(days=100):%y%m%d%H%M%S}Z", [x509_ip(
                    bytes.fromhex("fd000000000000000000000000000007"))])
    monkeypatch.setenv("CSI_LOCAL_SNAPSHOT_METADATA_TLS_CERT", TLS_CERT)
    for address, code in (("[fd00::7]:6443", 0), (f"{SM_HOST}:6443", 1)):
        monkeypatch.setenv("CSI_LOCAL_SNAPSHOT_METADATA_ADDRESS", address)
        ns = build_parser().parse_args([*flags, "--endpoint", ENDPOINT])
        assert doctor.run(m.system(), ns, out=io.StringIO()) == code, address


def test_doctor_takes_the_certificate_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    flags = ["doctor", "--volume-group", "vg0", "--thin-pool", "pool0"]
    ns = build_parser().parse_args(flags)
    assert (ns.snapshot_metadata_tls_cert, ns.tls_cert_warning_days) == (None, 14)
    monkeypatch.setenv("CSI_LOCAL_SNAPSHOT_METADATA_TLS_CERT", TLS_CERT)
    monkeypatch.setenv("CSI_LOCAL_TLS_CERT_WARNING_DAYS", "30")
    ns = build_parser().parse_args(flags)
    assert (ns.snapshot_metadata_tls_cert, ns.tls_cert_warning_days) == (TLS_CERT, 30)
    for bad in ("tls.crt", "-1", "two"):
        env = ("CSI_LOCAL_SNAPSHOT_METADATA_TLS_CERT" if bad == "tls.crt"
               else "CSI_LOCAL_TLS_CERT_WARNING_DAYS")
        monkeypatch.setenv(env, bad)
        with pytest.raises(SystemExit):
            build_parser().parse_args(flags)
        monkeypatch.setenv(env, TLS_CERT if env.endswith("CERT") else "30")


def test_doctor_run_passes_the_certificate_settings(m: Machine, listening: None,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A certificate with 20 days left: ok with the default 14, a warning
    with CSI_LOCAL_TLS_CERT_WARNING_DAYS=30 (exit 0 either way)."""
    now = datetime.now(UTC)
    _write_cert(m.root, f"{now - timedelta(days=1):%y%m%d%H%M%S}Z",
                f"{now + timedelta(days=20, hours=1):%y%m%d%H%M%S}Z")
    monkeypatch.setenv("CSI_LOCAL_SNAPSHOT_METADATA_TLS_CERT", TLS_CERT)
    for days, status in ((None, OK), ("30", WARN)):
        if days:
            monkeypatch.setenv("CSI_LOCAL_TLS_CERT_WARNING_DAYS", days)
        ns = build_parser().parse_args(["doctor", "--volume-group", "vg0", "--thin-pool",
                                        "pool0", "--endpoint", ENDPOINT, "--json"])
        out = io.StringIO()
        assert doctor.run(m.system(), ns, out=out) == 0
        (got,) = [c for c in json.loads(out.getvalue())["checks"]
                  if c["name"] == "snapshot-metadata TLS certificate"]
        assert got["status"] == status, got


def test_lvm_view_pvs_without_a_report_is_a_warning(views: Views) -> None:
    views.answer(views.plugin, ACCEPT_ALL.format(udf=0), "  WARNING: something\n")
    got = views.check()
    assert (got.status, got.message) == (
        WARN, "not checked: pvs printed no JSON report: '  WARNING: something\\n'")


def test_encryption_needs_cryptsetup_and_dm_crypt(m: Machine) -> None:
    """Warnings only: encryption is opt-in."""
    del m.tools["cryptsetup"]
    m.write("proc/modules", "dm_thin_pool 36864 1 - Live 0x0\n")
    checks = m.checks()
    assert checks["cryptsetup"].status == WARN and "cryptsetup-bin" in checks["cryptsetup"].fix
    assert checks["kernel module dm_crypt"].status == WARN


# LVM's versions -------------------------------------------------------------------------

CAPTURED = json.loads((Path(__file__).parent / "data" / "lvm-metadata.json").read_text())


def _written(version: str, host: str = "node-1") -> vg_text.VgMetadata:
    """A VG's metadata as an lvm2 of `version` on `host` wrote it: the text
    a real lvm2 2.03.16 wrote, its header and creation_host changed."""
    text = CAPTURED["text"].encode()
    text = text.replace(b"LVM2 version 2.03.16(2) (2022-05-18):",
                        f"LVM2 version {version}:".encode())
    text = text.replace(b'\ncreation_host = "virtme-ng"\t', f'\ncreation_host = "{host}"\t'
                        .encode())
    return vg_text.vg_metadata(text)


def _versions(m: Machine, monkeypatch: pytest.MonkeyPatch,
              written: dict[str, vg_text.VgMetadata | None],
              vgs: Sequence[str] = ("vg0",)) -> Check:
    monkeypatch.setattr(CommittedMetadata, "volume_group",
                        lambda self, vg, only=None: written.get(vg))
    return doctor.check_lvm_versions(m.system(), vgs)


def test_lvm_versions_here_and_of_each_vgs_metadata(m: Machine,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """This LVM's three versions, and the lvm2 (and host) that last wrote
    each VG, read off its PVs: the host's lvm binary is out of reach."""
    check = _versions(m, monkeypatch, {"vg0": _written("2.03.16(2) (2022-05-18)"),
                                       "vg1": _written("2.03.11(2) (2021-01-08)", "node-2")},
                      ["vg0", "vg1", "vg0", "gone"])
    assert check == Check("lvm versions", OK, (
        "here: LVM 2.03.16(2) (2022-05-18), library 1.02.185 (2022-05-18), driver 4.47.0; "
        "VG vg0 last written by LVM 2.03.16(2) (2022-05-18) on node-1; "
        "VG vg1 last written by LVM 2.03.11(2) (2021-01-08) on node-2; "
        "VG gone: no lvm2 version read off its PVs"))


def test_metadata_of_a_newer_lvm2_warns(m: Machine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Newer by its patch level alone: this LVM may not read what that one
    wrote, and drops it when it writes the VG next."""
    check = _versions(m, monkeypatch, {"vg0": _written("2.03.17(2) (2022-11-10)")})
    assert check.status == WARN
    assert check.message.startswith(
        "VG vg0's metadata was written by lvm2 2.03.17 on node-1, newer than this 2.03.16: ")
    assert "here: LVM 2.03.16(2)" in check.message
    assert "at least as new as the host's" in check.fix


@pytest.mark.parametrize(("version", "status"), [
    ("2.03.10(2) (2020-08-09)", WARN), ("2.02.187(2) (2020-03-24)", WARN),
    ("2.03.11(2) (2021-01-08)", OK), ("2.03.31(2) (2025-02-27)", OK),
    ("2.03.32(2) (2025-05-05)", WARN)])
def test_metadata_of_an_lvm2_outside_the_supported_releases_warns(
        m: Machine, monkeypatch: pytest.MonkeyPatch, version: str, status: str) -> None:
    # Here the newest: only the supported releases decide.
    m.canned.replies[("lvm", "version")] = []
    m.canned.on(["lvm", "version"], "  LVM version:     2.03.40(2) (2030-01-01)\n")
    check = _versions(m, monkeypatch, {"vg0": _written(version)})
    assert check.status == status
    if check.status == WARN:
        assert "outside the releases csi-local supports (2.03.11 to 2.03.31)" in check.message
        assert check.fix == "use an lvm2 from 2.03.11 to 2.03.31 on the host and in the image"


def test_lvm_versions_without_lvm_version(m: Machine, monkeypatch: pytest.MonkeyPatch) -> None:
    m.canned.replies[("lvm", "version")] = []
    m.canned.on(["lvm", "version"], rc=3, stderr="boom")
    check = _versions(m, monkeypatch, {"vg0": _written("2.03.16(2) (2022-05-18)")})
    assert check.status == OK
    assert check.message.startswith("here: LVM version unknown (")

