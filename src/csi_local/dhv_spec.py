"""Pure logic of the Nomad dynamic host volume plugin: the request Nomad passes
in its environment, the volume's parameters, the plugin's configuration file,
LV names and tags, and the size arithmetic. No processes, no LVM.

Nomad (client/hostvolumemanager/host_volume_plugin.go) runs the plugin with
`$1` = fingerprint|create|delete and an environment holding only DHV_*
variables. Create gets DHV_OPERATION, DHV_VOLUMES_DIR, DHV_PLUGIN_DIR,
DHV_NODE_POOL, DHV_NAMESPACE, DHV_VOLUME_NAME, DHV_VOLUME_ID, DHV_NODE_ID,
DHV_CAPACITY_MIN_BYTES, DHV_CAPACITY_MAX_BYTES and DHV_PARAMETERS (JSON of a
string map, "null" when empty); delete gets the same without the capacities,
plus DHV_CREATED_PATH (the path create reported; on the clean-up after a
failed client state write it is the volumes directory itself, so it is never
trusted as "the volume").
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from csi_local import fsrules

PLUGIN_ID = "csi-local-dhv"
CONFIG_SUFFIX = ".json"
DEFAULT_LOCK_DIR = "/run/lock/csi-local"  # the CSI plugin's default: shared locks
DEFAULT_SIZE = 1 << 30
DEFAULT_TIMEOUT = 55.0  # Nomad kills create/delete after 60 s
FS_TYPES = fsrules.SUPPORTED_FS
FS_MIN_SIZE = fsrules.MIN_SIZE
OPERATIONS = ("fingerprint", "create", "delete")

LV_PREFIX = "dhv-"
TAG_KIND = "csi-local-dhv.kind"
KIND_VOLUME = "volume"
TAG_ID = "csi-local-dhv.id"  # the Nomad volume ID, verbatim (validated)
TAG_NAME = "csi-local-dhv.name"  # the Nomad volume name, hex-encoded
TAG_NAMESPACE = "csi-local-dhv.namespace"  # hex-encoded
TAG_FS = "csi-local-dhv.fs"  # the file system the volume was made with
TAG_FRESH = "csi-local-dhv.fresh"  # never formatted: mkfs is allowed
TAG_GROW_FS = "csi-local-dhv.grow-fs"  # extended, fs not yet grown
_MAX_HEX_TAG = 512  # hex characters; longer names are not recorded

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_LV_RE = re.compile(r"^dhv-[0-9a-f]{32}$")
_INT_RE = re.compile(r"^[0-9]{1,20}$")
_SIZE_RE = re.compile(r"^(\d+)\s*([KMGT]i?B?|B)?$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_LVM_NAME_RE = re.compile(r"^[A-Za-z0-9+_.][A-Za-z0-9+_.-]{0,126}$")
PARAMETERS = ("fs_type", "mount_options")


class DhvError(Exception):
    """A failure reported to Nomad as {"error": message} with a non-zero exit."""


# --- the request -------------------------------------------------------------


@dataclass(frozen=True)
class Parameters:
    fs_type: str | None  # None: the configured default (or the existing volume's)
    mount_options: tuple[str, ...]


@dataclass(frozen=True)
class Request:
    operation: str
    volume_id: str
    volumes_dir: str
    plugin_dir: str
    volume_name: str
    namespace: str
    node_id: str
    node_pool: str
    capacity_min: int
    capacity_max: int
    parameters: Parameters | None  # None on delete: never needed, never validated
    created_path: str

    @property
    def lv_name(self) -> str:
        return lv_name_for(self.volume_id)

    @property
    def path(self) -> str:
        """Where the volume is mounted: DHV_VOLUMES_DIR/<volume id>."""
        return os.path.join(self.volumes_dir, self.volume_id)


def check_volume_id(volume_id: str) -> str:
    if not _ID_RE.match(volume_id) or ".." in volume_id:
        raise DhvError(
            f"DHV_VOLUME_ID {volume_id!r} is not a volume ID "
            "(letters, digits, '.', '_' and '-', at most 128)"
        )
    return volume_id


def lv_name_for(volume_id: str) -> str:
    """The LV name: a hash of the (validated) Nomad volume ID."""
    digest = hashlib.sha256(check_volume_id(volume_id).encode()).hexdigest()[:32]
    return LV_PREFIX + digest


def is_dhv_lv_name(name: str) -> bool:
    return bool(_LV_RE.match(name))


def _abs_dir(env: Mapping[str, str], key: str) -> str:
    raw = env.get(key, "")
    if not raw:
        raise DhvError(f"{key} is not set")
    if "\0" in raw or not os.path.isabs(raw):
        raise DhvError(f"{key} must be an absolute path, not {raw!r}")
    norm = os.path.normpath(raw)
    if norm == "/":
        raise DhvError(f"{key} must not be /")
    return norm


def _bytes(env: Mapping[str, str], key: str) -> int:
    raw = env.get(key, "").strip()
    if not raw:
        return 0
    if not _INT_RE.match(raw):
        raise DhvError(f"{key} must be a whole number of bytes, not {raw!r}")
    return int(raw)


def parse_mount_options(text: str) -> tuple[str, ...]:
    opts = [o.strip() for o in text.split(",") if o.strip()]
    try:
        return tuple(fsrules.check(opts))
    except fsrules.MountOptionError as err:
        raise DhvError(str(err)) from None


def parse_parameters(raw: str) -> Parameters:
    """DHV_PARAMETERS: a JSON object of strings ("null" or empty: none)."""
    text = raw.strip()
    data: object = None
    if text:
        try:
            data = json.loads(text)
        except ValueError as err:
            raise DhvError(f"DHV_PARAMETERS is not JSON: {err}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise DhvError("DHV_PARAMETERS must be a JSON object")
    unknown = sorted(set(data) - set(PARAMETERS))
    if unknown:
        raise DhvError(
            f"unknown parameter(s) {', '.join(map(repr, unknown))}; "
            f"supported: {', '.join(PARAMETERS)}"
        )
    for key, value in data.items():
        if not isinstance(value, str):
            raise DhvError(f"parameter {key!r} must be a string")
    fs_type = data.get("fs_type") or None
    if fs_type is not None and fs_type not in FS_TYPES:
        raise DhvError(f"unsupported fs_type {fs_type!r}; supported: {', '.join(FS_TYPES)}")
    return Parameters(fs_type=fs_type, mount_options=parse_mount_options(
        data.get("mount_options", "")))


def parse_request(operation: str, env: Mapping[str, str], argv0: str = "") -> Request:
    """The create/delete request from Nomad's environment (validated)."""
    if operation not in ("create", "delete"):
        raise DhvError(f"unknown operation {operation!r}; expected one of {OPERATIONS}")
    env_op = env.get("DHV_OPERATION", "")
    if env_op and env_op != operation:
        raise DhvError(f"argument {operation!r} and DHV_OPERATION {env_op!r} disagree")
    volume_id = check_volume_id(env.get("DHV_VOLUME_ID", ""))
    volumes_dir = _abs_dir(env, "DHV_VOLUMES_DIR")
    if env.get("DHV_PLUGIN_DIR"):
        plugin_dir = _abs_dir(env, "DHV_PLUGIN_DIR")
    elif argv0 and os.path.isabs(argv0):
        plugin_dir = os.path.dirname(argv0)
    else:
        raise DhvError("DHV_PLUGIN_DIR is not set")
    cap_min = cap_max = 0
    params: Parameters | None = None
    if operation == "create":
        cap_min = _bytes(env, "DHV_CAPACITY_MIN_BYTES")
        cap_max = _bytes(env, "DHV_CAPACITY_MAX_BYTES")
        if cap_max and cap_min > cap_max:
            raise DhvError(
                f"DHV_CAPACITY_MIN_BYTES {cap_min} exceeds DHV_CAPACITY_MAX_BYTES {cap_max}"
            )
        params = parse_parameters(env.get("DHV_PARAMETERS", ""))
    return Request(
        operation=operation,
        volume_id=volume_id,
        volumes_dir=volumes_dir,
        plugin_dir=plugin_dir,
        volume_name=env.get("DHV_VOLUME_NAME", ""),
        namespace=env.get("DHV_NAMESPACE", ""),
        node_id=env.get("DHV_NODE_ID", ""),
        node_pool=env.get("DHV_NODE_POOL", ""),
        capacity_min=cap_min,
        capacity_max=cap_max,
        parameters=params,
        created_path=env.get("DHV_CREATED_PATH", ""),
    )


