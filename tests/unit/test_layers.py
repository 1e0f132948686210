"""The layering the code promises, checked on its source. One rule: the
package is a stack of folders, and no module imports one from a folder above
its own. Beside it, the homes that must stay single: LVM commands run only in
storage/, the thin tools only in storage/thin_mappings, transport types
(grpc, protobuf, the generated stubs) appear only in csi/, and host/ knows
nothing of LVM. A change that breaks a rule fails here, before any review."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from csi_local import errors
from csi_local.csi import rpc

SRC = Path(__file__).resolve().parents[2] / "src" / "csi_local"

# Top to bottom. A module may import from its own floor or any floor below.
# The root modules stand where their imports put them: the CLI on top, the
# configuration between the front ends and the volume layer, errors and logs
# at the bottom.
FLOORS: list[set[str]] = [
    {"cli", "__main__"},
    {"csi", "dhv"},  # the two front ends; neither imports the other (below)
    {"ops"},
    {"config"},
    {"nodestate"},
    {"volumes"},
    {"storage"},
    {"host"},
    {"errors", "logs", "version", ""},  # "" is csi_local itself (its __version__)
]
FRONT_ENDS = {"csi", "dhv"}
TRANSPORT = ("grpc", "google.protobuf", "csi_local._gen")
LVM_COMMANDS = {"lvs", "vgs", "pvs", "lvcreate", "lvremove", "lvextend", "lvchange",
                "vgcreate", "vgchange", "vgremove", "lvm", "lvmconfig"}
THIN_TOOLS = {"dmsetup", "thin_dump", "thin_delta", "thin_ls", "thin_check"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        if "_gen" in path.parts:
            continue
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


@functools.cache  # each file parsed and walked once per run, not once per test
def _nodes(path: Path) -> tuple[ast.AST, ...]:
    """Every node of `path`'s syntax tree."""
    return tuple(ast.walk(ast.parse(path.read_text())))


def _imports(path: Path) -> frozenset[str]:
    """Every module `path` imports, at any depth of the file (lazy imports too)."""
    found: set[str] = set()
    for node in _nodes(path):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return frozenset(found)


def _floor_name(module: str) -> str:
    """csi_local.volumes.pool -> "volumes"; csi_local.config -> "config"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _floor(module: str) -> int:
    name = _floor_name(module)
    for i, floor in enumerate(FLOORS):
        if name in floor:
            return i
    raise AssertionError(f"{module} stands on no floor: add its folder to FLOORS")


MODULES = _modules()


def test_every_module_stands_on_a_floor() -> None:
    assert {"csi_local.storage.lvm", "csi_local.volumes.pool", "csi_local.dhv.host_volumes"} \
        <= set(MODULES)
    for name in MODULES:
        _floor(name)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_imports_from_a_floor_above_its_own(name: str) -> None:
    mine = _floor(name)
    ours = {i for i in _imports(MODULES[name])
            if i.startswith("csi_local") and not i.startswith("csi_local._gen")}
    above = {i for i in ours if _floor(i) < mine}
    assert not above, f"{name} imports {sorted(above)} from above"
    if _floor_name(name) in FRONT_ENDS:
        other = FRONT_ENDS - {_floor_name(name)}
        crossing = {i for i in ours if _floor_name(i) in other}
        assert not crossing, f"{name} imports the other front end: {sorted(crossing)}"


@pytest.mark.parametrize("name", sorted(m for m in MODULES if _floor_name(m) != "csi"))
def test_transport_types_stay_in_the_csi_front_end(name: str) -> None:
    """Outside the CSI front end (the CLI above it, the other front end beside
    it, every floor below) no grpc, protobuf or generated stubs: storage
    errors carry no code, the edge chooses it, and `csi-local status` or the
    host volume plugin never load grpc."""
    bad = {i for i in _imports(MODULES[name]) if i.startswith(TRANSPORT)}
    assert not bad, f"{name} imports {sorted(bad)}"


def _argv_heads(path: Path) -> list[tuple[int, str]]:
    heads = []
    for node in _nodes(path):
        if isinstance(node, ast.List) and node.elts:
            first = node.elts[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                heads.append((node.lineno, first.value))
    return heads


@pytest.mark.parametrize("name", sorted(m for m in MODULES if _floor_name(m) != "storage"))
def test_only_storage_runs_lvm_or_the_thin_tools(name: str) -> None:
    """An argv list starting with an LVM tool outside storage/ is a second
    home for LVM; route it through storage.lvm.Lvm."""
    for line, head in _argv_heads(MODULES[name]):
        if head in LVM_COMMANDS | THIN_TOOLS:
            pytest.fail(f"{name}:{line} runs {head}")


@pytest.mark.parametrize("name", sorted(m for m in MODULES if m.startswith("csi_local.storage")
                                        and m != "csi_local.storage.thin_mappings"))
def test_only_thin_mappings_reads_pool_metadata(name: str) -> None:
    """The metadata snapshot dmsetup and thin-provisioning-tools need must be
    reserved and released in one place."""
    for line, head in _argv_heads(MODULES[name]):
        if head in THIN_TOOLS:
            pytest.fail(f"{name}:{line} runs {head}")


# What only LVM's callers know: a VG, an LV, a thin pool by name.
LVM_NOUNS = {"vg", "lv", "pool", "vg_name", "lv_name", "volume_group", "thin_pool"}


@pytest.mark.parametrize("name", sorted(m for m in MODULES if _floor_name(m) == "host"))
def test_host_knows_nothing_of_lvm(name: str) -> None:
    """host/ offers generic reads (bytes of a device, a device-mapper device by
    its name) and named locks; no function of it takes a VG, an LV or a pool:
    LVM's names and layouts (storage/lv_devices.py) and the lock keys
    (volumes/lock_keys.py) are the callers'."""
    for node in _nodes(MODULES[name]):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            named = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
            assert not named & LVM_NOUNS, f"{name}:{node.lineno} {node.name} takes " \
                f"{sorted(named & LVM_NOUNS)}"


