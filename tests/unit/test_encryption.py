"""Encrypted volumes through the CSI servicers, over the fake host's cryptsetup
(tests/unit/fakes/crypt.py): CreateVolume's parameter and tag, stage (format
the header only with the proof, open, mkfs on the dm-crypt device), a wrong
or missing key, unstage, block mode, growth, restores and clones, stats.
The VM tests (tests/integration/test_encryption.py) prove the same on real
dm-crypt."""

from __future__ import annotations

from pathlib import Path

import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.host import crypt
from csi_local.volumes import encryption, lifecycle, naming
from tests.unit.servicers import (
    NO_CONTEXT,
    GiB,
    Node,
    block_cap,
    call,
    make_node,
    mount_cap,
    vol_id,
)

KEY = "s3cret key\n"
SECRETS = {encryption.SECRET_KEY: KEY}


@pytest.fixture
def n(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Node:
    return make_node(tmp_path, monkeypatch)


def create(n: Node, name: str = "pvc-1", size: int = GiB, *,
           params: dict[str, str] | None = None,
           source: pb.VolumeContentSource | None = None) -> tuple[str, str]:
    req = pb.CreateVolumeRequest(
        name=name, capacity_range=pb.CapacityRange(required_bytes=size),
        volume_capabilities=[mount_cap()],
        parameters={encryption.PARAMETER: "luks2"} if params is None else params)
    if source is not None:
        req.volume_content_source.CopyFrom(source)
    code, reply = call(n.controller.CreateVolume, req)
    return code, reply.volume.volume_id if code == "OK" else reply


def stage(n: Node, vid: str, secrets: dict[str, str] | None = None, *, block: bool = False,
          path: str = "stage") -> tuple[str, object]:
    return call(n.node.NodeStageVolume, pb.NodeStageVolumeRequest(
        volume_id=vid, staging_target_path=n.path(path),
        volume_capability=block_cap() if block else mount_cap(),
        secrets=SECRETS if secrets is None else secrets))


def unstage(n: Node, vid: str, path: str = "stage") -> tuple[str, object]:
    return call(n.node.NodeUnstageVolume, pb.NodeUnstageVolumeRequest(
        volume_id=vid, staging_target_path=n.path(path)))


def spy_freezes(n: Node, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths the node freezes from now on, in order."""
    frozen: list[str] = []
    freeze = n.host.freeze

    def spy(path: str) -> None:
        frozen.append(path)
        freeze(path)

    monkeypatch.setattr(n.host, "freeze", spy)
    return frozen


def is_placeholder(argv: tuple[str, ...]) -> bool:
    return argv[1] == "luksFormat" and crypt.PLACEHOLDER_LABEL in argv


def node_crypt(n: Node) -> list[tuple[str, ...]]:
    """The cryptsetup commands run, but CreateVolume's placeholder headers'."""
    return [c for c in n.host.commands("cryptsetup") if not is_placeholder(c)]


def crypt_calls(n: Node, sub: str) -> list[tuple[str, ...]]:
    return [c for c in node_crypt(n) if c[1] == sub]


def top_source(n: Node, path: str) -> str:
    top = n.host.top_mount(path)
    assert top is not None, path
    return top.source


def test_create_tags_an_encrypted_volume_and_refuses_other_values(n: Node) -> None:
    code, vid = create(n)
    assert code == "OK"
    assert naming.TAG_ENCRYPTED in n.host.lv(vid).tags
    code, plain = create(n, "pvc-plain", params={})
    assert code == "OK" and naming.TAG_ENCRYPTED not in n.host.lv(plain).tags
    code, msg = create(n, "pvc-bad", params={encryption.PARAMETER: "aes"})
    assert code == "INVALID_ARGUMENT" and "luks2" in msg
    # The plain volume's create ran no cryptsetup; the encrypted one's only
    # wrote its placeholder header (the next test).
    assert [is_placeholder(c) for c in n.host.commands("cryptsetup")] == [True]


def test_create_gives_an_encrypted_volume_a_placeholder_header_that_no_key_opens(
        n: Node) -> None:
    """From CreateVolume on, a new encrypted volume holds a LUKS2 header
    (labelled, its key random and kept nowhere): a version from before
    encryption, which would take its bare LV for a plain volume and mkfs it,
    refuses a device with a signature (the rollback test in
    tests/integration/test_upgrades.py shows it). No tag, no LVM command
    beyond lvcreate."""
    _, vid = create(n)
    lv = n.host.lv(vid)
    luks = lv.content.luks
    assert luks is not None and luks.label == crypt.PLACEHOLDER_LABEL
    assert luks.key != SECRETS[encryption.SECRET_KEY].encode() and len(luks.key) == 32
    (fmt,) = n.host.commands("cryptsetup")
    assert "pbkdf2" in fmt and "argon2id" not in fmt  # no argon2 memory for a throwaway key
    assert [c[0] for c in n.host.calls if c[0] in ("lvchange", "lvextend")] == []
    # The first stage formats it for real, with no open tried on the
    # placeholder, and changes nothing in LVM (no tag to drop).
    assert stage(n, vid)[0] == "OK"
    (real,) = crypt_calls(n, "luksFormat")
    assert "argon2id" in real
    luks = n.host.lv(vid).content.luks
    assert luks is not None and luks.key == SECRETS[encryption.SECRET_KEY].encode()
    assert luks.label == ""
    assert len(crypt_calls(n, "open")) == 1
    assert [c[0] for c in n.host.calls if c[0] in ("lvchange", "lvextend")] == []
    # Formatted for real: never again, whatever key comes.
    unstage(n, vid)
    assert stage(n, vid, {encryption.SECRET_KEY: "another"})[0] == "UNAUTHENTICATED"
    assert len(crypt_calls(n, "luksFormat")) == 1


def test_a_placeholder_with_data_written_past_it_is_never_formatted(n: Node) -> None:
    """Handed out raw by a version from before encryption (its pod wrote in
    plain text behind the header): the thin device maps more than the
    placeholder wrote, so the stage refuses, and writes nothing."""
    _, vid = create(n)
    lv = n.host.lv(vid)
    lv.chunks.update({c: 1000 + c for c in range(100, 120)})
    code, msg = stage(n, vid)
    assert code == "FAILED_PRECONDITION" and "placeholder" in str(msg)
    assert not crypt_calls(n, "luksFormat") and not n.host.mappers


def test_a_create_killed_before_its_placeholder_writes_it_on_the_retry(n: Node) -> None:
    n.host.fail_next(["cryptsetup", "luksFormat"], timed_out=True)
    code, _ = create(n)
    assert code == "INTERNAL"
    assert not [lv for lv in n.host.lvs.values() if lv.kind == "thin"]  # nothing half-made
    # Killed between lvcreate and the header (the LV there, bare): the CO's
    # retry writes it, as the volume maps no block.
    _, vid = create(n)
    lv = n.host.lv(vid)
    lv.content = type(lv.content)()
    code, again = create(n)
    assert code == "OK" and again == vid
    luks = n.host.lv(vid).content.luks
    assert luks is not None and luks.label == crypt.PLACEHOLDER_LABEL
    # A retry of a volume that holds its header writes nothing.
    formats = len(n.host.commands("cryptsetup"))
    assert create(n) == ("OK", vid)
    assert len(n.host.commands("cryptsetup")) == formats


def test_a_volume_whose_mapping_cannot_be_read_gets_no_placeholder_and_says_so(
        n: Node, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Nothing proves such a device empty, so no header is written blind;
    the volume is made and stages as before, and the log says what it lacks."""
    monkeypatch.setattr(lifecycle, "thin_mapped_sectors", lambda host, vg, lv: None)
    with caplog.at_level("WARNING"):
        code, vid = create(n)
    assert code == "OK"
    assert n.host.lv(vid).content.luks is None
    assert not n.host.commands("cryptsetup")
    assert any("no placeholder LUKS2 header" in r.getMessage() and vid in r.getMessage()
               for r in caplog.records)


def test_copies_of_a_volume_never_staged_format_at_their_first_stage(n: Node) -> None:
    _, vid = create(n)
    snap = call(n.controller.CreateSnapshot, pb.CreateSnapshotRequest(
        name="snap-1", source_volume_id=vid))[1].snapshot.snapshot_id
    code, restored = create(n, "pvc-restored", source=pb.VolumeContentSource(
        snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=snap)))
    assert code == "OK"
    assert stage(n, restored, path="stage-r")[0] == "OK"
    assert n.host.lv(restored).content.luks.key == SECRETS[  # type: ignore[union-attr]
        encryption.SECRET_KEY].encode()


def test_stage_formats_opens_and_mounts_the_dm_crypt_device(n: Node) -> None:
    _, vid = create(n)
    code, msg = stage(n, vid, secrets={})
    assert code == "INVALID_ARGUMENT" and encryption.SECRET_KEY in str(msg)
    assert not node_crypt(n) and n.host.lv(vid).content.luks.key != KEY.encode()  # type: ignore[union-attr]
    assert stage(n, vid)[0] == "OK"
    mapper = f"/dev/mapper/{encryption.mapper_name(vid)}"
    assert top_source(n, n.path("stage")) == mapper
    lv = n.host.lv(vid)
    assert lv.content.fs == "crypto_LUKS" and lv.content.luks is not None
    assert lv.content.luks.data.fs == "ext4"  # the file system is behind the header
    assert [c[-1] for c in n.host.commands("mkfs.ext4")] == [mapper]
    # The key went to cryptsetup's standard input, and never into an argv.
    assert KEY.encode() in n.host.crypt_inputs
    assert not any("s3cret" in a for c in n.host.calls for a in c)
    # Staged again (a retry): nothing is opened or formatted again; the key
    # is still needed, and only its header is asked (--test-passphrase).
    before = len(node_crypt(n))
    assert stage(n, vid, secrets={})[0] == "INVALID_ARGUMENT"
    assert stage(n, vid)[0] == "OK"
    assert node_crypt(n)[before:] == [
        ("cryptsetup", "open", "--test-passphrase", "--type", "luks2", "--key-file", "-",
         f"/dev/vg0/{vid}")]
    # Unstage closes the dm-crypt device; the LV is free again.
    assert unstage(n, vid)[0] == "OK"
    assert not n.host.mappers and not n.host.is_mount_point(n.path("stage"))
    assert crypt_calls(n, "close") == [("cryptsetup", "close", encryption.mapper_name(vid))]


def test_the_dm_crypt_device_passes_discards_and_the_header_keeps_the_flag(n: Node) -> None:
    """Without --allow-discards dm-crypt drops discards: fstrim on an
    encrypted volume said "the discard operation is not supported" and the
    thin pool never got freed space back. Every open allows them, and
    stores the flag in the header (--persistent): a volume made before gets
    it at its next open, and so does an open by hand."""
    _, vid = create(n)
    assert stage(n, vid)[0] == "OK"
    name = encryption.mapper_name(vid)
    assert n.host.mappers[name].discards
    luks = n.host.lv(vid).content.luks
    assert luks is not None and luks.flags == {"allow-discards"}
    (argv,) = crypt_calls(n, "open")
    assert {"--allow-discards", "--persistent"} <= set(argv)
    # Kept: the next open allows discards without rewriting the header.
    unstage(n, vid)
    assert stage(n, vid)[0] == "OK"
    argv = crypt_calls(n, "open")[-1]
    assert "--allow-discards" in argv and "--persistent" not in argv
    assert n.host.mappers[name].discards
    # A header made before, without the flag: its next open stores it.
    unstage(n, vid)
    luks.flags = set()
    assert stage(n, vid)[0] == "OK"
    assert "--persistent" in crypt_calls(n, "open")[-1]
    assert n.host.mappers[name].discards and luks.flags == {"allow-discards"}


def test_a_wrong_key_is_refused_and_nothing_is_written(n: Node) -> None:
    _, vid = create(n)
    stage(n, vid)
    unstage(n, vid)
    uuid = n.host.lv(vid).content.luks.data.uuid  # type: ignore[union-attr]
    code, msg = stage(n, vid, {encryption.SECRET_KEY: "wrong"})
    assert code == "UNAUTHENTICATED" and "no keyslot" in str(msg)
    assert "wrong" not in str(msg)
    assert not n.host.mappers and not n.host.is_mount_point(n.path("stage"))
    assert len(crypt_calls(n, "luksFormat")) == 1  # never formatted again
    assert stage(n, vid)[0] == "OK"
    assert n.host.lv(vid).content.luks.data.uuid == uuid  # type: ignore[union-attr]
    assert len(n.host.commands("mkfs.ext4")) == 1


@pytest.mark.parametrize("block", [False, True])
def test_a_repeated_stage_with_a_wrong_key_is_refused(n: Node, block: bool) -> None:
    """The volume is staged (its dm-crypt device open and mounted): a stage
    with a wrong key answered OK, since nothing was opened and nothing asked
    the header. It is refused as at a first open, and counted."""
    told: list[str] = []
    n.node.volumes.steps.on_open_failure = told.append
    _, vid = create(n)
    assert stage(n, vid, block=block)[0] == "OK"
    code, msg = stage(n, vid, {encryption.SECRET_KEY: "wrong"}, block=block)
    assert code == "UNAUTHENTICATED" and "no keyslot" in str(msg)
    assert "wrong" not in str(msg) and told == ["key_refused"]
    assert n.host.mappers  # still staged, as it was: the refusal closes nothing
    assert stage(n, vid, block=block)[0] == "OK" and told == ["key_refused"]


def test_an_open_device_left_by_a_killed_stage_needs_the_key(n: Node) -> None:
    """A stage killed right after `cryptsetup open`: its dm-crypt device is
    open, nothing mounted. The retry reused the open device whatever key it
    brought (no cryptsetup ran) and mounted the volume for a wrong key."""
    told: list[str] = []
    n.node.volumes.steps.on_open_failure = told.append
    _, vid = create(n)
    stage(n, vid)
    unstage(n, vid)
    n.host.open_luks(n.host.lv(vid), encryption.mapper_name(vid))  # the killed stage's
    code, msg = stage(n, vid, {encryption.SECRET_KEY: "wrong"})
    assert code == "UNAUTHENTICATED" and "no keyslot" in str(msg)
    assert not n.host.is_mount_point(n.path("stage")) and told == ["key_refused"]
    assert stage(n, vid, {})[0] == "INVALID_ARGUMENT"
    assert told == ["key_refused", "key_missing"]
    assert stage(n, vid)[0] == "OK"
    assert top_source(n, n.path("stage")) == f"/dev/mapper/{encryption.mapper_name(vid)}"
    # Opened once (the first stage); the open device reused after two tests of the key.
    assert [c[2] for c in crypt_calls(n, "open")] == ["--type", "--test-passphrase",
                                                      "--test-passphrase"]
    assert len(crypt_calls(n, "luksFormat")) == 1


def test_failed_opens_are_told_why(n: Node) -> None:
    told: list[str] = []
    n.node.volumes.steps.on_open_failure = told.append
    _, vid = create(n)
    assert stage(n, vid, {})[0] == "INVALID_ARGUMENT"  # no secret
    stage(n, vid)
    unstage(n, vid)
    assert stage(n, vid, {encryption.SECRET_KEY: "wrong"})[0] == "UNAUTHENTICATED"
    assert told == ["key_missing", "key_refused"]
    assert stage(n, vid)[0] == "OK" and told == ["key_missing", "key_refused"]


def test_failed_expands_are_told_why(n: Node) -> None:
    """NodeExpandVolume of a device whose volume key is in the kernel's
    keyring asks for the key as a stage does (cryptsetup resize), and a
    key given is checked wherever; their failures count the same (docs: "at
    stage or expand"); they went uncounted."""
    told: list[str] = []
    n.node.volumes.steps.on_open_failure = told.append
    _, vid = create(n)
    assert stage(n, vid)[0] == "OK"
    n.host.mappers[encryption.mapper_name(vid)].keyring = True  # an older version's open
    req = pb.NodeExpandVolumeRequest(volume_id=vid, volume_path=n.path("stage"),
                                     capacity_range=pb.CapacityRange(required_bytes=2 * GiB))
    assert call(n.node.NodeExpandVolume, req)[0] == "INVALID_ARGUMENT"  # no secret
    req.secrets[encryption.SECRET_KEY] = "wrong"
    assert call(n.node.NodeExpandVolume, req)[0] == "UNAUTHENTICATED"
    assert told == ["key_missing", "key_refused"]
    req.secrets[encryption.SECRET_KEY] = KEY
    assert call(n.node.NodeExpandVolume, req)[0] == "OK"
    assert told == ["key_missing", "key_refused"]


def test_a_failing_counter_never_hides_a_refused_key(n: Node) -> None:
    def broken(reason: str) -> None:
        raise RuntimeError("counter down")
    n.node.volumes.steps.on_open_failure = broken
    _, vid = create(n)
    stage(n, vid)
    unstage(n, vid)
    assert stage(n, vid, {encryption.SECRET_KEY: "wrong"})[0] == "UNAUTHENTICATED"


def test_an_encrypted_volume_that_holds_data_without_a_header_is_never_formatted(
        n: Node) -> None:
    _, vid = create(n)
    # Handed out raw by a version from before encryption, and written in
    # plain text over its placeholder header.
    n.host.set_content(vid, "ext4")
    code, msg = stage(n, vid)
    assert code == "FAILED_PRECONDITION" and "no LUKS2 header" in str(msg)
    assert not crypt_calls(n, "luksFormat") and n.host.lv(vid).content.fs == "ext4"


def test_a_luks_format_cut_short_is_formatted_again(n: Node) -> None:
    """Killed after luksFormat wrote a header (its keyslot not yet, say): the
    mark says the plugin's own format never finished, so the retry formats
    again, whatever key it brings; the volume was never handed out."""
    _, vid = create(n)
    n.host.fail_next(["cryptsetup", "open"], timed_out=True)
    assert stage(n, vid)[0] == "INTERNAL"
    assert n.host.lv(vid).content.luks is not None and not n.host.mappers
    assert stage(n, vid, {encryption.SECRET_KEY: "another"})[0] == "OK"
    assert len(crypt_calls(n, "luksFormat")) == 2
    assert n.host.lv(vid).content.luks.key == b"another"  # type: ignore[union-attr]
    # Once formatted and handed out, a wrong key never formats it again.
    unstage(n, vid)
    assert stage(n, vid)[0] == "UNAUTHENTICATED"
    assert len(crypt_calls(n, "luksFormat")) == 2


def test_a_failed_mount_closes_what_the_stage_opened(n: Node) -> None:
    _, vid = create(n)
    n.host.fail_next(["mkfs.ext4"], rc=1, stderr="mkfs failed")
    assert stage(n, vid)[0] == "INTERNAL"
    assert not n.host.mappers  # no stray dm-crypt device


def test_block_mode_hands_out_the_dm_crypt_device(n: Node) -> None:
    _, vid = create(n)
    assert stage(n, vid, block=True)[0] == "OK"
    mapper = f"/dev/mapper/{encryption.mapper_name(vid)}"
    dev = n.host.device_numbers(mapper)
    assert dev is not None
    staged = f"{n.path('stage')}/{vid}"
    assert n.host.device_numbers(staged) == dev
    target = n.path("pods", "dev")
    code, _ = call(n.node.NodePublishVolume, pb.NodePublishVolumeRequest(
        volume_id=vid, target_path=target, staging_target_path=n.path("stage"),
        volume_capability=block_cap()))
    assert code == "OK" and n.host.device_numbers(target) == dev
    stats = n.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(
        volume_id=vid, volume_path=n.path("stage")), NO_CONTEXT)
    assert stats.usage[0].total == n.host.lv(vid).size - 16 * (1 << 20)
    assert not stats.volume_condition.abnormal
    # Handed out raw: a later stage as a file system never formats it.
    call(n.node.NodeUnpublishVolume, pb.NodeUnpublishVolumeRequest(volume_id=vid,
                                                                    target_path=target))
    assert unstage(n, vid)[0] == "OK" and not n.host.mappers
    code, _ = stage(n, vid)
    assert code == "FAILED_PRECONDITION" and not n.host.commands("mkfs.ext4")
    assert not n.host.mappers