# --- configuration ------------------------------------------------------------


@dataclass(frozen=True)
class PluginConfig:
    volume_group: str
    thin_pool: str
    fs_type: str = "ext4"
    lock_dir: str = DEFAULT_LOCK_DIR
    overprovision_ratio: float = 1.0
    default_size: int = DEFAULT_SIZE
    timeout_seconds: float = DEFAULT_TIMEOUT

    def __post_init__(self) -> None:
        for key in ("volume_group", "thin_pool"):
            value = getattr(self, key)
            if not isinstance(value, str) or not _LVM_NAME_RE.match(value):
                raise DhvError(f"config: {key} {value!r} is not an LVM name")
        if self.fs_type not in FS_TYPES:
            raise DhvError(f"config: unsupported fs_type {self.fs_type!r}")
        if not isinstance(self.lock_dir, str) or not os.path.isabs(self.lock_dir):
            raise DhvError(f"config: lock_dir {self.lock_dir!r} must be an absolute path")
        ratio = self.overprovision_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not ratio >= 1.0:
            raise DhvError("config: overprovision_ratio must be a number >= 1.0")
        if isinstance(self.default_size, bool) or not isinstance(self.default_size, int) \
                or self.default_size <= 0:
            raise DhvError("config: default_size must be a positive size")
        timeout = self.timeout_seconds
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) \
                or not 0 < timeout <= 3600:
            raise DhvError("config: timeout_seconds must be a number in (0, 3600]")

    def to_json(self) -> dict[str, object]:
        return {
            "volume_group": self.volume_group,
            "thin_pool": self.thin_pool,
            "fs_type": self.fs_type,
            "lock_dir": self.lock_dir,
            "overprovision_ratio": self.overprovision_ratio,
            "default_size": self.default_size,
            "timeout_seconds": self.timeout_seconds,
        }


