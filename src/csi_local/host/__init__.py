"""The node's kernel and processes: everything below LVM.

The process runner, the Host (what is read of the kernel: the mount table,
device nodes, a block device's bytes, device-mapper's devices and status),
device-mapper ioctls, mount calls, file systems and their rules, what holds
a device, named locks and atomic file writes. Knows nothing of volumes, LVM
or CSI: its reads are by device and by name, its locks guard any key.
"""
