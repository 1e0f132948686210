# nomad volume create deploy/nomad/host-volume.hcl
#
# A Nomad dynamic host volume made by the csi-local-dhv plugin: a thin LV in
# the node's pool, formatted and mounted under the client's host_volumes_dir.
# No CSI involved. Install the plugin on the clients first:
# docs/nomad-host-volumes.md.
#
# To grow the volume later, add the ID that `nomad volume create` printed
# (id = "...") and raise capacity_min, then run `nomad volume create` again.
# Shrinking is refused.
name      = "scratch"
type      = "host"
plugin_id = "csi-local-dhv" # the executable's name in host_volume_plugin_dir
node_pool = "default"

# capacity_min is the size made (rounded up to whole LVM extents); with neither
# set, the plugin's default_size (1 GiB unless configured) is used.
capacity_min = "1GiB"
capacity_max = "5GiB"

capability {
  access_mode     = "single-node-writer"
  attachment_mode = "file-system"
}

# Only on nodes that have fingerprinted the plugin.
constraint {
  attribute = "${attr.plugins.host_volume.csi-local-dhv.version}"
  operator  = "is_set"
}

# Passed to the plugin as DHV_PARAMETERS; an unknown key fails the create.
# (Dynamic host volumes have no mount_options block: mount options are a
# parameter.) source_volume / source_snapshot make a clone instead:
# deploy/nomad/host-volume-clone.hcl.
parameters {
  fs_type       = "xfs"     # ext4 (default), xfs or btrfs; fixed once made
  mount_options = "noatime" # comma-separated, as for mount -o
}
