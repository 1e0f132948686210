"""The only module that runs lvm (the plugins, the demo backing and the tests'
harness all come through here).

Reads use JSON reports in bytes; results are frozen dataclasses. LVM's "not
found" is mapped once, here, to LvNotFound / VolumeGroupMissing; an LV that
LVM will not remove because it is open is VolumeInUse. Every command runs
through the Runner, which sets LC_ALL=C and a timeout.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from csi_local.errors import (
    CommandError,
    LvNotFound,
    OriginFrozen,
    PoolUnusable,
    StorageError,
    VolumeGroupMissing,
    VolumeInUse,
)
from csi_local.storage import vg_text as lvm_metadata

if TYPE_CHECKING:
    from csi_local.host.device_mapper import PoolUsage
    from csi_local.host.runner import Runner

log = logging.getLogger(__name__)

LV_FIELDS = (
    "lv_name,vg_name,lv_size,lv_tags,lv_attr,pool_lv,origin,lv_path,"
    "data_percent,metadata_percent,lv_time,lv_health_status,lv_kernel_major,lv_kernel_minor,"
    "lv_metadata_size,thin_id,lv_uuid"
)
VG_FIELDS = "vg_name,vg_size,vg_free,vg_extent_size"
# The metadata area the docs recommend for a PV of the plugins' VGs, and
# the demo backing makes: room for the text of about 10,000 volumes and
# snapshots as the plugins tag them (measured; README, "Sizes and capacity").
RECOMMENDED_METADATA_SIZE = "16m"
# The VG's fields a report of its LVs carries: the extent size, and its
# smallest metadata area in use with what that area has left (LVM's answer,
# rounded down to whole sectors; see MetadataArea).
_VG_ROOM_FIELDS = "vg_extent_size,vg_mda_size,vg_mda_free"
# LVM names: letters, digits and "+_.-", not starting with "-"; tags add "/=!:#&".
_NAME_RE = re.compile(r"^[A-Za-z0-9+_.][A-Za-z0-9+_.-]{0,126}$")
_TAG_RE = re.compile(r"^[A-Za-z0-9_+.\-/=!:#&]{1,1024}$")
_NOT_FOUND_RE = re.compile(r"not found|Failed to find|does not exist", re.IGNORECASE)
# `lvs VG/LV` exits 5 both for a missing LV and for a missing VG. Only the
# first means "already gone": a missing VG (a disk not yet attached, a VG not
# yet activated) must never make an LV look deleted.
_VG_NOT_FOUND_RE = re.compile(r'Volume group "[^"]*" not found|Cannot process volume group',
                              re.IGNORECASE)
# lvremove of an LV that is open or mounted: "Logical volume vg/lv in use." or
# "Logical volume vg/lv contains a filesystem in use." (exit 5).
_IN_USE_RE = re.compile(r"in use|is open|still open", re.IGNORECASE)
# lvcreate's words when device-mapper's lockfs suspend of a thin origin fails
# because its file system is frozen already (EBUSY from freeze_bdev on 6.1).
_ORIGIN_SUSPEND_RE = re.compile(r"Failed to suspend thin snapshot origin")
_REPORT = ("--reportformat", "json", "--units", "b", "--nosuffix", "--config",
           "report/time_format=\"%s\"")


@dataclass(frozen=True)
class LogicalVolume:
    name: str
    vg: str
    size: int
    tags: frozenset[str]
    attr: str
    pool: str
    origin: str
    path: str
    data_percent: float | None
    metadata_percent: float | None
    created: int
    health: str
    kernel_major: int
    kernel_minor: int
    metadata_size: int = 0  # a thin pool's metadata LV, bytes (0 for other LVs)
    thin_id: int = -1  # a thin volume's device ID in its pool (-1: not a thin volume)
    uuid: str = ""  # LVM's ID of this LV: a new one for each LV ever made, never reused

    @property
    def active(self) -> bool:
        return len(self.attr) > 4 and self.attr[4] == "a"

    @property
    def open(self) -> bool:
        """Its device is open (mounted, or held by a process)."""
        return len(self.attr) > 5 and self.attr[5] == "o"

    @property
    def is_thin_pool(self) -> bool:
        return self.attr.startswith("t")

    @property
    def is_thin_volume(self) -> bool:
        return self.attr.startswith("V")

    @property
    def activation_skip(self) -> bool:
        return len(self.attr) > 9 and self.attr[9] == "k"

    def tag_value(self, key: str) -> str | None:
        """The value of a "key=value" tag, or None."""
        prefix = key + "="
        for tag in self.tags:
            if tag.startswith(prefix):
                return tag[len(prefix):]
        return None


@dataclass(frozen=True)
class MetadataArea:
    """How full the VG's tightest metadata area is: every change writes the
    VG's whole metadata text to each area in use (on every PV, less those
    `pvchange --metadataignore` set aside), and LVM refuses the change when
    the text outgrows the smallest one (lvm_metadata.max_text_size)."""

    size: int  # bytes, the smallest area in use, its header included
    used: int  # bytes of the committed text (its closing NUL included)

    @property
    def limit(self) -> int:
        """The largest text LVM will write there."""
        return lvm_metadata.max_text_size(self.size)

    @property
    def free(self) -> int:
        return max(0, self.limit - self.used)

    @property
    def used_ratio(self) -> float:
        return self.used / self.limit if self.limit else 1.0


@dataclass(frozen=True)
class VgReport:
    """Every LV of the VG and the VG's extent size, from one `lvs` call."""

    lvs: tuple[LogicalVolume, ...]
    extent_size: int
    # The VG's tightest metadata area; None when the report could not tell.
    metadata_area: MetadataArea | None = None

    def find(self, name: str) -> LogicalVolume | None:
        return next((lv for lv in self.lvs if lv.name == name), None)


