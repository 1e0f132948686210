"""The host volume plugin's configuration file: <plugin dir>/<plugin id>.json,
written by `csi-local-dhv install`. No processes, no LVM.

The pools come one of two ways: `volume_group` and `thin_pool` (one device
class, named `default`, as the CSI plugin's flags make it), or `classes_file`,
the CSI plugin's device classes file (TOML, csi_local.volumes.device_classes), whose classes
that set no `overprovision_ratio` or `default_fs_type` get this file's
`overprovision_ratio` and `fs_type`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

from csi_local.dhv.request import DhvError
from csi_local.host import filesystem_rules as fsrules
from csi_local.host.locks import DEFAULT_LOCK_DIR
from csi_local.storage.lvm import check_name
from csi_local.volumes.device_classes import (
    ClassConfigError,
    DeviceClasses,
    load_classes,
    single_class,
)
from csi_local.volumes.pool import PoolPolicy
from csi_local.volumes.sizes import parse_size as _parse_size

PLUGIN_ID = "csi-local-dhv"
CONFIG_SUFFIX = ".json"
DEFAULT_SIZE = 1 << 30
# Nomad's client gives a host volume plugin's create and delete one minute
# (the request context of client/host_volume_endpoint.go), then cancels it
# and kills the plugin. A budget must end before that, so the plugin reports
# its own error and undoes its half-made work; one as long or longer would
# never be used.
NOMAD_OPERATION_LIMIT = 60.0
DEFAULT_TIMEOUT = 55.0
# A caller other than Nomad (a script, the project's tests in a VM under
# software emulation, where one create takes minutes) may wait longer; it says
# so with caller_deadline_seconds, never above an hour.
MAX_CALLER_DEADLINE = 3600.0


@dataclass(frozen=True)
class PluginConfig:
    # One pool (volume_group and thin_pool), or the device classes of a file
    # (classes_file, below): exactly one of the two.
    volume_group: str = ""
    thin_pool: str = ""
    fs_type: str = "ext4"
    lock_dir: str = DEFAULT_LOCK_DIR
    overprovision_ratio: float = 1.0
    default_size: int = DEFAULT_SIZE
    timeout_seconds: float = DEFAULT_TIMEOUT
    # How long the caller waits before it cancels a create or delete: Nomad's
    # fixed minute unless the caller is not Nomad. timeout_seconds ends first.
    caller_deadline_seconds: float = NOMAD_OPERATION_LIMIT
    # The CSI plugin's high-water marks (--pool-*-limit-percent): Nomad places
    # host volumes without a capacity check, so this plugin must refuse too.
    pool_data_limit_percent: float = 90.0
    pool_metadata_limit_percent: float = 90.0
    # The CSI plugin's device classes file (TOML, csi_local.volumes.device_classes; absolute).
    classes_file: str = ""
    # Encrypted volumes' keys (docs/encryption.md): key files by "volume:<Nomad
    # volume ID>" or "class:<device class>" (absolute paths, root's, mode 0600
    # or stricter); a volume's own wins over its class's.
    encryption_key_files: dict[str, str] = field(default_factory=dict)
    # The device classes, read once (from classes_file) when the configuration is.
    classes: DeviceClasses = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.classes_file, str):
            raise DhvError(f"config: classes_file {self.classes_file!r} must be a path")
        if self.classes_file:
            if self.volume_group or self.thin_pool:
                raise DhvError("config: give classes_file or volume_group and thin_pool, "
                               "not both (the file's classes name their volume groups "
                               "and thin pools)")
            if "\0" in self.classes_file or not os.path.isabs(self.classes_file):
                raise DhvError(f"config: classes_file {self.classes_file!r} must be an "
                               "absolute path")
        else:
            missing = [k for k in ("volume_group", "thin_pool") if not getattr(self, k)]
            if missing:
                raise DhvError(f"config: missing {', '.join(missing)} (or give classes_file, "
                               "a device classes file)")
            for key in ("volume_group", "thin_pool"):
                value = getattr(self, key)
                try:
                    check_name(value if isinstance(value, str) else "")
                except ValueError:
                    raise DhvError(f"config: {key} {value!r} is not an LVM name") from None
        if self.fs_type not in fsrules.SUPPORTED_FS:
            raise DhvError(f"config: unsupported fs_type {self.fs_type!r}")
        if not isinstance(self.lock_dir, str) or not os.path.isabs(self.lock_dir):
            raise DhvError(f"config: lock_dir {self.lock_dir!r} must be an absolute path")
        ratio = self.overprovision_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not ratio >= 1.0:
            raise DhvError("config: overprovision_ratio must be a number >= 1.0")
        if isinstance(self.default_size, bool) or not isinstance(self.default_size, int) \
                or self.default_size <= 0:
            raise DhvError("config: default_size must be a positive size")
        deadline = self.caller_deadline_seconds
        if isinstance(deadline, bool) or not isinstance(deadline, int | float) \
                or not 0 < deadline <= MAX_CALLER_DEADLINE:
            raise DhvError(f"config: caller_deadline_seconds must be a number above 0 and at "
                           f"most {MAX_CALLER_DEADLINE:g}")
        timeout = self.timeout_seconds
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) \
                or not 0 < timeout < deadline:
            if deadline == NOMAD_OPERATION_LIMIT:
                raise DhvError(f"config: timeout_seconds must be a number above 0 and below "
                               f"{NOMAD_OPERATION_LIMIT:g}: Nomad cancels a host volume create "
                               f"or delete after {NOMAD_OPERATION_LIMIT:g} s, so a longer "
                               "budget would never be used")
            raise DhvError(f"config: timeout_seconds must be a number above 0 and below "
                           f"caller_deadline_seconds ({deadline:g})")
        for key in ("pool_data_limit_percent", "pool_metadata_limit_percent"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not 0 < value <= 100:
                raise DhvError(f"config: {key} must be a percentage in (0, 100]")
        keys = self.encryption_key_files
        if not isinstance(keys, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in keys.items()):
            raise DhvError("config: encryption_key_files must map names to paths")
        for name, path in keys.items():
            if not name.startswith(("volume:", "class:")) or name.endswith(":"):
                raise DhvError(f"config: encryption_key_files: {name!r} must be "
                               "\"volume:<volume ID>\" or \"class:<device class>\"")
            if "\0" in path or not os.path.isabs(path):
                raise DhvError(f"config: encryption_key_files: {name!r}: {path!r} must be an "
                               "absolute path")
        object.__setattr__(self, "classes", self._read_classes())

    def _read_classes(self) -> DeviceClasses:
        """The classes of classes_file, or the one class of volume_group and
        thin_pool (named `default`)."""
        if not self.classes_file:
            return single_class(self.volume_group, self.thin_pool,
                                overprovision_ratio=float(self.overprovision_ratio),
                                default_fs_type=self.fs_type)
        try:
            return load_classes(self.classes_file,
                                overprovision_ratio=float(self.overprovision_ratio),
                                default_fs_type=self.fs_type)
        except ClassConfigError as err:  # says the file (and line)
            raise DhvError(f"config: classes_file: {err}") from None

    def key_file(self, volume_id: str, device_class: str) -> str | None:
        """The key file of a host volume: its own, else its class's (None: none)."""
        keys = self.encryption_key_files
        return keys.get(f"volume:{volume_id}") or keys.get(f"class:{device_class}")

    @property
    def pool_policy(self) -> PoolPolicy:
        return PoolPolicy(data_limit=self.pool_data_limit_percent,
                          metadata_limit=self.pool_metadata_limit_percent)

    def to_json(self) -> dict[str, object]:
        where: dict[str, object] = (
            {"classes_file": self.classes_file} if self.classes_file
            else {"volume_group": self.volume_group, "thin_pool": self.thin_pool})
        return {
            **where,
            "fs_type": self.fs_type,
            "lock_dir": self.lock_dir,
            "overprovision_ratio": self.overprovision_ratio,
            "default_size": self.default_size,
            "timeout_seconds": self.timeout_seconds,
            **({"caller_deadline_seconds": self.caller_deadline_seconds}
               if self.caller_deadline_seconds != NOMAD_OPERATION_LIMIT else {}),
            "pool_data_limit_percent": self.pool_data_limit_percent,
            "pool_metadata_limit_percent": self.pool_metadata_limit_percent,
            **({"encryption_key_files": dict(self.encryption_key_files)}
               if self.encryption_key_files else {}),
        }


