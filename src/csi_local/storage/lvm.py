"""The LVM commands on a VG and its LVs: reports, creation, snapshots,
growth, removal, tags (the plugins, the demo backing and the tests' harness
all come through here). LVM's own configuration is read in
storage.lvm_config; the VG as committed on its PVs, which spares a report on
the hot paths, in storage.committed_vg.

Reads use JSON reports in bytes; results are frozen dataclasses. LVM's "not
found" is mapped once, here, to LvNotFound / VolumeGroupMissing; an LV that
LVM will not remove because it is open is VolumeInUse. Every command runs
through the Runner, which sets LC_ALL=C and a timeout.
"""

from __future__ import annotations

import dataclasses
import json
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
    VolumeGroupMissing,
    VolumeInUse,
)
from csi_local.storage import vg_text

if TYPE_CHECKING:
    from csi_local.host.runner import Runner


LV_FIELDS = (
    "lv_name,vg_name,lv_size,lv_tags,lv_attr,pool_lv,origin,lv_path,"
    "data_percent,metadata_percent,lv_time,lv_health_status,lv_kernel_major,lv_kernel_minor,"
    "lv_metadata_size,thin_id,lv_uuid,chunk_size"
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
_NAME_RE = re.compile(r"[A-Za-z0-9+_.][A-Za-z0-9+_.-]{0,126}")
_TAG_RE = re.compile(r"[A-Za-z0-9_+.\-/=!:#&]{1,1024}")
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
    chunk_size: int = 0  # a thin pool's chunk size, bytes (0 for other LVs)

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
    the text outgrows the smallest one (vg_text.max_text_size)."""

    size: int  # bytes, the smallest area in use, its header included
    used: int  # bytes of the committed text (its closing NUL included)

    @property
    def limit(self) -> int:
        """The largest text LVM will write there."""
        return vg_text.max_text_size(self.size)

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
    limit = vg_text.max_text_size(size)
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
                    chunk_size=_int(row.get("chunk_size", "")),
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
    if not _NAME_RE.fullmatch(name):
        raise ValueError(f"invalid LVM name {name!r}")
    return name


def check_tag(tag: str) -> str:
    if not _TAG_RE.fullmatch(tag):
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
        self.change_tags(name, add=(), delete=tags)

    def change_tags(self, name: str, *, add: Sequence[str], delete: Sequence[str]) -> None:
        """Delete and add tags in one lvchange: one metadata commit, so that a
        reader sees the tags as they were or as they are, never half-way."""
        if not add and not delete:
            return
        argv = ["lvchange"]
        for tag in delete:
            argv += ["--deltag", check_tag(tag)]
        self.runner.run([*argv, *_tag_args(add), f"{self.vg}/{check_name(name)}"])


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


def pvs_by_vg(runner: Runner) -> dict[str, list[tuple[str, str]]]:
    """{VG: [(PV path, PV UUID)]} of every PV in a VG, from one `pvs` (a
    missing PV's path is "[unknown]"): where CommittedMetadata reads."""
    out = runner.run(["pvs", *_REPORT, "-o", "pv_name,vg_name,pv_uuid"]).stdout
    data = json.loads(out) if out.strip() else {"report": []}
    pvs: dict[str, list[tuple[str, str]]] = {}
    for rep in data.get("report", []):
        for row in rep.get("pv", []):
            if row.get("vg_name"):
                pvs.setdefault(row["vg_name"], []).append(
                    (row["pv_name"], row.get("pv_uuid", "")))
    return pvs


# LVM's warnings of a VG's metadata copies and PVs (lvm2's metadata.c,
# lvmcache.c): an outdated PV, copies of different seqnos, a PV missing.
_METADATA_WARNING_RE = re.compile(
    r"WARNING: (outdated PV .*|ignoring metadata seqno .*|Inconsistent metadata found .*"
    r"|Couldn't find device with uuid .*|VG \S+ is missing PV .*|PV \S+ .*is missing.*)")


def metadata_warnings(runner: Runner, vg: str) -> list[str]:
    """LVM's own warnings of `vg`'s metadata, from one `vgs` (none when it
    cannot be read: the VG's own checks say why)."""
    try:
        err = runner.run(["vgs", *_REPORT, "-o", "vg_name", check_name(vg)]).stderr
    except CommandError as failed:
        err = failed.stderr
    return [f"LVM: {m.group(1).strip()}" for m in _METADATA_WARNING_RE.finditer(err)]


def _tag_args(tags: Iterable[str]) -> list[str]:
    args: list[str] = []
    for tag in tags:
        args += ["--addtag", check_tag(tag)]
    return args