@dataclass(frozen=True)
class VolumeGroup:
    name: str
    size: int
    free: int
    extent_size: int


def _metadata_area(row: dict[str, str]) -> MetadataArea | None:
    """The VG's tightest metadata area from a report row's vg_mda_size and
    vg_mda_free (None when the row lacks them: no area in use)."""
    size = _int(row.get("vg_mda_size", ""))
    if size <= 0:
        return None
    limit = lvm_metadata.max_text_size(size)
    return MetadataArea(size, max(0, limit - _int(row.get("vg_mda_free", ""))))


def _float(text: str) -> float | None:
    return float(text) if text.strip() else None


def _int(text: str, default: int = 0) -> int:
    try:
        return int(text)
    except ValueError:
        return default


def parse_lvs(output: str) -> list[LogicalVolume]:
    """Parse `lvs --reportformat json --units b --nosuffix -o LV_FIELDS`."""
    data = json.loads(output) if output.strip() else {"report": []}
    result = []
    for report in data.get("report", []):
        for row in report.get("lv", []):
            tags = frozenset(t for t in row.get("lv_tags", "").split(",") if t)
            result.append(
                LogicalVolume(
                    name=row["lv_name"],
                    vg=row["vg_name"],
                    size=_int(row["lv_size"]),
                    tags=tags,
                    attr=row.get("lv_attr", ""),
                    pool=row.get("pool_lv", ""),
                    origin=row.get("origin", ""),
                    path=row.get("lv_path", ""),
                    data_percent=_float(row.get("data_percent", "")),
                    metadata_percent=_float(row.get("metadata_percent", "")),
                    created=_int(row.get("lv_time", "")),
                    health=row.get("lv_health_status", ""),
                    kernel_major=_int(row.get("lv_kernel_major", ""), -1),
                    kernel_minor=_int(row.get("lv_kernel_minor", ""), -1),
                    metadata_size=_int(row.get("lv_metadata_size", "")),
                    thin_id=_int(row.get("thin_id", ""), -1),
                    uuid=row.get("lv_uuid", ""),
                )
            )
    return result


def parse_vgs(output: str) -> list[VolumeGroup]:
    data = json.loads(output) if output.strip() else {"report": []}
    return [
        VolumeGroup(
            name=row["vg_name"],
            size=_int(row["vg_size"]),
            free=_int(row["vg_free"]),
            extent_size=_int(row["vg_extent_size"]),
        )
        for report in data.get("report", [])
        for row in report.get("vg", [])
    ]


def check_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise ValueError(f"invalid LVM name {name!r}")
    return name


def check_tag(tag: str) -> str:
    if not _TAG_RE.match(tag):
        raise ValueError(f"invalid LVM tag {tag!r}")
    return tag


# LVM tags allow only [A-Za-z0-9_+.-/=!:#&]; free text (a CO's volume name, a
# namespace) is stored hex-encoded, and not at all when too long for a tag.
_MAX_HEX_TAG = 512


def hex_tag(key: str, value: str) -> list[str]:
    """["key=<hex of value>"], or [] for an empty or too long value."""
    encoded = value.encode("utf-8", "surrogateescape").hex()
    if not encoded or len(encoded) > _MAX_HEX_TAG:
        return []
    return [check_tag(f"{key}={encoded}")]


def decode_hex_tag(value: str | None) -> str | None:
    """The text of a hex_tag's value; None for a missing or malformed one."""
    if value is None:
        return None
    try:
        return bytes.fromhex(value).decode("utf-8", "surrogateescape")
    except ValueError:
        return None


def lvm_version(runner: Runner) -> str:
    """LVM's version line ("LVM version: 2.03.16(2) (2022-05-18)"), "" if none."""
    out = runner.run(["lvmconfig", "--version"]).stdout
    return next((" ".join(ln.split()) for ln in out.splitlines() if ln.strip()), "")


def read_config(runner: Runner, keys: Sequence[str]) -> dict[str, str]:
    """{"udev_sync": "1", ...}: the settings in effect for `keys`
    ("activation/udev_sync", ...), by their last path element.

    `--type full` (lvm.conf merged over LVM's defaults) fails when there is no
    lvm.conf at all ("Failed to clone current config tree", lvm2 2.03); then
    the defaults are what applies, and `--type default` prints them ("# "
    before each). CommandError when neither can be read."""
    try:
        out = runner.run(["lvmconfig", "--type", "full", *keys]).stdout
    except CommandError as err:
        if "clone current config tree" not in err.stderr:
            raise
        out = runner.run(["lvmconfig", "--type", "default", *keys]).stdout
    values = {}
    for line in out.splitlines():
        key, sep, value = line.strip().lstrip("#").partition("=")
        if sep:
            values[key.strip()] = value.strip().strip('"')
    return values


