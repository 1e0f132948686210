"""Encrypted host volumes (csi-local-dhv) over the fake host's cryptsetup:
the parameter, the key file the configuration names (per volume or per
class), create, grow and delete, clones, and what is refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from csi_local.dhv import removal as dhv_removal
from csi_local.dhv.config import PluginConfig
from csi_local.dhv.request import DhvError, lv_name_for
from csi_local.errors import KeyMissing, KeyRefused
from csi_local.host.crypt import HEADER_BYTES
from csi_local.host.volume_users import VolumeUsers
from csi_local.volumes import encryption
from csi_local.volumes.host_volume_names import TAG_ENCRYPTED
from tests.unit.dhvnode import DhvNode
from tests.unit.fakehost import FakeHost, GiB, MiB

VG, POOL = "vg0", "pool0"
KEY = "host volume key"
ENC = {"encryption": "luks2"}


def key_file(tmp_path: Path, name: str, text: str = KEY, mode: int = 0o600) -> str:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keys: dict[str, str]) -> DhvNode:
    monkeypatch.setattr(dhv_removal, "volume_users", lambda *a, **k: VolumeUsers((), ()))
    monkeypatch.setattr(dhv_removal, "_SETTLE", ())
    config = PluginConfig(volume_group=VG, thin_pool=POOL, lock_dir=str(tmp_path / "locks"),
                          encryption_key_files=keys)
    return DhvNode(FakeHost(VG, POOL, pool_size=10 * GiB), config, tmp_path)


def test_create_grow_delete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = make(tmp_path, monkeypatch, {"class:default": key_file(tmp_path, "class.key")})
    path, _ = d.create("vol-1", params=ENC, cap_min=256 * MiB)
    lv = d.host.lvs[lv_name_for("vol-1")]
    assert TAG_ENCRYPTED in lv.tags and lv.content.fs == "crypto_LUKS"
    assert lv.content.luks is not None and lv.content.luks.key == KEY.encode()
    mapper = f"/dev/mapper/{encryption.mapper_name(lv.name)}"
    top = d.host.top_mount(path)
    assert top is not None and top.source == mapper and lv.content.luks.data.fs == "ext4"
    assert KEY.encode() in d.host.crypt_inputs
    assert not any("host volume key" in a for c in d.host.calls for a in c)
    # Nomad repeats the create at every client start: nothing is done again.
    calls = len(d.host.calls)
    d.create("vol-1", params=ENC, cap_min=256 * MiB)
    assert not [c for c in d.host.calls[calls:] if c[0] in ("cryptsetup", "mkfs.ext4")]
    # Grown: the LV, then the dm-crypt device, then the file system on it.
    d.create("vol-1", params=ENC, cap_min=512 * MiB)
    grew = d.host.calls[calls:]
    resize = grew.index(("cryptsetup", "resize", "--batch-mode", "--key-file", "-",
                         encryption.mapper_name(lv.name)))
    assert grew.index(("resize2fs", mapper)) > resize
    assert d.host.lvs[lv.name].size == 512 * MiB
    assert d.host.device_size(mapper) == 512 * MiB - HEADER_BYTES  # the device grew too
    # Deleted: unmounted, closed, removed.
    d.delete("vol-1")
    assert lv.name not in d.host.lvs and not d.host.mappers
    assert not os.path.exists(path)


def test_a_volumes_own_key_file_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = make(tmp_path, monkeypatch, {"class:default": key_file(tmp_path, "class.key"),
                                     "volume:vol-2": key_file(tmp_path, "v2.key", "own key")})
    d.create("vol-2", params=ENC)
    luks = d.host.lvs[lv_name_for("vol-2")].content.luks
    assert luks is not None and luks.key == b"own key"


def test_a_binary_key_file_is_used_byte_for_byte(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A key file is read as `cryptsetup --key-file FILE` reads it: any bytes,
    not only UTF-8 text (one was refused: "is not UTF-8 text")."""
    raw = bytes(range(256)) + b"\n"  # not UTF-8, NUL and a trailing newline included
    path = tmp_path / "binary.key"
    path.write_bytes(raw)
    path.chmod(0o600)
    d = make(tmp_path, monkeypatch, {"class:default": str(path)})
    d.create("vol-b", params=ENC)
    luks = d.host.lvs[lv_name_for("vol-b")].content.luks
    assert luks is not None and luks.key == raw
    assert d.host.crypt_inputs and all(i == raw for i in d.host.crypt_inputs if i is not None)


