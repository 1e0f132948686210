# nomad volume create deploy/nomad/volume-fast.hcl
#
# A thin volume in the device class "fast" on the node "client-1", whose
# plugin runs with device classes (classes_toml of csi-local.nomad.hcl;
# docs/device-classes.md). Nomad does not ask the plugin for capacity before it
# creates a volume: the node named here must have the class's pool, or the
# create fails.
id        = "data-fast"
name      = "data-fast"
type      = "csi"
plugin_id = "csi-local-client-1"

capacity_min = "1GiB"
capacity_max = "10GiB"

capability {
  access_mode     = "single-node-writer"
  attachment_mode = "file-system"
}

mount_options {
  fs_type = "xfs"
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

# Passed to CreateVolume. Without deviceClass, the file's default class.
# Snapshots stay in their source's class (nomad volume snapshot create needs
# no class). A restore (snapshot_id) or a clone (clone_id) stays there too:
# its specification must name its source's class here, unless that is the
# default class; another class is refused.
#
# IO limits (docs/qos.md): readBps and writeBps in bytes per second
# (k, M, G, T or Ki, Mi, Gi, Ti), readIops and writeIops in operations per
# second, enforced on the tasks of the allocations that use the volume.
parameters {
  deviceClass = "fast"
  writeBps    = "200Mi"
  readIops    = "5000"
}
