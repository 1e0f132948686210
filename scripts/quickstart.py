"""The quick start's tour: a plugin on a VG of its own, one volume through its life.

`scripts/quickstart` runs this as root where device-mapper is (the host, or the
project's VM). It starts `csi-local serve` in demo mode (a loop-file-backed VG
and thin pool that the plugin makes itself), then, as a CO would, creates a
volume, stages it (mkfs + mount), publishes it (a bind mount), writes a file,
takes the volume down and up again (unpublish, unstage, stage, publish), reads
the file back and compares it. Last it deletes the volume, stops the plugin and
removes the VG, the loop device and the backing file: it leaves nothing behind,
on success or failure.

Everything lives under a fresh directory in /run (a tmpfs on Debian, and in the
VM, whose view of the host's files cannot take a loop device's backing file),
and the VG has a name of its own: the tour never touches another VG.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from csi_local._gen import csi_pb2, csi_pb2_grpc

SIZE = 256 << 20
PROBE_SECONDS = 180.0


def say(text: str) -> None:
    print(f"quickstart: {text}", flush=True)


def run(argv: list[str]) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


@contextlib.contextmanager
def plugin(work: Path, vg: str) -> Iterator[str]:
    """`csi-local serve` in demo mode; stopped (SIGTERM) on the way out."""
    endpoint = f"unix://{work}/csi.sock"
    csi_local = Path(sys.executable).parent / "csi-local"
    argv = [str(csi_local), "serve", "--endpoint", endpoint, "--node-id", "quickstart",
            "--volume-group", vg, "--thin-pool", "pool", "--state-dir", str(work / "state"),
            "--lock-dir", str(work / "locks"), "--backing-file", str(work / "backing.img"),
            "--backing-size", "1G"]
    say("$ " + " ".join(argv))
    log = (work / "plugin.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield endpoint
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        if proc.returncode not in (0, -signal.SIGTERM):
            say(f"the plugin exited {proc.returncode}; its log:")
            print((work / "plugin.log").read_text(errors="replace"), flush=True)


def wait_ready(identity: csi_pb2_grpc.IdentityStub, work: Path) -> None:
    deadline = time.monotonic() + PROBE_SECONDS
    while True:
        try:
            if identity.Probe(csi_pb2.ProbeRequest(), timeout=10).ready.value:
                return
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            print((work / "plugin.log").read_text(errors="replace"), flush=True)
            raise SystemExit(f"quickstart: the plugin did not answer Probe in {PROBE_SECONDS}s")
        time.sleep(1)


def tear_down_vg(vg: str, backing: Path) -> None:
    """Remove what demo mode made: the VG, its loop device, the backing file."""
    subprocess.run(["vgremove", "-f", "-y", vg], capture_output=True, check=False)
    if backing.exists():
        attached = run(["losetup", "--associated", str(backing)]).strip()
        for line in attached.splitlines():
            subprocess.run(["losetup", "-d", line.split(":", 1)[0]], check=False)
        backing.unlink()


def tour(endpoint: str, work: Path) -> None:
    channel = grpc.insecure_channel(endpoint)
    identity = csi_pb2_grpc.IdentityStub(channel)
    controller = csi_pb2_grpc.ControllerStub(channel)
    node = csi_pb2_grpc.NodeStub(channel)
    started = time.monotonic()
    wait_ready(identity, work)
    info = identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest())
    say(f"plugin {info.name} {info.vendor_version} ready after "
        f"{time.monotonic() - started:.1f}s")

    cap = csi_pb2.VolumeCapability(
        mount=csi_pb2.VolumeCapability.MountVolume(fs_type="ext4"),
        access_mode=csi_pb2.VolumeCapability.AccessMode(
            mode=csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_WRITER),
    )
    volume = controller.CreateVolume(csi_pb2.CreateVolumeRequest(
        name="quickstart-volume", capacity_range=csi_pb2.CapacityRange(required_bytes=SIZE),
        volume_capabilities=[cap])).volume
    vid = volume.volume_id
    say(f"created volume {vid} ({volume.capacity_bytes >> 20} MiB, a thin LV)")
    staging = work / "staging"
    staging.mkdir()
    target = work / "pod" / "volume"
    target.parent.mkdir()
    payload = f"written by the csi-local quick start, {secrets.token_hex(8)}\n"
    try:
        for turn in ("first", "second"):
            node.NodeStageVolume(csi_pb2.NodeStageVolumeRequest(
                volume_id=vid, staging_target_path=str(staging), volume_capability=cap))
            fs = run(["findmnt", "-n", "-o", "SOURCE,FSTYPE", str(staging)]).split()
            say(f"staged ({turn} time): {fs[0]} ({fs[1]}) mounted at the staging path")
            node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
                volume_id=vid, staging_target_path=str(staging), target_path=str(target),
                volume_capability=cap))
            say(f"published: bind-mounted at {target}")
            note = target / "hello.txt"
            if turn == "first":
                with note.open("w") as f:
                    f.write(payload)
                    f.flush()
                    os.fsync(f.fileno())
                say(f"wrote {note}: {payload.strip()!r}")
            else:
                back = note.read_text()
                if back != payload:
                    raise SystemExit(f"quickstart: read back {back!r}, wrote {payload!r}")
                say(f"read back {note} after unstaging and staging again: the same bytes")
            node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
                volume_id=vid, target_path=str(target)))
            node.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(
                volume_id=vid, staging_target_path=str(staging)))
            say(f"unpublished and unstaged ({turn} time)")
    finally:
        # After a failure part-way: each undo on its own (both are idempotent),
        # so a failed unpublish does not leave the volume staged.
        with contextlib.suppress(grpc.RpcError):
            node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
                volume_id=vid, target_path=str(target)))
        with contextlib.suppress(grpc.RpcError):
            node.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(
                volume_id=vid, staging_target_path=str(staging)))
        controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vid))
        say(f"deleted volume {vid}")
    channel.close()


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    if os.geteuid() != 0:
        raise SystemExit("quickstart: needs root (LVM, loop devices, mounts)")
    work = Path(tempfile.mkdtemp(prefix="csi-local-quickstart-", dir="/run"))
    vg = f"quickstart{secrets.token_hex(4)}"
    try:
        with plugin(work, vg) as endpoint:
            tour(endpoint, work)
    finally:
        tear_down_vg(vg, work / "backing.img")
        subprocess.run(["rm", "-rf", "--one-file-system", str(work)], check=False)
    say("done: a volume created, staged, published, written, read back and deleted; "
        "nothing left behind")
    return 0


if __name__ == "__main__":
    sys.exit(main())
