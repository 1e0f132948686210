"""Device classes from the node configuration file (csi_local.volumes.device_classes), and how
the plugin's configuration takes them.

Every refusal names the file and the line of the offending key or table
header ("classes.toml:LINE: message"), so each row below writes its TOML one
line per element and says which line that is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from csi_local.cli import build_parser, config_from_args
from csi_local.config import Config, ConfigError
from csi_local.volumes.device_classes import (
    DEFAULT_CLASS,
    ClassConfigError,
    DeviceClass,
    DeviceClasses,
    load_classes,
    parse_classes,
)

SOURCE = "classes.toml"


def toml(*lines: str) -> str:
    """The file, line N being lines[N - 1]."""
    return "\n".join(lines) + "\n"


# The design's example, verbatim but for the comments.
GOOD = toml(
    "# /etc/csi-local/classes.toml",
    'default = "fast"                # the class used when a request names none',
    "",
    "[classes.fast]",
    'volume_group = "vg-nvme"',
    'thin_pool = "pool"',
    "overprovision_ratio = 2.0",
    'default_fs_type = "xfs"',
    "",
    "[classes.fast.lvcreate]",
    'readahead = "auto"',
    "",
    "[classes.big]",
    'volume_group = "vg-hdd"',
    'thin_pool = "pool"',
)


def one_class(*body: str, name: str = "fast") -> str:
    """A file of one class: its header on line 1, `body` from line 2."""
    return toml(f"[classes.{name}]", *body)


VG_POOL = ('volume_group = "vg"', 'thin_pool = "pool"')  # lines 2 and 3 of one_class


def lvcreate(*body: str) -> str:
    """One class with an lvcreate table: its header on line 4, `body` from line 5."""
    return one_class(*VG_POOL, "[classes.fast.lvcreate]", *body)


# parsing ------------------------------------------------------------------------------


def test_the_designs_example() -> None:
    classes = parse_classes(GOOD, source=SOURCE)
    assert classes.default == "fast" and classes.names == ["fast", "big"]
    assert classes.source == SOURCE
    assert classes.classes == (
        DeviceClass("fast", "vg-nvme", "pool", 2.0, "xfs",
                    ("--readahead", "auto")),
        DeviceClass("big", "vg-hdd", "pool", 1.0, "ext4", ()),
    )
    assert classes.default_class.name == "fast"
    assert classes.volume_groups == ["vg-nvme", "vg-hdd"]
    assert classes.get("big") is classes.classes[1] and classes.get("gold") is None
    assert classes.of_pool("vg-hdd", "pool") is classes.classes[1]
    assert classes.of_pool("vg-hdd", "other") is None
    assert classes.classes[0].pool_name == "vg-nvme/pool"


def test_the_flags_are_the_defaults_of_classes_that_set_none() -> None:
    classes = parse_classes(GOOD, source=SOURCE, overprovision_ratio=1.5,
                            default_fs_type="btrfs")
    fast, big = classes.classes
    assert (fast.overprovision_ratio, fast.default_fs_type) == (2.0, "xfs")  # its own
    assert (big.overprovision_ratio, big.default_fs_type) == (1.5, "btrfs")  # the flags'
    assert isinstance(big.overprovision_ratio, float)


@pytest.mark.parametrize(("text", "classes"), [
    pytest.param(one_class(*VG_POOL), (DeviceClasses(
        (DeviceClass("fast", "vg", "pool"),), "fast")), id="one-class-is-the-default"),
    pytest.param(toml('default = "fast"', *one_class(*VG_POOL).splitlines()),
                 DeviceClasses((DeviceClass("fast", "vg", "pool"),), "fast"),
                 id="one-class-named-default"),
    pytest.param(one_class(*VG_POOL, "overprovision_ratio = 3"),
                 DeviceClasses((DeviceClass("fast", "vg", "pool", 3.0),), "fast"),
                 id="integer-ratio"),
    pytest.param(toml('default = "b"', "[classes.a]", 'volume_group = "vg"', 'thin_pool = "p1"',
                      "[classes.b]", 'volume_group = "vg"', 'thin_pool = "p2"'),
                 DeviceClasses((DeviceClass("a", "vg", "p1"), DeviceClass("b", "vg", "p2")), "b"),
                 id="two-pools-in-one-vg"),
    pytest.param(toml("[classes.x]", 'volume_group = "vg"', 'thin_pool = "pool"'),
                 DeviceClasses((DeviceClass("x", "vg", "pool"),), "x"), id="one-letter-name"),
    pytest.param(toml(f"[classes.{'a' * 62}9]", *VG_POOL),
                 DeviceClasses((DeviceClass("a" * 62 + "9", "vg", "pool"),), "a" * 62 + "9"),
                 id="63-character-name"),
    pytest.param(toml('[ classes . "fast-1" ]   # NVMe', '"volume_group" = "vg"',
                      "thin_pool = 'pool'"),
                 DeviceClasses((DeviceClass("fast-1", "vg", "pool"),), "fast-1"),
                 id="quoted-and-spaced-names"),
    pytest.param(toml("[classes]", 'fast = { volume_group = "vg", thin_pool = "pool" }'),
                 DeviceClasses((DeviceClass("fast", "vg", "pool"),), "fast"), id="inline-table"),
])
def test_good_files(text: str, classes: DeviceClasses) -> None:
    assert parse_classes(text, source=SOURCE) == classes


@pytest.mark.parametrize(("body", "args"), [
    pytest.param(('readahead = "auto"',), ("--readahead", "auto"), id="readahead-auto"),
    pytest.param(('readahead = "none"',), ("--readahead", "none"), id="readahead-none"),
    pytest.param(("readahead = 256",), ("--readahead", "256"), id="readahead-sectors"),
    pytest.param(("readahead = 1",), ("--readahead", "1"), id="readahead-one-sector"),
    pytest.param((f"readahead = {1 << 20}",), ("--readahead", str(1 << 20)),
                 id="readahead-largest"),
    pytest.param((), (), id="empty-table"),
])
def test_lvcreate_args(body: tuple[str, ...], args: tuple[str, ...]) -> None:
    (c,) = parse_classes(lvcreate(*body), source=SOURCE).classes
    assert c.lvcreate_args == args


# refusals -----------------------------------------------------------------------------


def bad(id: str, text: str, line: int | None, says: str, *, xfail: str = "") -> Any:
    """A file refused with "classes.toml:LINE: ..." (LINE None: no line to name).
    `xfail`: a defect of src/ still open (strict: the row must fail until fixed)."""
    marks = [pytest.mark.xfail(strict=True, reason=xfail)] if xfail else []
    return pytest.param(text, line, says, id=id, marks=marks)


TWO = ("[classes.a]", 'volume_group = "vg"', 'thin_pool = "p1"',  # lines 2-4 after a top line
       "[classes.b]", 'volume_group = "vg2"', 'thin_pool = "p2"')  # lines 5-7

REFUSED = [
    # The top level.
    bad("unknown-top-key", toml('default = "fast"', 'colour = "blue"', "[classes.fast]",
                                *VG_POOL), 2, "unknown key 'colour' (known: default, classes)"),
    bad("unknown-top-key-singular", toml('class = "fast"', "[classes.fast]", *VG_POOL), 1,
        "unknown key 'class'"),
    bad("no-classes", toml('default = "fast"'), None, "no device class defined"),
    bad("classes-not-a-table", toml("classes = 5"), 1, "no device class defined"),
    bad("several-classes-without-default", toml("# two", *TWO), None,
        "several classes and no default: add default = \"NAME\" at the top"),
    bad("default-unknown", toml('default = "gold"', *TWO), 1,
        "default class 'gold' is not defined (defined: a, b)"),
    bad("default-unknown-after-comments", toml("# c", "", 'default = "A"', *TWO), 3,
        "default class 'A' is not defined"),
    bad("default-not-a-string", toml("default = 1", *TWO), 1, "default class 1 is not defined"),
    # A class's table.
    bad("unknown-class-key", one_class(*VG_POOL, "size = 3"), 4,
        "class 'fast': unknown key 'size' (known: volume_group, thin_pool, "
        "overprovision_ratio, default_fs_type, lvcreate, encryption, qos)"),
    bad("unknown-class-key-second-class", toml('default = "a"', *TWO, "zero = true"), 8,
        "class 'b': unknown key 'zero'"),
    bad("missing-volume-group", one_class('thin_pool = "pool"'), 1,
        "class 'fast' needs volume_group"),
    bad("missing-thin-pool", toml("# c", *one_class('volume_group = "vg"').splitlines()), 2,
        "class 'fast' needs thin_pool"),
    bad("missing-thin-pool-second-class", toml('default = "a"', *TWO[:5]), 5,
        "class 'b' needs thin_pool"),
    bad("volume-group-not-a-string", one_class("volume_group = 5", 'thin_pool = "pool"'), 2,
        "class 'fast': volume_group must be a string"),
    bad("thin-pool-not-a-string", one_class('volume_group = "vg"', 'thin_pool = ["p"]'), 3,
        "class 'fast': thin_pool must be a string"),
    bad("volume-group-bad-lvm-name", one_class('volume_group = "-vg"', 'thin_pool = "pool"'), 2,
        "class 'fast': volume_group: invalid LVM name '-vg'"),
    bad("thin-pool-bad-lvm-name", one_class('volume_group = "vg"', 'thin_pool = "a b"'), 3,
        "class 'fast': thin_pool: invalid LVM name 'a b'"),
    bad("volume-group-empty", one_class('volume_group = ""', 'thin_pool = "pool"'), 2,
        "invalid LVM name ''"),
    bad("class-name-upper-case", one_class(*VG_POOL, name="Fast"), 1,
        "device class name 'Fast' must be 1 to 63 lower-case letters"),
    bad("class-name-underscore", toml("# c", *one_class(*VG_POOL, name="a_b").splitlines()), 2,
        "device class name 'a_b'"),
    bad("class-name-leading-dash", one_class(*VG_POOL, name='"-a"'), 1,
        "device class name '-a'"),
    bad("class-name-trailing-dash", one_class(*VG_POOL, name="a-"), 1, "device class name 'a-'"),
    bad("class-name-64-characters", one_class(*VG_POOL, name="a" * 64), 1,
        f"device class name '{'a' * 64}'"),
    bad("class-name-with-space", one_class(*VG_POOL, name='"a b"'), 1, "device class name 'a b'"),
    bad("class-not-a-table", toml("[classes]", "fast = 5"), 2, "class 'fast' must be a table"),
    # Values.
    bad("ratio-below-one", one_class(*VG_POOL, "overprovision_ratio = 0.5"), 4,
        "class 'fast': overprovision_ratio must be a number >= 1.0"),
    bad("ratio-zero", one_class(*VG_POOL, "overprovision_ratio = 0"), 4, ">= 1.0"),
    bad("ratio-bool", one_class(*VG_POOL, "overprovision_ratio = true"), 4, ">= 1.0"),
    bad("ratio-string", one_class(*VG_POOL, 'overprovision_ratio = "2"'), 4, ">= 1.0"),
    bad("ratio-nan", one_class(*VG_POOL, "overprovision_ratio = nan"), 4, ">= 1.0"),
    bad("ratio-infinite", one_class(*VG_POOL, "overprovision_ratio = inf"), 4, ">= 1.0"),
    bad("ratio-of-the-second-class", toml('default = "a"', "[classes.a]",
                                          *VG_POOL, "overprovision_ratio = 2.0", "[classes.b]",
                                          'volume_group = "vg2"', 'thin_pool = "p"',
                                          "overprovision_ratio = 0.9"), 9,
        "class 'b': overprovision_ratio"),
    bad("fs-unsupported", one_class(*VG_POOL, 'default_fs_type = "ntfs"'), 4,
        "class 'fast': default_fs_type 'ntfs' is not one of ext4, xfs, btrfs"),
    bad("fs-not-a-string", one_class(*VG_POOL, "default_fs_type = 4"), 4,
        "default_fs_type 4 is not one of"),
    bad("fs-upper-case", one_class(*VG_POOL, 'default_fs_type = "XFS"'), 4,
        "default_fs_type 'XFS'"),
    # lvcreate options: the allow-list.
    bad("lvcreate-option-not-allowed", lvcreate("zero = true"), 5,
        "class 'fast': lvcreate option 'zero' is not allowed (allowed: readahead)"),
    bad("lvcreate-stripes", lvcreate("readahead = 8", "stripes = 2"), 6,
        "lvcreate option 'stripes' is not allowed (allowed: readahead) "
        "(striping is the thin pool's: create the pool with lvcreate --type thin-pool "
        "--stripes N)"),
    bad("lvcreate-stripesize", lvcreate('stripesize = "64k"'), 5,
        "'stripesize' is not allowed (allowed: readahead) (striping is the "
        "thin pool's"),
    bad("lvcreate-activate", lvcreate('activate = "n"'), 5, "'activate' is not allowed"),
    bad("lvcreate-addtag", lvcreate('addtag = "x"'), 5, "'addtag' is not allowed"),
    bad("readahead-word", lvcreate('readahead = "fast"'), 5,
        "class 'fast': readahead must be \"auto\", \"none\" or a number of 512-byte sectors"),
    bad("readahead-digits-as-string", lvcreate('readahead = "256"'), 5, "readahead must be"),
    bad("readahead-zero", lvcreate("readahead = 0"), 5, "readahead must be"),
    bad("readahead-negative", lvcreate("readahead = -8"), 5, "readahead must be"),
    bad("readahead-too-big", lvcreate(f"readahead = {(1 << 20) + 1}"), 5, "readahead must be"),
    bad("readahead-bool", lvcreate("readahead = true"), 5, "readahead must be"),
    bad("readahead-float", lvcreate("readahead = 8.0"), 5, "readahead must be"),
    # lvcreate refuses it for thin volumes: refused at start, not by every CreateVolume.
    bad("autoactivation-true", lvcreate("autoactivation = true"), 5,
        "class 'fast': lvcreate option 'autoactivation' is not allowed: lvcreate refuses "
        "--setautoactivation for thin volumes and snapshots; set it on the volume group "
        "instead (vgchange --setautoactivation y|n VG)"),
    bad("autoactivation-false", lvcreate('readahead = 8', "autoactivation = false"), 6,
        "'autoactivation' is not allowed: lvcreate refuses --setautoactivation"),
    # One pool, one class.
    bad("two-classes-on-one-pool", toml('default = "a"', "[classes.a]", *VG_POOL, "",
                                        "[classes.b]  # the same pool", *VG_POOL), 6,
        "classes 'a' and 'b' both use thin pool vg/pool: a pool belongs to one class"),
    # The file itself.
    bad("toml-syntax-error", toml('default = "a"', "[classes.a]", "volume_group = "), 3,
        "Invalid value (TOML syntax)"),
    bad("toml-duplicate-key", one_class(*VG_POOL, 'volume_group = "vg2"'), 4, "(TOML syntax)"),
    bad("toml-duplicate-table", toml("[classes.a]", *VG_POOL, "[classes.a]"), 4,
        "(TOML syntax)"),
    # Where the file's style puts the key.
    bad("empty-classes-table", toml('default = "a"', "[classes]"), 2,
        "no device class defined"),
    bad("lvcreate-not-a-table", one_class(*VG_POOL, "lvcreate = 5"), 4,
        "class 'fast': lvcreate must be a table"),
    bad("dotted-keys", toml("[classes]", 'fast.volume_group = "vg"', 'fast.thin_pool = "p"',
                            "fast.size = 1"), 4, "class 'fast': unknown key 'size'"),
    bad("dotted-keys-spaced-and-quoted", toml("[classes]", 'fast . volume_group = "vg"',
                                              '"fast".thin_pool = "-p"'), 3,
        "class 'fast': thin_pool: invalid LVM name '-p'"),
    bad("dotted-lvcreate-key", one_class(*VG_POOL, "lvcreate.zero = 1"), 4,
        "lvcreate option 'zero' is not allowed"),
    bad("inline-table-names-its-line", toml("[classes]",
                                            'fast = { volume_group = "vg", thin_pool = "p", '
                                            "size = 1 }"), 2,
        "class 'fast': unknown key 'size'"),
    bad("class-only-by-its-lvcreate-table", toml("# c", "[classes.fast.lvcreate]",
                                                 "readahead = 8"), 2,
        "class 'fast' needs volume_group"),
    bad("array-of-tables", toml("[[classes]]", *VG_POOL), 1, "no device class defined"),
]


@pytest.mark.parametrize(("text", "line", "says"), REFUSED)
def test_refused(text: str, line: int | None, says: str) -> None:
    with pytest.raises(ClassConfigError) as caught:
        parse_classes(text, source=SOURCE)
    message = str(caught.value)
    prefix = f"{SOURCE}:{line}: " if line is not None else f"{SOURCE}: "
    assert message.startswith(prefix), message
    assert says in message, message


def test_refusal_is_a_value_error() -> None:
    """config_from_args turns ValueErrors into the CLI's ConfigError."""
    assert issubclass(ClassConfigError, ValueError)


