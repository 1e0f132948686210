"""The layering the code promises, checked on its source: servicers above one
shared volume layer, no servicer importing another, no transport types
below the servicers, and lvm.py the only module that names an LVM command.
A change that breaks a rule fails here, before any review."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from csi_local import errors, rpc

SRC = Path(__file__).resolve().parents[2] / "src" / "csi_local"
SERVICERS = {"csi_local.controller", "csi_local.node", "csi_local.identity",
             "csi_local.snapshot_metadata", "csi_local.group_controller"}
# The RPC edge: may use grpc, protobuf, the generated stubs and rpc's coded errors.
EDGE = SERVICERS | {"csi_local.server", "csi_local.plugin", "csi_local.validation",
                    "csi_local.pagination", "csi_local.rpc", "csi_local.cli",
                    "csi_local.messages"}
TRANSPORT = ("grpc", "google.protobuf", "csi_local._gen", "csi_local.rpc",
             "csi_local.validation")
LVM_COMMANDS = {"lvs", "vgs", "pvs", "lvcreate", "lvremove", "lvextend", "lvchange",
                "vgcreate", "vgchange", "vgremove", "lvm", "lvmconfig"}
THIN_TOOLS = {"dmsetup", "thin_dump", "thin_delta", "thin_ls", "thin_check"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        if "_gen" in path.parts:
            continue
        rel = path.relative_to(SRC.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of the file (lazy imports too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


MODULES = _modules()


def test_the_module_list_is_real() -> None:
    assert {"csi_local.lvm", "csi_local.pool", "csi_local.dhv.plugin"} <= set(MODULES)


@pytest.mark.parametrize("name", sorted(SERVICERS))
def test_no_servicer_imports_another(name: str) -> None:
    imported = _imports(MODULES[name])
    others = {s for s in SERVICERS - {name}
              if any(i == s or i.startswith(s + ".") for i in imported)}
    assert not others, f"{name} imports {others}"


@pytest.mark.parametrize("name", sorted(set(MODULES) - EDGE))
def test_no_transport_types_below_the_servicers(name: str) -> None:
    imported = _imports(MODULES[name])
    bad = {i for i in imported if i.startswith(TRANSPORT)}
    bad |= {i for i in imported for s in SERVICERS if i == s or i.startswith(s + ".")}
    assert not bad, f"{name} imports {sorted(bad)}"


def test_both_plugins_stand_on_the_shared_layer() -> None:
    # The CSI servicers get the pool, locks, fs and lvm through their Backend;
    # the host volume plugin builds the same objects from the same modules.
    shared = {"csi_local.pool", "csi_local.locks", "csi_local.fs", "csi_local.lvm"}
    for servicer in ("csi_local.controller", "csi_local.node"):
        assert "csi_local.backend" in _imports(MODULES[servicer]), servicer
    for user in ("csi_local.backend", "csi_local.dhv.plugin"):
        # The backend reaches LVM through the pools (one per device class).
        wanted = shared - {"csi_local.lvm"} if user == "csi_local.backend" else shared
        imported = _imports(MODULES[user])
        assert {s for s in shared if any(i.startswith(s) for i in imported)} == wanted, user


@pytest.mark.parametrize("name", sorted(set(MODULES) - {"csi_local.lvm"}))
def test_only_lvm_py_names_an_lvm_command(name: str) -> None:
    """An argv list starting with an LVM tool anywhere but lvm.py is a second
    home for LVM; route it through Lvm."""
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.List) and node.elts:
            first = node.elts[0]
            if isinstance(first, ast.Constant) and first.value in LVM_COMMANDS:
                pytest.fail(f"{name}:{node.lineno} runs {first.value}")


@pytest.mark.parametrize("name", sorted(set(MODULES) - {"csi_local.thinmeta"}))
def test_only_thinmeta_py_reads_pool_metadata(name: str) -> None:
    """dmsetup and thin-provisioning-tools have one home too: the metadata
    snapshot they need must be reserved and released in one place."""
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.List) and node.elts:
            first = node.elts[0]
            if isinstance(first, ast.Constant) and first.value in THIN_TOOLS:
                pytest.fail(f"{name}:{node.lineno} runs {first.value}")


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
    ("CreateVolume", KeyError("x"), "INTERNAL"),
    ("GetMetadataDelta", errors.SnapshotsNotComparable("two volumes"), "INVALID_ARGUMENT"),
    ("GetMetadataDelta", errors.MappingToolsMissing("no thin_delta"), "FAILED_PRECONDITION"),
    ("GetMetadataAllocated", errors.MetadataUnavailable("held"), "UNAVAILABLE"),
    ("GetMetadataAllocated", errors.LvNotFound("gone"), "NOT_FOUND"),
])
def test_codes_are_chosen_at_the_edge_per_rpc(method: str, error: Exception,
                                              code: str) -> None:
    assert rpc.status_of(method, error)[0] == code
