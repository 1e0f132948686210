"""The guest's side of test_power_cut.py, in two boots on one disk.

`before`: a VG on the attached disk (its thin pool, and an LV holding the
plugin's state directory, as /var/lib is on a node's disk), the plugin
started, an encrypted volume created, staged and published as kubelet does,
data written and fsync'ed, more written and not synced, then the power cut:
sysrq b, no sync, no unmount. `after`, on a fresh boot: the VG activated, the
plugin started on the same state directory, the volume staged again (a wrong
key first) and published, its data read. Each step prints one line
`POWERCUT {json}` for the host side to check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc

from csi_local._gen import csi_pb2 as pb
from csi_local._gen import csi_pb2_grpc

DISK = "/dev/vda"  # CSI_LOCAL_VM_DISK (scripts/vm-run)
VG = "csipowercut"
RUN = Path("/run/powercut")
STATE_MNT = RUN / "var-lib"
STAGING = RUN / "globalmount"
TARGET = RUN / "pod" / "mount"
KEY = "power cut passphrase\n"
SYNCED = b"fsynced before the power cut\n" * 4096
UNSYNCED = b"written, never synced\n" * 4096
MiB = 1 << 20


def say(**fields: object) -> None:
    print("POWERCUT " + json.dumps(fields), flush=True)


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False,
                          env={**os.environ, "LVM_SUPPRESS_FD_WARNINGS": "1"})
    if check and proc.returncode != 0:
        raise RuntimeError(f"{argv} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def cap() -> pb.VolumeCapability:
    return pb.VolumeCapability(
        mount=pb.VolumeCapability.MountVolume(fs_type="ext4"),
        access_mode=pb.VolumeCapability.AccessMode(
            mode=pb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER))


def start_plugin() -> tuple[subprocess.Popen[bytes], grpc.Channel]:
    (RUN / "locks").mkdir(parents=True, exist_ok=True)
    log = open(RUN / "plugin.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "csi_local", "serve", "--endpoint", f"unix://{RUN}/csi.sock",
         "--node-id", "node-1", "--volume-group", VG, "--thin-pool", "pool",
         "--state-dir", str(STATE_MNT / "csi-local"), "--lock-dir", str(RUN / "locks")],
        stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    channel = grpc.insecure_channel(f"unix://{RUN}/csi.sock")
    deadline = time.monotonic() + 300
    while True:
        try:
            csi_pb2_grpc.IdentityStub(channel).Probe(pb.ProbeRequest(), timeout=5)
            return proc, channel
        except grpc.RpcError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((RUN / "plugin.log").read_text()) from None
            time.sleep(0.2)


def mounted_source(path: Path) -> str | None:
    found = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if left.split()[4] == str(path):
            found = right.split()[1]
    return found


def stage(node: csi_pb2_grpc.NodeStub, vid: str, key: str) -> None:
    node.NodeStageVolume(pb.NodeStageVolumeRequest(
        volume_id=vid, staging_target_path=str(STAGING), volume_capability=cap(),
        secrets={"encryptionKey": key}), timeout=600)


def publish(node: csi_pb2_grpc.NodeStub, vid: str) -> None:
    node.NodePublishVolume(pb.NodePublishVolumeRequest(
        volume_id=vid, staging_target_path=str(STAGING), target_path=str(TARGET),
        volume_capability=cap()), timeout=600)


def before() -> None:
    run("pvcreate", "--yes", DISK)
    run("vgcreate", "--yes", VG, DISK)
    run("lvcreate", "--yes", "--size", "64m", "--name", "varlib", VG)
    run("mkfs.ext4", "-q", f"/dev/{VG}/varlib")
    STATE_MNT.mkdir(parents=True)
    run("mount", f"/dev/{VG}/varlib", str(STATE_MNT))
    run("lvcreate", "--yes", "--type", "thin-pool", "--extents", "80%FREE", "--name", "pool",
        VG)
    _, channel = start_plugin()
    controller = csi_pb2_grpc.ControllerStub(channel)
    node = csi_pb2_grpc.NodeStub(channel)
    vid = controller.CreateVolume(pb.CreateVolumeRequest(
        name="pvc-powercut", capacity_range=pb.CapacityRange(required_bytes=64 * MiB),
        volume_capabilities=[cap()], parameters={"encryption": "luks2"}),
        timeout=600).volume.volume_id
    stage(node, vid, KEY)
    publish(node, vid)
    with open(TARGET / "synced", "wb") as f:
        f.write(SYNCED)
        os.fsync(f.fileno())
    fd = os.open(TARGET, os.O_RDONLY)
    os.fsync(fd)  # the directory entry too
    os.close(fd)
    with open(TARGET / "unsynced", "wb") as f:
        f.write(UNSYNCED)
    say(step="before", vid=vid, staged=mounted_source(STAGING))
    Path("/proc/sys/kernel/sysrq").write_text("1\n")
    Path("/proc/sysrq-trigger").write_text("b\n")  # the power cut: no sync, no unmount
    time.sleep(60)
    say(step="still running after sysrq b")


def after(vid: str) -> None:
    run("vgchange", "--activate", "y", VG)
    STATE_MNT.mkdir(parents=True)
    run("mount", f"/dev/{VG}/varlib", str(STATE_MNT))
    plugin, channel = start_plugin()
    node = csi_pb2_grpc.NodeStub(channel)
    refused = ""
    try:
        stage(node, vid, "not the passphrase")
    except grpc.RpcError as err:
        refused = err.code().name
    stage(node, vid, KEY)
    publish(node, vid)
    synced = (TARGET / "synced").read_bytes() == SYNCED
    unsynced = (TARGET / "unsynced").exists()
    lv = Path(f"/dev/{VG}/{vid}").read_bytes()
    say(step="after", refused=refused, staged=mounted_source(STAGING), synced=synced,
        unsynced_exists=unsynced, plaintext_on_lv=SYNCED[:4096] in lv,
        log_has_key=KEY.strip() in (RUN / "plugin.log").read_text())
    node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id=vid,
                                                           target_path=str(TARGET)))
    node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(volume_id=vid,
                                                       staging_target_path=str(STAGING)))
    say(step="closed", mapper_left=[d for d in os.listdir("/dev/mapper")
                                    if d.startswith("csi-local-luks-")])
    plugin.terminate()
    plugin.wait(60)


if __name__ == "__main__":
    if sys.argv[1] == "before":
        before()
    else:
        after(sys.argv[2])