def test_load_classes_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "classes.toml"
    path.write_text(GOOD)
    assert load_classes(str(path)) == parse_classes(GOOD)
    assert load_classes(str(path)).source == str(path)
    path.write_text(one_class(*VG_POOL, "size = 3"))
    with pytest.raises(ClassConfigError, match=rf"^{path}:4: class 'fast': unknown key"):
        load_classes(str(path))
    with pytest.raises(ClassConfigError, match="cannot read the configuration file"):
        load_classes(str(tmp_path / "absent.toml"))
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ClassConfigError, match="cannot read the configuration file"):
        load_classes(str(path))


# the plugin's configuration -------------------------------------------------------------

BASE = ["serve", "--endpoint", "unix:///run/x.sock", "--node-id", "n1",
        "--state-dir", "/var/lib/x"]
CLASSES = parse_classes(GOOD, source=SOURCE)


def config(**kw: Any) -> Config:
    return Config(endpoint="unix:///run/x.sock", node_id="n1", **kw)


@pytest.mark.parametrize("kw", [
    pytest.param({"device_classes": CLASSES, "volume_group": "vg0"}, id="classes-and-vg"),
    pytest.param({"device_classes": CLASSES, "thin_pool": "pool"}, id="classes-and-pool"),
    pytest.param({"device_classes": CLASSES, "volume_group": "vg0", "thin_pool": "pool"},
                 id="classes-and-both"),
])
def test_config_refuses_classes_with_the_flags(kw: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="not both"):
        config(**kw)


