"""The Nomad host volume plugin's pure logic: Nomad's environment, parameters,
configuration, names, tags and sizes, and what delete counts as holding a
volume (on a /proc and /sys tree made of files). No processes (the unit guard
forbids them)."""

from __future__ import annotations

import ast
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

import csi_local
from csi_local import dhv
from csi_local.dhv import config as dhv_config
from csi_local.dhv import host_volumes
from csi_local.dhv import install as dhv_install
from csi_local.dhv import removal as dhv_removal
from csi_local.dhv import request as dhv_request
from csi_local.dhv.request import DhvError, Request
from csi_local.errors import SizeOutOfRange
from csi_local.host import mounts
from csi_local.host.runner import Result
from csi_local.host.volume_users import VolumeUsers, volume_users
from csi_local.storage.lvm import LogicalVolume, parse_lvs
from csi_local.volumes import host_volume_names as dhv_tags
from csi_local.volumes import sizes
from tests.dhvharness import run_main
from tests.unit.conftest import FakeRunner

VOL_ID = "e715fdf0-f8b7-a4bd-4565-f17e15b85f09"
MIB = 1 << 20
EXTENT = 4 * MIB


def create_env(**extra: str) -> dict[str, str]:
    env = {
        "DHV_OPERATION": "create",
        "DHV_VOLUMES_DIR": "/opt/nomad/data/host_volumes",
        "DHV_PLUGIN_DIR": "/opt/nomad/data/host_volume_plugins",
        "DHV_NODE_POOL": "default",
        "DHV_NAMESPACE": "default",
        "DHV_VOLUME_NAME": "scratch",
        "DHV_VOLUME_ID": VOL_ID,
        "DHV_NODE_ID": "node-1",
        "DHV_CAPACITY_MIN_BYTES": str(100 * MIB),
        "DHV_CAPACITY_MAX_BYTES": str(200 * MIB),
        "DHV_PARAMETERS": '{"fs_type":"xfs","mount_options":"noatime,nodev"}',
    }
    env.update(extra)
    return env


# --- the request ------------------------------------------------------------------


def test_create_request_from_nomads_environment() -> None:
    req = dhv_request.parse_request("create", create_env())
    assert req.volume_id == VOL_ID
    assert req.path == f"/opt/nomad/data/host_volumes/{VOL_ID}"
    assert req.capacity_min == 100 * MIB and req.capacity_max == 200 * MIB
    assert req.parameters == dhv_request.Parameters("xfs", ("noatime", "nodev"))
    assert re.fullmatch(r"dhv-[0-9a-f]{32}", req.lv_name)


def test_delete_request_needs_no_capacity_and_ignores_parameters() -> None:
    env = create_env(DHV_OPERATION="delete", DHV_PARAMETERS='{"whatever":"x"}',
                     DHV_CREATED_PATH=f"/opt/nomad/data/host_volumes/{VOL_ID}")
    del env["DHV_CAPACITY_MIN_BYTES"], env["DHV_CAPACITY_MAX_BYTES"]
    req = dhv_request.parse_request("delete", env)
    assert req.parameters is None
    assert req.created_path.endswith(VOL_ID)
    assert req.lv_name == dhv_request.parse_request("create", create_env()).lv_name


@pytest.mark.parametrize("bad_id", ["", "../etc", "a/b", "-x", "a b", "x" * 129, "a..b", "é"])
def test_volume_ids_that_could_escape_are_refused(bad_id: str) -> None:
    with pytest.raises(DhvError, match="DHV_VOLUME_ID"):
        dhv_request.parse_request("create", create_env(DHV_VOLUME_ID=bad_id))


def test_lv_name_is_a_hash_of_the_id_not_the_id() -> None:
    name = dhv_request.lv_name_for(VOL_ID)
    assert VOL_ID not in name and len(name) == len("dhv-") + 32
    assert name != dhv_request.lv_name_for(VOL_ID.upper())
    assert not name.startswith("csi-")


