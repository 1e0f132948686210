"""csi-local: a CSI plugin for node-local block storage on LVM thin pools."""

__version__ = "0.1.0"
