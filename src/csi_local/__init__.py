"""csi-local: a CSI plugin for node-local block storage on LVM thin pools."""

import os

from csi_local.version import __version__ as __version__  # its one home

# The plugin runs lvm, mkfs and mount from a multi-threaded gRPC server, and
# starting a process forks. gRPC's own at-fork handlers then run in the child while
# other threads are inside gRPC, and the child crashes (SIGSEGV, seen under
# load). The children exec at once and never use gRPC, so the handlers are
# not needed. This must be set before grpc is first imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