def test_node_expand_resizes_the_dm_crypt_device_then_the_file_system(n: Node) -> None:
    """Nomad's NodeExpandVolume carries no secrets: it was refused with
    INVALID_ARGUMENT ("growing its open dm-crypt device needs its key"), so
    an encrypted volume could not grow online under Nomad. The plugin opens
    with the volume key in the dm-crypt table (--disable-keyring), where
    cryptsetup resize finds it without the passphrase."""
    _, vid = create(n)
    stage(n, vid)
    name = encryption.mapper_name(vid)
    assert "--disable-keyring" in crypt_calls(n, "open")[0]
    req = pb.NodeExpandVolumeRequest(volume_id=vid, volume_path=n.path("stage"),
                                     capacity_range=pb.CapacityRange(required_bytes=2 * GiB))
    code, msg = call(n.node.NodeExpandVolume, req)
    assert code == "OK", msg
    mapper = f"/dev/mapper/{name}"
    assert crypt_calls(n, "resize") == [("cryptsetup", "resize", "--batch-mode", name)]
    assert n.host.crypt_inputs[-1] is None  # no key, nothing on its standard input
    assert n.host.commands("resize2fs") == [("resize2fs", mapper)]
    assert n.host.lv(vid).size == 2 * GiB
    assert n.host.device_size(mapper) == 2 * GiB - crypt.HEADER_BYTES


