"""How `csi-local status` prints what csi_local.ops.status.collect read: the
human table (sizes, ages, conditions, one block per device class when
there are several) and the JSON document.
"""

from __future__ import annotations

import dataclasses
import json

from csi_local.ops.status.collect import PoolInfo, Status, VolumeGroupInfo
from csi_local.volumes.naming import Condition
from csi_local.volumes.pool import METADATA_AREA_WARN


def human_size(n: float) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def human_age(seconds: float) -> str:
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    if s < 2 * 3600:
        return f"{s // 60}m"
    if s < 2 * 86400:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def _pct(p: float | None) -> str:
    return "-" if p is None else f"{p:.1f}%"


def _co(names: dict[str, str]) -> str:
    name, ns = names.get("pvc_name"), names.get("pvc_namespace")
    if name and ns:
        return f"{ns}/{name}"
    return name or "-"


def _cond(c: Condition) -> str:
    return f"ABNORMAL: {c.message}" if c.abnormal else "ok"


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  "
            + r[-1] for r in rows]


def _pool_lines(vg: VolumeGroupInfo | None, pool: PoolInfo, error: str | None,
                indent: str = "") -> list[str]:
    """A class's VG and thin pool."""
    if vg is None:
        name = pool.name.partition("/")[0]  # the pool's name is VG/POOL
        return [f"{indent}Volume group {name}: PROBLEM: {error}"]
    out = [f"{indent}Volume group {vg.name}: size {human_size(vg.size)}, "
           f"free {human_size(vg.free)}"]
    out += [f"{indent}  PROBLEM: {p} (LVM's own answers are used until it is "
            "resolved)" for p in vg.metadata_problems]
    if pool.problem:
        out.append(f"{indent}Thin pool {pool.name}: PROBLEM: {pool.problem}")
        return out + _area_lines(vg, indent)
    state = "active" if pool.active else "NOT ACTIVE"
    out.append(f"{indent}Thin pool {pool.name}: size {human_size(pool.size)}, data "
               f"{_pct(pool.data_percent)}, metadata {_pct(pool.metadata_percent)}, "
               f"{state}; room for new volumes {human_size(pool.available)} "
               f"(over-provisioning ratio {pool.overprovision_ratio:g})")
    if pool.health:
        out.append(f"{indent}  PROBLEM: thin pool health is {pool.health}")
    out.append(f"{indent}  WARNING: {pool.fill_problem}" if pool.fill_problem
               else f"{indent}  below its high-water marks")
    if pool.count_problem:
        out.append(f"{indent}  PROBLEM: no new volumes or snapshots: {pool.count_problem}")
    return out + _area_lines(vg, indent)


def _area_lines(vg: VolumeGroupInfo, indent: str) -> list[str]:
    """The VG's metadata area: how full, and a warning above METADATA_AREA_WARN."""
    area = vg.metadata_area
    if area is None:
        return []
    out = [f"{indent}Metadata area of {vg.name}: {area.used_percent:.1f}% full, {area.used} "
           f"of {area.limit} bytes of text (smallest area in use {human_size(area.size)}); "
           f"room for at least {area.lvs_that_fit} more volumes or snapshots"]
    if area.problem is not None:
        out.append(f"{indent}  PROBLEM: {area.problem}")
    elif area.used_percent >= 100 * METADATA_AREA_WARN:
        out.append(f"{indent}  WARNING: above {100 * METADATA_AREA_WARN:g}% full: give the "
                   "VG a bigger metadata area (pvcreate --metadatasize; docs/kubernetes.md, "
                   "\"Prepare the nodes\")")
    return out


def _by_class(status: Status) -> bool:
    """Whether the classes come from a configuration file: then every class is
    named and so is every volume's. The flags' one class (`default`) is not,
    and the output stays as it was before device classes."""
    return status.config is not None or len(status.classes) > 1


