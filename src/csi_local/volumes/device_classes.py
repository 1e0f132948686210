"""Device classes: the thin pools of one node, each with a name a request can
choose (a StorageClass's `deviceClass`, a Nomad host volume's `device_class`).

Defined by a TOML file (`--config`), or by the plugin's flags as one class
named `default`. Both plugins read the same file through this module, so
they agree on what a class is. No processes, no LVM here.

A volume's class is not recorded anywhere: the LV's VG and thin pool say it,
so a class may be renamed in the file without touching a volume, and two
classes may never share a pool.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from csi_local.host.filesystem_rules import SUPPORTED_FS
from csi_local.storage.lvm import check_name
from csi_local.volumes import qos

DEFAULT_CLASS = "default"  # the class the flags define
# Shown in StorageClass parameters and Nomad volume specs: keep it plain.
_CLASS_RE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_CLASS_KEYS = ("volume_group", "thin_pool", "overprovision_ratio", "default_fs_type",
               "lvcreate", "encryption", "qos")
# Extra lvcreate options a class may carry: only what lvcreate accepts for a
# thin volume and what cannot break the plugin's own handling of the LV.
# Striping is not here: lvcreate refuses --stripes for a thin volume ("is
# supported only with thin pool creation"); a striped class is a striped pool.
_LVCREATE_KEYS = ("readahead",)
# Options that lvcreate refuses for a thin volume, with what to do instead:
# refused here, when the file is read, not by every CreateVolume of the class.
_THIN_REFUSES = {
    # lvm2 2.03: "Option --setautoactivation is unsupported with thins." (and
    # "... with snapshots." for the clones and restores)
    "autoactivation": "lvcreate refuses --setautoactivation for thin volumes and "
                      "snapshots; set it on the volume group instead "
                      "(vgchange --setautoactivation y|n VG)",
}


class ClassConfigError(ValueError):
    """A configuration file the plugins refuse to start with."""


@dataclass(frozen=True)
class DeviceClass:
    name: str
    volume_group: str
    thin_pool: str
    overprovision_ratio: float = 1.0
    default_fs_type: str = "ext4"
    # lvcreate arguments rendered from the allow-list, for every new thin LV
    # (volumes, clones and restores) of the class.
    lvcreate_args: tuple[str, ...] = ()
    # The class's volumes are encrypted (LUKS2) unless a request says
    # `encryption: none` (docs/encryption.md).
    encrypted: bool = False
    # The IO limits of the class's new volumes, unless a request says
    # otherwise ([classes.NAME.qos]; docs/qos.md): written into each new
    # volume's tags, so a later change of the file leaves existing volumes be.
    qos: qos.Limits = qos.NO_LIMITS

    @property
    def pool_name(self) -> str:
        return f"{self.volume_group}/{self.thin_pool}"


@dataclass(frozen=True)
class DeviceClasses:
    """Every class of the node and the default one."""

    classes: tuple[DeviceClass, ...]
    default: str
    source: str = field(default="", compare=False)  # the file, or "" for the flags

    def __post_init__(self) -> None:
        if not self.classes:
            raise ClassConfigError("no device class defined")
        if self.default not in self.names:
            raise ClassConfigError(f"default class {self.default!r} is not defined")

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.classes]

    def get(self, name: str) -> DeviceClass | None:
        return next((c for c in self.classes if c.name == name), None)

    @property
    def default_class(self) -> DeviceClass:
        found = self.get(self.default)
        assert found is not None  # __post_init__
        return found

    @property
    def volume_groups(self) -> list[str]:
        """The VGs of all classes, each once, in the file's order."""
        return list(dict.fromkeys(c.volume_group for c in self.classes))

    def of_pool(self, vg: str, pool: str) -> DeviceClass | None:
        """The class whose thin pool is `vg`/`pool`."""
        return next((c for c in self.classes
                     if c.volume_group == vg and c.thin_pool == pool), None)


def single_class(volume_group: str, thin_pool: str, *, overprovision_ratio: float = 1.0,
                 default_fs_type: str = "ext4") -> DeviceClasses:
    """The one class the flags define."""
    return DeviceClasses((DeviceClass(DEFAULT_CLASS, volume_group, thin_pool,
                                      overprovision_ratio, default_fs_type),),
                         DEFAULT_CLASS)


def check_class_name(name: str) -> str:
    if not _CLASS_RE.fullmatch(name):
        raise ValueError(f"device class name {name!r} must be 1 to 63 lower-case letters, "
                         "digits and '-', starting and ending with a letter or digit")
    return name