def physical_volumes(runner: Runner) -> dict[str, str]:
    """{PV path: its VG ("" for none)} of every PV this LVM (its configuration:
    filters, devices file, system ID) sees. `--readonly`: no lock, no
    device-mapper, the on-disk metadata as it is; for doctor, never a fast
    path. CommandError, or StorageError when pvs prints no JSON report."""
    out = runner.run(["pvs", "--readonly", "--reportformat", "json",
                      "-o", "pv_name,vg_name"]).stdout
    try:
        return {row["pv_name"]: row.get("vg_name", "") for report in json.loads(out)["report"]
                for row in report.get("pv", [])}
    except (ValueError, AttributeError, TypeError, KeyError):
        raise StorageError(f"pvs printed no JSON report: {out[:200]!r}") from None


def profile_dir(runner: Runner) -> str:
    """Where LVM reads command profiles (config/profile_dir)."""
    return read_config(runner, ["config/profile_dir"]).get("profile_dir") or "/etc/lvm/profile"


def backup_dir(runner: Runner) -> str | None:
    """Where LVM keeps a metadata backup of each VG this host changed
    (backup/backup_dir); None when backups are off or LVM cannot say."""
    try:
        config = read_config(runner, ["backup/backup", "backup/backup_dir"])
    except CommandError as err:
        log.warning("cannot read LVM's backup settings: %s", err)
        return None
    if config.get("backup", "1") == "0":
        return None
    return config.get("backup_dir") or "/etc/lvm/backup"


def _vg_missing(err: CommandError) -> bool:
    return err.returncode == 5 and bool(_VG_NOT_FOUND_RE.search(err.stderr))


def _is_not_found(err: CommandError) -> bool:
    """LVM's "no such LV"; a missing VG is never that."""
    return (err.returncode == 5 and bool(_NOT_FOUND_RE.search(err.stderr))
            and not _vg_missing(err))


