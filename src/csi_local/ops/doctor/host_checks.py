"""Doctor's checks of the host: the kernel's modules and device-mapper, and
the tools the plugin runs (LVM's, those every volume needs, those of the
optional file systems).
"""

from __future__ import annotations

from csi_local.errors import StorageError
from csi_local.ops.doctor.system import FAIL, OK, WARN, Check, System
from csi_local.storage.lvm_config import lvm_version

# The LVM commands the plugins run; all are symlinks to `lvm` in lvm2.
LVM_TOOLS = ("lvm", "lvs", "vgs", "lvcreate", "lvextend", "lvremove", "lvchange", "lvmconfig")
# Tools every volume needs (package in parentheses in the fix).
BASE_TOOLS = {"blkid": "util-linux", "wipefs": "util-linux", "losetup": "util-linux",
              "mount": "mount", "umount": "mount", "mkfs.ext4": "e2fsprogs",
              "resize2fs": "e2fsprogs", "sync": "coreutils"}
# Tools of the optional file systems: missing ones make that fs unavailable.
FS_TOOLS = {"xfs": (("mkfs.xfs", "xfs_growfs"), "xfsprogs"),
            "btrfs": (("mkfs.btrfs", "btrfs", "btrfstune"), "btrfs-progs")}


def check_encryption(system: System) -> list[Check]:
    """What encrypted volumes (LUKS2, opt-in) need: cryptsetup, and the
    kernel's dm-crypt. Warnings, not failures: a node without encrypted
    volumes needs neither; a stage of an encrypted one fails without them."""
    checks = [check_module(system, "dm_crypt", required=False,
                           why=" (encrypted volumes need it; cryptsetup loads it at the first "
                               "open where the plugin can run modprobe)")]
    found = system.which("cryptsetup")
    if found is None:
        checks.append(Check("cryptsetup", WARN, "not installed: encrypted volumes cannot be "
                            "staged", "apt-get install cryptsetup-bin"))
    else:
        checks.append(Check("cryptsetup", OK, found))
    return checks


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
