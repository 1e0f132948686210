"""Request fields to plain values. Everything a command will see is checked here first.

The RPC edge: this module knows the protobuf types and raises the RPC's own
errors (INVALID_ARGUMENT, OUT_OF_RANGE); what it returns is plain Python,
so nothing below the servicers sees a transport type.
"""

from __future__ import annotations

import os
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from csi_local._gen import csi_pb2 as pb
from csi_local.csi.rpc import InvalidArgument, ResourceExhausted
from csi_local.errors import MountOptionError
from csi_local.host import filesystem_rules as fsrules
from csi_local.host.crypt import Key
from csi_local.volumes import encryption, qos
from csi_local.volumes.node_records import AccessType

Mode = pb.VolumeCapability.AccessMode.Mode
SINGLE_NODE_MODES = frozenset({
    pb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER,
    pb.VolumeCapability.AccessMode.SINGLE_NODE_READER_ONLY,
    pb.VolumeCapability.AccessMode.SINGLE_NODE_SINGLE_WRITER,
    pb.VolumeCapability.AccessMode.SINGLE_NODE_MULTI_WRITER,
})
READ_ONLY_MODES = frozenset({pb.VolumeCapability.AccessMode.SINGLE_NODE_READER_ONLY})
# Keys the CO adds on its own (Kubernetes' external-provisioner and -snapshotter).
CO_PARAMETER_PREFIXES = ("csi.storage.k8s.io/",)
MAX_PATH = 4096
MAX_ID_BYTES = 128
# Unicode categories an ID must not hold: controls (C0, DEL, C1), line and
# paragraph separators.
_BREAKS = frozenset({"Cc", "Zl", "Zp"})
# System trees no staging or target path may lie in (or resolve into).
FORBIDDEN_TREES = ("/dev", "/proc", "/sys", "/etc")


@dataclass(frozen=True)
class Capability:
    access_type: AccessType
    fs_type: str  # "" for block; resolved to the default otherwise
    mount_flags: tuple[str, ...]
    mode: int

    @property
    def read_only_mode(self) -> bool:
        return self.mode in READ_ONLY_MODES


def required(value: str, field: str) -> str:
    if not value:
        raise InvalidArgument(f"{field} is required")
    return value