def test_a_device_with_its_key_in_the_keyring_needs_the_key_to_grow(n: Node) -> None:
    """A device opened with its volume key in the kernel's keyring (an older
    version of the plugin, or by hand): cryptsetup resize asks for the
    passphrase, finds none on /dev/null, and the expand is refused as
    documented (INVALID_ARGUMENT); with the key it grows; after an unstage
    and a stage it grows without one."""
    _, vid = create(n)
    stage(n, vid)
    name = encryption.mapper_name(vid)
    n.host.mappers[name].keyring = True
    req = pb.NodeExpandVolumeRequest(volume_id=vid, volume_path=n.path("stage"),
                                     capacity_range=pb.CapacityRange(required_bytes=2 * GiB))
    code, msg = call(n.node.NodeExpandVolume, req)
    assert code == "INVALID_ARGUMENT" and "keyring" in str(msg)
    mapper = f"/dev/mapper/{name}"
    assert n.host.device_size(mapper) == GiB - crypt.HEADER_BYTES
    req.secrets[encryption.SECRET_KEY] = KEY
    assert call(n.node.NodeExpandVolume, req)[0] == "OK"
    assert n.host.device_size(mapper) == 2 * GiB - crypt.HEADER_BYTES
    unstage(n, vid)
    stage(n, vid)
    req = pb.NodeExpandVolumeRequest(volume_id=vid, volume_path=n.path("stage"),
                                     capacity_range=pb.CapacityRange(required_bytes=3 * GiB))
    assert call(n.node.NodeExpandVolume, req)[0] == "OK"
    assert n.host.device_size(mapper) == 3 * GiB - crypt.HEADER_BYTES


