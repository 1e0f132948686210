"""`csi-local doctor`: does this node have what the plugin needs?

Each check is a small function returning a Check ("ok", "warn" or "FAIL",
a message, and for every miss how to fix it), reading the machine through
a System, so that unit tests drive every branch without processes (see
system.py).

Nothing is changed: no directory is made, no module loaded, no lock taken.

The VG, thin pool, zeroing and fill checks run for every device class of the
node: the flags' one (`--volume-group`, `--thin-pool`; labelled as they always
were) or each class of a configuration file (`--config`; labelled
"class NAME: ...", after a check of the file itself).

The checks are grouped by what they look at: host_checks (the kernel and
the tools), lvm_config_checks (how LVM is set up where the plugin runs),
pool_checks (each device class's VG and thin pool), deploy_checks (the
directories, the socket, mount propagation, the TLS certificate); system
holds Check and System. This module runs them all and prints the result.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TextIO

from csi_local import config as config_mod
from csi_local.host.locks import DEFAULT_LOCK_DIR
from csi_local.host.runner import ProcessRunner
from csi_local.ops.doctor.deploy_checks import (
    CERT_WARNING_DAYS,
    KUBELET_DIR,
    SNAPSHOT_METADATA_ADDRESS,
    SNAPSHOT_METADATA_SECRET,
    check_directory,
    check_propagation,
    check_socket,
    check_tls_certificate,
    parse_propagation,
)
from csi_local.ops.doctor.host_checks import (
    BASE_TOOLS,
    FS_TOOLS,
    LVM_TOOLS,
    check_device_mapper,
    check_encryption,
    check_fs_tools,
    check_lvm_tools,
    check_module,
    check_tools,
)
from csi_local.ops.doctor.lvm_config_checks import (
    LVM_DIR,
    LVM_SETTINGS,
    LVMLOCAL_FIX,
    VIEW_SETTINGS,
    LvmView,
    check_lvm_settings,
    check_lvm_shell,
    check_lvm_versions,
    check_lvm_view,
    read_lvm_settings,
    read_lvm_view,
    view_differences,
)
from csi_local.ops.doctor.pool_checks import (
    check_device_ids,
    check_fill,
    check_metadata,
    check_metadata_area,
    check_metadata_snapshot,
    check_pool,
    check_volume_group,
    check_zeroing,
    vg_and_pool_checks,
)
from csi_local.ops.doctor.system import FAIL, OK, WARN, Check, System
from csi_local.storage.lvm import Lvm
from csi_local.volumes.device_classes import ClassConfigError, load_classes

# Every check and what it needs, where `csi_local.ops.doctor` always had them.
__all__ = [
    "BASE_TOOLS",
    "CERT_WARNING_DAYS",
    "FAIL",
    "FS_TOOLS",
    "KUBELET_DIR",
    "LVMLOCAL_FIX",
    "LVM_DIR",
    "LVM_SETTINGS",
    "LVM_TOOLS",
    "OK",
    "SNAPSHOT_METADATA_ADDRESS",
    "SNAPSHOT_METADATA_SECRET",
    "VIEW_SETTINGS",
    "WARN",
    "Check",
    "LvmView",
    "Options",
    "System",
    "check_device_ids",
    "check_device_mapper",
    "check_directory",
    "check_fill",
    "check_fs_tools",
    "check_lvm_settings",
    "check_lvm_shell",
    "check_lvm_tools",
    "check_lvm_versions",
    "check_lvm_view",
    "check_metadata",
    "check_metadata_area",
    "check_metadata_snapshot",
    "check_module",
    "check_pool",
    "check_propagation",
    "check_socket",
    "check_tls_certificate",
    "check_tools",
    "check_volume_group",
    "check_zeroing",
    "exit_code",
    "main",
    "parse_propagation",
    "read_lvm_settings",
    "read_lvm_view",
    "render",
    "run",
    "run_checks",
    "to_json",
    "view_differences",
]


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
    # Where backup clients dial the sidecar: the host the certificate must name.
    snapshot_metadata_address: str = SNAPSHOT_METADATA_ADDRESS


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
        *check_encryption(system),
    ]
    class_checks, vgs = _class_checks(system, opts)
    checks += class_checks
    checks.append(check_lvm_versions(system, vgs))
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
                                            warning_days=opts.tls_cert_warning_days,
                                            address=opts.snapshot_metadata_address))
    return checks


def _class_checks(system: System, opts: Options) -> tuple[list[Check], list[str]]:
    """The VG and pool checks of every device class, and the classes' VGs."""
    if not opts.config:
        return (vg_and_pool_checks(Lvm(system.runner, opts.volume_group, opts.thin_pool),
                                   system.host, state_dir=system.path(opts.state_dir)),
                [opts.volume_group])
    label = f"configuration file {opts.config}"
    try:
        classes = load_classes(system.path(os.path.abspath(opts.config)))
    except ClassConfigError as err:
        return [Check(label, FAIL, f"{err}; no device class checked",
                      "correct the file (docs/device-classes.md): the plugin refuses to "
                      "start with it")], []
    names = ", ".join(c.name for c in classes.classes)
    checks = [Check(label, OK, f"{len(classes.classes)} device class(es): {names}; "
                    f"default {classes.default}")]
    for c in classes.classes:
        lvm = Lvm(system.runner, c.volume_group, c.thin_pool)
        setting = f"thin_pool of class {c.name} in {opts.config}"
        checks += [dataclasses.replace(check, name=f"class {c.name}: {check.name}")
                   for check in vg_and_pool_checks(lvm, system.host, setting,
                                                   state_dir=system.path(opts.state_dir))]
    return checks, [c.volume_group for c in classes.classes]


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
                                                 CERT_WARNING_DAYS),
                   snapshot_metadata_address=getattr(args, "snapshot_metadata_address",
                                                     SNAPSHOT_METADATA_ADDRESS))
    checks = run_checks(system, opts)
    out.write(to_json(checks) if args.json else render(checks))
    return exit_code(checks)


def main(args: argparse.Namespace) -> int:
    return run(System(ProcessRunner(timeout=30.0)), args)