class Lvm:
    """LVM operations on one VG and thin pool."""

    def __init__(self, runner: Runner, vg: str, pool: str,
                 create_args: Sequence[str] = ()) -> None:
        self.runner = runner
        self.vg = check_name(vg)
        self.pool = check_name(pool)
        # A device class's extra lvcreate options (csi_local.volumes.device_classes, an
        # allow-list), given to every new thin LV that is activated.
        self.create_args = tuple(create_args)

    def _raise_if_vg_missing(self, err: CommandError) -> None:
        if _vg_missing(err):
            raise VolumeGroupMissing(
                f"volume group {self.vg} not found: the node cannot serve volumes until it "
                "is back"
            ) from err

    # reads -----------------------------------------------------------------

    def volume_group(self) -> VolumeGroup:
        try:
            out = self.runner.run(["vgs", *_REPORT, "-o", VG_FIELDS, self.vg]).stdout
        except CommandError as err:
            self._raise_if_vg_missing(err)
            raise
        vgs = parse_vgs(out)
        if not vgs:
            raise VolumeGroupMissing(f"volume group {self.vg} not found: the node cannot "
                                      "serve volumes until it is back")
        return vgs[0]

    def list(self) -> list[LogicalVolume]:
        """Every LV of the VG (one lvs call)."""
        try:
            out = self.runner.run(["lvs", *_REPORT, "-o", LV_FIELDS, self.vg]).stdout
        except CommandError as err:
            self._raise_if_vg_missing(err)
            raise
        return parse_lvs(out)

    def report(self) -> VgReport:
        """Every LV and the extent size in one `lvs` call: what CreateVolume and the
        capacity arithmetic need, instead of a `vgs` and an `lvs` (every LVM
        command costs a process start and a scan of the devices)."""
        try:
            out = self.runner.run(
                ["lvs", *_REPORT, "-o", LV_FIELDS + "," + _VG_ROOM_FIELDS, self.vg]).stdout
        except CommandError as err:
            self._raise_if_vg_missing(err)
            raise
        lvs = parse_lvs(out)
        data = json.loads(out) if out.strip() else {"report": []}
        rows = [row for rep in data.get("report", []) for row in rep.get("lv", [])]
        extent = _int(rows[0].get("vg_extent_size", "")) if rows else 0
        area = _metadata_area(rows[0]) if rows else None
        if extent <= 0:  # no LV at all (so no pool either): ask the VG itself
            extent = self.volume_group().extent_size
        return VgReport(tuple(lvs), extent, area)

    def get(self, name: str) -> LogicalVolume:
        check_name(name)
        try:
            out = self.runner.run(
                ["lvs", *_REPORT, "-o", LV_FIELDS, f"{self.vg}/{name}"]
            ).stdout
        except CommandError as err:
            self._raise_if_vg_missing(err)
            if _is_not_found(err):
                raise LvNotFound(f"logical volume {self.vg}/{name} not found") from err
            raise
        for lv in parse_lvs(out):
            if lv.name == name:
                return lv
        raise LvNotFound(f"logical volume {self.vg}/{name} not found")

    def find(self, name: str) -> LogicalVolume | None:
        try:
            return self.get(name)
        except LvNotFound:
            return None

    def thin_pool(self) -> LogicalVolume:
        try:
            lv = self.get(self.pool)
        except LvNotFound as err:
            raise VolumeGroupMissing(f"thin pool {self.vg}/{self.pool} not found") from err
        if not lv.is_thin_pool:
            raise PoolUnusable(f"{self.vg}/{self.pool} is not a thin pool")
        return lv

    # writes ----------------------------------------------------------------

    def create_thin(self, name: str, size: int, tags: Iterable[str], *,
                    read_back: bool = True) -> LogicalVolume:
        """A new, active thin LV of `size` bytes (a multiple of the extent size).

        Without `read_back`, the LV is described from what lvcreate was told
        (LVM makes a thin LV of exactly a whole number of extents), sparing an
        `lvs`; its device numbers are then unknown (-1).
        """
        tag_list = list(tags)
        argv = [
            "lvcreate", "--yes", "--thin", f"{self.vg}/{self.pool}",
            "--virtualsize", f"{size}b", "--name", check_name(name),
            "--setactivationskip", "n", "--activate", "y", *self.create_args,
        ]
        argv += _tag_args(tag_list)
        self.runner.run(argv)
        if read_back:
            return self.get(name)
        return LogicalVolume(
            name=name, vg=self.vg, size=size, tags=frozenset(tag_list), attr="Vwi-a-tz--",
            pool=self.pool, origin="", path=f"/dev/{self.vg}/{name}", data_percent=None,
            metadata_percent=None, created=int(time.time()), health="", kernel_major=-1,
            kernel_minor=-1,
        )

    def snapshot(
        self, source: str, name: str, tags: Iterable[str], *, writable_volume: bool,
        read_back: bool = True, size: int = 0,
    ) -> LogicalVolume:
        """A thin snapshot of `source`.

        Snapshot objects keep LVM's activation skip (they are never read
        directly); volumes restored or cloned from a source are activated.
        Without `read_back`, the LV is described from what lvcreate was told
        (a thin snapshot has its origin's `size`), sparing an `lvs`.
        """
        tag_list = list(tags)
        argv = ["lvcreate", "--yes", "--snapshot", "--name", check_name(name)]
        if writable_volume:
            argv += ["--setactivationskip", "n", "--activate", "y", *self.create_args]
        else:
            argv += ["--setactivationskip", "y", "--activate", "n"]
        argv += _tag_args(tag_list)
        argv.append(f"{self.vg}/{check_name(source)}")
        try:
            self.runner.run(argv)
        except CommandError as err:
            if _ORIGIN_SUSPEND_RE.search(err.stderr):
                raise OriginFrozen(
                    f"LVM could not suspend {self.vg}/{source} for its snapshot: {err.message}"
                ) from err
            raise
        if read_back or size <= 0:
            return self.get(name)
        return LogicalVolume(
            name=name, vg=self.vg, size=size, tags=frozenset(tag_list),
            attr="Vwi-a-tz--" if writable_volume else "Vwi---tz-k", pool=self.pool,
            origin=source, path=f"/dev/{self.vg}/{name}", data_percent=None,
            metadata_percent=None, created=int(time.time()), health="", kernel_major=-1,
            kernel_minor=-1,
        )

    def activate(self, lv: LogicalVolume) -> LogicalVolume:
        """The LV, active; `lv` is what the caller last read, to spare a report."""
        name = lv.name
        if not lv.active:
            self.runner.run(
                ["lvchange", "--activate", "y", "--ignoreactivationskip", f"{self.vg}/{name}"]
            )
            lv = self.get(name)
        return lv

    def extend(self, name: str, size: int) -> LogicalVolume:
        """Grow to at least `size` bytes; returns the LV as LVM reports it afterwards."""
        lv = self.get(name)
        if lv.size >= size:
            return lv
        self.runner.run(["lvextend", "--size", f"{size}b", f"{self.vg}/{check_name(name)}"])
        return self.get(name)

    def extend_to(self, lv: LogicalVolume, size: int) -> LogicalVolume:
        """`lv` grown to `size` bytes, a whole number of extents, with one
        lvextend: `lv` is what the caller read under the pool lock, so no
        report before or after (LVM makes exactly that size)."""
        if lv.size >= size:
            return lv
        self.runner.run(["lvextend", "--size", f"{size}b", f"{self.vg}/{check_name(lv.name)}"])
        return dataclasses.replace(lv, size=size)

    def remove(self, name: str) -> bool:
        """Remove an LV; False when it was already gone, VolumeInUse when it is open."""
        try:
            self.runner.run(["lvremove", "--yes", f"{self.vg}/{check_name(name)}"])
        except CommandError as err:
            self._raise_if_vg_missing(err)
            if _is_not_found(err):
                return False
            if _IN_USE_RE.search(err.stderr):
                raise VolumeInUse(err.message) from err
            raise
        return True

    def extend_pool(self, data_bytes: int = 0, metadata_bytes: int = 0) -> None:
        """Grow the thin pool's data and/or metadata by these many bytes."""
        target = f"{self.vg}/{self.pool}"
        if data_bytes > 0:
            self.runner.run(["lvextend", "--size", f"+{data_bytes}b", target])
        if metadata_bytes > 0:
            self.runner.run(["lvextend", "--poolmetadatasize", f"+{metadata_bytes}b", target])

    def add_tags(self, name: str, tags: Sequence[str]) -> None:
        self.runner.run(["lvchange", *_tag_args(tags), f"{self.vg}/{check_name(name)}"])

    def delete_tags(self, name: str, tags: Sequence[str]) -> None:
        argv = ["lvchange"]
        for tag in tags:
            argv += ["--deltag", check_tag(tag)]
        self.runner.run([*argv, f"{self.vg}/{check_name(name)}"])


    # the demo backing (csi-local serve --backing-file) ------------------------

    def create_volume_group(self, device: str) -> None:
        """A VG on `device`, made a PV with a metadata area of
        RECOMMENDED_METADATA_SIZE (LVM's default fills up after some hundreds
        of volumes: README, "Sizes and capacity")."""
        self.runner.run(["vgcreate", "--yes", "--metadatasize", RECOMMENDED_METADATA_SIZE,
                         self.vg, device])

    def activate_volume_group(self) -> None:
        self.runner.run(["vgchange", "--activate", "y", self.vg])

    def create_thin_pool(self, percent_of_vg: int) -> None:
        """The thin pool, on `percent_of_vg` of the VG, failing writes at once when
        it fills (instead of queueing them until someone extends it)."""
        self.runner.run([
            "lvcreate", "--yes", "--type", "thin-pool", "--extents", f"{percent_of_vg}%VG",
            "--name", self.pool, self.vg,
        ])
        self.runner.run(["lvchange", "--errorwhenfull", "y", f"{self.vg}/{self.pool}"])


