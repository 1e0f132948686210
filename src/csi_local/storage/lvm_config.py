"""How this host's LVM is set up, as LVM itself says: its version, the
settings in effect (lvmconfig), where it keeps command profiles and
metadata backups, and the PVs its device filters let it see. Read at plugin
assembly and by doctor; the commands on a VG and its LVs are in
storage.lvm.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from csi_local.errors import CommandError, StorageError

if TYPE_CHECKING:
    from csi_local.host.runner import Runner

log = logging.getLogger(__name__)


def lvm_version(runner: Runner) -> str:
    """LVM's version line ("LVM version: 2.03.16(2) (2022-05-18)"), "" if none."""
    out = runner.run(["lvmconfig", "--version"]).stdout
    return next((" ".join(ln.split()) for ln in out.splitlines() if ln.strip()), "")


# The lvm2 releases csi-local supports, (major, minor, patch), the oldest and
# the newest: doctor warns of a VG whose metadata an lvm2 outside them wrote.
SUPPORTED_LVM2 = ((2, 3, 11), (2, 3, 31))


def lvm_versions(runner: Runner) -> dict[str, str]:
    """{"LVM": "2.03.16(2) (2022-05-18)", "Library": "1.02.185 (2022-05-18)",
    "Driver": "4.47.0"}: `lvm version`'s lines, by their first word (the
    driver's is the kernel's device-mapper, read through the library)."""
    out = runner.run(["lvm", "version"]).stdout
    found = {}
    for line in out.splitlines():
        key, sep, value = line.partition(" version:")
        if sep and key.strip() and value.strip():
            found[key.strip()] = " ".join(value.split())
    return found


def release(version: str) -> tuple[int, int, int] | None:
    """(2, 3, 16) of "2.03.16(2) (2022-05-18)"; None when it starts otherwise."""
    found = re.match(r"\s*(\d+)\.(\d+)\.(\d+)", version)
    if found is None:
        return None
    major, minor, patch = (int(g) for g in found.groups())
    return major, minor, patch


def release_text(numbers: tuple[int, int, int]) -> str:
    """2.03.11 for (2, 3, 11), as lvm2 numbers its releases."""
    major, minor, patch = numbers
    return f"{major}.{minor:02d}.{patch}"


def read_config(runner: Runner, keys: Sequence[str]) -> dict[str, str]:
    """{"udev_sync": "1", ...}: the settings in effect for `keys`
    ("activation/udev_sync", ...), by their last path element.

    `--type full` (lvm.conf merged over LVM's defaults) fails when there is no
    lvm.conf at all ("Failed to clone current config tree", lvm2 2.03); then
    the defaults are what applies, and `--type default` prints them ("# "
    before each). CommandError when neither can be read."""
    try:
        out = runner.run(["lvmconfig", "--type", "full", *keys]).stdout
    except CommandError as err:
        if "clone current config tree" not in err.stderr:
            raise
        out = runner.run(["lvmconfig", "--type", "default", *keys]).stdout
    values = {}
    for line in out.splitlines():
        key, sep, value = line.strip().lstrip("#").partition("=")
        if sep:
            values[key.strip()] = value.strip().strip('"')
    return values


def physical_volumes(runner: Runner) -> dict[str, str]:
    """{PV path: its VG ("" for none)} of every PV this LVM (its configuration:
    filters, devices file, system ID) sees. `--readonly`: no lock, no
    device-mapper, the on-disk metadata as it is; for doctor, never a fast
    path. CommandError, or StorageError when pvs prints no JSON report."""
    out = runner.run(["pvs", "--readonly", "--reportformat", "json",
                      "-o", "pv_name,vg_name"]).stdout
    try:
        return {row["pv_name"]: row.get("vg_name", "") for report in json.loads(out)["report"]
                for row in report.get("pv", [])}
    except (ValueError, AttributeError, TypeError, KeyError):
        raise StorageError(f"pvs printed no JSON report: {out[:200]!r}") from None


def profile_dir(runner: Runner) -> str:
    """Where LVM reads command profiles (config/profile_dir)."""
    return read_config(runner, ["config/profile_dir"]).get("profile_dir") or "/etc/lvm/profile"


def backup_dir(runner: Runner) -> str | None:
    """Where LVM keeps a metadata backup of each VG this host changed
    (backup/backup_dir); None when backups are off or LVM cannot say."""
    try:
        config = read_config(runner, ["backup/backup", "backup/backup_dir"])
    except CommandError as err:
        log.warning("cannot read LVM's backup settings: %s", err)
        return None
    if config.get("backup", "1") == "0":
        return None
    return config.get("backup_dir") or "/etc/lvm/backup"
