"""The bench's fast fill (benchmarks/fill.py): the metadata text and thin
pool XML it writes, on what LVM and thin_dump wrote in the test VM for two
volumes and a snapshot made by the plugin (tests/unit/data/fill/). That LVM
takes the result is proven in the VM: tests/integration/test_bench_fill.py."""

from __future__ import annotations

import random
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from benchmarks import fill
from csi_local.storage.vg_text import parse_text
from csi_local.volumes import naming

DATA = Path(__file__).parent / "data" / "fill"
VG_TEXT = (DATA / "vgcfgbackup.txt").read_text()
THIN_XML = (DATA / "thin_dump.xml").read_text()
VG = "csibench96f89407"
VOL0 = "csi-v-264847917d29f20405972b68238d0d96"  # the snapshot's origin
SNAP = "csi-s-5180e1e3e9e409bc09cec1a201e176ed"


def _vg(text: str) -> dict[str, Any]:
    vg = parse_text(text.encode())[VG]
    assert isinstance(vg, dict)
    return vg


def _lvs(text: str) -> dict[str, Any]:
    lvs = _vg(text)["logical_volumes"]
    assert isinstance(lvs, dict)
    return lvs


def _clones(n: int, snaps: int) -> list[fill.Clone]:
    volumes = [fill.Clone(naming.volume_id_for(f"v{i}"), VOL0) for i in range(n)]
    return volumes + [fill.Clone(naming.snapshot_id_for(f"s{i}"), SNAP, volumes[i].name)
                      for i in range(snaps)]


def test_sample_is_what_the_plugin_made() -> None:
    assert fill.thin_ids(VG_TEXT, "pool") == {
        VOL0: 1, "csi-v-496955f82751aa43b09ff3cbdb4743ae": 2, SNAP: 3}


def test_clones_get_new_names_ids_devices_and_the_template_tags() -> None:
    clones = _clones(50, 5)
    text, made, transaction = fill.clone_vg_text(VG_TEXT, "pool", clones,
                                                 rng=random.Random(1))
    assert transaction == 4
    assert sorted(made.values()) == list(range(4, 4 + 55))
    lvs = _lvs(text)
    assert len(lvs) == len(_lvs(VG_TEXT)) + 55
    ids = [lv["id"] for lv in lvs.values()]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"[A-Za-z0-9]{6}(-[A-Za-z0-9]{4}){5}-[A-Za-z0-9]{6}", str(i))
               for i in ids)
    pool = lvs["pool"]["segment1"]
    assert pool["transaction_id"] == 4
    v = lvs[clones[7].name]
    assert v["tags"] == ["csi-local.kind=volume", "csi-local.size=4194304"]
    assert v["flags"] == []
    seg = v["segment1"]
    assert (seg["type"], seg["thin_pool"], seg["device_id"], seg["transaction_id"]) == (
        "thin", "pool", made[clones[7].name], 3)
    assert "origin" not in seg
    s = lvs[clones[52].name]
    origin = clones[2].name
    assert s["tags"] == ["csi-local.kind=snapshot",
                         f"csi-local.source=volume:{origin}"]
    assert s["flags"] == ["ACTIVATION_SKIP"]
    assert s["segment1"]["origin"] == origin
    # The templates themselves are untouched.
    assert lvs[SNAP]["segment1"]["origin"] == VOL0
    assert lvs[VOL0]["segment1"]["device_id"] == 1
    assert _vg(text)["seqno"] == 10


def test_clone_text_refuses_what_lvm_would() -> None:
    with pytest.raises(ValueError, match="exists already"):
        fill.clone_vg_text(VG_TEXT, "pool", [fill.Clone(VOL0, VOL0)])
    with pytest.raises(ValueError, match="not a thin LV"):
        fill.clone_vg_text(VG_TEXT, "pool", [fill.Clone("x", "pool_tdata")])
    with pytest.raises(ValueError, match="no origin"):
        fill.clone_vg_text(VG_TEXT, "pool", [fill.Clone("x", SNAP, "csi-v-nothere")])
    with pytest.raises(ValueError, match="origin"):
        fill.clone_vg_text(VG_TEXT, "pool", [fill.Clone("x", VOL0, VOL0)])
    with pytest.raises(ValueError, match="not a thin pool"):
        fill.clone_vg_text(VG_TEXT, VOL0, [])


def test_thin_xml_gets_a_device_per_clone_at_the_new_transaction() -> None:
    xml = fill.thin_xml_with(THIN_XML, [4, 5, 6], 4)
    root = ET.fromstring(xml)
    assert root.get("transaction") == "4"
    assert root.get("nr_data_blocks") == "52160"  # the pool's data, unchanged
    devices = {int(d.get("dev_id", "0")): d for d in root.iter("device")}
    assert sorted(devices) == [1, 2, 3, 4, 5, 6]
    assert devices[5].attrib == {"dev_id": "5", "mapped_blocks": "0", "transaction": "3",
                                 "creation_time": "1", "snap_time": "1"}
    with pytest.raises(ValueError, match="in use"):
        fill.thin_xml_with(THIN_XML, [3], 4)


def test_uuids_and_metadata_sizes() -> None:
    rng = random.Random(7)
    assert len({fill.lvm_uuid(rng) for _ in range(1000)}) == 1000
    assert fill.pool_metadata_bytes(3) == 12 << 20
    big = fill.pool_metadata_bytes(5500)
    assert big >= 2 * 5500 * 4096 and big % (4 << 20) == 0
