"""A VG on two PVs whose first is detached, reduced out of the VG while away
(`vgreduce --removemissing`) and attached again with its outdated metadata
copy: `lvs` warns and answers from the newest seqno, and so must every
answer of the plugin (issue 30, defect 2)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from csi_local._gen import csi_pb2 as pb
from tests.integration.conftest import SCRATCH, LoopVG, PluginProcess, run
from tests.integration.test_node import create, stage, unstage

pytestmark = pytest.mark.integration
MiB = 1 << 20


def settle() -> None:
    run("udevadm", "settle", "--timeout=60", check=False)


@dataclass
class TwoPvVG(LoopVG):
    """A LoopVG whose thin pool is on its second PV, `loop`; `first` is the
    PV that goes away (nothing is allocated on it, so it can)."""

    first: str = ""
    first_image: str = ""

    def detach_first(self) -> None:
        run("losetup", "--detach", self.first)
        run("vgreduce", "--removemissing", self.name)
        # The PV that vgreduce wrote is a udev event, and LVM's rules answer it
        # (pvscan, autoactivation) beside the test's next command: let them end
        # first, as the metadata walk does after every step.
        settle()

    def attach_first(self) -> None:
        # At the same node: where the plugin last saw it.
        run("losetup", self.first, self.first_image)
        settle()

    def destroy(self) -> None:
        super().destroy()
        run("losetup", "--detach", self.first, check=False)
        Path(self.first_image).unlink(missing_ok=True)


@pytest.fixture
def two_pv_vg() -> Iterator[TwoPvVG]:
    SCRATCH.mkdir(parents=True, exist_ok=True)
    name = f"csitest{uuid.uuid4().hex[:8]}"
    images = [SCRATCH / f"{name}-{i}.img" for i in range(2)]
    for image in images:
        with open(image, "wb") as f:
            f.truncate(512 * MiB)
    loops = [run("losetup", "--find", "--show", str(i)).stdout.strip() for i in images]
    run("vgcreate", "--yes", name, *loops)
    run("lvcreate", "--yes", "--type", "thin-pool", "--size", "256M", "--name", "pool",
        name, loops[1])
    vg = TwoPvVG(name=name, pool="pool", image=images[1], loop=loops[1], size=512 * MiB,
                 first=loops[0], first_image=str(images[0]))
    yield vg
    vg.destroy()


def _listed(p: PluginProcess) -> dict[str, pb.ListVolumesResponse.Entry]:
    entries = p.controller.ListVolumes(pb.ListVolumesRequest()).entries
    return {e.volume.volume_id: e for e in entries}


def _capacity(p: PluginProcess) -> int:
    return p.controller.GetCapacity(pb.GetCapacityRequest()).available_capacity


def _lvs(vg: LoopVG) -> set[str]:
    out = run("lvs", "--noheadings", "-o", "lv_name", vg.name).stdout
    return {x.strip() for x in out.split() if x.strip()}


def _outcome(fn: Callable[[], Any]) -> Any:
    """What a call answers: its reply, or its status code's name."""
    try:
        return fn()
    except grpc.RpcError as err:
        return err.code().name


def test_an_outdated_copy_attached_again_is_never_believed(
        plugin_factory: Any, two_pv_vg: TwoPvVG) -> None:
    vg = two_pv_vg
    p = plugin_factory(target_vg=vg)
    gone = create(p, "md-gone")  # the plugin has read the VG's PVs: both
    vg.detach_first()
    # LVM's shell refused the VG after another process reduced it (its view of
    # the devices stale): the plugin runs that command as a process instead.
    fresh = create(p, "md-fresh", 48 * MiB)  # a size of its own: the capacity differs
    p.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=gone))
    capacity = _capacity(p)
    vg.attach_first()
    assert fresh in _lvs(vg) and gone not in _lvs(vg)  # LVM: the newest seqno
    # Every answer is checked, and every wrong one named at the end.
    wrong: list[str] = []

    def expect(what: str, got: Any, want: Any) -> None:
        if got != want:
            wrong.append(f"{what}: {got!r}, expected {want!r}")

    listed = _listed(p)
    expect("ListVolumes lists the volume that exists", fresh in listed, True)
    expect("ListVolumes leaves out the one deleted", gone in listed, False)
    condition = listed[fresh].status.volume_condition if fresh in listed else None
    expect("the pool's condition is abnormal, naming the outdated PV",
           condition is not None and condition.abnormal and vg.first in condition.message,
           True)
    expect("ControllerGetVolume of the volume that exists", _outcome(
        lambda: p.controller.ControllerGetVolume(pb.ControllerGetVolumeRequest(
            volume_id=fresh)).volume.volume_id), fresh)
    expect("ControllerGetVolume of the one deleted", _outcome(
        lambda: p.controller.ControllerGetVolume(pb.ControllerGetVolumeRequest(
            volume_id=gone))), "NOT_FOUND")
    expect("GetCapacity: the figure of now", _outcome(lambda: _capacity(p)), capacity)
    expect("a CreateVolume retry", _outcome(lambda: create(p, "md-fresh", 48 * MiB)), fresh)
    expect("CreateVolume of the deleted one's name", _outcome(lambda: create(p, "md-gone")),
           gone)
    expect("... makes its LV again", gone in _lvs(vg), True)
    staging = p.path("s-md-gone")
    expect("... and it stages", _outcome(lambda: stage(p, gone, staging)), None)
    assert not wrong, "\n".join(wrong)
    unstage(p, gone, staging)