def _missing_vgs(err: CommandError, vgs: Sequence[str]) -> list[str]:
    """The VGs of `vgs` that LVM says are not there ("Volume group "x" not found")."""
    return [vg for vg in vgs if f'Volume group "{vg}" not found' in err.stderr]


def _read_vgs(runner: Runner, argv: list[str], vgs: Sequence[str]) -> tuple[str, list[str]]:
    """Run a report over `vgs`: (its output, the VGs missing). A missing VG makes
    LVM exit 5 after reporting the others, whose rows are kept."""
    try:
        return runner.run([*argv, *vgs]).stdout, []
    except CommandError as err:
        missing = _missing_vgs(err, vgs) if _vg_missing(err) else []
        if not missing:
            raise
        return err.stdout, missing


def find_in_vgs(runner: Runner, vgs: Sequence[str],
                names: Sequence[str]) -> tuple[list[LogicalVolume], list[str]]:
    """The LVs named `names` in any of `vgs`, in one `lvs`, and the VGs that
    are missing (where such an LV might be, so it cannot be called gone)."""
    select = " || ".join(f"lv_name=\"{check_name(n)}\"" for n in names)
    out, missing = _read_vgs(runner, ["lvs", *_REPORT, "-o", LV_FIELDS, "--select", select],
                             [check_name(vg) for vg in vgs])
    return parse_lvs(out), missing


def list_vgs(runner: Runner, vgs: Sequence[str]) -> tuple[list[LogicalVolume], list[str]]:
    """Every LV of `vgs` in one `lvs`, and the VGs that are missing."""
    out, missing = _read_vgs(runner, ["lvs", *_REPORT, "-o", LV_FIELDS],
                             [check_name(vg) for vg in vgs])
    return parse_lvs(out), missing


def _tag_args(tags: Iterable[str]) -> list[str]:
    args: list[str] = []
    for tag in tags:
        args += ["--addtag", check_tag(tag)]
    return args