def test_an_encrypted_block_volume_grows_online_as_kubelet_expands_it(n: Node) -> None:
    """kubelet calls NodeExpandVolume only when ControllerExpandVolume says
    node_expansion_required. A raw block volume needs no file system grown,
    but an encrypted one's open dm-crypt device grows only there (cryptsetup
    resize): the reply said false for it, and the device kept its old size."""
    _, vid = create(n)
    assert stage(n, vid, block=True)[0] == "OK"
    mapper = f"/dev/mapper/{encryption.mapper_name(vid)}"
    before = n.host.device_size(mapper)
    code, reply = call(n.controller.ControllerExpandVolume, pb.ControllerExpandVolumeRequest(
        volume_id=vid, capacity_range=pb.CapacityRange(required_bytes=2 * GiB),
        volume_capability=block_cap()))
    assert code == "OK", reply
    if reply.node_expansion_required:  # kubelet's rule
        code, msg = call(n.node.NodeExpandVolume, pb.NodeExpandVolumeRequest(
            volume_id=vid, volume_path=n.path("stage"), volume_capability=block_cap(),
            capacity_range=pb.CapacityRange(required_bytes=2 * GiB), secrets=SECRETS))
        assert code == "OK", msg
    assert n.host.lv(vid).size == 2 * GiB
    assert n.host.device_size(mapper) == 2 * GiB - crypt.HEADER_BYTES > before
    assert not n.host.commands("resize2fs")  # no file system of ours on it


