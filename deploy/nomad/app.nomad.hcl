# A job using the CSI volume "data" (deploy/nomad/volume.hcl). The volume is
# on one node; Nomad places the group there because only that node runs the
# volume's node plugin ("csi-local-<node name>").
job "app" {
  type = "service"

  group "app" {
    volume "data" {
      type            = "csi"
      source          = "data"
      access_mode     = "single-node-writer"
      attachment_mode = "file-system"
    }

    task "app" {
      driver = "docker"

      config {
        image   = "busybox:1.36"
        command = "sh"
        args    = ["-c", "date >> /data/log && sleep 3600"]
      }

      volume_mount {
        volume      = "data"
        destination = "/data"
      }

      resources {
        cpu    = 50
        memory = 32
      }
    }
  }
}