class CommittedMetadata:
    """LVs as the VGs' committed metadata records them and the kernel shows
    them: read off the PVs and asked of device-mapper, with no process (see
    csi_local.storage.vg_text). For the hot paths that only need to find one LV;
    None whenever it cannot answer for certain, and the caller asks `lvs`.

    The PVs of each VG come from one `pvs`, at first use and again (at most
    every REFRESH seconds) when the known PVs of a VG do not answer for
    certain: a PV added, removed or renamed under a new device node. A PV
    once seen in the VG is still read after (see _physical_volumes)."""

    REFRESH = 30.0

    def __init__(self, runner: Runner) -> None:
        import threading

        self.runner = runner
        self._lock = threading.Lock()
        self._pvs: dict[str, list[tuple[str, str]]] | None = None  # vg -> [(path, uuid)]
        self._read_at = 0.0
        # vg -> the last text read and what it says: a VG that did not change
        # since is not parsed again, and one that did parses its new sections.
        self._parsed: dict[str, tuple[bytes, lvm_metadata.VgMetadata]] = {}
        self._problems: dict[str, tuple[str, ...]] = {}
        self._areas: dict[str, MetadataArea] = {}

    def _physical_volumes(self, refresh: bool) -> dict[str, list[tuple[str, str]]]:
        with self._lock:
            stale = refresh and time.monotonic() - self._read_at >= self.REFRESH
            if self._pvs is None or stale:
                self._read_at = time.monotonic()
                out = self.runner.run(["pvs", *_REPORT, "-o", "pv_name,vg_name,pv_uuid"]).stdout
                data = json.loads(out) if out.strip() else {"report": []}
                pvs: dict[str, list[tuple[str, str]]] = {}
                for rep in data.get("report", []):
                    for row in rep.get("pv", []):
                        if row.get("vg_name"):
                            pvs.setdefault(row["vg_name"], []).append(
                                (row["pv_name"], row.get("pv_uuid", "")))
                # A PV once the VG's is still read: `pvs` leaves out one whose
                # copy is outdated (LVM ignores it, and warns), and it may come
                # back. One whose label says another ID now is skipped at read.
                # A missing PV is listed as "[unknown]": where it was is kept.
                for vg, known in (self._pvs or {}).items():
                    listed = pvs.setdefault(vg, [])
                    where = {uuid: path for path, uuid in listed}
                    for path, uuid in known:
                        if uuid not in where:
                            listed.append((path, uuid))
                        elif path.startswith("/") and not where[uuid].startswith("/"):
                            listed[:] = [(path if u == uuid else p, u) for p, u in listed]
                self._pvs = pvs
            return self._pvs

    def volume_group(self, vg: str) -> lvm_metadata.VgMetadata | None:
        """VG `vg`'s committed metadata, when every copy on its PVs agrees;
        None otherwise (the caller asks LVM, which reads them all too).

        As LVM: every metadata area of every PV of the VG is read, and the
        copy with the highest seqno is the VG's. PVs that copy does not list
        are none of the VG's (one taken out while it was away still holds
        the old copy). Whenever a listed PV is missing, or a copy is older
        or differs, LVM's own answer is taken (its warnings, its repair):
        problems() says why."""
        for refresh in (False, True):
            try:
                pvs = self._physical_volumes(refresh).get(vg, [])
            except CommandError:
                return None
            meta, problems = self._examine(vg, pvs)
            with self._lock:
                self._problems[vg] = tuple(problems)
            if meta is not None:
                return meta
        return None

    def problems(self, vg: str) -> tuple[str, ...]:
        """Why the last read of `vg` could not answer from its committed
        metadata (a PV missing, a copy outdated or differing); () when it
        could, or when `vg` was never read."""
        with self._lock:
            return self._problems.get(vg, ())

    def check(self, vg: str, *, ask_lvm: bool = False, attempts: int = 3,
              pause: float = 0.2) -> tuple[str, ...]:
        """problems() of a fresh read, for reports (status, doctor, metrics): a
        copy older than another for the instant LVM takes to commit a change
        to each PV in turn is no problem, so one is only reported when it
        lasts `attempts` reads.

        `ask_lvm`: LVM's own warnings of the VG's metadata too, from one
        `vgs`. `pvs` does not list a PV whose outdated copy LVM ignores, so
        a reader that never saw it there cannot tell; LVM reads every
        device and says so."""
        problems: tuple[str, ...] = ()
        for attempt in range(attempts):
            if self.volume_group(vg) is not None:
                break
            if attempt + 1 < attempts:
                time.sleep(pause)
        else:
            problems = self.problems(vg)
        if ask_lvm:
            problems += tuple(w for w in _metadata_warnings(self.runner, vg)
                              if w not in problems)
        return problems

    def _examine(self, vg: str, pvs: Sequence[tuple[str, str]]
                 ) -> tuple[lvm_metadata.VgMetadata | None, list[str]]:
        """(the newest metadata when it answers for certain, else None; the
        problems found) from the PVs `pvs` lists for `vg`."""
        # uuid -> (path, the copies of this VG it holds: (VG ID, seqno, text)),
        # and the sizes of the areas they are in
        present: dict[str, tuple[str, list[tuple[str, int, bytes]]]] = {}
        area_sizes: dict[str, tuple[int, ...]] = {}
        unreadable: dict[str, str] = {}  # uuid -> why
        for path, uuid in pvs:
            try:
                found = lvm_metadata.read_copies(path)
                if found.pv_uuid != uuid:
                    continue  # another PV under that node now
                copies = []
                for text in found.texts:
                    name, vg_id, seqno = lvm_metadata.text_head(text)
                    if name == vg:
                        copies.append((vg_id, seqno, text))
                area_sizes[uuid] = found.area_sizes
            except lvm_metadata.MetadataUnreadable as err:
                log.debug("committed metadata of %s from %s: %s", vg, path, err)
                unreadable[uuid] = str(err)
                continue
            present[uuid] = (path, copies)
        every = [c for _, copies in present.values() for c in copies]
        if not every:
            # No PV known (a VG not found, devices that cannot be read): `lvs`
            # says so, and the checks of the VG itself report it.
            return None, []
        newest = max(seqno for _, seqno, _ in every)
        texts = {text for _, seqno, text in every if seqno == newest}
        if len(texts) != 1:
            return None, [f"VG {vg}: copies of metadata seqno {newest} differ"]
        (text,) = texts
        cached = self._parsed.get(vg)
        try:
            if cached is not None and cached[0] == text:
                meta = cached[1]
            else:  # only the LVs whose sections changed are parsed
                meta = lvm_metadata.vg_metadata(text, cached[1] if cached is not None else None)
                self._parsed[vg] = (text, meta)
        except lvm_metadata.MetadataUnreadable as err:
            return None, [f"VG {vg}: metadata seqno {newest}: {err}"]
        if meta.name != vg:
            return None, [f"VG {vg}: its newest metadata names VG {meta.name}"]
        paths = {uuid: path for path, uuid in pvs}
        problems: list[str] = []
        # A PV that the newest copy does not list is not the VG's: unreadable,
        # it is no problem of the VG's; holding an old copy, it is (lvs warns).
        for uuid in sorted(meta.pv_uuids):
            where = f" ({paths[uuid]})" if uuid in paths else ""
            if uuid in unreadable:
                problems.append(f"PV {uuid}{where} of VG {vg} cannot be read: "
                                f"{unreadable[uuid]}")
            elif uuid in meta.missing_pvs or uuid not in present:
                problems.append(f"PV {uuid}{where} of VG {vg} is missing")
        for uuid, (path, copies) in present.items():
            old = sorted({seqno for vg_id, seqno, _ in copies
                          if seqno != newest or vg_id != meta.uuid})
            if not old:
                continue
            if uuid not in meta.pv_uuids:
                problems.append(f"PV {path} is not in VG {vg} (metadata seqno {newest}) but "
                                f"holds its outdated metadata (seqno {old[0]})")
            else:
                problems.append(f"PV {path} has outdated metadata of VG {vg} (seqno "
                                f"{old[0]}, newest {newest})")
        if not problems:
            # Every area in use of every PV of the VG holds this text (no
            # problem found), and LVM writes the next one to each of them.
            sizes = [size for uuid in meta.pv_uuids for size in area_sizes.get(uuid, ())]
            if sizes:
                with self._lock:
                    self._areas[vg] = MetadataArea(min(sizes), len(text))
        return (None if problems else meta), problems

    def space(self, vg: str) -> VolumeGroup | None:
        """What `Lvm.volume_group()` (one `vgs`) answers: the VG's size and free
        bytes, from the extents its PVs hold and those its LVs map on them.
        None when the metadata does not answer."""
        meta = self.volume_group(vg)
        if meta is None or meta.pe_count <= 0:
            return None
        used = sum(lv.pv_extents for lv in meta.lvs.values())
        extent = meta.extent_size
        return VolumeGroup(vg, meta.pe_count * extent, (meta.pe_count - used) * extent, extent)

    def metadata_area(self, vg: str) -> MetadataArea | None:
        """The tightest metadata area of `vg` as its last read found it (no
        I/O; None when no read of it answered)."""
        with self._lock:
            return self._areas.get(vg)

    def report(self, vg: str, pool: str) -> VgReport | None:
        """What `Lvm.report()` answers for capacity and idempotency checks:
        every LV of `vg` with its size, tags, thin pool and origin, and the
        thin pool `pool` with its usage as the kernel reports it. The thin
        volumes carry no kernel state (shown inactive, with no device): a
        caller that acts on a volume's device reads it another way. None when
        the metadata or the pool's status does not answer."""
        meta = self.volume_group(vg)
        if meta is None:
            return None
        usages = _pool_usages(vg, [pool] if pool in meta.lvs else [])
        if usages is None:
            return None
        return VgReport(tuple(_listed_lvs(vg, meta, usages, None)), meta.extent_size,
                        self.metadata_area(vg))

    def listing(self, vgs: Sequence[str]) -> list[LogicalVolume] | None:
        """Every LV of `vgs` as `lvs VG...` lists them, for the calls that
        read many volumes (ListVolumes, ListSnapshots, the state's recovery
        at start): sizes, tags, pools and origins from the metadata; which
        LVs are active, and their devices, from one list of the kernel's
        devices; each thin pool's usage and health from its status. Not
        read, and shown as not: whether a volume is open, and how much of a
        thin volume is mapped (data_percent). None when a VG, its pools or
        the kernel do not answer."""
        from csi_local.host import device_mapper as dm

        metas = []
        for vg in vgs:
            meta = self.volume_group(vg)
            if meta is None:
                return None
            metas.append((vg, meta))
        try:
            devices = dm.devices()
        except (StorageError, ValueError) as err:
            log.debug("device-mapper device list: %s", err)
            return None
        out: list[LogicalVolume] = []
        for vg, meta in metas:
            pools = [m.name for m in meta.lvs.values() if m.segment_type == "thin-pool"]
            usages = _pool_usages(vg, pools)
            if usages is None:
                return None
            out += _listed_lvs(vg, meta, usages, devices)
        return out

    def thin_pools(self, places: Sequence[tuple[str, str]]
                   ) -> dict[tuple[str, str], LogicalVolume | None] | None:
        """{(vg, pool): the thin pool's LV, None when the VG holds no LV of that
        name} for each of `places`, as Probe asks it, without a process. None
        when a VG or a pool's status does not answer (a missing VG among them:
        `lvs` says which)."""
        out: dict[tuple[str, str], LogicalVolume | None] = {}
        for vg in sorted({vg for vg, _ in places}):
            meta = self.volume_group(vg)
            if meta is None:
                return None
            names = [pool for v, pool in places if v == vg and pool in meta.lvs]
            usages = _pool_usages(vg, names)
            if usages is None:
                return None
            found = {lv.name: lv for lv in _listed_lvs(vg, meta, usages, None)}
            for v, pool in places:
                if v == vg:
                    out[(vg, pool)] = found.get(pool)
        return out

    def thin_volume(self, vg: str, name: str,
                    meta: lvm_metadata.VgMetadata | None = None) -> LogicalVolume | None:
        """Thin LV vg/name with its kernel state, or None: not found (LVM
        has the last word on absence), not a thin volume, or no answer.
        `meta`: the VG's metadata the caller has just read (not read again)."""
        from csi_local.host import device_mapper as dm

        meta = meta or self.volume_group(vg)
        found = meta.lvs.get(name) if meta is not None else None
        if found is None or found.segment_type != "thin" or not found.visible:
            return None
        try:
            device = dm.device(dm.dm_name(vg, name))
        except (StorageError, ValueError) as err:  # as report(): no answer, ask lvs
            log.debug("device-mapper device of %s/%s: %s", vg, name, err)
            return None
        live = device is not None and device.live
        opened = device is not None and device.open_count > 0
        # lv_attr as lvs prints it for a thin volume: type, permissions,
        # allocation, fixed minor, state, open, target, zeroing, health, skip.
        attr = (f"Vwi-{'a' if live else '-'}{'o' if opened else '-'}tz-"
                f"{'k' if found.activation_skip else '-'}")
        return LogicalVolume(
            name=name, vg=vg, size=found.size, tags=found.tags, attr=attr, pool=found.pool,
            origin=found.origin, path=f"/dev/{vg}/{name}", data_percent=None,
            metadata_percent=None, created=found.created, health="",
            kernel_major=device.major if live and device else -1,
            kernel_minor=device.minor if live and device else -1,
            thin_id=found.device_id, uuid=found.uuid)