def parse_size(value: object) -> int:
    """Bytes from 1073741824, "1073741824", "512M", "1G" or "1GiB" (binary units)."""
    if isinstance(value, bool):
        raise DhvError(f"invalid size {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value.strip())
        if m:
            return int(m.group(1)) * _UNITS[(m.group(2) or "").upper()[:1]]
    raise DhvError(f"invalid size {value!r}")


def parse_config(text: str, source: str = "config") -> PluginConfig:
    try:
        data = json.loads(text)
    except ValueError as err:
        raise DhvError(f"{source} is not JSON: {err}") from None
    if not isinstance(data, dict):
        raise DhvError(f"{source} must hold a JSON object")
    allowed = set(PluginConfig.__dataclass_fields__)
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise DhvError(f"{source}: unknown key(s) {', '.join(map(repr, unknown))}")
    missing = sorted({"volume_group", "thin_pool"} - set(data))
    if missing:
        raise DhvError(f"{source}: missing {', '.join(missing)}")
    if "default_size" in data:
        data["default_size"] = parse_size(data["default_size"])
    try:
        return PluginConfig(**data)
    except DhvError as err:
        raise DhvError(f"{source}: {err}".replace("config: ", "")) from None


def config_path(plugin_dir: str, argv0: str) -> str:
    """<plugin dir>/<plugin id>.json, the plugin ID being the executable's name
    (so two installs under different names may drive different pools)."""
    name = os.path.basename(argv0) if argv0 else ""
    if not name or name.startswith(".") or "\0" in name:
        name = PLUGIN_ID
    return os.path.join(plugin_dir, name + CONFIG_SUFFIX)


def load_config(plugin_dir: str, argv0: str) -> PluginConfig:
    path = config_path(plugin_dir, argv0)
    if not os.path.exists(path) and os.path.basename(path) != PLUGIN_ID + CONFIG_SUFFIX:
        path = os.path.join(plugin_dir, PLUGIN_ID + CONFIG_SUFFIX)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise DhvError(
            f"no configuration at {path}: run `csi-local-dhv install` or write it"
        ) from None
    except OSError as err:
        raise DhvError(f"cannot read {path}: {err.strerror}") from None
    return parse_config(text, path)


# --- tags and sizes ---------------------------------------------------------------


def _hex_tag(key: str, value: str) -> list[str]:
    encoded = value.encode("utf-8", "surrogateescape").hex()
    if not encoded or len(encoded) > _MAX_HEX_TAG:
        return []
    return [f"{key}={encoded}"]


def volume_tags(req: Request, fs_type: str) -> list[str]:
    """Tags of a new volume: its own namespace, never the CSI plugin's."""
    return [
        f"{TAG_KIND}={KIND_VOLUME}",
        f"{TAG_ID}={req.volume_id}",
        f"{TAG_FS}={fs_type}",
        TAG_FRESH,
        *_hex_tag(TAG_NAME, req.volume_name),
        *_hex_tag(TAG_NAMESPACE, req.namespace),
    ]


def decode_hex_tag(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return bytes.fromhex(value).decode("utf-8", "surrogateescape")
    except ValueError:
        return None


def size_for_new(cap_min: int, cap_max: int, extent: int, *, default: int,
                 minimum: int = 0) -> int:
    """The size of a new volume: capacity_min rounded up to whole extents; with
    no minimum, the default (capped by capacity_max); never below `minimum`."""
    if cap_min:
        size = _round_up(max(cap_min, minimum), extent)
    elif cap_max:
        size = max(min(default, cap_max // extent * extent), _round_up(minimum, extent))
    else:
        size = _round_up(max(default, minimum), extent)
    if cap_max and size > cap_max:
        raise DhvError(
            f"no size between capacity_min {cap_min} and capacity_max {cap_max} bytes: "
            f"sizes are whole extents of {extent} bytes"
            + (f" and at least {minimum} bytes" if minimum else "")
        )
    return size


def resize_target(current: int, cap_min: int, cap_max: int, extent: int) -> int:
    """The size an existing volume should have: `current` when it already meets
    the capacity range, larger when capacity_min grew. Shrinking is refused."""
    if cap_max and cap_max < current:
        raise DhvError(
            f"the volume is {current} bytes and capacity_max is {cap_max}: "
            "shrinking a volume is not supported (raise capacity_max to at least "
            f"{current}, or delete and re-create the volume)"
        )
    if cap_min <= current:
        return current
    size = _round_up(cap_min, extent)
    if cap_max and size > cap_max:
        raise DhvError(
            f"cannot grow to capacity_min {cap_min} bytes within capacity_max {cap_max}: "
            f"sizes are whole extents of {extent} bytes"
        )
    return size


def _round_up(size: int, unit: int) -> int:
    return max(1, math.ceil(size / unit)) * unit


def ok_json(path: str, size: int) -> str:
    return json.dumps({"path": path, "bytes": size})


def error_json(message: str) -> str:
    return json.dumps({"error": message})
