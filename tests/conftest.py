"""Top-level test configuration: the VM harness (see tests/harness/vm.py)."""

import os

# Tests fork commands (through csi_local's runner) from processes that also
# hold gRPC channels; gRPC's at-fork handlers abort such children. Set before
# anything imports grpc (csi_local does the same for the plugin itself).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

pytest_plugins = ["tests.harness.vm"]
