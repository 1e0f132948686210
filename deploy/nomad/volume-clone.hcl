# nomad volume create deploy/nomad/volume-clone.hcl
#
# A new volume cloned from the existing volume "data" (a thin snapshot of it,
# made writable). Same node, same plugin id as the source.
id        = "data-clone"
name      = "data-clone"
type      = "csi"
plugin_id = "csi-local-client-1"

# The source volume's external ID as shown by "nomad volume status data".
clone_id = "SOURCE_EXTERNAL_ID"

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
