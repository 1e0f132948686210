from pathlib import Path

import pytest

from csi_local.errors import LvNotFound, VolumeGroupMissing
from csi_local.storage import lvm as lvm_mod
from csi_local.storage.lvm import Lvm, parse_lvs, parse_vgs
from csi_local.volumes import naming
from tests.unit.conftest import FakeRunner

DATA = Path(__file__).parent / "data"


def lvs_json() -> str:
    return (DATA / "lvs.json").read_text()


def test_parse_real_lvs_output() -> None:
    lvs = {lv.name: lv for lv in parse_lvs(lvs_json())}
    pool = lvs["pool"]
    assert pool.is_thin_pool and pool.active and pool.data_percent is not None
    vol = next(lv for lv in lvs.values() if naming.is_csi_volume(lv))
    assert vol.is_thin_volume and vol.pool == "pool" and vol.size > 0
    assert vol.path.startswith("/dev/") and vol.kernel_major > 0 and vol.created > 1_600_000_000
    assert naming.requested_size(vol) == vol.size
    snap = next(lv for lv in lvs.values() if naming.is_csi_snapshot(lv))
    assert snap.activation_skip and not snap.active
    assert naming.source_of(snap) == naming.Source(naming.SourceKind.VOLUME, vol.name)


def test_parse_vgs() -> None:
    out = ('{"report": [{"vg": [{"vg_name":"vg0", "vg_size":"4290772992", '
           '"vg_free":"851443712", "vg_extent_size":"4194304"}]}]}')
    (vg,) = parse_vgs(out)
    assert (vg.name, vg.extent_size) == ("vg0", 4194304)


def test_not_found_is_mapped_once(runner: FakeRunner) -> None:
    runner.on(["lvs"], rc=5, stderr='  Failed to find logical volume "vg0/nope"\n')
    lvm = Lvm(runner, "vg0", "pool")
    with pytest.raises(LvNotFound):
        lvm.get("nope")
    assert lvm.find("nope") is None


def test_missing_vg(runner: FakeRunner) -> None:
    runner.on(["vgs"], rc=5, stderr='  Volume group "vg0" not found\n')
    with pytest.raises(VolumeGroupMissing):
        Lvm(runner, "vg0", "pool").volume_group()


def test_other_failures_are_not_not_found(runner: FakeRunner) -> None:
    from csi_local.errors import CommandError

    runner.on(["lvs"], rc=5, stderr="  Device or resource busy\n")
    with pytest.raises(CommandError):
        Lvm(runner, "vg0", "pool").get("x")


def test_create_thin_argv(runner: FakeRunner) -> None:
    runner.on(["lvcreate"])
    runner.on(["lvs"], stdout=lvs_json())
    lvm = Lvm(runner, "vg0", "pool")
    with pytest.raises(LvNotFound):  # the canned report lacks "new"
        lvm.create_thin("new", 8 << 20, ["csi-local.kind=volume"])
    argv = runner.calls[0]
    assert argv[:4] == ("lvcreate", "--yes", "--thin", "vg0/pool")
    assert "--virtualsize" in argv and f"{8 << 20}b" in argv
    assert ("--addtag", "csi-local.kind=volume") == argv[-2:]


@pytest.mark.parametrize("bad", ["-rf", "a b", "x;y", "", "é"])
def test_names_validated_before_any_command(runner: FakeRunner, bad: str) -> None:
    with pytest.raises(ValueError):
        Lvm(runner, "vg0", "pool").remove(bad)
    assert runner.calls == []


def test_bad_tag_refused() -> None:
    with pytest.raises(ValueError):
        lvm_mod.check_tag("has space")
