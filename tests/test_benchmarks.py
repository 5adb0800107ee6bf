"""The benchmark scripts never rot: a smoke run (tiny sizes) produces every table, the JSON and the chart."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_benchmark_smoke_run_writes_ratios_and_chart(tmp_path):
    from conftest import run_command

    proc = run_command(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--smoke", "--out", str(tmp_path)],
        cwd=tmp_path,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((tmp_path / "latest.json").read_text())
    assert results["overhead"]["ratio"] > 0
    rows = results["memory"]["rows"]
    # sharding really divides what each rank holds
    assert rows["FULL_SHARD@2"]["total"] < 0.6 * rows["NO_SHARD@2"]["total"]
    assert rows["FULL_SHARD@4"]["total"] < 0.35 * rows["NO_SHARD@4"]["total"]
    for fmt in ("full", "sharded", "local"):
        assert results["checkpoint"][fmt]["bytes"] > 0
    assert set(results["checkpoint"]["reshard_load_s"]) == {"2->1", "2->4"}
    assert (tmp_path / "latest.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ratio" in proc.stdout
    assert "vs disk" in proc.stdout