def test_refusals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loose = key_file(tmp_path, "loose.key", mode=0o644)
    d = make(tmp_path, monkeypatch, {"volume:loose": loose})
    with pytest.raises(DhvError, match="names no key file"):
        d.create("nokey", params=ENC)
    with pytest.raises(KeyMissing, match="chmod 600") as err:
        d.create("loose", params=ENC)
    assert KEY not in err.value.message
    assert not d.host.commands("cryptsetup")
    with pytest.raises(DhvError, match="encryption"):
        d.create("bad", params={"encryption": "yes"})
    # A plain volume stays plain; its encryption cannot change.
    d.create("plain")
    with pytest.raises(DhvError, match="cannot be turned on"):
        d.create("plain", params=ENC)


def test_clones_carry_the_header_and_a_wrong_key_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = make(tmp_path, monkeypatch, {"class:default": key_file(tmp_path, "class.key")})
    d.create("src", params=ENC)
    data = d.host.lvs[lv_name_for("src")].content.luks.data.uuid  # type: ignore[union-attr]
    d.create("copy", params={"source_volume": "src"})
    copy = d.host.lvs[lv_name_for("copy")]
    assert TAG_ENCRYPTED in copy.tags and len(d.host.commands("cryptsetup")) > 0
    assert copy.content.luks is not None and copy.content.luks.data.uuid == data
    assert len([c for c in d.host.commands("cryptsetup") if c[1] == "luksFormat"]) == 1
    with pytest.raises(DhvError, match="is encrypted"):
        d.create("copy2", params={"source_volume": "src", "encryption": "none"})
    # A volume whose key file now holds another key: refused, nothing written.
    d.delete("copy")
    d.config.encryption_key_files["class:default"] = key_file(tmp_path, "new.key", "rotated")
    d.host.run(["umount", d.path("src")])
    d.host.run(["cryptsetup", "close", encryption.mapper_name(lv_name_for("src"))])
    with pytest.raises(KeyRefused):
        d.create("src", params=ENC)
    assert len([c for c in d.host.commands("cryptsetup") if c[1] == "luksFormat"]) == 1


