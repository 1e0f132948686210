"""The CSI front end: where a gRPC request enters and its reply leaves.

The server and the plugin's wiring, the RPC edge (error codes chosen for the
wire in one place), request validation, pagination, CSI messages, and one
servicer per CSI service (identity, controller, node, group controller,
snapshot metadata). Servicers validate, call the volume layer below, and
build replies; nothing outside this folder knows gRPC or protobuf.
"""
