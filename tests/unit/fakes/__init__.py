"""The parts of tests/unit/fakehost.FakeHost: fake LVM (lvm.py), block devices
(devices.py) and mounts (mounts.py), each a class FakeHost composes."""
