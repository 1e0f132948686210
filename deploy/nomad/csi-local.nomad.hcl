# csi-local on Nomad: one monolith CSI plugin (Identity + Controller + Node)
# on each listed client node.
#
# Why one plugin id per node: Nomad sends every controller RPC
# (CreateVolume, DeleteVolume, CreateSnapshot, ControllerExpandVolume, ...)
# for a plugin id to ONE healthy controller instance of that id, chosen
# without regard to topology. A volume is a thin LV on one node, so the
# controller call must reach that node's plugin: each node registers its own
# plugin id "csi-local-<node name>" and a volume spec names the plugin of
# the node it lives on (plugin_id = "csi-local-<node name>").
#
# Why not id = "csi-local-${node.unique.name}": Nomad does NOT interpolate
# csi_plugin.id. The client registers task.CSIPluginConfig.ID verbatim
# (client/allocrunner/taskrunner/plugin_supervisor_hook.go), so every node
# would register the literal string "csi-local-${node.unique.name}", i.e.
# one plugin id again (hashicorp/nomad issue #11116, open; #12361 closed as
# its duplicate). Instead the node names are a job variable and an HCL2
# dynamic block (expanded when the job is parsed, before submission) makes
# one task group per node, pinned to that node by a constraint, with the
# node's plugin id written out literally.
#
#   nomad job run -var='nodes=["client-1","client-2"]' csi-local.nomad.hcl
#
# Adding a node: run the job again with the longer list.
#
# Client requirements (docs/nomad.md): docker driver with
# allow_privileged = true and volumes { enabled = true }; each node has the
# volume group and thin pool named below, or the pools of the device classes
# in classes_toml (docs/device-classes.md):
#
#   nomad job run -var='nodes=["client-1"]' \
#     -var="classes_toml=$(cat deploy/nomad/classes.toml)" csi-local.nomad.hcl

variable "nodes" {
  type        = list(string)
  description = "node.unique.name of every client that runs the plugin"
}

# The image scripts/build-image -t localhost/csi-local:0.2.0 makes, by the
# same name as deploy/kubernetes/base/kustomization.yaml's images entry. Fully
# qualified: the docker driver takes a name without a registry for one on
# docker.io (csi-local:0.2.0 is docker.io/library/csi-local:0.2.0), finds no
# such image among those loaded on the client and pulls it, which fails; an
# image that `docker load` put there under this name is used as it is.
variable "image" {
  type    = string
  default = "localhost/csi-local:0.2.0"
}

variable "volume_group" {
  type    = string
  default = "csilocal"
}

variable "thin_pool" {
  type    = string
  default = "pool"
}

variable "classes_toml" {
  type        = string
  description = "device classes: the text of a classes.toml (docs/device-classes.md); replaces volume_group and thin_pool when set"
  # Empty: one class, named "default", from volume_group and thin_pool.
  default = ""
}

variable "lvm_local_conf" {
  type        = string
  description = "LVM settings of the clients' own lvm.conf that the plugin must share, such as devices/global_filter (docs/nomad.md)"
  # Copy here what `lvmconfig devices/global_filter devices/filter` prints on
  # the clients, inside a devices section; not needed where they use a
  # devices file (LVM ignores filters then).
  default = "devices {\n}\n"
}

variable "datacenters" {
  type    = list(string)
  default = ["*"]
}

