"""lightning-habana interplay, with the real 1.6.0 wheel from PyPI installed into a throwaway directory."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.versions  # also run on the older torch/Lightning pairings in CI


@pytest.fixture(scope="module")
def habana_site(tmp_path_factory):
    target = tmp_path_factory.mktemp("lightning_habana_site")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), "lightning-habana==1.6.0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        pytest.skip(f"could not fetch lightning-habana 1.6.0 from PyPI: {proc.stderr.strip()[-200:]}")
    return target


def _python(code: str, site) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONWARNINGS": "default"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=240
    )


def test_installed_lightning_habana_never_breaks_our_import(habana_site):
    probe = _python(
        """
        try:
            import lightning_habana
            print("habana-imports")
        except Exception:
            print("habana-broken")
    """,
        habana_site,
    )
    broken = "habana-broken" in probe.stdout
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
    if "does not import" in out.stdout:
        assert "fix: lightning-habana: lightning-habana is archived" in out.stdout
    else:
        assert "1.6.0 (imports; its HPUAccelerator is accepted)" in out.stdout