@pytest.mark.parametrize("key,value", [
    ("DHV_VOLUMES_DIR", "relative/dir"),
    ("DHV_VOLUMES_DIR", "/"),
    ("DHV_VOLUMES_DIR", ""),
    ("DHV_PLUGIN_DIR", "plugins"),
    ("DHV_CAPACITY_MIN_BYTES", "1GiB"),
    ("DHV_CAPACITY_MAX_BYTES", "-1"),
])
def test_bad_environment_values(key: str, value: str) -> None:
    with pytest.raises(DhvError, match=key):
        dhv_request.parse_request("create", create_env(**{key: value}))


def test_min_above_max_is_refused() -> None:
    with pytest.raises(DhvError, match="exceeds"):
        dhv_request.parse_request("create", create_env(DHV_CAPACITY_MIN_BYTES=str(300 * MIB)))


def test_operation_argument_and_variable_must_agree() -> None:
    with pytest.raises(DhvError, match="disagree"):
        dhv_request.parse_request("delete", create_env())
    with pytest.raises(DhvError, match="unknown operation"):
        dhv_request.parse_request("resize", create_env(DHV_OPERATION=""))


def test_plugin_dir_falls_back_to_the_executables_directory() -> None:
    env = create_env()
    del env["DHV_PLUGIN_DIR"]
    req = dhv_request.parse_request("create", env, "/plugins/csi-local-dhv")
    assert req.plugin_dir == "/plugins"
    with pytest.raises(DhvError, match="DHV_PLUGIN_DIR"):
        dhv_request.parse_request("create", env, "csi-local-dhv")


# --- parameters -------------------------------------------------------------------


@pytest.mark.parametrize("raw", ["", "null", "{}"])
def test_no_parameters(raw: str) -> None:
    assert dhv_request.parse_parameters(raw) == dhv_request.Parameters(None, ())


@pytest.mark.parametrize("raw,message", [
    ('{"size":"1G"}', "unknown parameter.*'size'"),
    ('{"fs_type":"ntfs"}', "unsupported fs_type 'ntfs'"),
    ('{"fs_type":4}', "must be a string"),
    ('["ext4"]', "JSON object"),
    ("{not json", "not JSON"),
    ('{"mount_options":"noatime,remount"}', "not allowed"),
    ('{"mount_options":"bind"}', "not allowed"),
    ('{"mount_options":"-o x"}', "invalid mount option"),
    ('{"mount_options":"a;b"}', "invalid mount option"),
])
def test_bad_parameters(raw: str, message: str) -> None:
    with pytest.raises(DhvError, match=message):
        dhv_request.parse_parameters(raw)


def test_mount_options_split_and_trimmed() -> None:
    params = dhv_request.parse_parameters('{"mount_options":" noatime , ,discard "}')
    assert params.mount_options == ("noatime", "discard")


# --- configuration ----------------------------------------------------------------


def test_config_defaults() -> None:
    cfg = dhv_config.parse_config('{"volume_group":"vg0","thin_pool":"pool"}')
    assert cfg.fs_type == "ext4"
    assert cfg.lock_dir == "/run/lock/csi-local"  # the CSI plugin's: shared locks
    assert cfg.overprovision_ratio == 1.0 and cfg.default_size == 1 << 30
    assert cfg.timeout_seconds < 60  # Nomad kills create/delete at 60 s


def test_config_full_and_sizes() -> None:
    cfg = dhv_config.parse_config(json.dumps({
        "volume_group": "vg0", "thin_pool": "pool", "fs_type": "xfs",
        "lock_dir": "/run/lock/x", "overprovision_ratio": 2, "default_size": "512M",
        "timeout_seconds": 30,
    }))
    assert cfg.default_size == 512 * MIB and cfg.fs_type == "xfs"
    assert dhv_config.parse_config(json.dumps(cfg.to_json())) == cfg
    assert "caller_deadline_seconds" not in cfg.to_json()  # Nomad's, the default


def test_a_caller_other_than_nomad_may_wait_longer() -> None:
    """The project's VM tests run the plugin outside Nomad, under emulation:
    they name their own deadline, and the budget must still end before it."""
    cfg = dhv_config.parse_config(json.dumps({
        "volume_group": "vg0", "thin_pool": "pool", "timeout_seconds": 600,
        "caller_deadline_seconds": 3600}))
    assert cfg.timeout_seconds == 600 and cfg.caller_deadline_seconds == 3600
    assert dhv_config.parse_config(json.dumps(cfg.to_json())) == cfg