job "csi-local" {
  type        = "system"
  datacenters = var.datacenters
  # Storage must come up before the jobs that claim volumes.
  priority = 90

  # The task is a privileged container with bind mounts of host paths. The
  # docker driver sets these attributes only on a client that allows both
  # (allow_privileged = true, volumes { enabled = true }; its fingerprint,
  # drivers/docker/fingerprint.go): on another client placement fails
  # naming the constraint, instead of the task failing at start.
  constraint {
    attribute = "${attr.driver.docker.privileged.enabled}"
    value     = "true"
  }
  constraint {
    attribute = "${attr.driver.docker.volumes.enabled}"
    value     = "true"
  }

  dynamic "group" {
    for_each = var.nodes
    labels   = ["node-${group.value}"]

    content {
      constraint {
        attribute = "${node.unique.name}"
        value     = group.value
      }

      restart {
        attempts = 10
        interval = "5m"
        delay    = "10s"
        mode     = "delay"
      }

      # The plugin's Prometheus endpoint (--metrics-address below): a dynamic
      # host port mapped to 9810 in the container.
      network {
        port "metrics" {
          to = 9810
        }
      }

      # Nomad's own service catalogue (no Consul needed, and none implied: a
      # Consul service would keep the plugin off nodes without Consul).
      # Prometheus finds it with nomad_sd_configs.
      service {
        name     = "csi-local-metrics"
        provider = "nomad"
        port     = "metrics"
        tags     = ["metrics", "node-${group.value}"]

        check {
          type     = "http"
          path     = "/metrics"
          interval = "30s"
          timeout  = "5s"
        }
      }

      task "plugin" {
        driver = "docker"

        config {
          image      = var.image
          privileged = true
          ports      = ["metrics"]

          # ENTRYPOINT is "csi-local serve". Nomad sets CSI_ENDPOINT to
          # unix:///csi/csi.sock (mount_dir below); passed explicitly anyway.
          # The pools: the device classes of var.classes_toml when it is set,
          # else one class from var.volume_group and var.thin_pool; never both
          # (the plugin refuses to start with both).
          args = concat([
            "--endpoint=unix:///csi/csi.sock",
            "--node-id=${node.unique.name}",
            "--state-dir=/var/lib/csi-local",
            "--log-format=json",
            "--metrics-address=:9810",
            ], var.classes_toml == "" ? [
            "--volume-group=${var.volume_group}",
            "--thin-pool=${var.thin_pool}",
            ] : [
            # Written by the template below. NOMAD_TASK_DIR is the task's
            # local/ as the container sees it (/local), whatever the image's
            # working directory.
            "--config=${NOMAD_TASK_DIR}/classes.toml",
          ])

          # Shared with host LVM, see deploy/container/lvm.conf: the same
          # VG locks, hints and metadata backup history as the host.
          # (Nomad itself mounts /dev and the plugin directory.)
          mount {
            type   = "bind"
            source = "/run/lock/lvm"
            target = "/run/lock/lvm"
          }
          mount {
            type   = "bind"
            source = "/run/lvm"
            target = "/run/lvm"
          }
          mount {
            type   = "bind"
            source = "/etc/lvm/backup"
            target = "/etc/lvm/backup"
          }
          mount {
            type   = "bind"
            source = "/etc/lvm/archive"
            target = "/etc/lvm/archive"
          }
          # The host's device selection, honoured as on the host (see
          # deploy/container/lvm.conf): its devices file (shared read-write:
          # LVM updates it, under its lock in /run/lock/lvm), multipath's
          # WWIDs, and the host's device filters from var.lvm_local_conf,
          # which LVM reads after the image's own lvm.conf.
          mount {
            type   = "bind"
            source = "/etc/lvm/devices"
            target = "/etc/lvm/devices"
          }
          mount {
            type     = "bind"
            source   = "/etc/multipath"
            target   = "/etc/multipath"
            readonly = true
          }
          mount {
            type     = "bind"
            source   = "local/lvmlocal.conf"
            target   = "/etc/lvm/lvmlocal.conf"
            readonly = true
          }
          # Per-volume lock files (--lock-dir default), shared with the
          # csi-local-dhv host volume plugin on this node.
          mount {
            type   = "bind"
            source = "/run/lock/csi-local"
            target = "/run/lock/csi-local"
          }
          # Volume registry of this node; survives plugin restarts.
          mount {
            type   = "bind"
            source = "/var/lib/csi-local"
            target = "/var/lib/csi-local"
          }
          # The host's cgroup v2 hierarchy, where a volume's IO limits go into
          # its allocation's task scopes (docs/qos.md). The container's own
          # /sys/fs/cgroup is its cgroup namespace's, which holds no task.
          mount {
            type   = "bind"
            source = "/sys/fs/cgroup"
            target = "/host/sys/fs/cgroup"
          }
        }

        template {
          destination = "local/lvmlocal.conf"
          data        = var.lvm_local_conf
        }

        # The device classes, only when given: a template with empty data is
        # an invalid job ("Must specify a source path or have an embedded
        # template"), so the block is there or not. The plugin reads the file
        # when it starts: run the job again with the changed text, which
        # replaces the allocations.
        dynamic "template" {
          for_each = var.classes_toml == "" ? [] : [var.classes_toml]
          content {
            destination = "local/classes.toml"
            data        = template.value
          }
        }

        env {
          CSI_LOCAL_DEFAULT_FS_TYPE     = "ext4"
          CSI_LOCAL_OVERPROVISION_RATIO = "1.0"
          CSI_LOCAL_COMMAND_TIMEOUT     = "120"
          CSI_LOCAL_CGROUP_ROOT         = "/host/sys/fs/cgroup"
        }

        csi_plugin {
          # Literal per node: see the top of this file.
          id                     = "csi-local-${group.value}"
          type                   = "monolith"
          mount_dir              = "/csi"
          stage_publish_base_dir = "/local/csi"
          health_timeout         = "2m"
        }

        # Let in-flight LVM commands and mounts finish: the plugin refuses new
        # RPCs at SIGTERM and gives running ones up to 20 s (--shutdown-grace),
        # which leaves it 10 s to stop before the SIGKILL. Not more: a Nomad
        # client caps kill_timeout at its max_kill_timeout, 30 s by default,
        # silently. (A longer one needs max_kill_timeout raised on every
        # client first, docs/nomad.md. A kill -9 part-way is safe either way:
        # state writes are atomic and a half-done RPC is retried.)
        kill_timeout = "30s"

        # memory is a hard limit (no memory_max): the docker driver sets the
        # container's to it, and the kernel kills the task past it. The plugin
        # idles at about 50 MB, and staging an encrypted volume runs
        # cryptsetup, whose argon2id takes 64 MiB more (host/crypt.py): 128
        # left no room. The same 256 MiB as the Kubernetes node container's
        # limit (deploy/kubernetes/base/node.yaml); tests/integration/
        # test_encryption.py measures an encrypted stage under it.
        resources {
          cpu    = 100
          memory = 256
        }
      }
    }
  }
}
