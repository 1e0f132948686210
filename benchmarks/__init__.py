"""Benchmarks: csi-local's RPCs next to the raw LVM, mkfs and mount commands
they wrap, timed in the same run on the same loop-backed VG.

Run as root where device-mapper works (the test VM):
`scripts/vm-run -- python -m benchmarks [--scale 10,100] [--rounds N] [--json FILE]`.
Pure measurement: figures and ratios, never a timed assert.
"""
