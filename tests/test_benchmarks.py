"""The benchmark scripts never rot: a smoke run (tiny sizes) produces every table, the JSON and the chart, for both
engines (FSDP1 ``FullyShardedDataParallel`` and FSDP2 ``fully_shard``), and the effects they measure are real."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("fsdp1", "fsdp2")


def _smoke(tmp_path: Path, *only: str) -> tuple[Any, dict[str, Any]]:
    from conftest import run_command

    sections = [arg for name in only for arg in ("--only", name)]
    proc = run_command(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--smoke", *sections, "--out", str(tmp_path)],
        cwd=tmp_path,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, json.loads((tmp_path / "latest.json").read_text())


def _check_checkpoint_section(proc: Any, results: dict[str, Any], tmp_path: Path) -> None:
    checkpoint = results["checkpoint"]
    for engine in ENGINES:
        for fmt in ("full", "sharded", "local"):
            assert checkpoint[engine][fmt]["bytes"] > 0
        # each format was saved in its own layout (the benchmark switches the strategy's format between saves)
        layouts = {fmt: checkpoint[engine][fmt]["rounds"][-1]["files"] for fmt in ("full", "sharded", "local")}
        assert {"rank_00000.pt", "rank_00001.pt"} <= set(layouts["local"]), layouts
        assert ".metadata" in layouts["sharded"], layouts
        assert "rank_00000.pt" not in layouts["sharded"], layouts
        assert layouts["full"] not in (layouts["sharded"], layouts["local"]), layouts
        for fmt in ("full", "sharded", "local"):
            assert checkpoint[engine][fmt]["save_s"] > 0
            background = checkpoint[engine][fmt]["async"]  # the same save with async_save=True, in the same round
            assert 0 < background["blocked_s"] <= background["save_s"]
            # the staging buffers hold rank 0's part of the checkpoint's tensors: all of them (full) or its shard
            assert 0 < background["staging_bytes"] <= checkpoint[engine][fmt]["bytes"]
            # the shards of parameters and AdamW state (full: the pieces each rank sends to rank 0, which streams
            # the file in the background), copied during the next forward and backward
            assert background["deferred_bytes"] > 0.9 * background["staging_bytes"], background
        assert set(checkpoint[engine]["reshard_load_s"]) == {"2->1", "2->4"}
        in_fit = checkpoint[engine]["in_fit"]["rounds"]  # a full save inside fit and torch.save, once per step
        assert len(in_fit["full"]) == len(in_fit["torch_save_plain"]) >= 1

    summary = {row["measurement"]: row for row in results["summary"]}
    assert summary["full save / torch.save"]["target"] == "<= 1.5"
    row = summary["full save / torch.save"]
    # each engine's verdict is its own ratio against the target (a smoke run's ratios may land either side of it)
    assert row["met"] == {engine: row[engine] <= 1.5 for engine in ENGINES}, row
    assert summary["full save / torch.save without CRC32s"]["target"] == "<= 1.2"
    assert all(summary["full save / torch.save without CRC32s"][engine] > 0 for engine in ENGINES)
    in_fit = summary["full save inside fit / torch.save without CRC32s (paired per step)"]
    assert in_fit["target"] == "<= 1.2"
    assert all(in_fit[engine] > 0 for engine in ENGINES)
    for fmt in ("sharded", "local", "full"):
        row = summary[f"{fmt} save: blocked time, async / sync"]
        assert row["target"] == "<= 0.1"
        assert all(row[engine] > 0 for engine in ENGINES)
    assert (tmp_path / "latest.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for text in ("vs disk", "async blocked s", "FSDP2 checkpoints", "summary, FSDP1 vs FSDP2"):
        assert text in proc.stdout


@pytest.mark.timeout(500)  # the smoke run's own 400 s, then the checks
def test_benchmark_checkpoint_section_smoke_run_writes_ratios_and_chart(tmp_path):
    """The default run's representative of the benchmarks: the checkpoint section (saves in every format, async,
    reshard loads) for both engines, its summary rows and the chart. The whole smoke run is under ``-m slow``."""
    proc, results = _smoke(tmp_path, "checkpoint")
    _check_checkpoint_section(proc, results, tmp_path)
    assert set(results) == {"schema", "checkpoint", "summary"}


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_benchmark_smoke_run_writes_ratios_and_chart(tmp_path):
    proc, results = _smoke(tmp_path)

    overhead = results["overhead"]
    for engine in ENGINES:
        assert overhead[engine]["ratio"] > 0
        # the Trainer's strategy shards exactly as the hand-written loop of the same engine
        assert overhead[engine]["held_vs_raw"] == pytest.approx(1.0, rel=1e-3)
    assert overhead["fsdp2_vs_fsdp1"] > 0

    rows = results["memory"]["rows"]
    full = rows["fsdp1"]  # FSDP2 has no NO_SHARD; FSDP1's is the unsharded reference for both
    for engine in ENGINES:
        # sharding really divides what each rank holds
        assert rows[engine]["FULL_SHARD@2"]["total"] < 0.6 * full["NO_SHARD@2"]["total"]
        assert rows[engine]["FULL_SHARD@4"]["total"] < 0.35 * full["NO_SHARD@4"]["total"]
        assert rows[engine]["FULL_SHARD@2"]["grads"] > 0  # counted before zero_grad, for both engines
    assert "NO_SHARD@2" not in rows["fsdp2"]

    _check_checkpoint_section(proc, results, tmp_path)
    summary = {row["measurement"]: row for row in results["summary"]}
    both = [row for row in summary.values() if row["fsdp1"] is not None and row["fsdp2"] is not None]
    assert len(both) >= 10
    assert "ratio" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_pretrained_benchmark_smoke_run(tmp_path):
    """The pretrained-weights section (kept out of the default smoke run: its workers import transformers)."""
    from conftest import run_command

    pytest.importorskip("transformers")
    command = [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--smoke", "--only", "pretrained"]
    proc = run_command([*command, "--out", str(tmp_path)], cwd=tmp_path, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    section = json.loads((tmp_path / "latest.json").read_text())["pretrained"]
    for contender in ("strategy", "from_pretrained"):
        row = section["fsdp1"][contender]
        assert row["shard_bytes"] == pytest.approx(section["model_bytes"] / 2, rel=0.1)  # each rank: its half
        assert row["peak_added"] > 0
    assert "pretrained weights in" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_resume_benchmark_smoke_run_prints_every_row(tmp_path):
    """The resume section (``--smoke --only resume``: 2 and 4 layers of width 32, both engines, sharded, local and full,
    the reshards, the memory restoring needs): its table and summary rows are printed and the JSON holds every
    number. About 50 CPU seconds (its workers import transformers and run about 40 fits): under ``-m slow``."""
    pytest.importorskip("transformers")
    proc, results = _smoke(tmp_path, "resume")
    section = results["resume"]
    assert section["layers"] == [2, 4]
    header = proc.stdout[proc.stdout.index("== resume") :].splitlines()[1].split()
    assert header[:4] == ["engine", "/", "layers", "share"]
    for engine in ENGINES:
        for n in (2, 4):
            assert f"{engine.upper()} {n} " in proc.stdout
            row = section[engine][str(n)]
            assert row["share_bytes"] > 0
            for fmt in ("sharded", "local", "full"):
                assert isinstance(row[fmt]["added_s"], float)  # a difference of two times: tiny runs can be < 0
                assert row[fmt]["torch_load_s"] > 0
                assert row[fmt]["restore_extra_vs_share"] >= 0
        assert set(section[engine]["reshard"]) == {"2->1", "2->4"}
        for key in ("2->1", "2->4"):
            assert f"{engine.upper()} {key}" in proc.stdout
    for fmt in ("sharded", "local"):
        for what in ("time added / torch.load of the rank's share", "memory only while restoring / the rank's share"):
            assert f"{fmt} resume: {what}, 2 and 4 layers" in proc.stdout
    assert "full resume: time added / torch.load on rank 0 + scatter, 2 and 4 layers (target at 4)" in proc.stdout
    assert "sharded resume 2->4 ranks / same-size resume, 4 layers" in proc.stdout
