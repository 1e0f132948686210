# nomad volume create deploy/nomad/volume.hcl
#
# A thin volume on the node "client-1". plugin_id names that node's plugin
# (csi-local.nomad.hcl registers "csi-local-<node name>" on each node), and
# topology_request states the same node in the plugin's topology key.
id        = "data"
name      = "data"
type      = "csi"
plugin_id = "csi-local-client-1"

capacity_min = "1GiB"
capacity_max = "10GiB"

capability {
  access_mode     = "single-node-writer"
  attachment_mode = "file-system"
}

capability {
  access_mode     = "single-node-reader-only"
  attachment_mode = "file-system"
}

mount_options {
  fs_type     = "ext4"
  mount_flags = ["noatime"]
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