def test_storage_errors_carry_no_code() -> None:
    for cls in vars(errors).values():
        if isinstance(cls, type) and issubclass(cls, errors.StorageError):
            assert not hasattr(cls, "code"), cls


@pytest.mark.parametrize(("method", "error", "code"), [
    ("CreateVolume", errors.NoRoom("full"), "RESOURCE_EXHAUSTED"),
    ("CreateSnapshot", errors.NoRoom("full"), "RESOURCE_EXHAUSTED"),
    ("ControllerExpandVolume", errors.NoRoom("full"), "OUT_OF_RANGE"),
    ("NodeExpandVolume", errors.NoRoom("full"), "OUT_OF_RANGE"),
    ("DeleteVolume", errors.VolumeGroupMissing("no vg"), "UNAVAILABLE"),
    ("NodeStageVolume", errors.LvNotFound("gone"), "NOT_FOUND"),
    ("NodeStageVolume", errors.LockBusy("busy"), "ABORTED"),
    ("NodeStageVolume", errors.FormatRefused("used"), "FAILED_PRECONDITION"),
    ("NodeStageVolume", errors.MountOptionError("bind"), "INVALID_ARGUMENT"),
    ("DeleteVolume", errors.VolumeInUse("open"), "FAILED_PRECONDITION"),
    ("CreateVolume", errors.SizeOutOfRange("no size"), "OUT_OF_RANGE"),
    ("CreateVolume", errors.CommandError(["lvcreate"], 3, "", "boom"), "INTERNAL"),
    ("CreateVolume", rpc.AlreadyExists("other"), "ALREADY_EXISTS"),
    ("CreateVolume", errors.NameTaken("other source"), "ALREADY_EXISTS"),
    ("CreateSnapshot", errors.NameTaken("other volume"), "ALREADY_EXISTS"),
    ("CreateVolume", KeyError("x"), "INTERNAL"),
    ("GetMetadataDelta", errors.SnapshotsNotComparable("two volumes"), "INVALID_ARGUMENT"),
    ("GetMetadataDelta", errors.MappingToolsMissing("no thin_delta"), "FAILED_PRECONDITION"),
    ("GetMetadataAllocated", errors.MetadataUnavailable("held"), "UNAVAILABLE"),
    ("GetMetadataAllocated", errors.LvNotFound("gone"), "NOT_FOUND"),
])
def test_codes_are_chosen_at_the_edge_per_rpc(method: str, error: Exception,
                                              code: str) -> None:
    assert rpc.status_of(method, error)[0] == code
