"""An in-memory host for unit tests: LVM, block devices, file systems, loop
devices and the mount table, behind both seams the plugin has (the Runner that
runs commands and the Kernel that reads the kernel's view).

Why a simulation and not canned replies: the servicers run many commands per
RPC and then read back what those commands did (`lvs` after `lvcreate`, the
mount table after `mount`). Canned replies make every test restate that
sequence; a model that answers like the real tools lets a test say only what
is special about it (a device with stray signatures, a busy LV, one failing
command) and run every RPC in milliseconds.

Fidelity rules, each the real behaviour the plugin must cope with:
- exit codes and stderr are those of LVM, util-linux and mkfs (the plugin maps
  them with regular expressions); anything not simulated is an AssertionError
  naming the argv, so a test never passes on an unknown command;
- a device-node bind shows a devtmpfs mount whose root is "/dm-N" (or
  "/loopN"), and a loop device's backing file is the resolved node
  ("/dev/dm-N"), as /sys shows it; btrfs mounts show an anonymous 0:N device;
- an LV is open (lvremove and deactivation refuse) while a file system on it
  is mounted, a loop device is attached over it, or a test marks it busy; a
  bind of its *node* does not open it, just as on Linux;
- mkfs.xfs and mkfs.btrfs (no -f) refuse a device with a signature, mkfs
  refuses a mounted one, and the kernel refuses a second xfs (without
  nouuid) or btrfs with a mounted one's UUID.
- several volume groups, each with any number of thin pools (device classes):
  LV names are unique per VG only, `lvs` takes several VG operands and a
  `--select 'lv_name="a" || lv_name="b"'`, sorts its rows by VG then LV, and
  with a VG missing among its operands reports the others' rows and exits 5
  with `Volume group "x" not found` on stderr, as LVM does.
- what the plugin reads without a process is the same state in the kernel's
  and LVM's own formats: each present VG's PV holds LVM's label, metadata
  area and text (each change a new seqno, written after the last one round
  the area), and device-mapper shows each active LV as LVM names and stacks
  it, with its target's status; the fake's `lvs` derives a pool's
  percentages from the blocks that status counts, as LVM does.
Directories and files are real (under a pytest tmp_path); only the table of
what is mounted on them is simulated.

The first VG (the constructor's `vg`, `pool`) is the default of every helper
that takes a `vg`: `host.lvs`, `host.vg_present` and `host.vg_size` are that
VG's, so single-VG tests never name one. More VGs: `add_vg`; more pools:
`add_pool`; every LV of every VG: `all_lvs()`, keyed by (vg, name).

Its parts, one class each in tests/unit/fakes: lvm.py (VGs, pools, LVs, the
LVM commands, device-mapper's and the thin tools' view of a pool, each VG's
PV, whose bytes pv_metadata.py renders in LVM's on-disk format),
devices.py (block devices, what is on them, mkfs & co., loop devices),
mounts.py (the mount table, mount(8), umount(8), binds, freezes, the tools
that grow a mounted file system), crypt.py (cryptsetup and dm-crypt
devices), cgroups.py (the cgroup v2 hierarchy and io.max). FakeHost
composes them, holds their state and is the Runner: it dispatches each
command to its part's simulation.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from csi_local.errors import CommandError
from csi_local.host.runner import Result
from tests.unit.fakes import pv_metadata
from tests.unit.fakes.cgroups import FakeCgroups
from tests.unit.fakes.common import (
    DM_MAJOR,
    LOOP_MAJOR,
    GiB,
    MiB,
    WholeOutputStreams,
    _Fail,
)
from tests.unit.fakes.crypt import FakeCrypt, FakeMapper
from tests.unit.fakes.devices import Content, FakeDevices, FakeLoop
from tests.unit.fakes.lvm import FakeLv, FakeLvm, FakeVg
from tests.unit.fakes.mounts import FakeMounts, _Rec

# The LVM commands that change a VG's metadata.
_LVM_CHANGES = frozenset({"lvcreate", "lvextend", "lvremove", "lvchange", "vgcreate"})

__all__ = ["DM_MAJOR", "LOOP_MAJOR", "Content", "FakeHost", "FakeLoop", "FakeLv", "FakeVg",
           "GiB", "MiB"]


class FakeHost(FakeCrypt, FakeLvm, FakeDevices, FakeMounts, FakeCgroups, WholeOutputStreams):
    """The host's LVM, devices and mounts in memory; also the Runner."""

    def __init__(self, vg: str = "vg0", pool: str = "pool0", pool_size: int = 10 * GiB,
                 extent: int = 4 * MiB, *, with_vg: bool = True, with_pool: bool = True,
                 vg_size: int | None = None) -> None:
        self.vg = vg  # the first VG: the default of every helper taking a `vg`
        self.pool_name = pool  # its first pool: the default of add_lv
        self.vgs: dict[str, FakeVg] = {}
        self.loops: dict[int, FakeLoop] = {}
        self.mappers: dict[str, FakeMapper] = {}  # dm-crypt devices, by name
        self.crypt_inputs: list[bytes | None] = []
        self.calls: list[tuple[str, ...]] = []
        self.clock = 1_700_000_000  # lv_time of the next LV; each lvcreate advances it
        self._loop_nodes: set[int] = set()  # loop nodes ever made (they outlive detach)
        self._table: list[_Rec] = []
        self._next_mount_id = 100
        self._next_anon = 40
        self._uuids = 0
        self._failures: list[tuple[tuple[str, ...], _Fail, bool]] = []
        self._tools: dict[str, Callable[[Sequence[str]], str]] = {
            "lvs": self._lvs, "vgs": self._vgs, "pvs": self._pvs, "lvcreate": self._lvcreate,
            "lvextend": self._lvextend, "lvremove": self._lvremove, "lvchange": self._lvchange,
            "vgcreate": self._vgcreate, "vgchange": self._vgchange, "blkid": self._blkid,
            "wipefs": self._wipefs, "mkfs.ext4": self._mkfs, "mkfs.xfs": self._mkfs,
            "mkfs.btrfs": self._mkfs, "resize2fs": self._grow, "xfs_growfs": self._grow,
            "btrfs": self._grow, "btrfstune": self._btrfstune, "sync": self._sync,
            "mount": self._mount, "umount": self._umount, "losetup": self._losetup,
            "dmsetup": self._dmsetup, "thin_dump": self._thin_dump,
            "thin_delta": self._thin_delta,
        }
        self._next_data_chunk = 0
        # `pvs` lists each present VG's PV, and the committed-metadata reader
        # reads it (fakes/pv_metadata.py); False: no PV, every read is `lvs`.
        self.pv_metadata = True
        self.thin_status_error = False  # see FakeLvm._thin_status
        # File systems frozen with FIFREEZE, by device numbers. The kernel of
        # Debian 12 (6.1) cannot nest LVM's lockfs suspend of a thin origin in
        # such a freeze; newer ones can (`nested_freeze`).
        self.frozen: set[tuple[int, int]] = set()
        self.init_cgroups()
        self.nested_freeze = True
        self.add_vg(vg, pool=pool if with_pool else None, pool_size=pool_size, extent=extent,
                    vg_size=vg_size, present=with_vg)

    def fail_next(self, prefix: Sequence[str], rc: int = 1, stderr: str = "boom", *,
                  stdout: str = "", timed_out: bool = False) -> None:
        """The next command starting with `prefix` fails once, changing nothing."""
        self._failures.append((self._norm(prefix), _Fail(rc, stderr, stdout), timed_out))

    def commands(self, name: str) -> list[tuple[str, ...]]:
        return [c for c in self.calls if c[0] == name]

    def run(self, argv: Sequence[str], *, ok_codes: Sequence[int] = (0,),
            input: str | bytes | None = None, timeout: float | None = None) -> Result:
        full = tuple(str(a) for a in argv)
        call = self._norm(full)
        self.calls.append(call)
        for i, (prefix, fail, timed_out) in enumerate(self._failures):
            if call[:len(prefix)] == prefix:
                del self._failures[i]
                if timed_out:
                    raise CommandError(full, -9, "", "timed out", timed_out=True)
                return self._result(full, fail.rc, fail.stdout, fail.stderr, ok_codes)
        if call[0] == "cryptsetup":  # the one tool that reads its standard input
            try:
                return self._result(full, 0, self._cryptsetup(call, input), "", ok_codes)
            except _Fail as fail:
                return self._result(full, fail.rc, fail.stdout, fail.stderr, ok_codes)
        tool = self._tools.get(call[0])
        if tool is None:
            raise AssertionError(f"FakeHost does not simulate {full!r}")
        try:
            out = tool(call)
        except _Fail as fail:
            return self._result(full, fail.rc, fail.stdout, fail.stderr, ok_codes)
        if call[0] in _LVM_CHANGES:  # each change LVM commits is a new version on the PVs
            for fvg in self.vgs.values():
                if fvg.present:
                    pv_metadata.commit(fvg)
        return self._result(full, 0, out, "", ok_codes)

    @staticmethod
    def _norm(argv: Sequence[str]) -> tuple[str, ...]:
        return (os.path.basename(argv[0]), *argv[1:]) if argv else ()

    @staticmethod
    def _result(argv: tuple[str, ...], rc: int, out: str, err: str,
                ok_codes: Sequence[int]) -> Result:
        if rc not in ok_codes:
            raise CommandError(argv, rc, out, err)
        return Result(argv, rc, out, err)
