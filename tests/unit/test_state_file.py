import json
import os
from pathlib import Path

import pytest

from csi_local.nodestate import state_file as st
from csi_local.nodestate.state_file import StateLocked, StateStore
from csi_local.volumes.node_records import AccessType, Publish, Staging, VolumeRecord


def test_missing_means_empty(tmp_path: Path) -> None:
    store = StateStore(str(tmp_path))
    rec = store.get("csi-v-x")
    assert rec.empty and rec.publish_count == 0
    store.close()


def test_roundtrip_and_counts(tmp_path: Path) -> None:
    store = StateStore(str(tmp_path))
    store.set_staging("v1", Staging("/s", AccessType.MOUNT, "ext4", ("noatime",), 1))
    store.add_publish("v1", "/t1", Publish(False, 1))
    store.add_publish("v1", "/t2", Publish(True, 1))
    data = json.loads((tmp_path / "state.json").read_text())
    assert data["version"] == 1
    assert data["volumes"]["v1"]["publish_count"] == 2
    store.close()
    again = StateStore(str(tmp_path))
    assert again.get("v1").publishes == {"/t1": Publish(False, 1), "/t2": Publish(True, 1)}
    assert [v for v, rec in again.all().items() if "/t2" in rec.publishes] == ["v1"]
    again.remove_publish("v1", "/t1")
    again.remove_publish("v1", "/t2")
    again.set_staging("v1", None)
    assert json.loads((tmp_path / "state.json").read_text())["volumes"] == {}
    again.close()


def test_second_process_is_kept_out(tmp_path: Path) -> None:
    first = StateStore(str(tmp_path))
    with pytest.raises(StateLocked, match="in use"):
        StateStore(str(tmp_path))
    first.close()
    StateStore(str(tmp_path)).close()


def test_corrupt_file_is_rebuilt_and_kept_aside(tmp_path: Path) -> None:
    (tmp_path / "state.json").write_text("{broken")
    rebuilt = {"v9": VolumeRecord("v9", Staging("/s9", AccessType.BLOCK), {})}
    store = StateStore(str(tmp_path), rebuild=lambda: rebuilt)
    assert store.get("v9").staging == Staging("/s9", AccessType.BLOCK)
    assert (tmp_path / "state.json.corrupt").read_text() == "{broken"
    assert json.loads((tmp_path / "state.json").read_text())["volumes"]["v9"]
    store.close()


def test_failed_write_leaves_old_file_and_no_temp(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    store = StateStore(str(tmp_path))
    store.set_staging("v1", Staging("/s", AccessType.MOUNT, "ext4"))
    before = (tmp_path / "state.json").read_text()

    def boom(src: str, dst: str) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        store.add_publish("v1", "/t", Publish())
    monkeypatch.undo()
    assert (tmp_path / "state.json").read_text() == before
    assert store.get("v1").publishes == {}  # memory matches disk
    assert not [p for p in os.listdir(tmp_path) if ".tmp." in p]
    store.close()


def test_stale_temp_files_removed_at_start(tmp_path: Path) -> None:
    (tmp_path / "state.json.tmp.123.456").write_text("half")
    StateStore(str(tmp_path)).close()
    assert not (tmp_path / "state.json.tmp.123.456").exists()


def test_render_parse_roundtrip() -> None:
    recs = {"a": VolumeRecord("a", Staging("/x", AccessType.MOUNT, "xfs", ("ro",), 5),
                              {"/p": Publish(True, 5)})}
    assert st.parse(st.render(recs)) == recs
    for other in (0, -1, "1", None, True, 1.0):  # not ours: set aside and rebuilt
        with pytest.raises(ValueError):
            st.parse(json.dumps({"version": other, "volumes": {}}))


def test_one_volume_a_line_and_one_change_renders_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = StateStore(str(tmp_path))
    for i in range(50):
        store.set_staging(f"v{i:02}", Staging(f"/s{i}", AccessType.MOUNT, "ext4", (), 1))
    text = (tmp_path / "state.json").read_text()
    lines = text.splitlines()
    assert len(lines) == 52 and lines[1].startswith('"v00": {') and lines[50].startswith('"v49"')
    assert st.parse(text) == store.all()  # still the JSON the store (and status) reads
    rendered: list[str] = []
    real = st.render_line

    def render_line(rec: VolumeRecord) -> str:
        rendered.append(rec.volume_id)
        return real(rec)

    monkeypatch.setattr(st, "render_line", render_line)
    store.add_publish("v07", "/t", Publish(False, 1))
    assert rendered == ["v07"]  # not the 49 others: a publish costs the same at any scale
    assert st.parse((tmp_path / "state.json").read_text())["v07"].publishes == {
        "/t": Publish(False, 1)}
    store.close()
    again = StateStore(str(tmp_path))  # records loaded from disk render once, then are kept
    rendered.clear()
    again.remove_publish("v07", "/t")
    assert len(rendered) == 50
    rendered.clear()
    again.add_publish("v08", "/t", Publish(True, 1))
    assert rendered == ["v08"]
    assert st.parse((tmp_path / "state.json").read_text()) == again.all()
    again.close()


LV_ID = "Xq3d1b-Hn0A-kM2f-9sLe-Jw7T-cP4u-Rr8eVb"  # an lv_uuid as LVM prints it


def test_formatting_mark_outlives_the_process_and_a_corrupt_state_file(
        tmp_path: Path) -> None:
    store = StateStore(str(tmp_path))
    assert not store.formatting(LV_ID)
    store.mark_formatting(LV_ID)
    store.mark_formatting(LV_ID)  # a retry marks again: still one mark
    store.close()
    # A restart (kill -9 inside mkfs) that finds the state file corrupt and
    # rebuilds it from the mounts still finds the mark: nothing mounted knows it.
    (tmp_path / "state.json").write_text("{broken")
    again = StateStore(str(tmp_path), rebuild=dict, reconcile=lambda r: {})
    assert again.formatting(LV_ID)
    assert not again.formatting(LV_ID.replace("X", "Y"))  # keyed by the LV's own ID
    again.clear_formatting(LV_ID)
    again.clear_formatting(LV_ID)  # gone already: nothing to do
    assert not again.formatting(LV_ID)
    assert sorted(os.listdir(tmp_path)) == ["state.json", "state.json.corrupt", "state.lock"]
    again.close()


@pytest.mark.parametrize("key", ["", "../state.json", "a/b", "x" * 65, "a b", "\u00e9"])
def test_formatting_mark_refuses_what_is_not_an_lv_id(tmp_path: Path, key: str) -> None:
    store = StateStore(str(tmp_path))
    for call in (store.mark_formatting, store.formatting, store.clear_formatting):
        with pytest.raises(ValueError, match="invalid LV ID"):
            call(key)
    assert sorted(os.listdir(tmp_path)) == ["state.lock"]
    store.close()