@pytest.mark.parametrize("data,message", [
    ({"volume_group": "vg0"}, "missing thin_pool"),
    ({"volume_group": "vg0", "thin_pool": "p", "colour": "red"}, "unknown key.*colour"),
    ({"volume_group": "-vg", "thin_pool": "p"}, "not an LVM name"),
    ({"volume_group": "vg/x", "thin_pool": "p"}, "not an LVM name"),
    ({"volume_group": "vg", "thin_pool": "p", "fs_type": "zfs"}, "unsupported fs_type"),
    ({"volume_group": "vg", "thin_pool": "p", "lock_dir": "locks"}, "absolute"),
    ({"volume_group": "vg", "thin_pool": "p", "overprovision_ratio": 0.5}, ">= 1.0"),
    ({"volume_group": "vg", "thin_pool": "p", "overprovision_ratio": "2"}, ">= 1.0"),
    ({"volume_group": "vg", "thin_pool": "p", "default_size": "lots"}, "invalid size"),
    ({"volume_group": "vg", "thin_pool": "p", "timeout_seconds": 0}, "timeout_seconds"),
    # Nomad cancels a create or delete at 60 s: a budget that long is never used
    ({"volume_group": "vg", "thin_pool": "p", "timeout_seconds": 60},
     "below 60: Nomad cancels a host volume create or delete after 60 s"),
    ({"volume_group": "vg", "thin_pool": "p", "timeout_seconds": 3600}, "below 60"),
    ({"volume_group": "vg", "thin_pool": "p", "timeout_seconds": float("inf")}, "below 60"),
    # a caller that is not Nomad names its own deadline, an hour at most
    ({"volume_group": "vg", "thin_pool": "p", "timeout_seconds": 600,
      "caller_deadline_seconds": 600}, r"below caller_deadline_seconds \(600\)"),
    ({"volume_group": "vg", "thin_pool": "p", "caller_deadline_seconds": 7200},
     "caller_deadline_seconds must be a number above 0 and at most 3600"),
    ({"volume_group": "vg", "thin_pool": "p", "caller_deadline_seconds": 0},
     "caller_deadline_seconds"),
])
def test_bad_config(data: dict[str, object], message: str) -> None:
    with pytest.raises(DhvError, match=message):
        dhv_config.parse_config(json.dumps(data), "/plugins/csi-local-dhv.json")


def test_config_file_is_named_after_the_plugin_id(tmp_path: Path) -> None:
    (tmp_path / "csi-local-dhv.json").write_text('{"volume_group":"a","thin_pool":"p"}')
    (tmp_path / "fast-pool.json").write_text('{"volume_group":"b","thin_pool":"p"}')
    assert dhv_config.load_config(str(tmp_path), str(tmp_path / "fast-pool")).volume_group == "b"
    assert dhv_config.load_config(str(tmp_path), str(tmp_path / "csi-local-dhv")).volume_group \
        == "a"
    # another name without its own file falls back to csi-local-dhv.json
    assert dhv_config.load_config(str(tmp_path), str(tmp_path / "other")).volume_group == "a"


def test_missing_config_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DhvError, match=r"no configuration at .*csi-local-dhv\.json"):
        dhv_config.load_config(str(tmp_path), str(tmp_path / "csi-local-dhv"))


# --- tags and sizes ------------------------------------------------------------------


def test_tags_are_in_their_own_namespace() -> None:
    req = dhv_request.parse_request("create", create_env(DHV_VOLUME_NAME="my vol/ü"))
    tags = dhv_tags.volume_tags(req.volume_id, req.volume_name, req.namespace, "xfs")
    assert all(t.startswith("csi-local-dhv.") for t in tags)
    assert not any(t.startswith("csi-local.") for t in tags)
    assert f"csi-local-dhv.id={VOL_ID}" in tags and "csi-local-dhv.fs=xfs" in tags
    name_tag = next(t for t in tags if t.startswith("csi-local-dhv.name="))
    assert dhv_tags.decode_hex_tag(name_tag.split("=", 1)[1]) == "my vol/ü"
    from csi_local.storage.lvm import check_tag

    for tag in tags:
        check_tag(tag)  # every tag is one LVM accepts