# LVM's warnings of a VG's metadata copies and PVs (lvm2's metadata.c,
# lvmcache.c): an outdated PV, copies of different seqnos, a PV missing.
_METADATA_WARNING_RE = re.compile(
    r"WARNING: (outdated PV .*|ignoring metadata seqno .*|Inconsistent metadata found .*"
    r"|Couldn't find device with uuid .*|VG \S+ is missing PV .*|PV \S+ .*is missing.*)")


def _metadata_warnings(runner: Runner, vg: str) -> list[str]:
    """LVM's own warnings of `vg`'s metadata, from one `vgs` (none when it
    cannot be read: the VG's own checks say why)."""
    try:
        err = runner.run(["vgs", *_REPORT, "-o", "vg_name", check_name(vg)]).stderr
    except CommandError as failed:
        err = failed.stderr
    return [f"LVM: {m.group(1).strip()}" for m in _METADATA_WARNING_RE.finditer(err)]


def _pool_usages(vg: str, pools: Sequence[str]) -> dict[str, PoolUsage | None] | None:
    """{pool: its usage, None when it is not active} from each thin pool's
    status; None when one cannot be read or trusted (a failed pool: `lvs`
    tells its health)."""
    from csi_local.host import device_mapper as dm

    out: dict[str, PoolUsage | None] = {}
    for pool in pools:
        try:
            out[pool] = dm.pool_usage(vg, pool)
        except (StorageError, ValueError) as err:
            log.debug("thin pool %s/%s status: %s", vg, pool, err)
            return None
    return out