def test_a_plain_block_volume_needs_no_node_expansion(n: Node) -> None:
    _, vid = create(n, params={})
    code, reply = call(n.controller.ControllerExpandVolume, pb.ControllerExpandVolumeRequest(
        volume_id=vid, capacity_range=pb.CapacityRange(required_bytes=2 * GiB),
        volume_capability=block_cap()))
    assert (code, reply.node_expansion_required) == ("OK", False)


def test_restores_and_clones_keep_the_header_and_key(n: Node,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _, vid = create(n)
    stage(n, vid)
    frozen = spy_freezes(n, monkeypatch)
    data_uuid = n.host.lv(vid).content.luks.data.uuid  # type: ignore[union-attr]
    code, snap = call(n.controller.CreateSnapshot, pb.CreateSnapshotRequest(
        name="snap-1", source_volume_id=vid))
    assert code == "OK"
    snap_id = snap.snapshot.snapshot_id
    assert naming.TAG_ENCRYPTED in n.host.lv(snap_id).tags
    # A mounted encrypted source is frozen for the instant of the snapshot
    # (LVM's own suspend freezes the LV's file system, which has none).
    assert frozen == [n.path("stage")] and not n.host.frozen  # thawed
    source = pb.VolumeContentSource(snapshot=pb.VolumeContentSource.SnapshotSource(
        snapshot_id=snap_id))
    code, msg = create(n, "restore-plain", params={encryption.PARAMETER: "none"},
                       source=source)
    assert code == "INVALID_ARGUMENT" and "is encrypted" in msg
    code, restored = create(n, "restore", params={}, source=source)
    assert code == "OK" and naming.TAG_ENCRYPTED in n.host.lv(restored).tags
    clone_src = pb.VolumeContentSource(volume=pb.VolumeContentSource.VolumeSource(
        volume_id=vid))
    code, clone = create(n, "clone", params={}, source=clone_src)
    assert code == "OK" and naming.TAG_ENCRYPTED in n.host.lv(clone).tags
    formats = len(crypt_calls(n, "luksFormat"))
    for copy in (restored, clone):
        assert stage(n, copy, {encryption.SECRET_KEY: "other"}, path=f"s-{copy}")[0] == \
            "UNAUTHENTICATED"
        assert stage(n, copy, path=f"s-{copy}")[0] == "OK"  # the source's key
        assert top_source(n, n.path(f"s-{copy}")) == \
            f"/dev/mapper/{encryption.mapper_name(copy)}"
        assert n.host.lv(copy).content.luks.data.uuid == data_uuid  # type: ignore[union-attr]
    assert len(crypt_calls(n, "luksFormat")) == formats  # never formatted
    # A plain source cannot become encrypted on the way.
    code, plain = create(n, "plain", params={})
    code, msg = create(n, "plain-clone", source=pb.VolumeContentSource(
        volume=pb.VolumeContentSource.VolumeSource(volume_id=plain)))
    assert code == "INVALID_ARGUMENT" and "is not encrypted" in msg


def test_stats_report_a_dm_crypt_device_gone_while_staged(n: Node,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    _, vid = create(n)
    stage(n, vid)
    monkeypatch.setattr(n.backend.fs, "usage", lambda path: None)
    n.host.mappers.clear()  # removed behind the plugin's back (dmsetup remove -f)
    stats = n.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(
        volume_id=vid, volume_path=n.path("stage")), NO_CONTEXT)
    assert stats.volume_condition.abnormal
    assert "dm-crypt device" in stats.volume_condition.message


def test_a_class_may_encrypt_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                        ) -> None:
    from tests.unit.servicers import make_class_node
    n = make_class_node(tmp_path, monkeypatch, """\
default = "secure"

[classes.secure]
volume_group = "vg0"
thin_pool = "pool0"
encryption = "luks2"
""")
    code, vid = create(n, params={})
    assert code == "OK" and naming.TAG_ENCRYPTED in n.host.lv(vid).tags
    code, plain = create(n, "pvc-2", params={encryption.PARAMETER: "none"})
    assert code == "OK" and naming.TAG_ENCRYPTED not in n.host.lv(plain).tags