def test_the_smallest_encrypted_host_volume_holds_its_header_and_file_system(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """capacity_min 1 MiB on a pool of 192 KiB chunks: the header's data starts
    at 16.125 MiB (aligned to the chunk), and the file system's 2 MiB follow."""
    d = make(tmp_path, monkeypatch, {"class:default": key_file(tmp_path, "class.key")})
    d.host.lv(POOL).chunk_size = 192 << 10
    path, size = d.create("tiny", params=ENC, cap_min=MiB)
    offset = 16 * MiB + (128 << 10)
    assert size == 20 * MiB  # 2 MiB + 16.125 MiB, in whole 4 MiB extents
    lv = d.host.lvs[lv_name_for("tiny")]
    assert lv.content.luks is not None and lv.content.luks.offset == offset
    mapper = f"/dev/mapper/{encryption.mapper_name(lv.name)}"
    assert d.host.device_size(mapper) == size - offset
    top = d.host.top_mount(path)
    assert top is not None and top.source == mapper


def test_a_clone_larger_than_its_encrypted_source(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The new clone's LV is described as lvcreate was told, without its
    device numbers: growing its dm-crypt device raised "... is open, but not
    over volume ...", and the failed create left the LV and the open
    dm-crypt device behind."""
    d = make(tmp_path, monkeypatch, {"class:default": key_file(tmp_path, "class.key")})
    d.create("src", params=ENC, cap_min=256 * MiB)
    source = d.host.lvs[lv_name_for("src")].content.luks
    assert source is not None
    path, size = d.create("big", params={"source_volume": "src"}, cap_min=512 * MiB)
    lv = d.host.lvs[lv_name_for("big")]
    assert size == lv.size == 512 * MiB and lv.content.luks is not None
    assert lv.content.luks.data.uuid == source.data.uuid  # the source's file system
    mapper = f"/dev/mapper/{encryption.mapper_name(lv.name)}"
    assert d.host.device_size(mapper) == 512 * MiB - HEADER_BYTES
    assert d.host.filesystem_size(mapper, path, "ext4") == 512 * MiB - HEADER_BYTES
    top = d.host.top_mount(path)
    assert top is not None and top.source == mapper


def _nothing_left(d: DhvNode, vid: str) -> None:
    name = lv_name_for(vid)
    assert name not in d.host.lvs
    assert encryption.mapper_name(name) not in d.host.mappers
    assert not d.host.is_mount_point(d.path(vid)) and not os.path.exists(d.path(vid))


NEW_STEPS = [["cryptsetup", "isLuks"], ["cryptsetup", "luksFormat"], ["cryptsetup", "open"],
             ["blkid"], ["mkfs.ext4"], ["lvchange", "--deltag"], ["mount"]]
CLONE_STEPS = [["lvextend"], ["cryptsetup", "isLuks"], ["cryptsetup", "open"], ["blkid"],
               ["lvchange", "--deltag", "csi-local-dhv.new-fsid"], ["mount"],
               ["cryptsetup", "resize"], ["resize2fs"],
               ["lvchange", "--deltag", "csi-local-dhv.grow-fs"]]


@pytest.mark.parametrize("step", NEW_STEPS, ids=" ".join)
def test_a_failed_encrypted_create_leaves_nothing_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: list[str]) -> None:
    """A failure at any step after the LV exists: the rollback unmounts,
    closes the dm-crypt device, removes the LV and the directory. It never
    closed the device, so the lvremove failed and the LV stayed."""
    d = make(tmp_path, monkeypatch, {"class:default": key_file(tmp_path, "class.key")})
    d.host.fail_next(step, 4, f"{step[0]}: boom\n")  # 4: not an answer of isLuks
    with pytest.raises(Exception, match="boom"):
        d.create("vol", params=ENC, cap_min=256 * MiB)
    _nothing_left(d, "vol")
    d.create("vol", params=ENC, cap_min=256 * MiB)  # and the next try makes it
    top = d.host.top_mount(d.path("vol"))
    assert top is not None and top.fs_type == "ext4"


@pytest.mark.parametrize("step", CLONE_STEPS, ids=" ".join)
def test_a_failed_larger_encrypted_clone_leaves_nothing_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: list[str]) -> None:
    d = make(tmp_path, monkeypatch, {"class:default": key_file(tmp_path, "class.key")})
    d.create("src", params=ENC, cap_min=256 * MiB)
    d.host.fail_next(step, 4, f"{step[0]}: boom\n")  # 4: not an answer of isLuks
    with pytest.raises(Exception, match="boom"):
        d.create("big", params={"source_volume": "src"}, cap_min=512 * MiB)
    _nothing_left(d, "big")
    top = d.host.top_mount(d.path("src"))  # the source is as it was
    assert top is not None and top.source == \
        f"/dev/mapper/{encryption.mapper_name(lv_name_for('src'))}"


def test_a_create_without_its_key_file_leaves_nothing_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = make(tmp_path, monkeypatch, {})
    with pytest.raises(DhvError, match="names no key file"):
        d.create("vol", params=ENC)
    _nothing_left(d, "vol")


def test_a_failure_after_the_mount_of_a_new_encrypted_volume_leaves_nothing_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After first_mount (which closes what it opened when it fails itself),
    the rollback unmounted but never closed the dm-crypt device: lvremove
    failed on the open LV, and the LV and its mapping stayed."""
    from csi_local.volumes.lifecycle import VolumeSteps

    def boom(*args: object, **kwargs: object) -> bool:
        raise RuntimeError("boom after the mount")

    d = make(tmp_path, monkeypatch, {"class:default": key_file(tmp_path, "class.key")})
    monkeypatch.setattr(VolumeSteps, "grow_pending", boom)
    with pytest.raises(RuntimeError, match="boom after the mount"):
        d.create("vol", params=ENC)
    _nothing_left(d, "vol")
