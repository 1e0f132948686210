# nomad volume snapshot create data data-snap   (prints the snapshot ID)
# nomad volume create deploy/nomad/volume-from-snapshot.hcl
#
# A new volume restored from a snapshot of "data". The snapshot is a thin LV
# on the same node as its origin, so the new volume uses the same node's
# plugin and topology.
id        = "data-restored"
name      = "data-restored"
type      = "csi"
plugin_id = "csi-local-client-1"

# The snapshot ID printed by "nomad volume snapshot create".
snapshot_id = "SNAPSHOT_ID"

capacity_min = "1GiB"
capacity_max = "10GiB"

capability {
  access_mode     = "single-node-writer"
  attachment_mode = "file-system"
}

mount_options {
  fs_type = "ext4"
}

topology_request {
  required {
    topology {
      segments = {
        "topology.lvm.csi-local.dev/node" = "client-1"
      }
    }
  }
}
