"""The checked-in stubs are exactly what proto/csi.proto generates."""

import filecmp
import hashlib
import importlib
import importlib.util
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GEN = REPO / "src" / "csi_local" / "_gen"
# grpc_tools ships no types: imported by name, it is a module of Any
protoc = importlib.import_module("grpc_tools.protoc")


def test_proto_is_upstream_v1_12() -> None:
    # sha256 of csi.proto as released in container-storage-interface/spec v1.12.0
    data = (REPO / "proto" / "csi.proto").read_bytes()
    assert hashlib.sha256(data).hexdigest() == (
        "5b81236a3809f3ff0b877ff9b82215d0b74a8e291d7f3ec6ee1a44f537c0f86a"
    )


def test_checked_in_stubs_match_the_proto(tmp_path: Path) -> None:
    if shutil.which("protoc-gen-mypy") is None:
        pytest.fail("protoc-gen-mypy (mypy-protobuf) is required to check the stubs")
    proto_dir = tmp_path / "in" / "csi_local" / "_gen"
    proto_dir.mkdir(parents=True)
    shutil.copy(REPO / "proto" / "csi.proto", proto_dir / "csi.proto")
    out = tmp_path / "out"
    out.mkdir()
    spec = importlib.util.find_spec("grpc_tools")
    assert spec is not None and spec.origin is not None
    include = str(Path(spec.origin).parent / "_proto")
    rc = protoc.main([
        "protoc", f"-I{tmp_path / 'in'}", f"-I{include}",
        f"--python_out={out}", f"--mypy_out={out}", f"--grpc_python_out={out}",
        f"--mypy_grpc_out={out}", "csi_local/_gen/csi.proto",
    ])
    assert rc == 0
    for name in ("csi_pb2.py", "csi_pb2.pyi", "csi_pb2_grpc.py", "csi_pb2_grpc.pyi"):
        assert filecmp.cmp(out / "csi_local" / "_gen" / name, GEN / name, shallow=False), name
