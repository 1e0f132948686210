# nomad volume create deploy/nomad/host-volume-clone.hcl
#
# A golden-volume clone: a csi-local-dhv host volume made as a writable thin
# snapshot of a prepared source, in a second and without copying. Walk-through:
# docs/nomad-host-volumes.md, "Golden volumes". Make one per allocation
# ("db[0]", "db[1]", ...) for a job whose group volume has per_alloc = true
# (deploy/nomad/golden.nomad.hcl).
#
# The source lives on one node, so the clone must be made there: set node_id
# to that node's ID (nomad node status), or constrain on its name.
name      = "db[0]"
type      = "host"
plugin_id = "csi-local-dhv"
node_id   = "00000000-0000-0000-0000-000000000000" # the node holding the snapshot

# At least the source's size; a larger capacity_min grows the clone and its
# file system at its first mount. capacity_max below the source's size is an
# error.
capacity_min = "2GiB"

capability {
  access_mode     = "single-node-writer"
  attachment_mode = "file-system"
}

parameters {
  # A snapshot taken with `csi-local-dhv snapshot create VOLUME_ID pg-golden-v1`
  # on that node, or use source_volume = "<Nomad ID or name of a host volume>"
  # (not both). The source must be in this volume's namespace. fs_type is the
  # source's and may be left out.
  source_snapshot = "pg-golden-v1"
  mount_options   = "noatime"
}
