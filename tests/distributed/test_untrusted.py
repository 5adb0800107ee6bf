"""Trainer resume from untrusted checkpoints, 2 ranks in one launch (``scenarios/untrusted.py``): safe by default in
every format, each crafted file refused before its payload runs, ``Trainer.fit(..., weights_only=False)`` honoured."""

from __future__ import annotations

import pytest

BLOCKED = "needs posix.system, which safe loading (weights_only=True) refuses; nothing in it was run"


# the module's scenario may run for 300 s inside whichever test sets it up first
pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from conftest import run_script

    run = run_script("untrusted.py", {}, tmp_path_factory.mktemp("untrusted"), timeout=300)
    return run.rank(0), run.rank(1)


@pytest.mark.parametrize("fmt", ["full", "sharded", "local"])
def test_own_checkpoints_with_common_hparams_resume_bitwise_under_the_safe_default(results, fmt):
    rank0, _ = results
    outcome = rank0[fmt]
    assert outcome["error"] is None
    assert outcome["step"] == 8
    assert outcome["bitwise"]  # equal to 8 uninterrupted steps
    assert outcome["hparams_equal"]
    assert outcome["hparam_types"]["data_dir"] == "PosixPath"
    assert outcome["hparam_types"]["label_smoothing"] == "float64"
    assert outcome["hparam_types"]["seed_offset"] == "int64"


@pytest.mark.parametrize(
    ("name", "file", "rank"),
    [
        ("full", "bad_full", 0),
        ("sharded_meta", "meta.pt", 0),
        ("local_trainer_state", "trainer_state.pt", 0),
        ("local_rank1_shard", "rank_00001.pt", 1),
    ],
)
def test_crafted_checkpoints_are_refused_on_every_rank_before_the_payload_runs(results, name, file, rank):
    for outcome in (r[f"refused_{name}"] for r in results):
        assert outcome["error"] is not None
        assert f"bad_{name}" in outcome["error"]
        assert f"({file}) {BLOCKED}" in outcome["error"]
        assert f"(reported by rank {rank})" in outcome["error"]
        assert "weights_only=False" in outcome["error"]
        assert not outcome["marker"]


@pytest.mark.parametrize("name", ["full", "local_rank1_shard"])
def test_weights_only_false_loads_them(results, name):
    if f"trusted_{name}" not in results[0]:
        pytest.skip("this Lightning's Trainer.fit has no weights_only argument")
    for outcome in (r[f"trusted_{name}"] for r in results):
        assert outcome["error"] is None
        assert outcome["step"] == 4
        assert outcome["marker"]  # trusting a checkpoint runs what it carries