def test_size_for_a_new_volume() -> None:
    assert sizes.size_for(100 * MIB + 1, 0, EXTENT, default=1 << 30) == 104 * MIB
    assert sizes.size_for(0, 0, EXTENT, default=1 << 30) == 1 << 30
    assert sizes.size_for(0, 200 * MIB, EXTENT, default=1 << 30) == 200 * MIB
    assert sizes.size_for(10 * MIB, 0, EXTENT, default=1 << 30,
                                 minimum=300 * MIB) == 300 * MIB
    with pytest.raises(SizeOutOfRange, match="no size in the range"):
        sizes.size_for(10 * MIB, 100 * MIB, EXTENT, default=1 << 30, minimum=300 * MIB)
    with pytest.raises(SizeOutOfRange, match="whole extents"):
        sizes.size_for(MIB, 2 * MIB, EXTENT, default=1 << 30)


def test_grow_target() -> None:
    cur = 400 * MIB
    assert sizes.grow_target(cur, 100 * MIB, 0, EXTENT) == cur
    assert sizes.grow_target(cur, cur, cur, EXTENT) == cur
    assert sizes.grow_target(cur, 500 * MIB + 1, 0, EXTENT) == 504 * MIB
    with pytest.raises(SizeOutOfRange, match="shrinking a volume is not supported"):
        sizes.grow_target(cur, 100 * MIB, 200 * MIB, EXTENT)
    with pytest.raises(SizeOutOfRange, match="within the limit"):
        sizes.grow_target(cur, 500 * MIB + 1, 502 * MIB, EXTENT)


# --- the executable's entry point ---------------------------------------------------


def test_fingerprint_prints_a_version(monkeypatch: pytest.MonkeyPatch) -> None:
    rc, out, _ = run_main(["/plugins/csi-local-dhv", "fingerprint"], monkeypatch,
                       {"DHV_OPERATION": "fingerprint"})
    assert rc == 0
    version = json.loads(out)["version"]
    assert version == csi_local.__version__
    # Nomad parses it with go-version: dot-separated numbers.
    assert re.fullmatch(r"\d+(\.\d+){1,2}", version), version


def test_fingerprint_path_does_not_load_the_heavy_modules() -> None:
    # Module-level imports run before fingerprint answers: stdlib and the version only;
    # grpc, protobuf, pyudev and sh come in with create/delete.
    tree = ast.parse(Path(dhv.__file__).read_text())
    top_level = sorted(
        alias.name if isinstance(node, ast.Import) else f"{node.module}.{alias.name}"
        for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    )
    assert top_level == ["__future__.annotations", "csi_local.__version__", "os", "sys"]


def test_unknown_parameter_fails_with_json_before_any_work(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "csi-local-dhv.json").write_text('{"volume_group":"vg","thin_pool":"p"}')
    env = create_env(DHV_PLUGIN_DIR=str(tmp_path), DHV_PARAMETERS='{"colour":"red"}')
    rc, out, _ = run_main([str(tmp_path / "csi-local-dhv"), "create"], monkeypatch, env)
    assert rc == 1
    assert "unknown parameter" in json.loads(out)["error"]


def test_unknown_operation(monkeypatch: pytest.MonkeyPatch) -> None:
    rc, out, _ = run_main(["csi-local-dhv", "resize"], monkeypatch)
    assert rc == 1 and "unknown operation" in json.loads(out)["error"]


def test_install_writes_shim_and_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    rc, out, _ = run_main(["csi-local-dhv", "install", "--plugin-dir", str(tmp_path),
                        "--volume-group", "vg0", "--thin-pool", "pool", "--fs-type", "xfs",
                        "--python", "/usr/bin/python3"], monkeypatch)
    assert rc == 0, out
    shim = tmp_path / "csi-local-dhv"
    text = shim.read_text()
    assert text.startswith("#!/usr/bin/python3 -I\n")
    assert "from csi_local.dhv import main" in text
    assert os.stat(shim).st_mode & 0o777 == 0o755
    conf = tmp_path / "csi-local-dhv.json"
    assert os.stat(conf).st_mode & 0o111 == 0  # Nomad fingerprints every executable
    cfg = dhv_config.load_config(str(tmp_path), str(shim))
    assert (cfg.volume_group, cfg.thin_pool, cfg.fs_type) == ("vg0", "pool", "xfs")
    assert sorted(os.listdir(tmp_path)) == ["csi-local-dhv", "csi-local-dhv.json"]


