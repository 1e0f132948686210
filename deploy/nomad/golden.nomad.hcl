# Three databases, each on its own clone of one golden volume
# (deploy/nomad/host-volume-clone.hcl, made as "db[0]", "db[1]" and "db[2]").
# per_alloc gives allocation N the host volume "db[N]"; the clones live on
# the node that holds the golden snapshot, so Nomad places the group there.
job "golden" {
  type = "service"

  group "db" {
    count = 3

    volume "data" {
      type            = "host"
      source          = "db"
      per_alloc       = true
      access_mode     = "single-node-writer"
      attachment_mode = "file-system"
    }

    task "postgres" {
      driver = "docker"

      config {
        image = "postgres:16"
      }

      env {
        PGDATA = "/var/lib/postgresql/data/pgdata"
      }

      volume_mount {
        volume      = "data"
        destination = "/var/lib/postgresql/data"
      }

      resources {
        cpu    = 200
        memory = 256
      }
    }
  }
}
