"""Device classes of the Nomad dynamic host volume plugin against real LVM:
`csi-local-dhv install --config FILE` with two classes on two volume groups
(`fast`, the session's VG and the default; `big`, a VG of the test's own), the
plugin run as Nomad's client runs it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from csi_local.dhv.request import lv_name_for, snapshot_lv_name
from csi_local.host import mounts
from csi_local.storage.lvm import LogicalVolume
from tests.integration.conftest import LoopVG, make_vg, unmount_under
from tests.integration.dhvkit import (
    MIB,
    Dhv,
    all_lvs,
    dhv_fixture,  # noqa: F401 - the `dhv` fixture
    failed,
    mounted_device,
    new_id,
    ok,
)

pytestmark = pytest.mark.integration

CLASSES = """\
default = "fast"

[classes.fast]
volume_group = "{fast}"
thin_pool = "{fast_pool}"

[classes.big]
volume_group = "{big}"
thin_pool = "{big_pool}"
default_fs_type = "xfs"

[classes.big.lvcreate]
readahead = 256
"""


@dataclass
class Classes:
    dhv: Dhv
    big: LoopVG

    def lv(self, vg: LoopVG, lv_name: str) -> LogicalVolume | None:
        return next((lv for lv in all_lvs(vg) if lv.name == lv_name), None)

    def where(self, vid: str) -> str | None:
        """The VG holding the volume's LV, None if none does."""
        found = [vg.name for vg in (self.dhv.vg, self.big)
                 if self.lv(vg, lv_name_for(vid)) is not None]
        assert len(found) <= 1, found
        return found[0] if found else None

    def mounted(self, vid: str, vg: LoopVG, fs_type: str) -> None:
        lv = self.lv(vg, lv_name_for(vid))
        assert lv is not None, vid
        top = mounted_device(self.dhv.path(vid))
        assert top is not None and top.fs_type == fs_type, top
        assert mounts.mount_is_device(top, lv.kernel_major, lv.kernel_minor), (top, lv)


@pytest.fixture
def classes(dhv: Dhv) -> Iterator[Classes]:
    """The plugin installed again, with --config: fast (the session's VG) and big."""
    big = make_vg(size=2 << 30)  # room for a volume, two clones and a snapshot of 320 MiB
    path = dhv.workdir / "classes.toml"
    path.write_text(CLASSES.format(fast=dhv.vg.name, fast_pool=dhv.vg.pool, big=big.name,
                                   big_pool=big.pool))
    dhv.install(classes_file=path)
    written = json.loads((dhv.plugin_dir / "csi-local-dhv.json").read_text())
    assert written["classes_file"] == str(path) and "volume_group" not in written
    try:
        yield Classes(dhv, big)
    finally:
        unmount_under(dhv.workdir)
        big.destroy()


def test_create_grow_and_delete_in_each_class(classes: Classes) -> None:
    dhv, big = classes.dhv, classes.big
    in_fast, in_big = new_id(), new_id()
    ok(dhv.call("create", in_fast, cap_min=64 * MIB))  # no device_class: the default
    out = ok(dhv.call("create", in_big, cap_min=320 * MIB, params={"device_class": "big"}))
    assert classes.where(in_fast) == dhv.vg.name
    assert classes.where(in_big) == big.name
    classes.mounted(in_fast, dhv.vg, "ext4")
    classes.mounted(in_big, big, "xfs")  # big's default_fs_type
    # Nomad repeats create at every client start; a grow finds it in its class too
    again = ok(dhv.call("create", in_big, cap_min=400 * MIB))
    assert again["path"] == out["path"] and again["bytes"] == 400 * MIB
    failed(dhv.call("create", in_big, cap_min=400 * MIB, params={"device_class": "fast"}),
           "exists in device class 'big', not 'fast'")
    ok(dhv.call("delete", in_big))
    assert classes.where(in_big) is None and classes.where(in_fast) == dhv.vg.name
    ok(dhv.call("delete", in_big))  # gone: succeeds
    ok(dhv.call("delete", in_fast))
    assert classes.where(in_fast) is None


def test_clones_and_snapshots_stay_in_their_class(classes: Classes) -> None:
    dhv, big = classes.dhv, classes.big
    src = new_id()
    ok(dhv.call("create", src, cap_min=320 * MIB, params={"device_class": "big"},
                name="golden"))
    clone = new_id()
    ok(dhv.call("create", clone, params={"source_volume": "golden"}, name="clone"))
    assert classes.where(clone) == big.name  # its source's class, not the default
    classes.mounted(clone, big, "xfs")
    refused = new_id()
    failed(dhv.call("create", refused, params={"source_volume": src, "device_class": "fast"},
                    name="refused"),
           "is in device class 'big', and what is made from it stays there")
    assert classes.where(refused) is None
    snap = ok(dhv.snapshot("create", src, "golden-v1"))
    assert snap["lv"] == f"{big.name}/{snapshot_lv_name('golden-v1')}"
    assert snap["device_class"] == "big"
    listed = json.loads(dhv.snapshot_run("list", "--json").stdout)["snapshots"]
    assert [(e["snapshot"], e["device_class"]) for e in listed] == [("golden-v1", "big")]
    failed(dhv.snapshot("create", src, "golden-v2", "--device-class", "fast"),
           "is in device class 'big', and what is made from it stays there")
    from_snap = new_id()
    ok(dhv.call("create", from_snap, params={"source_snapshot": "golden-v1"}, name="s"))
    assert classes.where(from_snap) == big.name
    for vid in (from_snap, clone, src):
        ok(dhv.call("delete", vid))
    assert ok(dhv.snapshot("delete", "golden-v1")) == {}
    assert classes.lv(big, snapshot_lv_name("golden-v1")) is None


def test_unknown_class_makes_nothing(classes: Classes) -> None:
    vid = new_id()
    res = classes.dhv.call("create", vid, params={"device_class": "slow"})
    failed(res, "unknown device class 'slow' (this node has: big, fast)")
    assert res.rc == 1 and classes.where(vid) is None
    assert not (classes.dhv.volumes_dir / vid).exists()