def test_install_refuses_an_interpreter_a_shebang_cannot_hold() -> None:
    with pytest.raises(DhvError):
        dhv_install.shim_text("/opt/my python/bin/python3", "csi-local-dhv")
    with pytest.raises(DhvError):
        dhv_install.shim_text("python3", "csi-local-dhv")


# --- delete: what holds a volume ----------------------------------------------------
#
# The "volume" is a directory of tmp_path: its st_dev stands for the LV's
# major:minor, so links in the fake /proc that point into it stat as files on
# the volume, and links to /proc or /dev/null as files elsewhere.

VOL_PATH = f"/v/{VOL_ID}"


@dataclass
class FakeProc:
    root: Path
    vol: Path

    @property
    def proc(self) -> str:
        return str(self.root / "proc")

    @property
    def sysfs(self) -> str:
        return str(self.root / "sys")

    @property
    def devno(self) -> str:
        dev = os.stat(self.vol).st_dev
        return f"{os.major(dev)}:{os.minor(dev)}"

    @property
    def hexno(self) -> str:  # as /proc/PID/maps writes it
        major, minor = self.numbers
        return f"{major:02x}:{minor:02x}"

    @property
    def numbers(self) -> tuple[int, int]:
        dev = os.stat(self.vol).st_dev
        return os.major(dev), os.minor(dev)

    def process(self, pid: int, comm: str, ns: int, *, cwd: str = "/proc",
                fds: tuple[str, ...] = (), maps: str = "", mountinfo: str = "",
                cgroup: str = "0::/\n") -> None:
        base = self.root / "proc" / str(pid)
        (base / "ns").mkdir(parents=True)
        (base / "fd").mkdir()
        os.symlink(f"mnt:[{ns}]", base / "ns" / "mnt")
        os.symlink(cwd, base / "cwd")
        os.symlink("/proc", base / "root")  # not "/": tmp_path may be on the root fs
        for n, target in enumerate(fds):
            os.symlink(target, base / "fd" / str(n))
        (base / "comm").write_text(comm + "\n")
        (base / "maps").write_text(maps)
        (base / "cgroup").write_text(cgroup)
        (base / "mountinfo").write_text(mountinfo.replace("DEV", self.devno))


@pytest.fixture
def fake(tmp_path: Path) -> FakeProc:
    vol = tmp_path / "vol"
    (vol / "sub").mkdir(parents=True)
    (vol / "data").write_text("data")
    (tmp_path / "proc").mkdir()
    os.symlink("100", tmp_path / "proc" / "self")
    return FakeProc(tmp_path, vol)


# The plugin's own namespace: "/" is shared (as systemd makes it) and the
# volume is mounted at VOL_PATH.
OWN_MOUNTS = f"""\
1 0 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
20 1 DEV / {VOL_PATH} rw,noatime shared:7 - ext4 /dev/mapper/vg-dhv rw
"""
# A sandboxed service's namespace (systemd's PrivateTmp=, ProtectSystem=): a
# slave of "/", so it holds a copy of the volume's mount that our umount
# takes down with it.
SLAVE_MOUNTS = f"""\
101 100 8:1 / / rw,relatime shared:50 master:1 - ext4 /dev/sda1 rw
120 101 DEV / {VOL_PATH} rw,noatime shared:51 master:7 - ext4 /dev/mapper/vg-dhv rw
"""


