"""Doctor's checks of how LVM is set up where the plugin runs: lvm.conf's
udev and monitoring settings, the lvm shell's command profile, LVM's
version beside the lvm2 that last wrote each VG, and, in a container,
whether the plugin's LVM sees the devices and VGs the host's does.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from csi_local.errors import StorageError
from csi_local.host.runner import Runner
from csi_local.ops.doctor.system import OK, WARN, Check, System
from csi_local.storage.committed_vg import CommittedMetadata
from csi_local.storage.lvm_config import (
    SUPPORTED_LVM2,
    lvm_versions,
    physical_volumes,
    profile_dir,
    read_config,
    release,
    release_text,
)
from csi_local.storage.lvm_shell import PROFILE, PROFILE_FILE

LVM_SETTINGS = ("activation/udev_sync", "activation/udev_rules", "activation/monitoring")


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
    path = os.path.join(directory, PROFILE_FILE)
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


def check_lvm_versions(system: System, vgs: Sequence[str]) -> Check:
    """This container's LVM (`lvm version`: the tools, the device-mapper
    library, the kernel's driver) and, for each VG of `vgs`, the lvm2 that
    last wrote its metadata and on which host, as the metadata's own text
    says (read off the PVs: the host's lvm binary is out of the container's
    reach, and a VG is written by the host's LVM and by the plugin's alike).

    warn when a VG's metadata was written by an lvm2 newer than this one
    (which may not read all of it, and drops what it does not know when it
    writes the VG next) or outside the releases csi-local supports."""
    label = "lvm versions"
    try:
        mine = lvm_versions(system.runner)
        why = "lvm version printed none"
    except StorageError as err:
        mine, why = {}, err.message
    ours = release(mine.get("LVM", ""))
    shown = ", ".join(f"{name} {mine[key]}" for key, name in
                      (("LVM", "LVM"), ("Library", "library"), ("Driver", "driver"))
                      if key in mine)
    parts = [f"here: {shown}" if shown else f"here: LVM version unknown ({why})"]
    low, high = SUPPORTED_LVM2
    supported = f"{release_text(low)} to {release_text(high)}"
    problems, fixes = [], []
    committed = CommittedMetadata(system.runner, system.host)
    for vg in dict.fromkeys(vgs):
        meta = committed.volume_group(vg)
        written = release(meta.written_by) if meta is not None else None
        if meta is None or written is None:
            parts.append(f"VG {vg}: no lvm2 version read off its PVs")
            continue
        host = f" on {meta.creation_host}" if meta.creation_host else ""
        parts.append(f"VG {vg} last written by LVM {meta.written_by}{host}")
        if ours is not None and written > ours:
            problems.append(f"VG {vg}'s metadata was written by lvm2 "
                            f"{release_text(written)}{host}, newer than this "
                            f"{release_text(ours)}: this LVM may misread it, and drops what "
                            "it does not know when it writes the VG")
            fixes.append("run the plugin's image whose lvm2 is at least as new as the "
                         "host's (`lvm version` on the host)")
        if not low <= written <= high:
            problems.append(f"VG {vg}'s metadata was written by lvm2 "
                            f"{release_text(written)}{host}, outside the releases csi-local "
                            f"supports ({supported})")
            fixes.append(f"use an lvm2 from {supported} on the host and in the image")
    if problems:
        return Check(label, WARN, "; ".join([*problems, *parts]),
                     "; ".join(dict.fromkeys(fixes)))
    return Check(label, OK, "; ".join(parts))
