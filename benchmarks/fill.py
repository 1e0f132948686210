"""Thousands of CSI volumes in a VG in minutes: LVM's metadata written directly.

Under emulation a thin lvcreate takes seconds, more as the VG's metadata
grows, so 5,000 volumes made one by one take hours. Instead, a few template
LVs made by the plugin itself (CreateVolume, CreateSnapshot: their tags are
exactly the plugin's) are cloned in the VG's metadata text, and the thin
pool's own metadata is told about the clones' device IDs:

1. the pool's metadata is swapped out into an LV of its own (`lvconvert
   --thinpool VG/POOL --poolmetadata VG/LV`, lvmthin(7)'s documented repair
   path) and read with `thin_dump`; a device is added for each clone (no
   mappings: a clone is a thin LV never written, as CreateVolume leaves one),
   the transaction ID bumped, the result written back with `thin_restore`,
   checked with `thin_check` and swapped back in;
2. `vgcfgbackup`, the templates' sections cloned with new names, LV UUIDs,
   device IDs and origins (the source tag of a snapshot too), the pool's
   transaction ID bumped to match, then `vgcfgrestore --force`.

The real tools have the last word: `vgck` and `thin_check` pass, the pool
activates, and every clone is an LV the plugin lists, stages and deletes.
The clones are left inactive (as after a reboot, before a stage).
"""

from __future__ import annotations

import random
import re
import string
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Run = Callable[..., Any]  # benchmarks.lab.run: run(*argv, check=..., timeout=...)

# Every thin device has its own mapping-tree root (one 4 KiB block), and the
# pool's space maps and device-details tree want room besides.
THIN_META_BLOCK = 4096
UUID_CHARS = string.ascii_letters + string.digits
_UUID_GROUPS = (6, 4, 4, 4, 4, 4, 6)
# LVM's commands here write no archive or backup copy of each 3 MB text
# (the VM's /etc is memory).
NO_ARCHIVE = "backup/archive=0 backup/backup=0"


@dataclass(frozen=True)
class Clone:
    """A new LV `name`, a copy of template LV `template`; for a snapshot,
    `origin` replaces the template's origin (in its origin and its tags)."""

    name: str
    template: str
    origin: str | None = None


