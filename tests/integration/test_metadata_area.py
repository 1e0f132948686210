"""The VG's metadata area as a capacity, against real LVM.

LVM writes the VG's whole metadata text into every metadata area in use at
each change, beside the committed copy, and refuses a text larger than half
the area less a sector (vg_text.max_text_size). These tests fill a
small area: first with bare lvcreates, to show that LVM refuses exactly
where that rule says and that the plugin reads the area as LVM reports it;
then through CreateVolume, which must refuse before LVM does, with GetCapacity
at 0, nothing half-made, and room again once a volume is deleted.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.host.kernel import Kernel
from csi_local.host.runner import ProcessRunner
from csi_local.storage import vg_text
from csi_local.storage.committed_vg import CommittedMetadata
from csi_local.storage.lvm import MetadataArea
from csi_local.volumes import naming
from csi_local.volumes.pool import COMMAND_TEXT_MAX, LV_TEXT_MAX, lvs_that_fit
from tests.integration.conftest import (
    LoopVG,
    PluginProcess,
    block_cap,
    expect_code,
    make_vg,
    run,
)

pytestmark = pytest.mark.integration

# Small enough to fill with a few dozen LVs. pvcreate extends the area up to
# the start of the data, aligned to 1 MiB by default: a small alignment keeps
# it small.
SMALL, ALIGN = "32k", "32k"
MiB = 1 << 20
_REFUSED = re.compile(r"\((\d+) bytes\) exceeds maximum metadata size \((\d+) bytes\)")


@pytest.fixture
def small_vg() -> Iterator[LoopVG]:
    vg = make_vg(256 * MiB, metadatasize=SMALL, dataalignment=ALIGN)
    yield vg
    vg.destroy()


def lvm_area(vg: str) -> MetadataArea:
    """The VG's tightest metadata area as LVM reports it (vg_mda_size, and
    vg_mda_free: what the largest text leaves, in whole sectors)."""
    out = run("vgs", "--reportformat", "json", "--units", "b", "--nosuffix", "-o",
              "vg_mda_size,vg_mda_free", vg).stdout
    row = json.loads(out)["report"][0]["vg"][0]
    size = int(row["vg_mda_size"])
    return MetadataArea(size, vg_text.max_text_size(size) - int(row["vg_mda_free"]))


def ours(committed: CommittedMetadata, vg: str) -> MetadataArea:
    assert committed.volume_group(vg) is not None, committed.problems(vg)
    area = committed.metadata_area(vg)
    assert area is not None
    return area


def same_as_lvm(area: MetadataArea, vg: str) -> None:
    """The plugin's reading of the area, off the PV, is LVM's."""
    theirs = lvm_area(vg)
    assert area.size == theirs.size
    assert theirs.used - 512 < area.used <= theirs.used  # LVM's free is in whole sectors


def volume_argv(vg: LoopVG, n: int, pvc: str, namespace: str = "default") -> list[str]:
    """A bare lvcreate of a volume as the CSI plugin names and tags it."""
    tags = [f"{naming.TAG_KIND}={naming.KIND_VOLUME}", f"{naming.TAG_SIZE}={4 * MiB}",
            *naming.co_name_tags({"csi.storage.k8s.io/pvc/name": pvc,
                                "csi.storage.k8s.io/pvc/namespace": namespace})]
    argv = ["lvcreate", "--yes", "--thin", f"{vg.name}/{vg.pool}", "--virtualsize",
            f"{4 * MiB}b", "--name", naming.volume_id_for(f"pvc-{n}")]
    for tag in tags:
        argv += ["--addtag", tag]
    return argv


def test_lvm_refuses_the_text_the_rule_refuses(small_vg: LoopVG, session_vg: LoopVG) -> None:
    """Bare lvcreates with the plugin's tags until LVM refuses: it refuses the
    first text larger than max_text_size of the area, and not before."""
    print(f"LVM's default metadata area (vgcreate): {lvm_area(session_vg.name)}")
    committed = CommittedMetadata(ProcessRunner(), Kernel())
    first = ours(committed, small_vg.name)
    same_as_lvm(first, small_vg.name)
    # What one volume with the longest PVC names Kubernetes allows adds, and a
    # snapshot of it.
    run(*volume_argv(small_vg, 0, "p" * 253, "n" * 63))
    longest = ours(committed, small_vg.name).used - first.used
    snap = naming.snapshot_id_for("s")
    run("lvcreate", "--yes", "--snapshot", "--name", snap, "--setactivationskip", "y",
        "--activate", "n", "--addtag", f"{naming.TAG_KIND}={naming.KIND_SNAPSHOT}", "--addtag",
        naming.Source(naming.SourceKind.VOLUME, naming.volume_id_for("pvc-0")).tag(),
        f"{small_vg.name}/{naming.volume_id_for('pvc-0')}")
    snapshot = ours(committed, small_vg.name).used - first.used - longest
    print(f"text of a volume with the longest PVC tags: {longest} B, of its snapshot: "
          f"{snapshot} B")
    assert max(longest, snapshot) <= LV_TEXT_MAX
    made, sizes = 2, [ours(committed, small_vg.name).used]
    while True:
        proc = run(*volume_argv(small_vg, made, f"data-db-{made}"), check=False)
        if proc.returncode != 0:
            break
        made += 1
        sizes.append(ours(committed, small_vg.name).used)
        assert made < 100, "LVM never refused (is the area small?)"
    m = _REFUSED.search(proc.stderr)
    assert m is not None, proc.stderr
    wanted, limit = int(m.group(1)), int(m.group(2))
    assert limit == first.limit == vg_text.max_text_size(first.size)
    assert sizes[-1] <= limit < wanted  # the last text fitted, the next did not
    grew = [b - a for a, b in itertools.pairwise(sizes)]
    print(f"area {first.size} B, limit {limit} B, empty VG's text {first.used} B, "
          f"{made} LVs made; text per LV {min(grew)}..{max(grew)} B; refused at {wanted} B")
    assert max(grew) <= LV_TEXT_MAX
    # Nothing made of the refused one, and LVM still reads the VG whole.
    assert len(small_vg.lv_names()) == made
    run("vgck", small_vg.name)
    last = ours(committed, small_vg.name)
    same_as_lvm(last, small_vg.name)
    assert lvs_that_fit(last) == 0


def capacity(plugin: PluginProcess) -> int:
    reply = plugin.controller.GetCapacity(
        pb.GetCapacityRequest(volume_capabilities=[block_cap()]), timeout=120)
    return int(reply.available_capacity)


def create(plugin: PluginProcess, name: str) -> pb.CreateVolumeResponse:
    return plugin.controller.CreateVolume(pb.CreateVolumeRequest(
        name=name, volume_capabilities=[block_cap()],
        capacity_range=pb.CapacityRange(required_bytes=4 * MiB)), timeout=120)


def test_create_volume_refuses_before_lvm_does(small_vg: LoopVG, plugin_factory: Any) -> None:
    """CreateVolume until RESOURCE_EXHAUSTED: GetCapacity is 0 from then on
    (and not before), the refusal names the metadata area and its fix, nothing
    is half-made, LVM still takes the VG's metadata, a deletion makes room."""
    # Over-provisioned: the metadata area, not the pool's data, must be what runs out.
    plugin: PluginProcess = plugin_factory("--overprovision-ratio", "100", target_vg=small_vg)
    made: list[str] = []
    while True:
        room = capacity(plugin)
        try:
            made.append(create(plugin, f"pvc-{len(made)}").volume.volume_id)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
            message = err.details() or ""
            break
        assert room > 0, f"GetCapacity was 0, yet volume {len(made)} was made"
        assert len(made) < 100, "never refused"
    assert room == 0, "GetCapacity did not report 0 before the refusal"
    assert f"the metadata area of volume group {small_vg.name} is" in message
    assert "pvcreate --metadatasize" in message
    assert len(made) >= 3
    # Nothing half-made: the VG holds the volumes made, LVM reads it whole,
    # and the text left room: LVM refused nothing.
    assert small_vg.lv_names() == sorted(made)
    run("vgck", small_vg.name)
    area = lvm_area(small_vg.name)
    assert 0 < area.limit - area.used < LV_TEXT_MAX + COMMAND_TEXT_MAX
    assert "exceeds maximum metadata size" not in plugin.log()
    print(f"{len(made)} volumes in a {area.size} B area; refused with {area.limit - area.used} "
          "B of text left")
    # A retry of a volume that exists is still answered (nothing new to record).
    assert create(plugin, "pvc-0").volume.volume_id == made[0]
    # A deletion makes room again.
    plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=made.pop()), timeout=120)
    assert capacity(plugin) > 0
    made.append(create(plugin, "pvc-again").volume.volume_id)
    expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, create, plugin, "pvc-one-too-many")
    assert small_vg.lv_names() == sorted(made)
    # The fix the message names: a PV with a big area, the small one set aside
    # (LVM then writes the metadata to the big area only, and so do we count).
    image = small_vg.image.with_name(small_vg.image.stem + "-big.img")
    with open(image, "wb") as f:
        f.truncate(64 * MiB)
    loop = run("losetup", "--find", "--show", str(image)).stdout.strip()
    try:
        run("pvcreate", "--yes", "--metadatasize", "16m", loop)
        run("vgextend", small_vg.name, loop)
        run("pvchange", "--metadataignore", "y", small_vg.loop)
        big = lvm_area(small_vg.name)
        print(f"pvcreate --metadatasize 16m: {big}")
        assert big.size >= 16 * MiB
        assert capacity(plugin) > 0
        made.append(create(plugin, "pvc-one-too-many").volume.volume_id)
        assert small_vg.lv_names() == sorted(made)
    finally:
        for vid in made:
            plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vid), timeout=120)
        run("pvchange", "--metadataignore", "n", small_vg.loop, check=False)
        run("vgreduce", small_vg.name, loop, check=False)
        run("losetup", "--detach", loop, check=False)
        image.unlink(missing_ok=True)
