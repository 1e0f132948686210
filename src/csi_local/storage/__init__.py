"""LVM: the only folder that runs or reads it.

The LVM commands and their reports, the VG metadata text read off the PVs
(the committed view), the long-lived lvm shell, and the thin pool's block
mappings read from a metadata snapshot. Stands on host/ for processes and
device-mapper.
"""