def object_id(value: str, field: str) -> str:
    """A volume or snapshot ID as a CO sends it, checked before any lock, path
    or command sees it: at most 128 bytes (the spec's limit), no NUL, no
    control characters (C0, DEL, C1) or line separators (U+2028, U+2029), no
    "/" and not "." or "..", so that no ID can ever name a path outside the
    directory it is joined to or break a log line."""
    required(value, field)
    if (len(value.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES or value in (".", "..")
            or "/" in value or any(unicodedata.category(c) in _BREAKS for c in value)):
        raise InvalidArgument(f"{field} {value[:140]!r} is not a valid ID")
    return value


def lexical_path(value: str, field: str) -> str:
    """An absolute, normalised path with no NUL, "..", or oversize (no file-system look-up)."""
    required(value, field)
    if "\x00" in value or len(value) > MAX_PATH:
        raise InvalidArgument(f"{field} is not a valid path")
    if not os.path.isabs(value):
        raise InvalidArgument(f"{field} must be an absolute path, not {value!r}")
    if ".." in value.split("/"):
        raise InvalidArgument(f"{field} must not contain '..'")
    return os.path.normpath(value)


def path(value: str, field: str) -> str:
    """A staging or target path, as the kernel will see it.

    mount(8) follows symlinks while the mount table shows resolved paths, so
    a path is used resolved: symlinked parents (a /var/lib/kubelet that is a
    link, say) resolve, and mounts and their bookkeeping agree. A path that is
    itself a symlink is refused, as is anything that resolves into /dev, /proc,
    /sys or /etc, or to "/": a CO never hands those, an attacker would.
    """
    lexical = lexical_path(value, field)
    if os.path.islink(lexical):
        raise InvalidArgument(f"{field} {lexical} is a symbolic link; refusing to use it")
    real = os.path.realpath(lexical)
    if real == "/" or any(real == p or real.startswith(p + "/") for p in FORBIDDEN_TREES):
        raise InvalidArgument(f"{field} {lexical} resolves to {real}, where volumes are "
                              "never mounted")
    return real


def capability(cap: pb.VolumeCapability, default_fs: str) -> Capability:
    """One capability, or INVALID_ARGUMENT saying what is unsupported."""
    unsupported = capability_problem(cap, default_fs)
    if unsupported:
        raise InvalidArgument(unsupported)
    kind = cap.WhichOneof("access_type")
    mode = cap.access_mode.mode
    if kind == "block":
        return Capability(AccessType.BLOCK, "", (), mode)
    fs_type = cap.mount.fs_type or default_fs
    return Capability(AccessType.MOUNT, fs_type, tuple(cap.mount.mount_flags), mode)


def capability_problem(cap: pb.VolumeCapability, default_fs: str | None) -> str | None:
    """Why this plugin cannot serve `cap`, or None. `default_fs` None: a
    mount capability that names no fs type is left to the class's default,
    which the volume layer checks (volumes/sizes.minimum_size)."""
    kind = cap.WhichOneof("access_type")
    if kind is None:
        return "volume capability needs an access type (mount or block)"
    if not cap.HasField("access_mode") or cap.access_mode.mode == 0:
        return "volume capability needs an access mode"
    mode = cap.access_mode.mode
    if mode not in SINGLE_NODE_MODES:
        name = pb.VolumeCapability.AccessMode.Mode.Name(mode)
        return f"access mode {name} is not supported: volumes are local to one node"
    if kind == "mount":
        fs_type = cap.mount.fs_type or default_fs
        problem = fsrules.filesystem_problem(fs_type) if fs_type is not None else None
        if problem is not None:
            return problem
        try:
            fsrules.check(cap.mount.mount_flags)
        except MountOptionError as err:
            return f"mount flag refused: {err.message}"
    return None


def requested_fs_types(caps: Sequence[pb.VolumeCapability]) -> tuple[str, ...]:
    """The file systems a CreateVolume's capabilities ask for, one per mount
    capability, "" where the class's default is meant (block capabilities ask
    for none); INVALID_ARGUMENT for a capability no class could serve. Which
    class serves the volume, and so what "" means, the volume layer decides."""
    if not caps:
        raise InvalidArgument("volume_capabilities is required")
    for cap in caps:
        problem = capability_problem(cap, None)
        if problem:
            raise InvalidArgument(problem)
    return tuple(c.mount.fs_type for c in caps if c.WhichOneof("access_type") == "mount")


def parameters(params: Mapping[str, str], allowed: Sequence[str] = ()) -> dict[str, str]:
    """Plugin parameters; CO-added keys pass, unknown keys are INVALID_ARGUMENT."""
    own: dict[str, str] = {}
    for key, value in params.items():
        if key.startswith(CO_PARAMETER_PREFIXES):
            continue
        if key not in allowed:
            raise InvalidArgument(f"unknown parameter {key!r}")
        own[key] = value
    return own



def mutable_parameters(params: Mapping[str, str]) -> dict[str, int | None]:
    """A CreateVolume's or ControllerModifyVolume's mutable_parameters: the
    IO limits they set ({io.max key: value, None for `max`}). Only the
    limits can change after a volume is made: any other key, a CO's own
    included, is INVALID_ARGUMENT naming it, and so is a bad value."""
    for key in params:
        if key not in qos.CSI_PARAMETERS:
            raise InvalidArgument(
                f"unknown mutable parameter {key!r} (mutable: {', '.join(qos.CSI_PARAMETERS)})")
    return qos_changes(params)


def qos_changes(params: Mapping[str, str]) -> dict[str, int | None]:
    """The IO limits that parameters name; INVALID_ARGUMENT naming a bad one."""
    try:
        return qos.changes_from(params)
    except ValueError as err:
        raise InvalidArgument(str(err)) from None


# The keys kubelet adds to NodePublishVolume's volume_context when the
# CSIDriver says podInfoOnMount: true (the Kubernetes manifests do).
POD_NAME_KEY = "csi.storage.k8s.io/pod.name"
POD_NAMESPACE_KEY = "csi.storage.k8s.io/pod.namespace"
POD_UID_KEY = "csi.storage.k8s.io/pod.uid"


@dataclass(frozen=True)
class PodInfo:
    """The pod a publish is for, as kubelet names it."""

    name: str
    namespace: str
    uid: str


def pod_info(context: Mapping[str, str]) -> PodInfo | None:
    """The pod of a NodePublishVolume's volume_context, or None where the CO
    sends none (Nomad; a CSIDriver without podInfoOnMount). Informational
    only: any other key of the context is left alone, never refused."""
    if not any(k in context for k in (POD_NAME_KEY, POD_NAMESPACE_KEY, POD_UID_KEY)):
        return None
    return PodInfo(name=context.get(POD_NAME_KEY, ""),
                   namespace=context.get(POD_NAMESPACE_KEY, ""),
                   uid=context.get(POD_UID_KEY, ""))

def encryption_key(secrets: Mapping[str, str]) -> Key | None:
    """The encryption key in a request's secrets (None: none given); a value
    that cannot be a key is INVALID_ARGUMENT, its message naming the secret
    and never its value."""
    try:
        return encryption.key_from(secrets)
    except ValueError as err:
        raise InvalidArgument(str(err)) from None


def encryption_asked(parameters: Mapping[str, str]) -> bool | None:
    """Whether the parameters ask for encryption (None: they do not say, so
    the class's default or the content source decides); INVALID_ARGUMENT
    for a value that is neither luks2 nor none."""
    if encryption.PARAMETER not in parameters:
        return None
    try:
        return encryption.asked(parameters)
    except ValueError as err:
        raise InvalidArgument(str(err)) from None


def capacity_range(rng: pb.CapacityRange | None) -> tuple[int, int]:
    """(required, limit) bytes of a capacity range, 0 where not set; what size
    meets them is the volume layer's rule (sizes.size_for)."""
    req = rng.required_bytes if rng is not None else 0
    lim = rng.limit_bytes if rng is not None else 0
    if req < 0 or lim < 0:
        raise InvalidArgument("capacity_range bytes must not be negative")
    return req, lim


def topology_allows(req: pb.TopologyRequirement | None, key: str, node_id: str) -> None:
    """RESOURCE_EXHAUSTED when the requisite topology excludes this node."""
    if req is None or not req.requisite:
        return
    for topo in req.requisite:
        if topo.segments.get(key) == node_id:
            return
    raise ResourceExhausted(
        f"requisite topology excludes this node ({key}={node_id}): volumes are local"
    )
