"""The version of csi-local, in one place.

pyproject.toml reads it (`[tool.setuptools.dynamic]`), so the package's
metadata, `csi-local --version`, `csi-local-dhv fingerprint`, GetPluginInfo's
vendor_version and the `csi_local_build_info` metric all say this. The image
tag in the deployment files and the docs must equal it too
(tests/deploy/test_version.py). RELEASING.md says when it changes.

A module of its own, with nothing but the literal, rather than
importlib.metadata at run time: `csi-local-dhv fingerprint` has one second
and imports nothing but the standard library's os and sys (importlib.metadata
alone costs tens of milliseconds to import, and a lookup more), and an
editable install's metadata keeps the version of its last `pip install`
after a bump, so it would print an old version in a checkout.
"""

__version__ = "0.2.0"