@pytest.mark.parametrize("kw", [
    pytest.param({}, id="neither"),
    pytest.param({"volume_group": "vg0"}, id="vg-only"),
    pytest.param({"thin_pool": "pool"}, id="pool-only"),
])
def test_config_needs_a_pool(kw: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="--volume-group and --thin-pool are required"):
        config(**kw)


def test_config_classes() -> None:
    assert config(device_classes=CLASSES).classes is CLASSES
    flags = config(volume_group="vg0", thin_pool="pool", overprovision_ratio=1.5,
                   default_fs_type="xfs").classes
    assert flags == DeviceClasses(
        (DeviceClass(DEFAULT_CLASS, "vg0", "pool", 1.5, "xfs"),), DEFAULT_CLASS)
    with pytest.raises(ConfigError, match="does not go with --config"):
        config(device_classes=CLASSES, backing_file="/x.img", backing_size=1 << 30)


def test_cli_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "classes.toml"
    path.write_text(GOOD)
    cfg = config_from_args(build_parser().parse_args(
        [*BASE, "--config", str(path), "--overprovision-ratio", "1.25",
         "--default-fs-type", "btrfs"]))
    assert cfg.classes.names == ["fast", "big"] and cfg.classes.source == str(path)
    assert cfg.classes.get("big") == DeviceClass("big", "vg-hdd", "pool", 1.25, "btrfs")
    assert (cfg.volume_group, cfg.thin_pool) == ("", "")
    monkeypatch.setenv("CSI_LOCAL_CONFIG", str(path))
    assert config_from_args(build_parser().parse_args(BASE)).classes.default == "fast"


