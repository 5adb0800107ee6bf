"""lightning-habana interplay, with the real 1.6.0 wheel (its last release on PyPI, Apache-2.0, 81 kB) shipped as test
data in ``tests/data`` and unpacked into a throwaway directory: nothing is downloaded."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.versions  # also run on the older torch/Lightning pairings in CI

WHEEL = Path(__file__).parent / "data" / "lightning_habana-1.6.0-py3-none-any.whl"


def _habana_imports_here() -> bool:
    """lightning-habana 1.6.0 imports ``LRScheduler`` from Lightning's Fabric types, which Lightning 2.6 removed: on
    Lightning 2.5 it imports, on 2.6 it does not."""
    import lightning.fabric.utilities.types as types

    return hasattr(types, "LRScheduler")


@pytest.fixture(scope="module")
def habana_site(tmp_path_factory):
    target = tmp_path_factory.mktemp("lightning_habana_site")
    with zipfile.ZipFile(WHEEL) as wheel:  # a pure-Python wheel: unpacked, it is installed (dist-info included)
        wheel.extractall(target)
    return target


def _python(code: str, site) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)  # the tree under test too
    env = {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "default"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=240
    )


def test_installed_lightning_habana_never_breaks_our_import(habana_site):
    broken = not _habana_imports_here()
    out = _python(
        """
        import lightning as L
        import lightning_gaudi_fsdp
        from lightning.pytorch.accelerators import AcceleratorRegistry
        print("registered", AcceleratorRegistry["hpu"]["accelerator"].__module__)
        try:
            L.Trainer(accelerator="hpu", devices=1, strategy=lightning_gaudi_fsdp.GaudiFSDPStrategy(), logger=False)
        except Exception as err:
            print("trainer:", err)
    """,
        habana_site,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "registered lightning_gaudi_fsdp.accelerator" in out.stdout  # our "hpu", not lightning-habana's
    assert "not available" in out.stdout  # no Gaudi here: Lightning's usual error, not a demand for its strategies
    warnings = out.stderr.count("lightning-habana is installed but does not import")
    assert warnings == (1 if broken else 0)


def test_doctor_reports_a_broken_lightning_habana(habana_site):
    out = _python(
        "from lightning_gaudi_fsdp.cli import main; raise SystemExit(main(['doctor', '--accelerator', 'cpu']))",
        habana_site,
    )
    assert out.returncode == 0  # the CPU rehearsal does not need lightning-habana
    if _habana_imports_here():
        assert "[ok  ] lightning-habana               1.6.0 (imports; its HPUAccelerator is accepted)" in out.stdout
        assert "fix: lightning-habana" not in out.stdout
    else:
        assert "[warn] lightning-habana               1.6.0, does not import: ImportError: cannot import name " in (
            out.stdout
        )
        fix = "fix: lightning-habana: lightning-habana is archived and breaks on current Lightning; this package does"
        assert fix in out.stdout
