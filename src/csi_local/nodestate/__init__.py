"""What the node plugin remembers that LVM cannot: the state file of staged
and published paths, and its recovery after a restart (rebuilt from the
mount table, or reconciled with it)."""