def test_what_holds_a_volume_is_named(fake: FakeProc) -> None:
    vol = str(fake.vol)
    fake.process(100, "csi-local-dhv", 1, cwd=vol, fds=(f"{vol}/data",), mountinfo=OWN_MOUNTS
                 + f"21 20 0:50 / {VOL_PATH}/sub rw shared:8 - tmpfs tmpfs rw\n"
                 + "22 1 DEV /sub /elsewhere rw shared:7 - ext4 /dev/mapper/vg-dhv rw\n"
                 + "30 1 0:4 mnt:[9] /run/pin rw - nsfs nsfs rw\n"
                 + "31 1 0:4 mnt:[3] /run/pin3 rw - nsfs nsfs rw\n")
    fake.process(200, "sleep", 1, cwd=f"{vol}/sub")
    fake.process(300, "python3", 1, fds=("/dev/null", f"{vol}/data", "/proc/self"))
    fake.process(400, "app", 1, cgroup="0::/nomad.slice/alloc-1.app.scope\n",
                 maps=f"7f00-7f10 r-xp 0 {fake.hexno} 12 /data/lib.so\n"
                      "7f10-7f20 r-xp 0 08:01 13 /usr/lib/libc.so\n"
                      "7f20-7f30 rw-p 0 00:00 0 \n")
    fake.process(500, "logind", 2, mountinfo=SLAVE_MOUNTS)
    # a container: a private namespace with the volume bind-mounted at /data
    private = (f"201 200 8:1 / / rw - ext4 /dev/sda1 rw\n"
               f"220 201 DEV / {VOL_PATH} rw - ext4 /dev/mapper/vg-dhv rw\n"
               f"221 201 DEV / /data rw - ext4 /dev/mapper/vg-dhv rw\n")
    fake.process(600, "redis", 3, mountinfo=private)
    fake.process(601, "redis", 3, mountinfo=private)
    # a slave copy that umount propagation must leave: something is mounted on it
    fake.process(700, "tail", 4, mountinfo=SLAVE_MOUNTS.replace("shared:50", "shared:60")
                 + f"121 120 0:60 / {VOL_PATH}/x rw - tmpfs tmpfs rw\n")
    holders = fake.root / "sys" / "dev" / "block" / fake.devno / "holders"
    holders.mkdir(parents=True)
    (holders / "dm-9").mkdir()
    for loop, backing in (("loop3", f"{vol}/data"), ("loop4", "/proc/version")):
        (fake.root / "sys" / "block" / loop / "loop").mkdir(parents=True)
        (fake.root / "sys" / "block" / loop / "loop" / "backing_file").write_text(backing)

    users = volume_users(*fake.numbers, [VOL_PATH], proc=fake.proc, sysfs=fake.sysfs)
    assert users.busy == (
        f"process 200 (sleep) holds it: working directory {vol}/sub",
        f"process 300 (python3) holds it: open file {vol}/data",
        "process 400 (app) in cgroup /nomad.slice/alloc-1.app.scope holds it: "
        "mapped file /data/lib.so",
        f"{VOL_PATH}/sub is mounted inside it",
        "it is also mounted at /elsewhere",
        f"it is mounted at {VOL_PATH}, /data in the mount namespace of processes "
        "600 (redis), 601 (redis)",
        f"it is mounted at {VOL_PATH} in the mount namespace of process 700 (tail)",
        "block device dm-9 is stacked on it",
        f"loop device /dev/loop3 is backed by {vol}/data",
    )
    assert users.pinned == ("/run/pin",)  # mnt:[3] has processes, so it was looked at


def test_copies_that_umount_propagation_removes_do_not_hold(fake: FakeProc) -> None:
    # The volumes directory is also bind-mounted at /alt (a peer of "/"), so the
    # volume shows there too; and a slave of the slave namespace has a copy.
    fake.process(100, "csi-local-dhv", 1, mountinfo=OWN_MOUNTS
                 + "23 1 8:1 /v /alt rw shared:1 - ext4 /dev/sda1 rw\n"
                 + f"24 23 DEV / /alt/{VOL_ID} rw shared:7 - ext4 /dev/mapper/vg-dhv rw\n")
    fake.process(500, "logind", 2, mountinfo=SLAVE_MOUNTS)
    fake.process(501, "chronyd", 5, mountinfo=SLAVE_MOUNTS.replace(
        "shared:50 master:1", "master:50").replace("shared:51 master:7", "master:51"))
    fake.process(502, "sleep", 1, cwd="/proc", fds=("/dev/null",))
    users = volume_users(*fake.numbers, [VOL_PATH], proc=fake.proc, sysfs=fake.sysfs)
    assert users == VolumeUsers((), ())
    # the same copy under a private "/" would stay behind: it holds the volume
    fake.process(503, "sh", 6, mountinfo=SLAVE_MOUNTS.replace(" shared:50 master:1", ""))
    users = volume_users(*fake.numbers, [VOL_PATH], proc=fake.proc, sysfs=fake.sysfs)
    assert users.busy == (
        f"it is mounted at {VOL_PATH} in the mount namespace of process 503 (sh)",)


