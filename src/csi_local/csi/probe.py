"""`csi-local probe`: Identity Probe over the plugin's socket, the answer
printed as JSON. The client side of the CSI front end, kept here so that
grpc and the generated stubs stay in csi/ (the CLI imports this lazily:
`serve`, `status` and `doctor` do not load grpc for it)."""

from __future__ import annotations

import json

import grpc

from csi_local._gen import csi_pb2, csi_pb2_grpc


def probe(endpoint: str, timeout: float) -> int:
    """Print {"ready": bool} (a plugin that leaves `ready` unset is ready, as
    the spec says), or {"error": "CODE: details"}; 0, or 1 on an error."""
    with grpc.insecure_channel(endpoint) as channel:
        stub = csi_pb2_grpc.IdentityStub(channel)
        try:
            reply = stub.Probe(csi_pb2.ProbeRequest(), timeout=timeout, wait_for_ready=True)
        except grpc.RpcError as err:
            print(json.dumps({"error": f"{err.code().name}: {err.details()}"}))
            return 1
    ready = reply.ready.value if reply.HasField("ready") else True
    print(json.dumps({"ready": ready}))
    return 0