def pool_metadata_bytes(devices: int, extent: int = 4 << 20) -> int:
    """A thin pool metadata size with room for `devices` thin devices: twice
    their root blocks, and 8 MiB for the space maps; whole extents."""
    wanted = 2 * devices * THIN_META_BLOCK + (8 << 20)
    return max(4 << 20, -(-wanted // extent) * extent)


def lvm_uuid(rng: random.Random) -> str:
    """An LV UUID as LVM writes one (32 of [A-Za-z0-9], grouped 6-4-4-4-4-4-6)."""
    return "-".join("".join(rng.choice(UUID_CHARS) for _ in range(n)) for n in _UUID_GROUPS)


def _lv_span(text: str, name: str) -> tuple[int, int]:
    """Where LV `name`'s section is in a VG metadata text (vgcfgbackup's
    layout: two tabs before an LV's name and its closing brace)."""
    m = re.search(rf"^\t\t{re.escape(name)} {{\n.*?^\t\t}}\n", text, re.M | re.S)
    if m is None:
        raise ValueError(f"no logical volume {name} in the metadata text")
    return m.start(), m.end()


def lv_section(text: str, name: str) -> str:
    start, end = _lv_span(text, name)
    return text[start:end]


def _field(section: str, key: str) -> str | None:
    m = re.search(rf"^\t+{key} = (.+?)(\t#.*)?$", section, re.M)
    return m.group(1) if m else None


def _int_field(section: str, key: str) -> int:
    raw = _field(section, key)
    if raw is None:
        raise ValueError(f"no {key} in {section.splitlines()[0].strip()}")
    return int(raw)


def _set_field(section: str, key: str, value: str) -> str:
    new, count = re.subn(rf"^(\t+{key} = ).+?(\t#.*)?$", lambda m: m.group(1) + value,
                         section, count=1, flags=re.M)
    if count != 1:
        raise ValueError(f"no {key} in {section.splitlines()[0].strip()}")
    return new


def thin_ids(text: str, pool: str) -> dict[str, int]:
    """The device ID of each thin LV of `pool` in a VG metadata text."""
    found: dict[str, int] = {}
    for m in re.finditer(r"^\t\t(\S+) {\n(.*?)^\t\t}\n", text, re.M | re.S):
        body = m.group(2)
        if _field(body, "type") == '"thin"' and _field(body, "thin_pool") == f'"{pool}"':
            found[m.group(1)] = _int_field(body, "device_id")
    return found


def clone_vg_text(text: str, pool: str, clones: Sequence[Clone], *,
                  rng: random.Random | None = None) -> tuple[str, dict[str, int], int]:
    """`text` (a vgcfgbackup of the VG) with `clones` added: new names, LV
    UUIDs, device IDs (after the pool's highest), the pool's transaction ID
    one up and the clones made in the transaction before, as LVM records an
    lvcreate; the VG's seqno one up. Returns the text, each clone's device
    ID, and the new transaction ID."""
    rng = rng or random.Random()  # noqa: S311 - LV UUIDs need only be unique
    pool_start, pool_end = _lv_span(text, pool)
    pool_section = text[pool_start:pool_end]
    if _field(pool_section, "type") != '"thin-pool"':
        raise ValueError(f"{pool} is not a thin pool")
    transaction = _int_field(pool_section, "transaction_id")
    ids = thin_ids(text, pool)
    taken = set(re.findall(r'^\t+id = "([^"]+)"', text, re.M))
    names = set(re.findall(r"^\t\t(\S+) {$", text, re.M))
    next_id = max(ids.values(), default=0) + 1
    templates = {t: lv_section(text, t) for t in {c.template for c in clones}}
    made: dict[str, int] = {}
    parts: list[str] = []
    for c in clones:
        if c.name in names or c.name in made:
            raise ValueError(f"logical volume {c.name} exists already")
        if c.template not in ids:
            raise ValueError(f"template {c.template} is not a thin LV of {pool}")
        section = templates[c.template]
        old_origin = _field(section, "origin")
        if (old_origin is None) != (c.origin is None):
            raise ValueError(f"{c.name}: an origin needs a snapshot template, and back")
        section = section.replace(f"\t\t{c.template} {{\n", f"\t\t{c.name} {{\n", 1)
        if c.origin is not None and old_origin is not None:
            if c.origin not in names and c.origin not in made:
                raise ValueError(f"{c.name}: no origin {c.origin}")
            # Its origin, and the tags that name it (csi-local.source=volume:ID).
            section = section.replace(old_origin.strip('"'), c.origin)
        uuid = lvm_uuid(rng)
        while uuid in taken:
            uuid = lvm_uuid(rng)
        taken.add(uuid)
        section = _set_field(section, "id", f'"{uuid}"')
        section = _set_field(section, "device_id", str(next_id))
        section = _set_field(section, "transaction_id", str(transaction))
        made[c.name] = next_id
        next_id += 1
        parts.append("\n" + section)
    pool_section = _set_field(pool_section, "transaction_id", str(transaction + 1))
    out = text[:pool_start] + pool_section + "".join(parts) + text[pool_end:]
    seqno = re.search(r"^\tseqno = (\d+)$", out, re.M)
    if seqno is None:
        raise ValueError("no seqno in the metadata text")
    out = out[:seqno.start(1)] + str(int(seqno.group(1)) + 1) + out[seqno.end(1):]
    return out, made, transaction + 1


def thin_xml_with(xml: str, device_ids: Sequence[int], transaction: int) -> str:
    """A thin_dump XML with a device (no mappings) for each of `device_ids`,
    and the superblock at `transaction` (the one before, on the devices)."""
    root = ET.fromstring(xml)  # noqa: S314 - thin_dump of our own pool
    if root.tag != "superblock":
        raise ValueError("not a thin_dump XML")
    have = {int(d.get("dev_id", "-1")) for d in root.iter("device")}
    clash = have.intersection(device_ids)
    if clash:
        raise ValueError(f"thin device IDs in use already: {sorted(clash)[:5]}")
    time = root.get("time", "0")
    root.set("transaction", str(transaction))
    for dev_id in device_ids:
        dev = ET.SubElement(root, "device", {
            "dev_id": str(dev_id), "mapped_blocks": "0", "transaction": str(transaction - 1),
            "creation_time": time, "snap_time": time})
        dev.text = "\n  "
    return ET.tostring(root, encoding="unicode") + "\n"


def _deactivate(run: Run, vg: str, cfg: list[str], tries: int = 10) -> None:
    """Every LV of `vg` inactive (lvconvert swaps a pool's metadata only then).
    A device just made or closed may still be open for a moment (udev's
    probes), and vgchange leaves it active: settle, and try again."""
    active: list[str] = []
    for _ in range(tries):
        run("vgchange", *cfg, "--activate", "n", vg, check=False, timeout=7200)
        active = run("lvs", "-a", "--noheadings", "-o", "lv_name", "--select",
                     "lv_active=active", vg).stdout.split()
        if not active:
            return
        run("udevadm", "settle", check=False)
        time.sleep(1)
    raise RuntimeError(f"LVs of {vg} stay active: {', '.join(active)}")


def fill_vg(run: Run, vg: str, pool: str, clones: Sequence[Clone], workdir: Path,
            *, say: Callable[[str], None] = lambda _s: None) -> dict[str, int]:
    """Add `clones` (of thin LVs in `vg`/`pool`) to the VG, as the module's
    docstring says. Nothing may use the VG meanwhile (its LVs are deactivated;
    the pool is activated again at the end). Returns each clone's device ID."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = ["--config", NO_ARCHIVE]
    meta = "csibenchfillmeta"
    _deactivate(run, vg, cfg)
    size = run("lvs", "--noheadings", "--units", "b", "--nosuffix", "-o",
               "lv_metadata_size", f"{vg}/{pool}").stdout.strip()
    # The pool's metadata out into an LV of its own (the new, empty one in).
    run("lvcreate", *cfg, "--yes", "--activate", "n", "--zero", "n", "--size", f"{size}b",
        "--name", meta, vg)
    try:
        run("lvconvert", *cfg, "--yes", "--thinpool", f"{vg}/{pool}", "--poolmetadata",
            f"{vg}/{meta}", timeout=3600)
        run("lvchange", *cfg, "--activate", "y", f"{vg}/{meta}")
        dev = f"/dev/{vg}/{meta}"
        backup = workdir / "vg.txt"
        run("vgcfgbackup", "--file", str(backup), vg, timeout=3600)
        text, made, transaction = clone_vg_text(backup.read_text(), pool, clones)
        xml = thin_xml_with(run("thin_dump", dev, timeout=3600).stdout,
                            list(made.values()), transaction)
        (workdir / "pool.xml").write_text(xml)
        say(f"  thin_restore of {len(made)} new devices")
        run("thin_restore", "-i", str(workdir / "pool.xml"), "-o", dev, timeout=3600)
        run("thin_check", dev, timeout=3600)
        run("lvchange", *cfg, "--activate", "n", f"{vg}/{meta}")
        # Back in: the pool's metadata is the restored one, `meta` the unused one.
        run("lvconvert", *cfg, "--yes", "--thinpool", f"{vg}/{pool}", "--poolmetadata",
            f"{vg}/{meta}", timeout=3600)
    finally:
        run("lvremove", *cfg, "--yes", f"{vg}/{meta}", check=False, timeout=3600)
    # The text from a backup taken now: the swaps changed the pool's sections.
    run("vgcfgbackup", "--file", str(backup), vg, timeout=3600)
    current = backup.read_text()
    text, again, _ = clone_vg_text(current, pool, clones)
    if again != made:
        raise RuntimeError("the device IDs moved between the two backups")
    # The pool's transaction ID was read before the swap; same VG, same one.
    new = workdir / "vg-filled.txt"
    new.write_text(text)
    say(f"  vgcfgrestore of {len(made)} new LVs")
    # --force: LVM asks for it with thin LVs in the VG (none active here).
    run("vgcfgrestore", *cfg, "--force", "--file", str(new), vg, input="y\n", timeout=7200)
    run("lvchange", *cfg, "--activate", "y", f"{vg}/{pool}", timeout=3600)
    return made
