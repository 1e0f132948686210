"""csi-local's conformance suite for CSI plugins (``python -m sanity --endpoint ...``).

The suite only talks gRPC to the endpoint it is given, through the generated CSI v1.12.0
stubs, so it can be pointed at any CSI plugin.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:  # the stubs ship with csi-local; fall back to the source tree when not installed
    from csi_local._gen import csi_pb2, csi_pb2_grpc
except ImportError:  # pragma: no cover - depends on how the suite is run
    _src = Path(__file__).resolve().parent.parent / "src"
    if (_src / "csi_local" / "_gen").is_dir():
        sys.path.insert(0, str(_src))
    from csi_local._gen import csi_pb2, csi_pb2_grpc

SUITE_DIR = Path(__file__).resolve().parent
TESTS_DIR = SUITE_DIR / "tests"

__all__ = ["SUITE_DIR", "TESTS_DIR", "csi_pb2", "csi_pb2_grpc"]
