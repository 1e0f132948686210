import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.csi import validation
from csi_local.csi.rpc import InvalidArgument, ResourceExhausted
from csi_local.host import filesystem_rules as fsrules

MiB = 1 << 20


def rng(req: int = 0, lim: int = 0) -> pb.CapacityRange:
    return pb.CapacityRange(required_bytes=req, limit_bytes=lim)


@pytest.mark.parametrize(("req", "lim"), [(0, 0), (1, 0), (0, MiB), (5 * MiB, MiB)])
def test_capacity_range_is_its_two_numbers(req: int, lim: int) -> None:
    """Whether a range can be met is the volume layer's rule (sizes.size_for):
    here only what no VG can make right."""
    assert validation.capacity_range(rng(req, lim)) == (req, lim)
    assert validation.capacity_range(None) == (0, 0)


@pytest.mark.parametrize(("req", "lim"), [(-1, 0), (0, -1)])
def test_negative_bytes_invalid(req: int, lim: int) -> None:
    with pytest.raises(InvalidArgument, match="must not be negative"):
        validation.capacity_range(rng(req, lim))


def test_parameters_accept_co_keys_and_name_unknown_key() -> None:
    assert validation.parameters({"csi.storage.k8s.io/pvc/name": "x"}) == {}
    with pytest.raises(InvalidArgument, match="'colour'"):
        validation.parameters({"colour": "blue"})


Mode = pb.VolumeCapability.AccessMode


def mount(fs: str = "ext4", mode: Mode.Mode.ValueType = Mode.SINGLE_NODE_WRITER,
          flags: tuple[str, ...] = ()) -> pb.VolumeCapability:
    return pb.VolumeCapability(
        mount=pb.VolumeCapability.MountVolume(fs_type=fs, mount_flags=list(flags)),
        access_mode=pb.VolumeCapability.AccessMode(mode=mode),
    )


def test_capability_defaults_fs_and_refuses_multi_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fsrules, "mkfs_available", lambda fs: True)
    cap = validation.capability(mount(fs=""), "xfs")
    assert (cap.access_type, cap.fs_type) == ("mount", "xfs")
    with pytest.raises(InvalidArgument, match="MULTI_NODE_MULTI_WRITER"):
        validation.capability(
            mount(mode=pb.VolumeCapability.AccessMode.MULTI_NODE_MULTI_WRITER), "ext4")
    with pytest.raises(InvalidArgument, match="vfat"):
        validation.capability(mount(fs="vfat"), "ext4")
    with pytest.raises(InvalidArgument, match="mount flag"):
        validation.capability(mount(flags=("a b",)), "ext4")
    with pytest.raises(InvalidArgument, match="access mode"):
        validation.capability(pb.VolumeCapability(block=pb.VolumeCapability.BlockVolume()), "ext4")


def test_missing_mkfs_makes_fs_unsupported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fsrules, "mkfs_available", lambda fs: fs != "btrfs")
    assert validation.capability_problem(mount(fs="btrfs"), "ext4") is not None
    assert validation.capability_problem(mount(fs="ext4"), "ext4") is None


@pytest.mark.parametrize("bad", ["relative/path", "/a/../b", "/a\x00b", ""])
def test_paths_must_be_absolute_and_clean(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        validation.path(bad, "target_path")


def test_path_normalised() -> None:
    assert validation.path("/a//b/./c/", "p") == "/a/b/c"


def test_topology_requisite() -> None:
    key = "topology.x/node"
    here = pb.TopologyRequirement(requisite=[pb.Topology(segments={key: "n1"})])
    validation.topology_allows(here, key, "n1")
    validation.topology_allows(None, key, "n1")
    elsewhere = pb.TopologyRequirement(requisite=[pb.Topology(segments={key: "n2"})])
    with pytest.raises(ResourceExhausted):
        validation.topology_allows(elsewhere, key, "n1")