def test_volume_ids_make_distinct_mapper_names() -> None:
    a, b = vol_id("a"), vol_id("b")
    assert encryption.mapper_name(a) != encryption.mapper_name(b)
    assert len(encryption.mapper_name(a).encode()) <= 127


def test_a_lost_state_file_is_rebuilt_through_the_dm_crypt_device(n: Node) -> None:
    from csi_local.nodestate.recovery import rebuild_state, reconcile_state
    _, vid = create(n)
    stage(n, vid)
    target = n.path("pods", "vol")
    assert call(n.node.NodePublishVolume, pb.NodePublishVolumeRequest(
        volume_id=vid, target_path=target, staging_target_path=n.path("stage"),
        volume_capability=mount_cap()))[0] == "OK"
    rebuilt = rebuild_state(n.backend.pools, n.host)
    staging = rebuilt[vid].staging
    assert staging is not None and staging.path == n.path("stage")
    assert set(rebuilt[vid].publishes) == {target}
    kept = reconcile_state(n.backend.pools, n.host, {vid: n.state.get(vid)})
    assert kept[vid].staging is not None and set(kept[vid].publishes) == {target}


def test_status_shows_encrypted_volumes_and_their_dm_crypt_devices(n: Node) -> None:
    from csi_local.ops.status.collect import collect_classes
    from csi_local.ops.status.render import render
    _, vid = create(n)
    _, closed = create(n, "pvc-closed")
    _, plain = create(n, "pvc-plain", params={})
    stage(n, vid)
    st = collect_classes(n.host, n.backend.config.classes, n.backend.config.state_dir,
                         host=n.host)
    by_id = {v.id: v for v in st.volumes}
    assert by_id[vid].encrypted and by_id[vid].crypt_device == \
        f"/dev/mapper/{encryption.mapper_name(vid)}"
    assert by_id[closed].encrypted and by_id[closed].crypt_device is None
    assert not by_id[plain].encrypted and by_id[plain].crypt_device is None
    text = render(st)
    assert f"encrypted (LUKS2): /dev/mapper/{encryption.mapper_name(vid)}" in text
    assert "encrypted (LUKS2): closed" in text