class _Lines:
    """Where a table or key is written in the file, for messages that name the
    line (tomllib reports lines only for syntax errors). Every table header and
    key is recorded by its full dotted path; a lookup falls back to the nearest
    enclosing table or key (a key inside an inline table names the line of
    the table)."""

    _HEADER = re.compile(r"^\s*\[\[?\s*([^\[\]]+?)\s*\]\]?\s*(#.*)?\Z")
    _KEY = re.compile(r'^\s*((?:"[^"]*"|[A-Za-z0-9_-]+)(?:\s*\.\s*(?:"[^"]*"|[A-Za-z0-9_-]+))*)'
                      r"\s*=")

    def __init__(self, text: str) -> None:
        self.paths: dict[str, int] = {}
        table = ""
        for number, line in enumerate(text.splitlines(), 1):
            header = self._HEADER.match(line)
            if header:
                table = self._path(header.group(1))
                self.paths.setdefault(table, number)
                continue
            key = self._KEY.match(line)
            if key:
                path = self._path(key.group(1))
                self.paths.setdefault(f"{table}.{path}" if table else path, number)

    @staticmethod
    def _path(dotted: str) -> str:
        return ".".join(p.strip().strip('"') for p in dotted.split("."))

    def of(self, table: str, key: str | None = None) -> int | None:
        path = ".".join(p for p in (table, key) if p)
        while path:
            if path in self.paths:
                return self.paths[path]
            # a table made only by its sub-tables ([classes.fast.lvcreate])
            inner = [n for p, n in self.paths.items() if p.startswith(path + ".")]
            if inner:
                return min(inner)
            path = path.rpartition(".")[0]
        return None


_TOML_LINE = re.compile(r"\(at line (\d+), column \d+\)")


def parse_classes(text: str, *, source: str = "config", overprovision_ratio: float = 1.0,
                  default_fs_type: str = "ext4") -> DeviceClasses:
    """The classes a configuration file defines; ClassConfigError naming the
    file and line otherwise. `overprovision_ratio` and `default_fs_type` are
    what a class that does not set them gets (the plugin's flags)."""
    lines = _Lines(text)

    def fail(message: str, table: str = "", key: str | None = None) -> ClassConfigError:
        number = lines.of(table, key)
        where = f"{source}:{number}" if number else source
        return ClassConfigError(f"{where}: {message}")

    # Imported here: most nodes have no device class file, and the parser is
    # a tenth of the serve path's own imports under emulation (start-up).
    import tomllib

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        found = _TOML_LINE.search(str(err))
        message = _TOML_LINE.sub("", str(err)).strip()
        where = f"{source}:{found.group(1)}" if found else source
        raise ClassConfigError(f"{where}: {message} (TOML syntax)") from None
    for key in data:
        if key not in ("default", "classes"):
            raise fail(f"unknown key {key!r} (known: default, classes)", "", key)
    raw_classes = data.get("classes")
    if not isinstance(raw_classes, dict) or not raw_classes:
        raise fail("no device class defined: add a [classes.NAME] table with volume_group "
                   "and thin_pool", "", "classes")
    classes = []
    for name, body in raw_classes.items():
        table = f"classes.{name}"
        try:
            check_class_name(name)
        except ValueError as err:
            raise fail(str(err), table) from None
        if not isinstance(body, dict):
            raise fail(f"class {name!r} must be a table", "classes", name)
        classes.append(_parse_class(name, body, table, fail, overprovision_ratio,
                                    default_fs_type))
    seen: dict[str, str] = {}
    for c in classes:
        other = seen.setdefault(c.pool_name, c.name)
        if other != c.name:
            raise fail(f"classes {other!r} and {c.name!r} both use thin pool {c.pool_name}: "
                       "a pool belongs to one class", f"classes.{c.name}")
    default = data.get("default")
    if default is None:
        if len(classes) > 1:
            raise fail("several classes and no default: add default = \"NAME\" at the top")
        default = classes[0].name
    if not isinstance(default, str) or default not in seen.values():
        known = ", ".join(sorted(c.name for c in classes))
        raise fail(f"default class {default!r} is not defined (defined: {known})", "",
                   "default")
    return DeviceClasses(tuple(classes), default, source)