def _listed_lvs(vg: str, meta: lvm_metadata.VgMetadata, usages: dict[str, PoolUsage | None],
                devices: dict[str, tuple[int, int]] | None) -> list[LogicalVolume]:
    """The visible LVs of `meta` as `lvs` lists them. Thin pools in `usages`
    carry their usage and health (others are shown inactive); with `devices`
    (dm.devices()), an LV with a device-mapper device is active, with its
    numbers; without, no LV but a pool is shown active."""
    from csi_local.host import device_mapper as dm

    lvs = []
    for m in meta.lvs.values():
        if not m.visible:
            continue  # as `lvs VG` (no -a): a pool's _tdata and _tmeta are its own
        numbers = None
        if devices is not None:
            # A stacked pool's device is its -tpool layer, as lvs reports it.
            numbers = (m.segment_type == "thin-pool" and devices.get(
                f"{dm.dm_name(vg, m.name)}-tpool")) or devices.get(dm.dm_name(vg, m.name))
        usage = usages.get(m.name) if m.segment_type == "thin-pool" else None
        active = "a" if numbers is not None or usage is not None else "-"
        if m.segment_type == "thin":
            attr = f"Vwi-{active}-tz-{'k' if m.activation_skip else '-'}"
        elif m.segment_type == "thin-pool":
            attr = f"twi-{active}-tz{_pool_health(usage)[0]}-"
        else:
            attr = f"-wi-{active}-----"
        lvs.append(LogicalVolume(
            name=m.name, vg=vg, size=m.size, tags=m.tags, attr=attr, pool=m.pool,
            origin=m.origin,
            path="" if m.segment_type == "thin-pool" else f"/dev/{vg}/{m.name}",
            data_percent=_percent(usage.data_used, usage.data_total) if usage else None,
            metadata_percent=_percent(usage.metadata_used, usage.metadata_total)
            if usage else None,
            created=m.created,
            health=_pool_health(usage)[1] if m.segment_type == "thin-pool" else "",
            kernel_major=numbers[0] if numbers is not None else -1,
            kernel_minor=numbers[1] if numbers is not None else -1,
            metadata_size=_pool_metadata_size(meta, m),
            thin_id=m.device_id, uuid=m.uuid))
    return lvs


def _pool_health(usage: PoolUsage | None) -> tuple[str, str]:
    """(lv_attr's health character, lv_health_status) of a thin pool, as lvs
    derives them from its status (lvm2's report.c; a failed pool gives no
    usage here, and the caller asks lvs)."""
    if usage is None:
        return "-", ""
    if usage.out_of_data_space:
        return "D", "out_of_data"
    if usage.read_only:
        return "M", "metadata_read_only"
    return "-", ""


def _percent(used: int, total: int) -> float:
    """As lvs shows it: a percentage with two decimals."""
    return round(100.0 * used / total, 2) if total else 0.0


def _pool_metadata_size(meta: lvm_metadata.VgMetadata, lv: lvm_metadata.MetaLv) -> int:
    """A thin pool's metadata LV's size (lv_metadata_size); 0 for other LVs."""
    if lv.segment_type != "thin-pool" or not lv.metadata_lv:
        return 0
    found = meta.lvs.get(lv.metadata_lv)
    return found.size if found is not None else 0
