"""One node of the host volume plugin's unit tests: a FakeHost, the plugin's
configuration, and its requests built as Nomad's client builds them
(tests/dhvharness.py, which the integration tests use too)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from csi_local.dhv.config import PluginConfig
from csi_local.dhv.host_volumes import HostVolumes
from csi_local.dhv.request import Request, lv_name_for
from tests.dhvharness import Nomad
from tests.unit.fakehost import FakeHost


@dataclass
class DhvNode:
    """One node: its fake host and the plugin's configuration."""

    host: FakeHost
    config: PluginConfig
    root: Path

    cap_min = 0  # a create's DHV_CAPACITY_MIN_BYTES when the test names none

    @property
    def nomad(self) -> Nomad:
        return Nomad(str(self.root / "volumes"), str(self.root / "plugins"))

    @property
    def volumes_dir(self) -> str:
        return self.nomad.volumes_dir

    def path(self, vid: str) -> str:
        return self.nomad.path(vid)

    def plugin(self) -> HostVolumes:
        return HostVolumes(self.config, runner=self.host, host=self.host)

    def request(self, vid: str, *, name: str | None = None,
                params: dict[str, str] | None = None, cap_min: int | None = None,
                cap_max: int = 0, ns: str = "default") -> Request:
        """The create request as Nomad's environment carries it (the volume's
        name: its ID unless given)."""
        return self.nomad.request("create", vid, name=name if name is not None else vid,
                                  params=params, namespace=ns, cap_max=cap_max,
                                  cap_min=self.cap_min if cap_min is None else cap_min)

    def create(self, vid: str, **kw: Any) -> tuple[str, int]:
        return self.plugin().create(self.request(vid, **kw))

    def delete(self, vid: str) -> None:
        self.plugin().delete(self.nomad.request("delete", vid))

    def vg_of(self, vid: str) -> str | None:
        """The VG of the volume's LV (None: the host's first)."""
        return None

    def device(self, vid: str) -> tuple[int, int]:
        found = self.host.device_numbers(self.host.lv_path(lv_name_for(vid), self.vg_of(vid)))
        assert found is not None, vid
        return found

    def mounted(self, vid: str, fs: str) -> None:
        """`vid` is mounted, and only once, at its path, with `fs`."""
        found = self.host.mounts_at(self.path(vid))
        assert len(found) == 1, found
        assert found[0].fs_type == fs, found[0]
        assert self.host.shows_device(found[0], *self.device(vid)), found[0]

    def tools(self) -> set[str]:
        return {c[0] for c in self.host.calls}
