"""The request Nomad hands the host volume plugin in its environment, and the
volume's parameters, validated. No processes, no LVM.

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
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from csi_local.errors import MountOptionError
from csi_local.host import filesystem_rules as fsrules
from csi_local.volumes import encryption
from csi_local.volumes.device_classes import check_class_name
from csi_local.volumes.host_volume_names import LV_PREFIX, SNAPSHOT_LV_PREFIX

OPERATIONS = ("fingerprint", "create", "delete")
DEVICE_CLASS = "device_class"  # the parameter that names a volume's device class
PARAMETERS = ("fs_type", "mount_options", "source_volume", "source_snapshot", "attachment_mode",
              DEVICE_CLASS, "encryption")
_MAX_SOURCE = 256  # a Nomad volume name or ID, or a snapshot name

_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_INT_RE = re.compile(r"[0-9]{1,20}")


class DhvError(Exception):
    """A failure reported to Nomad as {"error": message} with a non-zero exit."""


@dataclass(frozen=True)
class Parameters:
    fs_type: str | None  # None: the configured default (or the existing volume's)
    mount_options: tuple[str, ...]
    source_volume: str | None = None  # a host volume's Nomad ID or name: clone it
    source_snapshot: str | None = None  # a snapshot's name: clone it
    # The device class (pool) of a new volume; None: the default class, or a
    # clone's source's class. Never moves an existing volume.
    device_class: str | None = None
    # LUKS2 (docs/encryption.md): True/False as the parameter says ("luks2" /
    # "none"); None when it says nothing (the class's default, or a clone's
    # source's).
    encryption: bool | None = None

    @property
    def source(self) -> tuple[str, str] | None:
        """("volume" | "snapshot", what the parameter names), or None."""
        if self.source_volume is not None:
            return ("volume", self.source_volume)
        if self.source_snapshot is not None:
            return ("snapshot", self.source_snapshot)
        return None


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


_ID_RULE = "letters, digits, '.', '_' and '-', at most 128, starting with a letter or digit"


def _checked_id(value: str, what: str, noun: str) -> str:
    """`value` if it is a volume ID or snapshot name: safe in a path, a tag and
    a log line."""
    if not _ID_RE.fullmatch(value) or ".." in value:
        raise DhvError(f"{what} {value!r} is not {noun} ({_ID_RULE})")
    return value


def _hashed(prefix: str, value: str) -> str:
    return prefix + hashlib.sha256(value.encode()).hexdigest()[:32]


def check_volume_id(volume_id: str) -> str:
    return _checked_id(volume_id, "DHV_VOLUME_ID", "a volume ID")


def lv_name_for(volume_id: str) -> str:
    """The LV name: a hash of the (validated) Nomad volume ID."""
    return _hashed(LV_PREFIX, check_volume_id(volume_id))


def check_snapshot_name(name: str) -> str:
    return _checked_id(name, "snapshot name", "valid")


def snapshot_lv_name(name: str) -> str:
    """A snapshot's LV name: a hash of its (validated) name, in its own prefix
    (never a volume's LV name, whatever the two names are)."""
    return _hashed(SNAPSHOT_LV_PREFIX, check_snapshot_name(name))


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
    if not _INT_RE.fullmatch(raw):
        raise DhvError(f"{key} must be a whole number of bytes, not {raw!r}")
    return int(raw)


def parse_mount_options(text: str) -> tuple[str, ...]:
    opts = [o.strip() for o in fsrules.split(text) if o.strip()]
    try:
        return tuple(fsrules.check(opts))
    except MountOptionError as err:
        raise DhvError(err.message) from None


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
    if fs_type is not None and fs_type not in fsrules.SUPPORTED_FS:
        raise DhvError(f"unsupported fs_type {fs_type!r}; "
                       f"supported: {', '.join(fsrules.SUPPORTED_FS)}")
    _check_attachment_mode(data.get("attachment_mode") or "file-system")
    source_volume = _source(data, "source_volume")
    source_snapshot = _source(data, "source_snapshot")
    if source_volume is not None and source_snapshot is not None:
        raise DhvError("give source_volume or source_snapshot, not both")
    if source_snapshot is not None:
        check_snapshot_name(source_snapshot)
    return Parameters(fs_type=fs_type, mount_options=parse_mount_options(
        data.get("mount_options", "")), source_volume=source_volume,
        source_snapshot=source_snapshot, device_class=_device_class(data),
        encryption=_encryption(data))


def _encryption(data: Mapping[str, str]) -> bool | None:
    if "encryption" not in data:
        return None
    try:
        return encryption.asked(data)
    except ValueError as err:
        raise DhvError(str(err)) from None


def _device_class(data: Mapping[str, str]) -> str | None:
    value = data.get(DEVICE_CLASS, "").strip()
    if not value:
        return None
    try:
        return check_class_name(value)
    except ValueError:
        raise DhvError(f"parameter device_class {value[:64]!r} is not a device class name "
                       "(1 to 63 lower-case letters, digits and '-', starting and ending "
                       "with a letter or digit)") from None


def _source(data: Mapping[str, str], key: str) -> str | None:
    value = data.get(key, "").strip()
    if not value:
        return None
    if len(value) > _MAX_SOURCE or any(ord(c) < 32 for c in value):
        raise DhvError(f"parameter {key} {value[:64]!r} is not a volume ID, name or snapshot name")
    return value


def _check_attachment_mode(mode: str) -> None:
    """Nomad does not support block-device host volumes: it never passes a
    volume's capability to the plugin (no DHV_* variable holds it), and its
    client gives a host volume to a task as a bind mount of the path, a
    directory, whatever the capability says; task drivers add no device
    cgroup rule for it. A volume asked for as a raw device is refused here
    rather than handed out as a file system."""
    if mode == "file-system":
        return
    if mode == "block-device":
        raise DhvError(
            "attachment_mode block-device is not supported: Nomad gives host volumes to "
            "tasks as bind-mounted directories and never tells the plugin a volume's "
            "capability, so a raw LV could not reach a task; use the CSI plugin "
            "(csi-local) for block volumes"
        )
    raise DhvError(f"unknown attachment_mode {mode!r}; supported: file-system")


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


def ok_json(path: str, size: int) -> str:
    return json.dumps({"path": path, "bytes": size})

