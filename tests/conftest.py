"""Top-level test configuration: the VM harness (see tests/harness/vm.py)."""

import os
import sys

# Tests fork commands (through csi_local's runner) from processes that also
# hold gRPC channels; gRPC's at-fork handlers abort such children. Set before
# anything imports grpc (csi_local does the same for the plugin itself).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

# The README's test command is `.venv/bin/python -m pytest`, with the venv not
# activated. Tools the project installs into the venv (vng and the virtme-*
# helpers it runs by name, hadolint, protoc-gen-mypy, kubernetes-validate) must
# be found by every subprocess the tests and the VM harness start, so the
# interpreter's own bin directory goes first on PATH. sys.executable is not
# resolved: a venv's python is a symlink to the system interpreter.
_BIN = os.path.dirname(os.path.abspath(sys.executable))
_PATH = os.environ.get("PATH") or "/usr/sbin:/usr/bin:/sbin:/bin"
if _PATH.split(os.pathsep)[0] != _BIN:
    os.environ["PATH"] = os.pathsep.join([_BIN, _PATH])

pytest_plugins = ["tests.harness.vm"]