def _parse_class(name: str, body: Mapping[str, Any], table: str,
                 fail: Any, ratio_default: float, fs_default: str) -> DeviceClass:
    for key in body:
        if key not in _CLASS_KEYS:
            raise fail(f"class {name!r}: unknown key {key!r} (known: {', '.join(_CLASS_KEYS)})",
                       table, key)
    names = {}
    for key in ("volume_group", "thin_pool"):
        value = body.get(key)
        if value is None:
            raise fail(f"class {name!r} needs {key}", table)
        if not isinstance(value, str):
            raise fail(f"class {name!r}: {key} must be a string", table, key)
        try:
            names[key] = check_name(value)
        except ValueError as err:
            raise fail(f"class {name!r}: {key}: {err}", table, key) from None
    ratio = body.get("overprovision_ratio", ratio_default)
    if (isinstance(ratio, bool) or not isinstance(ratio, int | float) or not ratio >= 1.0
            or not math.isfinite(ratio)):
        raise fail(f"class {name!r}: overprovision_ratio must be a number >= 1.0",
                   table, "overprovision_ratio")
    fs_type = body.get("default_fs_type", fs_default)
    if fs_type not in SUPPORTED_FS:
        raise fail(f"class {name!r}: default_fs_type {fs_type!r} is not one of "
                   f"{', '.join(SUPPORTED_FS)}", table, "default_fs_type")
    args = _lvcreate_args(name, body.get("lvcreate", {}), f"{table}.lvcreate", fail)
    encryption = body.get("encryption", "none")
    if encryption not in ("luks2", "none"):
        raise fail(f"class {name!r}: encryption must be \"luks2\" or \"none\"", table,
                   "encryption")
    limits = _qos(name, body.get("qos", {}), f"{table}.qos", fail)
    return DeviceClass(name, names["volume_group"], names["thin_pool"], float(ratio),
                       fs_type, args, encrypted=encryption == "luks2", qos=limits)


def _qos(name: str, body: object, table: str, fail: Any) -> qos.Limits:
    """A class's default IO limits: read_bps, write_bps, read_iops and
    write_iops, each a number or a string as the parameters take them."""
    if not isinstance(body, dict):
        raise fail(f"class {name!r}: qos must be a table", table.rpartition(".")[0], "qos")
    for key in body:
        if key not in qos.FILE_KEYS:
            raise fail(f"class {name!r}: unknown qos key {key!r} (known: "
                       f"{', '.join(qos.FILE_KEYS)})", table, key)
    values: dict[str, int | None] = {}
    for key, value in body.items():
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise fail(f"class {name!r}: qos {key} must be a number or a string", table, key)
        try:
            values[qos.FILE_KEYS[key]] = qos.parse_value(key, qos.FILE_KEYS[key], str(value))
        except ValueError as err:
            raise fail(f"class {name!r}: qos: {err}", table, key) from None
    return qos.NO_LIMITS.merged(values)


def _lvcreate_args(name: str, body: object, table: str, fail: Any) -> tuple[str, ...]:
    if not isinstance(body, dict):
        raise fail(f"class {name!r}: lvcreate must be a table", table.rpartition(".")[0],
                   "lvcreate")
    args: list[str] = []
    for key, value in body.items():
        if key in _THIN_REFUSES:
            raise fail(f"class {name!r}: lvcreate option {key!r} is not allowed: "
                       f"{_THIN_REFUSES[key]}", table, key)
        if key not in _LVCREATE_KEYS:
            hint = (" (striping is the thin pool's: create the pool with "
                    "lvcreate --type thin-pool --stripes N)" if "stripe" in key else "")
            raise fail(f"class {name!r}: lvcreate option {key!r} is not allowed (allowed: "
                       f"{', '.join(_LVCREATE_KEYS)}){hint}", table, key)
        if key == "readahead":
            if value in ("auto", "none"):
                args += ["--readahead", str(value)]
            elif isinstance(value, int) and not isinstance(value, bool) and 0 < value <= 1 << 20:
                args += ["--readahead", str(value)]
            else:
                raise fail(f"class {name!r}: readahead must be \"auto\", \"none\" or a "
                           "number of 512-byte sectors", table, key)
    return tuple(args)


def load_classes(path: str, *, overprovision_ratio: float = 1.0,
                 default_fs_type: str = "ext4") -> DeviceClasses:
    """parse_classes of the file at `path`; ClassConfigError when unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise ClassConfigError(f"cannot read the configuration file {path}: {err}") from None
    return parse_classes(text, source=path, overprovision_ratio=overprovision_ratio,
                         default_fs_type=default_fs_type)