@pytest.mark.parametrize(("args", "says"), [
    pytest.param(["--volume-group", "vg0"], "not both", id="with-volume-group"),
    pytest.param(["--thin-pool", "pool"], "not both", id="with-thin-pool"),
    pytest.param(["--volume-group", "vg0", "--thin-pool", "pool"], "not both", id="with-both"),
    pytest.param(["--backing-file", "/x.img", "--backing-size", "1G"], "--config",
                 id="with-backing-file"),
])
def test_cli_config_file_refused_with(tmp_path: Path, args: list[str], says: str) -> None:
    path = tmp_path / "classes.toml"
    path.write_text(GOOD)
    with pytest.raises(ConfigError, match=says):
        config_from_args(build_parser().parse_args([*BASE, "--config", str(path), *args]))


def test_cli_without_config_or_pool() -> None:
    with pytest.raises(ConfigError, match="--volume-group and --thin-pool are required"):
        config_from_args(build_parser().parse_args(BASE))


def test_cli_bad_config_file(tmp_path: Path) -> None:
    path = tmp_path / "classes.toml"
    path.write_text(lvcreate("stripes = 2"))
    with pytest.raises(ConfigError, match=rf"^{path}:5: class 'fast': lvcreate option "
                                          "'stripes' is not allowed"):
        config_from_args(build_parser().parse_args([*BASE, "--config", str(path)]))
    with pytest.raises(ConfigError, match="cannot read"):
        config_from_args(build_parser().parse_args(
            [*BASE, "--config", str(tmp_path / "absent.toml")]))


def test_config_refuses_an_infinite_flag_ratio() -> None:
    with pytest.raises(ConfigError):
        config(volume_group="vg0", thin_pool="pool", overprovision_ratio=float("inf"))
