# nomad volume create deploy/nomad/host-volume-fast.hcl
#
# A csi-local-dhv host volume in the device class "fast": the plugin installed
# with the classes file (csi-local-dhv install ... --config FILE, the same
# file as the CSI plugin's; docs/device-classes.md). Otherwise as
# deploy/nomad/host-volume.hcl.
name      = "scratch-fast"
type      = "host"
plugin_id = "csi-local-dhv"
node_pool = "default"

capacity_min = "1GiB"
capacity_max = "5GiB"

capability {
  access_mode     = "single-node-writer"
  attachment_mode = "file-system"
}

# Only on nodes that have fingerprinted the plugin. Nomad does not know which
# of them have the class: on one without it the create fails ("unknown device
# class"). Where only some clients have it, pin the volume to one (node_id) or
# constrain on a node meta of your own, e.g. with client { meta {
# csi_local_fast = "true" } } in their agent configuration:
#   constraint {
#     attribute = "${meta.csi_local_fast}"
#     value     = "true"
#   }
constraint {
  attribute = "${attr.plugins.host_volume.csi-local-dhv.version}"
  operator  = "is_set"
}

# Without device_class, the file's default class.
parameters {
  device_class  = "fast"
  fs_type       = "xfs"
  mount_options = "noatime"
}