def parse_size(value: object) -> int:
    """Bytes from 1073741824, "1073741824", "512M", "1G" or "1GiB" (sizes.parse_size)."""
    if not isinstance(value, str | int):
        raise DhvError(f"invalid size {value!r}")
    try:
        return _parse_size(value)
    except ValueError:
        raise DhvError(f"invalid size {value!r}") from None


def parse_config(text: str, source: str = "config") -> PluginConfig:
    try:
        data = json.loads(text)
    except ValueError as err:
        raise DhvError(f"{source} is not JSON: {err}") from None
    if not isinstance(data, dict):
        raise DhvError(f"{source} must hold a JSON object")
    allowed = {f.name for f in dataclasses.fields(PluginConfig) if f.init}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise DhvError(f"{source}: unknown key(s) {', '.join(map(repr, unknown))}")
    if "default_size" in data:
        data["default_size"] = parse_size(data["default_size"])
    try:
        return PluginConfig(**data)
    except DhvError as err:
        raise DhvError(f"{source}: {str(err).removeprefix('config: ')}") from None


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
            f"no configuration at {path}: run `csi-local-dhv install --plugin-dir "
            f"{plugin_dir} --volume-group VG --thin-pool POOL`, or write there "
            '{"volume_group": "VG", "thin_pool": "POOL"} (the pool volumes are made in; '
            "docs/nomad-host-volumes.md, Configure)"
        ) from None
    except OSError as err:
        raise DhvError(f"cannot read {path}: {err.strerror}") from None
    return parse_config(text, path)


