"""LVM: the only folder that runs or reads it.

lvm: the LVM commands on a VG and its LVs, and their reports. lvm_config:
how this host's LVM is set up (settings, profile and backup directories, the
PVs it sees). vg_text: the VG's metadata text parsed off a PV; lv_devices:
an LV's device-mapper devices as LVM names and stacks them, and what their
status says; committed_vg: the VG as committed on all its PVs, answering for
`lvs` without a process. lvm_shell: the long-lived lvm shell. thin_mappings:
the thin pool's block mappings read from a metadata snapshot. Stands on
host/ for processes, a PV's bytes and device-mapper.
"""
