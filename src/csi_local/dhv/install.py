"""`csi-local-dhv install`: the plugin executable (a shim that runs this
package's entry point) and its configuration, written into Nomad's host
volume plugin directory."""

from __future__ import annotations

import argparse
import json
import os
import sys

from csi_local.dhv.config import (
    DEFAULT_TIMEOUT,
    NOMAD_OPERATION_LIMIT,
    PLUGIN_ID,
    PluginConfig,
    parse_size,
)
from csi_local.dhv.request import DhvError
from csi_local.host.atomic_files import write_atomic
from csi_local.host.filesystem_rules import SUPPORTED_FS
from csi_local.host.locks import DEFAULT_LOCK_DIR

SHIM = """\
#!{python} -I
# Nomad dynamic host volume plugin "{plugin_id}", written by `csi-local-dhv install`.
# Configuration: {plugin_id}.json in this directory. -I: ignore the environment
# and keep this directory off sys.path.
import sys

from csi_local.dhv import main

sys.exit(main())
"""


def shim_text(python: str, plugin_id: str) -> str:
    if not os.path.isabs(python) or any(c.isspace() for c in python) or len(python) > 200:
        raise DhvError(f"interpreter path {python!r} cannot go in a #! line")
    return SHIM.format(python=python, plugin_id=plugin_id)


def install(args: list[str]) -> int:

    parser = argparse.ArgumentParser(
        prog="csi-local-dhv install",
        description="Write the plugin executable and its configuration into Nomad's "
        "host volume plugin directory (client host_volume_plugin_dir).",
    )
    parser.add_argument("--plugin-dir", required=True, help="Nomad's host_volume_plugin_dir")
    parser.add_argument("--volume-group", default="",
                        help="the volume group of the one pool (device class 'default')")
    parser.add_argument("--thin-pool", default="", help="the thin pool in that group")
    parser.add_argument("--config", default="", metavar="FILE",
                        help="the CSI plugin's device classes file (TOML), instead of "
                        "--volume-group and --thin-pool: several pools, chosen by a "
                        "volume's device_class parameter")
    parser.add_argument("--fs-type", default="ext4", choices=SUPPORTED_FS,
                        help="file system when a volume's parameters name none (with "
                        "--config: for the classes that set no default_fs_type)")
    parser.add_argument("--lock-dir", default=DEFAULT_LOCK_DIR,
                        help="must be the CSI plugin's --lock-dir when both share a pool")
    parser.add_argument("--overprovision-ratio", type=float, default=1.0,
                        help="use the CSI plugin's value (with --config: for the classes "
                        "that set none)")
    parser.add_argument("--default-size", default="1GiB",
                        help="size when a volume sets no capacity_min/capacity_max")
    parser.add_argument("--timeout-seconds", type=float, default=DEFAULT_TIMEOUT,
                        help="budget of one create or delete; below the caller's deadline")
    parser.add_argument("--caller-deadline-seconds", type=float,
                        default=NOMAD_OPERATION_LIMIT,
                        help="how long the caller waits: Nomad's fixed 60 s; set only for "
                        "a caller that is not Nomad")
    parser.add_argument("--pool-data-limit-percent", type=float, default=90.0,
                        help="refuse new volumes while the pool's data is this full "
                        "(use the CSI plugin's value)")
    parser.add_argument("--pool-metadata-limit-percent", type=float, default=90.0,
                        help="the same for the pool's metadata")
    parser.add_argument("--plugin-id", default=PLUGIN_ID,
                        help="executable name, the volume spec's plugin_id")
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter that has csi-local installed (default: this one)")
    ns = parser.parse_args(args)
    try:
        plugin_dir = os.path.abspath(ns.plugin_dir)
        if not ns.plugin_id or "/" in ns.plugin_id or ns.plugin_id.startswith("."):
            raise DhvError(f"invalid plugin id {ns.plugin_id!r}")
        if ns.config and (ns.volume_group or ns.thin_pool):
            raise DhvError("give --config or --volume-group and --thin-pool, not both")
        if not ns.config and not (ns.volume_group and ns.thin_pool):
            raise DhvError("give --volume-group and --thin-pool (one pool), or --config FILE "
                           "(device classes)")
        config = PluginConfig(
            volume_group=ns.volume_group,
            thin_pool=ns.thin_pool,
            # read now, so a file the plugin could not use fails the install
            classes_file=os.path.abspath(ns.config) if ns.config else "",
            fs_type=ns.fs_type,
            lock_dir=ns.lock_dir,
            overprovision_ratio=ns.overprovision_ratio,
            default_size=parse_size(ns.default_size),
            timeout_seconds=ns.timeout_seconds,
            caller_deadline_seconds=ns.caller_deadline_seconds,
            pool_data_limit_percent=ns.pool_data_limit_percent,
            pool_metadata_limit_percent=ns.pool_metadata_limit_percent,
        )
        shim = shim_text(ns.python, ns.plugin_id)
    except DhvError as err:
        message = str(err).removeprefix("config: ")
        parser.error(message.replace("classes_file: ", "--config: ", 1)
                     if message.startswith("classes_file: ") else message)
    os.makedirs(plugin_dir, mode=0o755, exist_ok=True)
    exe = os.path.join(plugin_dir, ns.plugin_id)
    conf = exe + ".json"
    _write(conf, json.dumps(config.to_json(), indent=2) + "\n", 0o644)
    _write(exe, shim, 0o755)
    sys.stdout.write(json.dumps({"plugin": exe, "config": conf}) + "\n")
    return 0


def _write(path: str, text: str, mode: int) -> None:
    write_atomic(path, text, mode)