def render(status: Status) -> str:
    """The human table."""
    out: list[str] = []
    by_class = _by_class(status)
    if by_class:
        names = ", ".join(c.name for c in status.classes)
        out.append(f"Device classes ({status.config or 'flags'}): {names}; "
                   f"default {status.default_class}")
        for c in status.classes:
            out.append(f"Class {c.name}{' (default)' if c.default else ''}:")
            out += _pool_lines(c.volume_group, c.thin_pool, c.error, "  ")
    else:
        (only,) = status.classes
        out += _pool_lines(only.volume_group, only.thin_pool, only.error)
    st = status.state
    if st.error:
        out.append(f"State file {st.path}: {st.error}; stagings and publishes unknown")
    else:
        out.append(f"State file {st.path}: {st.records} volume(s) staged or published")

    klass: list[str] = ["CLASS"] if by_class else []
    for title, items in (("CSI volumes", status.volumes), ("CSI snapshots", status.snapshots)):
        out.append("")
        out.append(f"{title}: {len(items)}")
        if not items:
            continue
        rows = [["ID", *klass, "SIZE", "DATA", "AGE", "CO NAME", "SOURCE", "CONDITION"]]
        rows += [[v.id, *([v.device_class or "-"] if by_class else []), human_size(v.size),
                  _pct(v.data_percent), human_age(v.age_seconds), _co(v.co_names),
                  v.source or "-", _cond(v.condition)] for v in items]
        lines = _table(rows)
        out.append(lines[0])
        for v, line in zip(items, lines[1:], strict=True):
            out.append(line)
            if v.encrypted:
                out.append(f"      encrypted (LUKS2): {v.crypt_device or 'closed'}")
            if v.staged:
                fs = f", {v.staged.fs_type}" if v.staged.fs_type else ""
                out.append(f"      staged at {v.staged.path} ({v.staged.access_type}{fs})")
            if v.io_limits:
                limits = ", ".join(f"{k}={n}" for k, n in v.io_limits.items())
                out.append(f"      IO limits: {limits}")
            for p in v.published:
                out.append(f"      published at {p.target} ({'ro' if p.readonly else 'rw'})")
                if p.io_limits:
                    out.append(f"        IO limits {p.io_limits}")
            if v.possible_orphan:
                out.append("      possible orphan: see below")

    out.append("")
    out.append(f"Host volumes (csi-local-dhv): {len(status.host_volumes)}")
    if status.host_volumes:
        rows = [["LV", *klass, "KIND", "SIZE", "DATA", "AGE", "FS", "NAME (NAMESPACE)",
                 "ID / SNAPSHOT", "SOURCE", "CONDITION"]]
        rows += [[h.lv, *([h.device_class or "-"] if by_class else []), h.kind,
                  human_size(h.size), _pct(h.data_percent), human_age(h.age_seconds),
                  h.fs_type or "-", f"{h.name or '-'} ({h.namespace or '-'})", h.id or "-",
                  h.source or "-", _cond(h.condition)] for h in status.host_volumes]
        lines = _table(rows)
        out.append(lines[0])
        for h, line in zip(status.host_volumes, lines[1:], strict=True):
            out.append(line)
            if h.encrypted:
                out.append(f"      encrypted (LUKS2): {h.crypt_device or 'closed'}")

    out.append("")
    out.append(f"Possible orphans: {len(status.possible_orphans)}")
    if st.error:
        out.append("  (unused volumes not judged: the state file could not be read)")
    if status.possible_orphans:
        rows = [["LV", "KIND", "AGE", "WHY"]]
        rows += [[o.lv, o.kind, human_age(o.age_seconds), o.reason]
                 for o in status.possible_orphans]
        out += _table(rows)
        out.append(f"  {status.orphan_note}")
    return "\n".join(out) + "\n"


def to_json(status: Status) -> str:
    return json.dumps(dataclasses.asdict(status), indent=2, sort_keys=False) + "\n"