def test_long_lists_are_cut(fake: FakeProc) -> None:
    fake.process(100, "csi-local-dhv", 1, mountinfo=OWN_MOUNTS)
    files = tuple(f"{fake.vol}/f{n}" for n in range(5))
    for n in range(5):
        Path(files[n]).write_text("x")
    fake.process(200, "a", 1, fds=files)
    for pid in range(300, 310):
        fake.process(pid, "b", 1, cwd=str(fake.vol))
    users = volume_users(*fake.numbers, [VOL_PATH], proc=fake.proc, sysfs=fake.sysfs)
    assert users.busy[0] == (f"process 200 (a) holds it: open files {files[0]}, {files[1]}, "
                                f"{files[2]} and 2 more")
    assert len(users.busy) == 11
    req = dhv_request.parse_request("delete", create_env(DHV_OPERATION="delete"))
    lv = parse_lvs_one()
    message = dhv_removal.in_use_message(req, lv, users.busy)
    assert message.count("holds it:") == 8 and "; and 3 more. Stop what holds it" in message


LV_NAME = dhv_request.lv_name_for(VOL_ID)
LVS_JSON = json.dumps({"report": [{"lv": [{
    "lv_name": LV_NAME, "vg_name": "vg0", "lv_size": str(64 * MIB),
    "lv_tags": f"csi-local-dhv.kind=volume,csi-local-dhv.id={VOL_ID},csi-local-dhv.fs=ext4",
    "lv_attr": "Vwi-aotz--", "pool_lv": "pool", "origin": "", "lv_path": f"/dev/vg0/{LV_NAME}",
    "data_percent": "1.00", "metadata_percent": "", "lv_time": "1700000000",
    "lv_health_status": "", "lv_kernel_major": "253", "lv_kernel_minor": "7"}]}]})


def parse_lvs_one() -> LogicalVolume:
    (lv,) = parse_lvs(LVS_JSON)
    return lv


class MountingRunner(FakeRunner):
    """A FakeRunner whose umount and mount change the mount table the plugin reads."""

    table: list[mounts.Mount]

    def run(self, argv: Sequence[str], *, ok_codes: Sequence[int] = (0,),
            input: str | bytes | None = None, timeout: float | None = None) -> Result:
        result = super().run(argv, ok_codes=ok_codes, input=input, timeout=timeout)
        if argv[0] == "umount":
            self.table = [m for m in self.table if m.mount_point != argv[-1]]
        elif argv[0] == "mount":
            line = f"30 1 253:7 / {argv[-1]} {argv[-3]} - {argv[2]} {argv[-2]} rw"
            self.table += mounts.parse_mountinfo(line)
        return result


