"""`csi-local-dhv snapshot create|delete|list`: snapshots of host volumes, for
an operator (Nomad has no snapshot verb for host volumes). They are the
sources of golden-volume clones (the source_snapshot parameter).

Run it as the plugin runs: the executable in Nomad's plugin directory, whose
configuration file sits next to it (or name the directory with --plugin-dir).
create and delete print one JSON object, errors {"error": ...} with exit
status 1, like the plugin's own operations.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import NoReturn, TextIO

from csi_local.dhv.config import PLUGIN_ID, load_config
from csi_local.dhv.host_volumes import HostVolumes
from csi_local.dhv.request import DhvError, check_snapshot_name, check_volume_id
from csi_local.storage.lvm import LogicalVolume
from csi_local.volumes.device_classes import check_class_name
from csi_local.volumes.host_volume_names import TAG_FS, TAG_SNAPSHOT, TAG_SOURCE


class _Parser(argparse.ArgumentParser):
    """Usage errors are reported like every other: {"error": ...}, exit 1."""

    def error(self, message: str) -> NoReturn:
        raise DhvError(f"{self.prog}: {message}")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="csi-local-dhv snapshot",
        description="Snapshots of csi-local-dhv host volumes (the sources of clones).")
    common = _Parser(add_help=False)
    common.add_argument("--plugin-dir", help="the directory of the plugin and its "
                        "configuration (default: this executable's directory)")
    common.add_argument("--plugin-id", help="the plugin's name, which names its "
                        f"configuration file (default: this executable's name, or {PLUGIN_ID})")
    sub = parser.add_subparsers(dest="command", required=True)
    create = sub.add_parser("create", parents=[common],
                            help="snapshot a host volume (its Nomad volume ID)")
    create.add_argument("volume_id")
    create.add_argument("name", help="the snapshot's name, unique on the node")
    create.add_argument("--device-class", help="the volume's device class: refused if it "
                        "is in another (a snapshot is made in its volume's class)")
    delete = sub.add_parser("delete", parents=[common], help="remove a snapshot")
    delete.add_argument("name")
    listing = sub.add_parser("list", parents=[common], help="list snapshots")
    listing.add_argument("volume_id", nargs="?", help="only this volume's")
    listing.add_argument("--json", action="store_true", help="print JSON")
    return parser


def _plugin_path(args: argparse.Namespace, argv0: str) -> tuple[str, str]:
    """(plugin dir, a path whose name is the plugin ID) for load_config."""
    plugin_dir = args.plugin_dir
    if plugin_dir is None:
        if not argv0 or os.sep not in argv0:
            raise DhvError("give --plugin-dir (the directory of the plugin's configuration)")
        plugin_dir = os.path.dirname(os.path.abspath(argv0))
    if "\0" in plugin_dir:
        raise DhvError("--plugin-dir is not a path")
    plugin_dir = os.path.abspath(plugin_dir)
    name = args.plugin_id or (os.path.basename(argv0) if argv0 else "") or PLUGIN_ID
    return plugin_dir, os.path.join(plugin_dir, name)


def entry(lv: LogicalVolume, device_class: str | None = None) -> dict[str, object]:
    source = lv.tag_value(TAG_SOURCE) or ""
    return {
        "snapshot": lv.tag_value(TAG_SNAPSHOT),
        "volume_id": source.removeprefix("volume:") if source.startswith("volume:") else None,
        "lv": f"{lv.vg}/{lv.name}",
        "bytes": lv.size,
        "fs_type": lv.tag_value(TAG_FS),
        "created": lv.created,
        "device_class": device_class,
    }


def _table(entries: list[dict[str, object]]) -> str:
    rows = [["SNAPSHOT", "VOLUME ID", "SIZE", "FS", "CREATED", "CLASS", "LV"]]
    for e in entries:
        created = int(e["created"]) if isinstance(e["created"], int) else 0
        rows.append([str(e["snapshot"]), str(e["volume_id"] or "-"), str(e["bytes"]),
                     str(e["fs_type"] or "-"),
                     time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created)) if created
                     else "-", str(e["device_class"] or "-"), str(e["lv"])])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def _device_class(name: str) -> str:
    try:
        return check_class_name(name)
    except ValueError as err:
        raise DhvError(f"--device-class: {err}") from None


def main(argv: list[str], argv0: str, out: TextIO | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        if args.command in ("create", "list") and args.volume_id is not None:
            try:
                check_volume_id(args.volume_id)
            except DhvError:
                raise DhvError(f"{args.volume_id!r} is not a Nomad volume ID") from None
        if args.command in ("create", "delete"):
            check_snapshot_name(args.name)
        if args.command == "create" and args.device_class is not None:
            _device_class(args.device_class)
        plugin_dir, plugin_path = _plugin_path(args, argv0)
        plugin = HostVolumes(load_config(plugin_dir, plugin_path))
        if args.command == "create":
            snap = plugin.snapshot_create(args.volume_id, args.name, args.device_class)
            text = json.dumps({k: v for k, v in entry(snap, plugin.class_of(snap)).items()
                               if k in ("snapshot", "volume_id", "lv", "bytes",
                                        "device_class")})
        elif args.command == "delete":
            plugin.snapshot_delete(args.name)
            text = "{}"
        else:
            entries = [entry(lv, plugin.class_of(lv)) for lv in plugin.snapshots(args.volume_id)]
            text = json.dumps({"snapshots": entries}) if args.json else _table(entries)
    except Exception as exc:
        from csi_local.dhv import fail_with

        return fail_with(exc)
    stream = out if out is not None else sys.stdout
    stream.write(text + "\n")
    stream.flush()
    return 0
