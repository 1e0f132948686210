"""What a volume is and what may be done to it, shared by both front ends.

Names and tags of CSI volumes and snapshots, device classes and their pools
(room, admission, growth, the pool monitor), sizes, group snapshots,
changed-block tracking, the lock keys both plugins share, and the volume
steps both the CSI and the host volume plugin take. Runs LVM only through
storage/, and the host only through host/.
"""
