import subprocess

import pytest

from tests.unit.conftest import RealProcessForbidden


def test_real_subprocess_is_refused() -> None:
    with pytest.raises(RealProcessForbidden):
        subprocess.run(["true"], check=False)