def test_group_snapshots_freeze_the_file_systems_on_the_dm_crypt_devices(
        n: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each member's file system, on its dm-crypt device, is frozen. LVM's
    suspend of the thin LV below does not meet that freeze, so even a kernel
    that cannot snapshot a frozen file system's own LV (Debian 12's) takes
    the group."""
    from csi_local.csi.group_controller_servicer import GroupControllerServicer
    from csi_local.volumes.group_snapshots import GroupSnapshots
    groups = GroupSnapshots(n.backend.pools, n.backend.fs, n.backend.host, n.backend.freezes)
    gc = GroupControllerServicer(n.backend, groups)
    n.host.nested_freeze = False
    _, a = create(n, "pvc-a")
    _, b = create(n, "pvc-b")
    stage(n, a, path="sa")
    stage(n, b, path="sb")
    frozen = spy_freezes(n, monkeypatch)
    code, reply = call(gc.CreateVolumeGroupSnapshot, pb.CreateVolumeGroupSnapshotRequest(
        name="g", source_volume_ids=[a, b]))
    assert code == "OK", reply
    assert sorted(frozen) == sorted([n.path("sa"), n.path("sb")]) and not n.host.frozen
    for snap in reply.group_snapshot.snapshots:
        assert naming.TAG_ENCRYPTED in n.host.lv(snap.snapshot_id).tags


def test_the_same_name_with_another_encryption_already_exists(n: Node) -> None:
    assert create(n)[0] == "OK"
    assert create(n)[0] == "OK"  # a retry
    code, msg = create(n, params={})
    assert code == "ALREADY_EXISTS" and "encryption" in msg


@pytest.mark.parametrize("chunk", [64 << 10, 192 << 10, 1 << 20, 32 << 20])
@pytest.mark.parametrize(("fs", "fs_min"), [("ext4", 2 << 20), ("xfs", 300 << 20)])
def test_the_smallest_encrypted_volume_holds_its_header_and_file_system(
        n: Node, chunk: int, fs: str, fs_min: int) -> None:
    """An encrypted ext4 volume asked for 1 MiB got 16 MiB, exactly its LUKS2
    header, and its first stage failed INTERNAL ("Requested offset is beyond
    real size of device"). Its minimum is the file system's plus the data
    offset cryptsetup chooses: the header aligned to the pool's chunk size."""
    n.host.lv("pool0").chunk_size = chunk
    code, reply = call(n.controller.CreateVolume, pb.CreateVolumeRequest(
        name=f"tiny-{fs}", capacity_range=pb.CapacityRange(required_bytes=1 << 20),
        volume_capabilities=[mount_cap(fs)], parameters={encryption.PARAMETER: "luks2"}))
    assert code == "OK", reply
    vid = reply.volume.volume_id
    offset = crypt.data_offset_for(chunk)
    extent = 4 << 20
    assert reply.volume.capacity_bytes == -(-(fs_min + offset) // extent) * extent
    code, msg = call(n.node.NodeStageVolume, pb.NodeStageVolumeRequest(
        volume_id=vid, staging_target_path=n.path("stage"), volume_capability=mount_cap(fs),
        secrets=SECRETS))
    assert code == "OK", msg
    luks = n.host.lv(vid).content.luks
    assert luks is not None and luks.offset == offset and luks.data.fs == fs
    mapper = f"/dev/mapper/{encryption.mapper_name(vid)}"
    assert n.host.device_size(mapper) == reply.volume.capacity_bytes - offset >= fs_min


def test_a_volume_no_larger_than_its_header_is_refused_at_stage(n: Node) -> None:
    """Made by an older version, 16 MiB: the stage says why and what to do
    (FAILED_PRECONDITION), where cryptsetup's open failed INTERNAL."""
    vid = vol_id("old-tiny")
    n.host.add_lv(vid, 16 << 20, tags=[f"{naming.TAG_KIND}={naming.KIND_VOLUME}",
                                       f"{naming.TAG_SIZE}={16 << 20}", naming.TAG_ENCRYPTED])
    code, msg = stage(n, vid)
    assert code == "FAILED_PRECONDITION" and "expand the volume" in str(msg), msg
    assert not n.host.mappers
