"""`csi-local doctor`: does this node have what the plugin needs?

Each check is a small function returning a Check: "ok", "warn" (printed, the
exit code stays 0) or "FAIL" (exit code 1), a message, and for every miss how
to fix it. The machine is read through a `System` (a root directory for
/proc, /sys, /dev and the configured paths, a runner for LVM, a tool lookup,
and the environment), so unit tests drive every branch with a directory tree
and canned replies, without processes.

Nothing is changed: no directory is made, no module loaded, no lock taken.

The VG, thin pool, zeroing and fill checks run for every device class of the
node: the flags' one (`--volume-group`, `--thin-pool`; labelled as they always
were) or each class of a configuration file (`--config`; labelled
"class NAME: ...", after a check of the file itself).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import socket
import stat
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TextIO

from csi_local import config as config_mod
from csi_local.errors import CommandError, StorageError, VolumeGroupMissing
from csi_local.host.device_mapper import dm_name
from csi_local.host.locks import DEFAULT_LOCK_DIR
from csi_local.host.runner import ProcessRunner, Runner, resolve
from csi_local.ops.status import human_size, read_only_pool
from csi_local.ops.x509 import CertificateError, pem_validity
from csi_local.storage.committed_vg import CommittedMetadata
from csi_local.storage.lvm import RECOMMENDED_METADATA_SIZE, LogicalVolume, Lvm, VgReport
from csi_local.storage.lvm_config import lvm_version, physical_volumes, profile_dir, read_config
from csi_local.storage.lvm_shell import PROFILE, PROFILE_NAME
from csi_local.storage.thin_mappings import Holder, ThinMetadata, holder_text
from csi_local.volumes.device_classes import ClassConfigError, load_classes
from csi_local.volumes.pool import (
    METADATA_AREA_WARN,
    PoolPolicy,
    device_id_problem,
    lvs_that_fit,
    metadata_area_problem,
)

OK, WARN, FAIL = "ok", "warn", "FAIL"
KUBELET_DIR = "/var/lib/kubelet"
# The LVM commands the plugins run; all are symlinks to `lvm` in lvm2.
LVM_TOOLS = ("lvm", "lvs", "vgs", "lvcreate", "lvextend", "lvremove", "lvchange", "lvmconfig")
# Tools every volume needs (package in parentheses in the fix).
BASE_TOOLS = {"blkid": "util-linux", "wipefs": "util-linux", "losetup": "util-linux",
              "mount": "mount", "umount": "mount", "mkfs.ext4": "e2fsprogs",
              "resize2fs": "e2fsprogs", "sync": "coreutils"}
# Tools of the optional file systems: missing ones make that fs unavailable.
FS_TOOLS = {"xfs": (("mkfs.xfs", "xfs_growfs"), "xfsprogs"),
            "btrfs": (("mkfs.btrfs", "btrfs", "btrfstune"), "btrfs-progs")}
LVM_SETTINGS = ("activation/udev_sync", "activation/udev_rules", "activation/monitoring")
# Markers of a container runtime (Docker, Podman) and of a CO's task environment.
_CONTAINER_FILES = ("/.dockerenv", "/run/.containerenv")
_CONTAINER_ENV = ("KUBERNETES_SERVICE_HOST", "NOMAD_ALLOC_ID", "container")


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # OK, WARN or FAIL
    message: str
    fix: str = ""


def _lvm_system_dir_runner(system_dir: str) -> Runner:
    return ProcessRunner(timeout=30.0, extra_env={"LVM_SYSTEM_DIR": system_dir})


def _which(tool: str) -> str | None:
    try:
        return resolve(tool)
    except CommandError:
        return None


class System:
    """The machine as doctor reads it. `root` prefixes every path (/proc,
    /sys, /dev, the state and lock directories, the socket), `root_uid` is
    the owner directories must have."""

    def __init__(self, runner: Runner, root: str = "/", *, root_uid: int = 0,
                 which: Callable[[str], str | None] = _which,
                 env: Mapping[str, str] | None = None,
                 lvm_runner: Callable[[str], Runner] | None = None,
                 clock: Callable[[], datetime] | None = None) -> None:
        self.runner = runner
        self.now = clock or (lambda: datetime.now(UTC))
        self.root = root
        self.root_uid = root_uid
        self.which = which
        self.env = os.environ if env is None else env
        self._lvm_runner = lvm_runner or _lvm_system_dir_runner

    def lvm_runner(self, system_dir: str) -> Runner:
        """A runner whose LVM commands read their configuration from
        `system_dir` (a path as this machine sees it) instead of /etc/lvm:
        LVM_SYSTEM_DIR, LVM's own way to point at another configuration."""
        return self._lvm_runner(self.path(system_dir))

    def path(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def read(self, path: str) -> str | None:
        try:
            with open(self.path(path), encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return None

    def read_bytes(self, path: str) -> bytes:
        """The file's bytes; OSError as open(2) fails."""
        with open(self.path(path), "rb") as f:
            return f.read()

    def exists(self, path: str) -> bool:
        return os.path.lexists(self.path(path))

    def lstat(self, path: str) -> os.stat_result | None:
        try:
            return os.lstat(self.path(path))
        except OSError:
            return None

    def writable(self, path: str) -> bool:
        return os.access(self.path(path), os.W_OK | os.X_OK)

    def connect(self, path: str, timeout: float = 2.0) -> str | None:
        """None when something accepts a connection on the unix socket, else why not."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            try:
                s.connect(self.path(path))
            except OSError as err:
                return err.strerror or str(err)
        return None

    def processes(self) -> set[str]:
        """Command names (comm) of the processes this namespace shows."""
        names: set[str] = set()
        try:
            pids = [p for p in os.listdir(self.path("/proc")) if p.isdigit()]
        except OSError:
            return names
        for pid in pids:
            comm = self.read(f"/proc/{pid}/comm")
            if comm:
                names.add(comm.strip())
        return names

    def in_container(self) -> bool:
        return (any(self.exists(p) for p in _CONTAINER_FILES)
                or any(k in self.env for k in _CONTAINER_ENV))


# the checks ---------------------------------------------------------------------


def check_module(system: System, name: str, *, required: bool = True,
                 why: str = "") -> Check:
    """A kernel module, loaded (/proc/modules) or built in (/sys/module/NAME)."""
    modules = system.read("/proc/modules") or ""
    loaded = any(line.split(" ", 1)[0] == name for line in modules.splitlines())
    label = f"kernel module {name}"
    if loaded:
        return Check(label, OK, "loaded")
    if system.exists(f"/sys/module/{name}"):
        return Check(label, OK, "built in")
    dashed = name.replace("_", "-")
    return Check(label, FAIL if required else WARN, f"not loaded{why}",
                 f"modprobe {dashed} on the host, and list {dashed} in "
                 "/etc/modules-load.d/csi-local.conf to load it at boot")


def check_device_mapper(system: System) -> Check:
    """The control node, and the driver behind it: the kernel lists device-mapper
    in /proc/misc (a node in a static /dev proves nothing)."""
    misc = system.read("/proc/misc") or ""
    driver = (any(line.split()[1:2] == ["device-mapper"] for line in misc.splitlines())
              or system.exists("/sys/module/dm_mod"))
    node = system.exists("/dev/mapper/control")
    if node and driver:
        return Check("device-mapper", OK, "/dev/mapper/control present, driver loaded")
    if not driver:
        return Check("device-mapper", FAIL, "the kernel has no device-mapper driver loaded "
                     "(not in /proc/misc): LVM cannot activate anything",
                     "modprobe dm-mod on the host")
    return Check("device-mapper", FAIL, "/dev/mapper/control is missing: LVM cannot talk "
                 "to the kernel's device-mapper",
                 "dmsetup mknodes on the host; in a container, mount the host's /dev")


def check_lvm_tools(system: System) -> Check:
    missing = [t for t in LVM_TOOLS if system.which(t) is None]
    if "lvm" in missing:
        return Check("lvm tools", FAIL, "lvm is not installed (not on PATH nor in "
                     "/usr/sbin, /sbin...)", "apt-get install lvm2 (dnf install lvm2)")
    if missing:
        return Check("lvm tools", FAIL, f"lvm is installed but {', '.join(missing)} "
                     "missing (they are symlinks to lvm)",
                     "reinstall lvm2, or link them: " + "; ".join(
                         f"ln -s lvm $(dirname $(command -v lvm))/{t}" for t in missing))
    version = ""
    try:
        line = lvm_version(system.runner)
        version = f", {line}" if line else ""
    except StorageError:
        pass
    return Check("lvm tools", OK, f"{system.which('lvm')}{version}")


def check_tools(system: System) -> Check:
    missing = {t: pkg for t, pkg in BASE_TOOLS.items() if system.which(t) is None}
    if missing:
        pkgs = sorted(set(missing.values()))
        return Check("tools", FAIL, f"missing: {', '.join(missing)}",
                     f"apt-get install {' '.join(pkgs)}")
    return Check("tools", OK, ", ".join(BASE_TOOLS) + " found")


def check_fs_tools(system: System, fs: str) -> Check:
    tools, pkg = FS_TOOLS[fs]
    missing = [t for t in tools if system.which(t) is None]
    if missing:
        return Check(f"{fs} tools", WARN, f"missing: {', '.join(missing)}; {fs} volumes are "
                     "unavailable on this node", f"apt-get install {pkg}")
    return Check(f"{fs} tools", OK, ", ".join(tools) + " found")


def check_volume_group(lvm: Lvm) -> Check:
    label = f"volume group {lvm.vg}"
    try:
        vg = lvm.volume_group()
    except VolumeGroupMissing:
        return Check(label, FAIL, "not found",
                     f"attach its disks and run vgchange --activate y {lvm.vg}; or create it: "
                     f"pvcreate DISK && vgcreate {lvm.vg} DISK")
    except StorageError as err:
        return Check(label, FAIL, f"cannot be read: {err.message}",
                     "run doctor as root on the node (or in the plugin's container)")
    return Check(label, OK, f"size {human_size(vg.size)}, free {human_size(vg.free)}")


def check_metadata(lvm: Lvm) -> Check:
    """Whether every copy of the VG's metadata on its PVs agrees and every PV
    is there: else the plugin takes LVM's answer for every read (slower),
    and LVM warns at each command until the VG is repaired."""
    label = f"volume group {lvm.vg} metadata"
    problems = CommittedMetadata(lvm.runner).check(lvm.vg, ask_lvm=True)
    if problems:
        return Check(label, WARN, "; ".join(problems),
                     f"attach the missing PV, or run vgreduce --removemissing {lvm.vg}; "
                     f"for outdated copies, vgck --updatemetadata {lvm.vg}")
    return Check(label, OK, "every PV's copy is the newest")


def check_pool(lvm: Lvm, report: VgReport, *, setting: str = "--thin-pool") -> Check:
    """`setting`: where the pool's name is given, for the fix."""
    label = f"thin pool {lvm.vg}/{lvm.pool}"
    lv = report.find(lvm.pool)
    if lv is None:
        return Check(label, FAIL, "not found",
                     f"lvcreate --type thin-pool --extents 90%FREE --name {lvm.pool} {lvm.vg}")
    if not lv.is_thin_pool:
        return Check(label, FAIL, f"exists but is not a thin pool (lv_attr {lv.attr})",
                     f"give {setting} the name of a thin pool, or convert this LV: "
                     f"lvconvert --type thin-pool {lvm.vg}/{lvm.pool}")
    if not lv.active:
        return Check(label, FAIL, "not active: no volume can be created or used",
                     f"lvchange --activate y {lvm.vg}/{lvm.pool}")
    if lv.health:
        return Check(label, FAIL, f"health is {lv.health}",
                     f"see lvs -a {lvm.vg}; a failed pool needs lvconvert --repair "
                     f"{lvm.vg}/{lvm.pool} (lvmthin(7))")
    return Check(label, OK, f"active, size {human_size(lv.size)}")


def check_zeroing(lvm: Lvm, pool: LogicalVolume) -> Check:
    """lv_attr bit 8 of a thin pool is 'z' when new blocks are zeroed (lvs(8))."""
    label = "thin pool zeroing"
    if len(pool.attr) > 7 and pool.attr[7] == "z":
        return Check(label, OK, "on: new blocks are zeroed before use")
    return Check(label, WARN, "off: a new volume's blocks may show data of deleted volumes "
                 "until written (a volume that was never formatted, a raw block volume)",
                 f"lvchange --zero y {lvm.vg}/{lvm.pool}")


def check_fill(lvm: Lvm, pool: LogicalVolume) -> Check:
    label = "thin pool fill"
    policy = PoolPolicy()
    data, meta = pool.data_percent, pool.metadata_percent
    message = f"data {_pct(data)}, metadata {_pct(meta)}"
    full = [w for w, p in (("data", data), ("metadata", meta)) if p is not None and p >= 100]
    problem = read_only_pool(lvm, policy=policy).fill_problem(pool)
    fix = (f"add room: vgextend {lvm.vg} DISK, then lvextend --extents +100%FREE "
           f"{lvm.vg}/{lvm.pool} (--poolmetadatasize +SIZE for metadata); or delete volumes "
           "and snapshots and run fstrim -av")
    if full:
        return Check(label, FAIL, f"{message}: out of {' and '.join(full)} space, writes "
                     "to every volume fail", fix)
    if problem:
        return Check(label, WARN, f"{message}: {problem}; new volumes are refused", fix)
    return Check(label, OK, f"{message} (high-water marks {policy.data_limit:g}% and "
                 f"{policy.metadata_limit:g}%)")


def check_metadata_area(lvm: Lvm, report: VgReport) -> Check:
    """How full the VG's tightest metadata area is: LVM refuses any change
    once the VG's metadata text outgrows it (see pool.metadata_area_problem)."""
    label = f"volume group {lvm.vg} metadata area"
    area = report.metadata_area
    if area is None:
        return Check(label, WARN, "not checked: LVM reports no metadata area in use", "")
    message = (f"{100 * area.used_ratio:.1f}% full: {area.used} of {area.limit} bytes of "
               f"text (smallest area in use: {human_size(area.size)}); room for "
               f"at least {lvs_that_fit(area)} more volumes or snapshots")
    size = RECOMMENDED_METADATA_SIZE
    fix = (f"add a PV made with `pvcreate --metadatasize {size}` (vgextend {lvm.vg} DISK), then "
           "`pvchange --metadataignore y` the small area's PV or move off it (pvmove, "
           f"vgreduce); prepare new nodes with `pvcreate --metadatasize {size}`")
    if metadata_area_problem(lvm.vg, area) is not None:
        return Check(label, FAIL, f"{message}: new volumes and snapshots are refused", fix)
    if area.used_ratio >= METADATA_AREA_WARN:
        return Check(label, WARN, f"{message} (above {100 * METADATA_AREA_WARN:g}%)", fix)
    return Check(label, OK, message)


def check_device_ids(lvm: Lvm, report: VgReport) -> Check:
    """Whether the thin pool can still give a new thin volume a device ID."""
    label = "thin pool device IDs"
    problem = device_id_problem(lvm.pool, report)
    if problem is not None:
        return Check(label, FAIL, problem, "delete the volume or snapshot with the highest "
                     f"thin_id (lvs -o lv_name,thin_id {lvm.vg})")
    return Check(label, OK, "a new thin volume gets an ID")


def check_metadata_snapshot(lvm: Lvm, state_dir: str) -> Check:
    """Whether the pool holds a metadata snapshot, and whose (thinmeta's mark
    in the state directory says which one csi-local reserved)."""
    label = "thin pool metadata snapshot"
    meta = ThinMetadata(lvm.runner, lvm.vg, lvm.pool, state_dir)
    try:
        holder = meta.holder()
    except StorageError as err:
        return Check(label, WARN, f"not checked: {err.message}", "")
    if holder is Holder.NONE:
        return Check(label, OK, "none held")
    release = (f"when no thin_dump, thin_delta or backup tool reads it: dmsetup message "
               f"{dm_name(lvm.vg, lvm.pool)}-tpool 0 release_metadata_snap (the pool's "
               "device without -tpool when no volume is active)")
    fix = {Holder.PLUGIN: "restart csi-local, which releases it",
           Holder.UNSURE: release, Holder.OTHER: release}[holder]
    return Check(label, WARN, f"{holder_text(holder)}; while it is held, every metadata "
                 "change is copied on write, and changed-block reads (GetMetadataAllocated, "
                 "GetMetadataDelta) fail with UNAVAILABLE", fix)


def _pct(p: float | None) -> str:
    return "-" if p is None else f"{p:.1f}%"


def read_lvm_settings(system: System) -> dict[str, str] | str:
    """{"udev_sync": "1", ...} (lvm_config.read_config), or why it could not be read."""
    try:
        return read_config(system.runner, LVM_SETTINGS)
    except StorageError as err:
        return err.message


def check_lvm_settings(system: System) -> list[Check]:
    settings = read_lvm_settings(system)
    if isinstance(settings, str):
        return [Check("lvm.conf", WARN, f"lvmconfig failed: {settings}",
                      "check lvm.conf with lvmconfig --validate")]
    return [_check_udev(system, settings), _check_monitoring(system, settings)]


def _check_udev(system: System, settings: Mapping[str, str]) -> Check:
    label = "lvm.conf udev"
    sync, rules = settings.get("udev_sync", "?"), settings.get("udev_rules", "?")
    values = f"activation/udev_sync={sync}, activation/udev_rules={rules}"
    udev_running = system.exists("/run/udev/control")
    if system.in_container() and "1" in (sync, rules):
        return Check(label, WARN, f"{values} in a container: LVM may wait for udev "
                     "confirmations that never come (no udevd here, or another IPC namespace)",
                     "set activation/udev_sync = 0 and activation/udev_rules = 0, as "
                     "deploy/container/lvm.conf does")
    if rules == "1" and not udev_running:
        return Check(label, WARN, f"{values} but udev is not running (no /run/udev/control): "
                     "device links rely on LVM noticing that and making them itself",
                     "start udev (systemd-udevd), or set activation/udev_rules = 0 and "
                     "activation/udev_sync = 0")
    return Check(label, OK, values + (", udev running" if udev_running else ""))


def _check_monitoring(system: System, settings: Mapping[str, str]) -> Check:
    label = "lvm.conf monitoring"
    value = settings.get("monitoring", "?")
    if value != "1":
        return Check(label, OK, f"activation/monitoring={value}: no dmeventd; use the "
                     "plugin's --pool-autoextend-threshold-percent to grow the pool")
    if "dmeventd" in system.processes():
        return Check(label, OK, "activation/monitoring=1, dmeventd running: LVM's own "
                     "thin-pool autoextend applies if configured "
                     "(activation/thin_pool_autoextend_threshold)")
    return Check(label, WARN, "activation/monitoring=1 but dmeventd is not running here: "
                 "LVM's thin-pool autoextend will not happen",
                 "use the plugin's autoextend (--pool-autoextend-threshold-percent) and set "
                 "activation/monitoring = 0; or run dmeventd on the host "
                 "(systemctl enable --now dm-event.socket)")


def check_lvm_shell(system: System) -> Check:
    """Whether the plugin's lvm shell will have its command profile: present,
    or in a directory the plugin can write it to."""
    label = "lvm shell profile"
    try:
        directory = profile_dir(system.runner)
    except StorageError:
        directory = "/etc/lvm/profile"
    path = os.path.join(directory, f"{PROFILE_NAME}.profile")
    text = system.read(path)
    if text == PROFILE:
        return Check(label, OK, f"{path} present: the plugin runs lvcreate, lvremove, "
                     "lvextend and lvchange in one lvm shell")
    state = "missing" if text is None else "not this version's"
    existing = directory
    while existing != "/" and system.lstat(existing) is None:
        existing = os.path.dirname(existing.rstrip("/")) or "/"
    st = system.lstat(existing)
    if st is not None and stat.S_ISDIR(st.st_mode) and system.writable(existing):
        return Check(label, OK, f"{path} {state}; the plugin writes it at start")
    return Check(label, WARN, f"{path} {state}, and it cannot be written there: the plugin "
                 "will start a process for every LVM command (it works, more slowly)",
                 "write it once: python3 -c \"from csi_local.storage.lvm_shell import "
                 f"ensure_profile; ensure_profile('{directory}')\"; or run the plugin with "
                 "--lvm-shell=false")


def check_directory(system: System, label: str, path: str, flag: str) -> Check:
    """Exists (or can be made), a real directory, owned by root, not world-writable."""
    label = f"{label} {path}"
    st = system.lstat(path)
    if st is None:
        parent = os.path.dirname(path.rstrip("/")) or "/"
        while parent != "/" and system.lstat(parent) is None:
            parent = os.path.dirname(parent)
        pst = system.lstat(parent)
        if pst is not None and stat.S_ISDIR(pst.st_mode) and system.writable(parent):
            return Check(label, OK, "missing; the plugin makes it at start")
        return Check(label, FAIL, f"missing, and cannot be made under {parent}",
                     f"mkdir -p -m 0700 {path}, or choose another {flag}")
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return Check(label, FAIL, "is not a directory (a symlink?)",
                     f"remove it, or choose another {flag}")
    problems = []
    if st.st_uid != system.root_uid:
        problems.append(f"owned by uid {st.st_uid}, not root")
    if st.st_mode & stat.S_IWOTH:
        problems.append(f"world-writable (mode {stat.S_IMODE(st.st_mode):04o})")
    if problems:
        return Check(label, FAIL, "; ".join(problems),
                     f"chown root:root {path} && chmod 0700 {path}")
    return Check(label, OK, f"mode {stat.S_IMODE(st.st_mode):04o}, owned by root")


def check_socket(system: System, endpoint: str) -> Check:
    label = "CSI socket"
    try:
        path = config_mod.socket_path(endpoint)
    except config_mod.ConfigError as err:
        return Check(label, FAIL, str(err), "give --endpoint unix:///absolute/path")
    st = system.lstat(path)
    if st is None:
        return Check(label, WARN, f"{path} does not exist: the plugin is not running",
                     "start the plugin (csi-local serve), or give --endpoint its socket")
    if not stat.S_ISSOCK(st.st_mode):
        return Check(label, FAIL, f"{path} is not a socket",
                     "remove it; the plugin makes its socket at start")
    refused = system.connect(path)
    if refused is not None:
        return Check(label, WARN, f"{path}: nothing answers ({refused}): the plugin is not "
                     "running (a stale socket is removed at its start)",
                     "start the plugin (csi-local serve)")
    return Check(label, OK, f"{path} answers")


_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_propagation(mountinfo: str) -> list[tuple[str, list[str]]]:
    """[(mount point, optional fields)] of /proc/self/mountinfo, in mount order."""
    rows = []
    for line in mountinfo.splitlines():
        left, sep, _ = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 6:
            continue
        rows.append((_unescape(fields[4]), fields[6:]))
    return rows


def _contains(mount_point: str, path: str) -> bool:
    return mount_point == "/" or path == mount_point or path.startswith(mount_point + "/")


def check_propagation(system: System, path: str = KUBELET_DIR) -> Check:
    label = f"mount propagation of {path}"
    if not system.exists(path):
        return Check(label, OK, f"no {path}: not a Kubernetes node, skipped")
    text = system.read("/proc/self/mountinfo")
    if text is None:
        return Check(label, WARN, "cannot read /proc/self/mountinfo", "mount /proc")
    rows = [r for r in parse_propagation(text) if _contains(r[0], path)]
    if not rows:
        return Check(label, WARN, "no mount contains it in /proc/self/mountinfo", "")
    longest = max(len(r[0]) for r in rows)
    point, optional = [r for r in rows if len(r[0]) == longest][-1]
    shared = [f for f in optional if f.startswith("shared:")]
    if shared:
        return Check(label, OK, f"on mount {point}, {' '.join(optional)}")
    kind = " ".join(optional) or "private"
    return Check(label, FAIL, f"on mount {point}, which is not shared ({kind}): mounts the "
                 "plugin makes there are invisible to kubelet",
                 "mount --make-rshared / on the host (systemd does by default), and mount "
                 f"{path} into the plugin's container with mountPropagation: Bidirectional")


# The settings that decide which devices LVM reads and which VGs it takes as
# this host's (lvm.conf(5), lvmsystemid(7)), compared between the plugin's
# LVM and the host's. The devices file is compared by what is in use: LVM
# uses none where use_devicesfile = 1 but the file does not exist (the image's
# lvm.conf on a host without one), the same as use_devicesfile = 0.
VIEW_SETTINGS = ("devices/global_filter", "devices/filter", "global/system_id_source",
                 "global/system_id_file", "local/system_id", "local/extra_system_ids")
_DEVICES_FILE_SETTINGS = ("devices/use_devicesfile", "devices/devicesfile")
LVM_DIR = "/etc/lvm"
LVMLOCAL_FIX = ("give the plugin's LVM the host's settings: copy them (on the node, "
                "lvmconfig devices/global_filter devices/filter prints the filters) into "
                "lvmlocal.conf of the ConfigMap csi-local-config "
                "(deploy/kubernetes/base/lvmlocal.conf) and apply it; the node pods roll "
                "over to it (docs/kubernetes.md, \"Device filtering\")")


@dataclass(frozen=True)
class LvmView:
    """What LVM with one configuration directory sees."""

    settings: dict[str, str]  # VIEW_SETTINGS and "devices file" -> value ("" unset)
    pvs: dict[str, str]  # PV path -> its VG ("" for none)


# The array settings of VIEW_SETTINGS. lvmconfig prints an array of one
# element as a plain string (global_filter="r|^/dev/sdb$|", read_config
# drops the quotes), of more as ["a","b"]: one form for both, so that
# [ "a|.*|" ] set by hand and the default ["a|.*|"] compare equal.
_ARRAY_SETTINGS = ("devices/global_filter", "devices/filter", "local/extra_system_ids")


def _config_value(key: str, value: str) -> str:
    if key in _ARRAY_SETTINGS and value and not value.startswith("["):
        return json.dumps([value], separators=(",", ":"))
    return value


def read_lvm_view(system: System, runner: Runner, system_dir: str) -> LvmView:
    """The view of LVM run by `runner`, whose configuration is in
    `system_dir`. StorageError (CommandError) when LVM cannot say."""
    values = read_config(runner, (*VIEW_SETTINGS, *_DEVICES_FILE_SETTINGS))
    settings = {key: _config_value(key, values.get(key.rsplit("/", 1)[1], ""))
                for key in VIEW_SETTINGS}
    name = values.get("devicesfile") or "system.devices"
    in_use = (values.get("use_devicesfile") == "1"
              and system.exists(os.path.join(system_dir, "devices", name)))
    settings["devices file"] = f"devices/{name}" if in_use else "none"
    return LvmView(settings, physical_volumes(runner))


def view_differences(plugin: LvmView, host: LvmView) -> list[str]:
    """Each setting, PV and VG on which the two views differ, with both values."""
    diffs = [f"{key}: plugin {plugin.settings[key] or '(unset)'}, host "
             f"{host.settings[key] or '(unset)'}"
             for key in plugin.settings if plugin.settings[key] != host.settings.get(key)]
    for pv in sorted(plugin.pvs.keys() | host.pvs.keys()):
        vg_here, vg_host = plugin.pvs.get(pv), host.pvs.get(pv)
        if vg_host is None:
            diffs.append(f"PV {pv}{_of_vg(vg_here)} seen by the plugin only")
        elif vg_here is None:
            diffs.append(f"PV {pv}{_of_vg(vg_host)} seen by the host only")
        elif vg_here != vg_host:
            diffs.append(f"PV {pv}: VG {vg_here or '(none)'} for the plugin, "
                         f"{vg_host or '(none)'} for the host")
    return diffs


def _of_vg(vg: str | None) -> str:
    return f" (VG {vg})" if vg else " (no VG)"


def check_lvm_view(system: System, host_dir: str) -> Check:
    """Whether the plugin's LVM (the image's lvm.conf and the deployment's
    lvmlocal.conf in /etc/lvm) sees the devices and VGs the host's LVM does
    (its /etc/lvm, mounted read-only at `host_dir`): the same settings, and
    the same PVs in the same VGs, as LVM itself reports with each."""
    label = "lvm view of the host"
    if not system.exists(os.path.join(host_dir, "lvm.conf")):
        return Check(label, OK, f"not checked: no lvm.conf in {host_dir} (the host's "
                     "/etc/lvm is not mounted there, or the host has no LVM)")
    try:
        if os.path.samefile(system.path(host_dir), system.path(LVM_DIR)):
            return Check(label, OK, f"{host_dir} is this machine's {LVM_DIR}: one view")
    except OSError:
        pass
    try:
        plugin = read_lvm_view(system, system.runner, LVM_DIR)
        host = read_lvm_view(system, system.lvm_runner(host_dir), host_dir)
    except StorageError as err:
        return Check(label, WARN, f"not checked: {err.message}",
                     f"check both configurations: lvmconfig --validate, and with "
                     f"LVM_SYSTEM_DIR={host_dir}")
    diffs = view_differences(plugin, host)
    if diffs:
        return Check(label, WARN, f"the plugin's LVM and the host's ({host_dir}) differ: "
                     + "; ".join(diffs), LVMLOCAL_FIX)
    vgs = sorted({vg for vg in plugin.pvs.values() if vg})
    return Check(label, OK, f"the same as the host's ({host_dir}): {len(plugin.pvs)} PV(s)"
                 f"{' in ' + ', '.join(vgs) if vgs else ''}; filters, devices file "
                 f"({plugin.settings['devices file']}) and system ID settings alike")


# The Secret the snapshot-metadata overlay mounts (deploy/kubernetes/examples/
# snapshot-metadata), for the fixes; and how early an expiry is a warning.
SNAPSHOT_METADATA_SECRET = "csi-local-snapshot-metadata-tls"  # noqa: S105 - a name
CERT_WARNING_DAYS = config_mod.DEFAULT_CERT_WARNING_DAYS
_CERT_FIX = (f"create the kubernetes.io/tls Secret {SNAPSHOT_METADATA_SECRET} (namespace "
             "csi-local), best with the cert-manager Certificate of docs/snapshot-metadata.md "
             "(\"TLS with cert-manager\"), which renews it; kubelet then updates this file "
             "and the sidecar loads it")


def _date(when: datetime) -> str:
    return when.strftime("%Y-%m-%d %H:%M:%S UTC")


def check_tls_certificate(system: System, path: str, *,
                          warning_days: int = CERT_WARNING_DAYS) -> Check:
    """The snapshot-metadata sidecar's certificate (the Secret's tls.crt, as
    mounted where doctor runs): there, a certificate, and not expired nor
    expiring within `warning_days`. Without it the sidecar does not start
    (changed-block tracking is down on the node); expired, every client
    refuses it."""
    label = "snapshot-metadata TLS certificate"
    try:
        text = system.read_bytes(path).decode("ascii", errors="replace")
    except FileNotFoundError:
        return Check(label, FAIL, f"{path} does not exist: the Secret "
                     f"{SNAPSHOT_METADATA_SECRET} (key tls.crt) is missing, and the "
                     "snapshot-metadata sidecar cannot start", _CERT_FIX)
    except OSError as err:
        return Check(label, FAIL, f"{path} cannot be read: {err.strerror or err}",
                     "run doctor as root in the plugin's container")
    try:
        valid = pem_validity(text)
    except CertificateError as err:
        return Check(label, FAIL, f"{path} is not a PEM certificate: {err}",
                     f"put the sidecar's certificate (PEM) into the Secret "
                     f"{SNAPSHOT_METADATA_SECRET} as tls.crt; {_CERT_FIX}")
    now = system.now()
    renew = ("renew it: cert-manager renews a Certificate before it expires (renewBefore); "
             "a certificate made with openssl: docs/snapshot-metadata.md, \"Renewal\"")
    if valid.not_after <= now:
        return Check(label, FAIL, f"{path} expired on {_date(valid.not_after)}: backup "
                     "clients refuse the sidecar", renew)
    if valid.not_before > now:
        return Check(label, WARN, f"{path} is not valid before {_date(valid.not_before)}: "
                     "clients refuse it until then (or this node's clock is behind)",
                     "check the node's clock (timedatectl), or the certificate's dates")
    days = (valid.not_after - now).days
    if valid.not_after - now < timedelta(days=warning_days):
        return Check(label, WARN, f"{path} expires on {_date(valid.not_after)}, in {days} "
                     f"day(s)", renew)
    return Check(label, OK, f"{path} valid until {_date(valid.not_after)} ({days} days)")


# all of them --------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    volume_group: str = ""
    thin_pool: str = ""
    state_dir: str = config_mod.DEFAULT_STATE_DIR
    lock_dir: str = DEFAULT_LOCK_DIR
    endpoint: str = config_mod.DEFAULT_ENDPOINT
    config: str | None = None  # the device classes' file, instead of the VG and pool
    # The host's /etc/lvm, mounted read-only where the plugin runs in a
    # container: compared with the plugin's LVM (check_lvm_view). None: no
    # such check (on the host itself LVM's view is the host's).
    host_lvm_dir: str | None = None
    # The snapshot-metadata sidecar's certificate, as mounted here (the
    # snapshot-metadata overlay sets it); None: no such sidecar, no check.
    tls_cert: str | None = None
    tls_cert_warning_days: int = CERT_WARNING_DAYS


def run_checks(system: System, opts: Options) -> list[Check]:
    checks = [
        check_module(system, "dm_thin_pool"),
        check_module(system, "dm_snapshot", required=False,
                     why=" (csi-local's thin snapshots use dm_thin_pool; LVM's old-style "
                     "snapshots need it)"),
        check_device_mapper(system),
        check_lvm_tools(system),
        check_tools(system),
        *(check_fs_tools(system, fs) for fs in FS_TOOLS),
    ]
    checks += _class_checks(system, opts)
    checks += check_lvm_settings(system)
    if opts.host_lvm_dir:
        checks.append(check_lvm_view(system, opts.host_lvm_dir))
    checks.append(check_lvm_shell(system))
    checks.append(check_directory(system, "state directory", opts.state_dir, "--state-dir"))
    checks.append(check_directory(system, "lock directory", opts.lock_dir, "--lock-dir"))
    checks.append(check_socket(system, opts.endpoint))
    checks.append(check_propagation(system))
    if opts.tls_cert:
        checks.append(check_tls_certificate(system, opts.tls_cert,
                                            warning_days=opts.tls_cert_warning_days))
    return checks


def _class_checks(system: System, opts: Options) -> list[Check]:
    """The VG and pool checks of every device class."""
    if not opts.config:
        return _lvm_checks(Lvm(system.runner, opts.volume_group, opts.thin_pool),
                           state_dir=system.path(opts.state_dir))
    label = f"configuration file {opts.config}"
    try:
        classes = load_classes(system.path(os.path.abspath(opts.config)))
    except ClassConfigError as err:
        return [Check(label, FAIL, f"{err}; no device class checked",
                      "correct the file (docs/device-classes.md): the plugin refuses to "
                      "start with it")]
    names = ", ".join(c.name for c in classes.classes)
    checks = [Check(label, OK, f"{len(classes.classes)} device class(es): {names}; "
                    f"default {classes.default}")]
    for c in classes.classes:
        lvm = Lvm(system.runner, c.volume_group, c.thin_pool)
        setting = f"thin_pool of class {c.name} in {opts.config}"
        checks += [dataclasses.replace(check, name=f"class {c.name}: {check.name}")
                   for check in _lvm_checks(lvm, setting,
                                            state_dir=system.path(opts.state_dir))]
    return checks


def _lvm_checks(lvm: Lvm, setting: str = "--thin-pool", *,
                state_dir: str = config_mod.DEFAULT_STATE_DIR) -> list[Check]:
    """One class's: its VG, then its pool, zeroing and fill."""
    vg_check = check_volume_group(lvm)
    if vg_check.status != OK:
        return [vg_check, Check(f"thin pool {lvm.vg}/{lvm.pool}", FAIL,
                                "not checked: the volume group cannot be read", vg_check.fix)]
    return [vg_check, check_metadata(lvm), *_pool_checks(lvm, setting, state_dir=state_dir)]


def _pool_checks(lvm: Lvm, setting: str = "--thin-pool", *,
                 state_dir: str = config_mod.DEFAULT_STATE_DIR) -> list[Check]:
    try:
        report = lvm.report()
    except StorageError as err:
        return [Check(f"thin pool {lvm.vg}/{lvm.pool}", FAIL, f"cannot be read: {err.message}",
                      "")]
    pool_check = check_pool(lvm, report, setting=setting)
    pool = report.find(lvm.pool)
    checks = [pool_check, check_metadata_area(lvm, report)]
    if pool is not None and pool.is_thin_pool:
        checks.append(check_device_ids(lvm, report))
        checks.append(check_zeroing(lvm, pool))
        if pool.active:
            checks.append(check_fill(lvm, pool))
            checks.append(check_metadata_snapshot(lvm, state_dir))
    return checks


def exit_code(checks: Iterable[Check]) -> int:
    return 1 if any(c.status == FAIL for c in checks) else 0


def render(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    out = []
    for c in checks:
        out.append(f"{c.status:<4}  {c.name:<{width}}  {c.message}")
        if c.fix and c.status != OK:
            out.append(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
    fails = sum(c.status == FAIL for c in checks)
    warns = sum(c.status == WARN for c in checks)
    out.append("")
    out.append(f"{len(checks)} checks: {fails} failed, {warns} warning(s)"
               + ("" if fails else "; the node is ready"))
    return "\n".join(out) + "\n"


def to_json(checks: list[Check]) -> str:
    return json.dumps({
        "ok": exit_code(checks) == 0,
        "failures": sum(c.status == FAIL for c in checks),
        "warnings": sum(c.status == WARN for c in checks),
        "checks": [dataclasses.asdict(c) for c in checks],
    }, indent=2) + "\n"


def run(system: System, args: argparse.Namespace, *, out: TextIO = sys.stdout) -> int:
    opts = Options(args.volume_group or "", args.thin_pool or "", args.state_dir,
                   args.lock_dir, args.endpoint, getattr(args, "config", None) or None,
                   host_lvm_dir=getattr(args, "host_lvm_dir", None) or None,
                   tls_cert=getattr(args, "snapshot_metadata_tls_cert", None) or None,
                   tls_cert_warning_days=getattr(args, "tls_cert_warning_days",
                                                 CERT_WARNING_DAYS))
    checks = run_checks(system, opts)
    out.write(to_json(checks) if args.json else render(checks))
    return exit_code(checks)


def main(args: argparse.Namespace) -> int:
    return run(System(ProcessRunner(timeout=30.0)), args)