def delete_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                  users: Callable[..., VolumeUsers],
                  ) -> tuple[host_volumes.HostVolumes, Request, MountingRunner]:
    """A plugin whose commands and mount table are fakes: the volume is mounted
    at its path; umount, mount and lvremove succeed unless a test says otherwise."""
    config = dhv_config.PluginConfig(volume_group="vg0", thin_pool="pool",
                                   lock_dir=str(tmp_path / "locks"))
    env = create_env(DHV_OPERATION="delete", DHV_VOLUMES_DIR=str(tmp_path / "volumes"))
    req = dhv_request.parse_request("delete", env)
    runner = MountingRunner()
    runner.table = mounts.parse_mountinfo(
        f"20 1 253:7 / {req.path} rw,nodev,noatime shared:7 - ext4 /dev/vg0/{LV_NAME} rw")
    runner.on(["lvs"], LVS_JSON)
    runner.on(["umount"])
    runner.on(["mount"])
    monkeypatch.setattr(mounts, "read_mounts", lambda path="": list(runner.table))
    monkeypatch.setattr(mounts, "read_mounts_at",
                        lambda at, source="": mounts.mounts_at(at, list(runner.table)))
    # raising=False: the same test shows what the code without the check does
    monkeypatch.setattr(dhv_removal, "volume_users", users, raising=False)
    monkeypatch.setattr(dhv_removal, "_SETTLE", (0.0,), raising=False)
    plugin = host_volumes.HostVolumes(config, runner)
    # The real host unmounts by a system call; here the fake runner's table is the kernel.
    monkeypatch.setattr(plugin.host, "unmount", lambda target: runner.run(["umount", target]))

    def mount_filesystem(device: str, target: str, fs_type: str, options: Sequence[str]) -> bool:
        runner.run(["mount", "-t", fs_type, "-o", ",".join(options), device, target])
        return True

    monkeypatch.setattr(plugin.host, "mount_filesystem", mount_filesystem)
    return plugin, req, runner


def test_delete_of_a_volume_in_use_unmounts_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, int, list[str]]] = []

    def users(major: int, minor: int, targets: Sequence[str]) -> VolumeUsers:
        seen.append((major, minor, list(targets)))
        return VolumeUsers(("process 42 (sleep) holds it: working directory /data",),
                                   ())

    plugin, req, runner = delete_plugin(tmp_path, monkeypatch, users)
    runner.on(["lvremove"])
    with pytest.raises(DhvError) as err:
        plugin.delete(req)
    assert str(err.value) == (
        f"volume {VOL_ID} (LV vg0/{LV_NAME}) is in use, so nothing was unmounted or removed: "
        "process 42 (sleep) holds it: working directory /data. Stop what holds it, then "
        "delete again")
    assert seen == [(253, 7, [req.path])] * 2  # looked again: a holder that stays
    assert [call[0] for call in runner.calls] == ["lvs"]  # no umount, no lvremove
    assert [m.mount_point for m in runner.table] == [req.path]


def test_delete_mounts_the_volume_again_when_lvremove_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plugin, req, runner = delete_plugin(
        tmp_path, monkeypatch, lambda *a, **k: VolumeUsers((), ("/run/pin",)))
    runner.on(["lvremove"], rc=5, stderr=f"  Logical volume vg0/{LV_NAME} contains a "
                                          "filesystem in use.\n")
    with pytest.raises(Exception) as err:
        plugin.delete(req)
    assert [m.mount_point for m in runner.table] == [req.path]
    assert runner.calls[-1] == ("mount", "-t", "ext4", "-o", "noatime,nodev,rw",
                                f"/dev/vg0/{LV_NAME}", req.path)
    assert isinstance(err.value, DhvError)
    assert str(err.value) == (
        f"LV vg0/{LV_NAME} could not be removed (lvremove exited 5: Logical volume "
        f"vg0/{LV_NAME} contains a filesystem in use.); it is mounted again at {req.path}, "
        "as before the delete; mount namespaces that no process is in, pinned at /run/pin, "
        "may hold it")


def test_missing_config_says_what_to_write(tmp_path: Path) -> None:
    """A plugin put into the directory without `install` (a symlink) fails its
    first create with the JSON to write: written as the message says (with
    the pool's names), the configuration loads."""
    import re

    with pytest.raises(DhvError) as info:
        dhv_config.load_config(str(tmp_path), str(tmp_path / "csi-local-dhv"))
    message = str(info.value)
    assert f"csi-local-dhv install --plugin-dir {tmp_path} " in message
    (shown,) = re.findall(r"\{.*?\}", message)
    text = shown.replace("VG", "vg0").replace("POOL", "pool")
    path = message.split("no configuration at ", 1)[1].split(":", 1)[0]
    Path(path).write_text(text)
    cfg = dhv_config.load_config(str(tmp_path), str(tmp_path / "csi-local-dhv"))
    assert (cfg.volume_group, cfg.thin_pool) == ("vg0", "pool")
