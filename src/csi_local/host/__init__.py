"""The node's kernel and processes: everything below LVM.

The process runner, device-mapper ioctls, the mount table and mount calls,
file systems and their rules, what keeps a file system busy (its users), the
lock files and atomic file writes. Knows nothing of volumes, LVM or CSI.
"""
