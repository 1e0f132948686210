"""`csi-local status`: what this node holds, read from LVM and the state file.

It works while the plugin is down: one `vgs` and one `lvs` through Lvm, and
the state file read as it is (never through a StateStore, which takes the
state directory's exclusive lock and would refuse, or block the plugin's
start). Nothing is changed: not LVM, not the state, not the lock directory.

Every device class is shown: its VG and thin pool (one `vgs` and one `lvs`
per VG, however many classes it holds), and the class of every volume (its
VG and thin pool say it). The classes are the flags' one (`--volume-group`,
`--thin-pool`, named `default`) or a configuration file's (`--config`).

Possible orphans are guesses, and say so: the node cannot know whether a CO
still knows a volume. A CSI volume that is neither staged nor published and
older than --orphan-age (a CreateVolume whose reply was lost, a claim deleted
while the node was away) and an LV with csi-local tags but no CSI name are
listed for an operator to check with the CO.

collect.py reads the node into a Status, render.py prints it (a table or
JSON); this module is the command.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from csi_local.errors import StorageError
from csi_local.host.cgroups import DEFAULT_ROOT, Cgroups
from csi_local.host.runner import ProcessRunner, Runner
from csi_local.ops.status.collect import (
    DEFAULT_ORPHAN_AGE,
    Status,
    collect,
    collect_classes,
    duration_text,
    node_classes,
    parse_duration,
    read_only_pool,
    read_state,
)
from csi_local.ops.status.render import human_age, human_size, render, to_json
from csi_local.storage.lvm import check_name
from csi_local.volumes.device_classes import ClassConfigError

# What collect.py and render.py offer the CLI, doctor and the tests, here
# where `csi_local.ops.status` always had them.
__all__ = [
    "DEFAULT_ORPHAN_AGE",
    "Status",
    "collect",
    "collect_classes",
    "duration_text",
    "human_age",
    "human_size",
    "lvm_name",
    "main",
    "node_classes",
    "parse_duration",
    "read_only_pool",
    "read_state",
    "render",
    "run",
    "to_json",
]


# the command --------------------------------------------------------------------


def run(runner: Runner, args: argparse.Namespace, *, out: TextIO = sys.stdout,
        err: TextIO = sys.stderr, now: float | None = None) -> int:
    """Print the status; 0, or 1 when a class's VG cannot be read (the others
    are shown), 2 when the configuration file cannot be used."""
    try:
        classes = node_classes(args, float(args.overprovision_ratio))
    except ClassConfigError as e:
        print(f"csi-local status: {e}", file=err)
        return 2
    try:
        status = collect_classes(runner, classes, args.state_dir,
                                 orphan_age=float(args.orphan_age), now=now,
                                 cgroups=Cgroups(getattr(args, "cgroup_root", DEFAULT_ROOT)))
    except StorageError as e:
        print(f"csi-local status: {e.message}", file=err)
        return 1
    out.write(to_json(status) if args.json else render(status))
    unread = [c for c in status.classes if c.error is not None]
    for c in unread:
        print(f"csi-local status: class {c.name}: {c.error}", file=err)
    return 1 if unread else 0


def main(args: argparse.Namespace) -> int:
    return run(ProcessRunner(), args)


def lvm_name(text: str) -> str:
    """An argparse `type` for a VG or pool name."""
    try:
        return check_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
