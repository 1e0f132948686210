"""Top-level test configuration: the VM harness (see tests/harness/vm.py)."""

pytest_plugins = ["tests.harness.vm"]
