# csi-local container image: one process serving CSI Identity, Controller and
# Node for LVM thin pools on the node it runs on.
#
# BASE is a build argument so that an environment without access to an image
# registry can build from a locally imported Debian bookworm root filesystem
# (scripts/build-image does that with debootstrap + podman import). Both stages
# use Debian's own python3, so the virtual environment built in the first stage
# has the same interpreter path (/usr/bin/python3) in the final stage.
#
# Pinned by digest, never by a tag alone (a tag moves with every rebuild of
# the image): the default is the official debian:bookworm-slim, its multi-arch
# index as docker-library/repo-info records it (repos/debian/remote/
# bookworm-slim.md; the build of 2026-08-03); the tag is only for readers, the
# digest decides. scripts/build-image passes its local base by that image's
# own content digest. To move to a newer base, take the digest from the same
# place (or `docker buildx imagetools inspect debian:bookworm-slim`).
# tests/deploy/test_dockerfile.py checks both are digests.
ARG BASE=docker.io/library/debian:bookworm-slim@sha256:abd67ffcfa541b485a3dff59865ab629aa048a6c613e639d36e7456b0b229241

# ---------------------------------------------------------------------------
# Builder: install the package and its dependencies into /opt/csi-local.
# ---------------------------------------------------------------------------
FROM ${BASE} AS builder

# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /src
# .dockerignore limits the context to pyproject.toml, README.md, LICENSE, src/
# and deploy/container/ (the conformance suite, sanity/, is no part of the image).
COPY . /src
# Behind a TLS-intercepting proxy, pass its CA bundle as the build secret
# "ca-bundle" (scripts/build-image --ca-bundle FILE); it is used by pip for
# this step only and never stored in a layer.
# Every package comes from deploy/container/requirements.lock, checked
# against its hash (--require-hashes; wheels only); the project itself is
# then built with the locked setuptools (no build isolation: nothing else is
# fetched) and installed without dependencies.
RUN --mount=type=secret,id=ca-bundle \
    if [ -s /run/secrets/ca-bundle ]; then export PIP_CERT=/run/secrets/ca-bundle; fi \
 && python3 -m venv /opt/csi-local \
 && /opt/csi-local/bin/pip install --no-cache-dir --disable-pip-version-check \
      --require-hashes --only-binary=:all: -r /src/deploy/container/requirements.lock \
 && /opt/csi-local/bin/pip install --no-cache-dir --disable-pip-version-check \
      --no-deps --no-build-isolation /src \
 && /opt/csi-local/bin/pip uninstall --yes --quiet pip setuptools wheel \
 && /opt/csi-local/bin/csi-local --version

# ---------------------------------------------------------------------------
# Final image: runtime tools only.
# ---------------------------------------------------------------------------
FROM ${BASE}

# Build arguments for the labels: the version must be src/csi_local/version.py's
# (tests/deploy/test_version.py; scripts/build-image passes it too), the source
# and revision come from scripts/build-image (the git remote without
# credentials, and the commit).
ARG VERSION=0.2.0
ARG SOURCE=""
ARG REVISION=""
LABEL org.opencontainers.image.title="csi-local" \
      org.opencontainers.image.description="CSI plugin for node-local block storage on LVM thin pools" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.revision="${REVISION}"

# lvm2 + thin-provisioning-tools: thin pools and thin volumes/snapshots
# e2fsprogs, xfsprogs, btrfs-progs: mkfs/fsck/resize for ext4, xfs, btrfs
# util-linux: mount, umount, blkid, findmnt, losetup (loop-backed demo VG)
# cryptsetup-bin: LUKS2 encryption at rest (docs/encryption.md)
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python3 \
      lvm2 \
      thin-provisioning-tools \
      e2fsprogs \
      xfsprogs \
      btrfs-progs \
      util-linux \
      cryptsetup-bin \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb

# LVM inside a container.
#
# Approach: run LVM in the container with a container-specific lvm.conf and
# share LVM's host state through hostPath mounts (see deploy/kubernetes and
# deploy/nomad): /dev, /run/lock/lvm, /run/lvm, /etc/lvm/backup,
# /etc/lvm/archive, and the host's device selection: /etc/lvm/devices (its
# devices file, use_devicesfile = 1), /etc/multipath (WWIDs, read-only) and
# its device filters, copied by the deployment into /etc/lvm/lvmlocal.conf.
#  * udev_sync = 0, udev_rules = 0: no udevd runs in the container, so LVM
#    must not wait for udev (it would hang); libdevmapper creates the device
#    nodes and /dev/VG/LV links itself in the (host) /dev.
#  * obtain_device_list_from_udev = 0: no udev database in the container.
#  * monitoring = 0, use_lvmpolld = 0, event_activation = 0: no dmeventd,
#    lvmpolld or autoactivation daemons in the container.
#  * locking_dir = /run/lock/lvm, mounted from the host: the container's LVM
#    commands take the same per-VG flock()s as the host's, so concurrent
#    metadata changes from the host (an administrator, dmeventd autoextend)
#    and from the plugin are serialised instead of overwriting each other.
#    The shared /etc/lvm/backup and /etc/lvm/archive keep a single metadata
#    history. The lvm2 in this image is bookworm's, the same metadata format
#    as the host's. Never run this image without the /run/lock/lvm mount:
#    without shared locks, two writers could update the same VG at once.
COPY deploy/container/lvm.conf /etc/lvm/lvm.conf
# The licence the labels name (org.opencontainers.image.licenses), shipped
# with what it covers, where Debian keeps its packages' own.
COPY LICENSE /usr/share/doc/csi-local/LICENSE
COPY --from=builder /opt/csi-local /opt/csi-local
# The command profile of the plugin's lvm shell (csi_local/storage/lvm_shell.py), in
# the image: the plugin then needs no write to /etc at run time.
RUN /opt/csi-local/bin/python3 -c \
      "from csi_local.storage.lvm_shell import ensure_profile; ensure_profile('/etc/lvm/profile')"

ENV PATH=/opt/csi-local/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

# Runs as root: LVM, mkfs and mount need it (the pod/task is privileged).
ENTRYPOINT ["csi-local", "serve"]
