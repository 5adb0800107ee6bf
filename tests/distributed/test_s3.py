"""Checkpoints on a real S3 server (SeaweedFS, the ``s3`` fixture) from 2 ranks: a run saves there with Lightning's
``ModelCheckpoint(dirpath="s3://...")``, the bucket holds exactly the committed checkpoints (listed through the
server; nothing under the working directory), and ``fit(ckpt_path="last")`` resumes from there to the same weights,
optimizer state and schedule as a run that never stopped, bitwise. A rank SIGKILLed in the middle of an upload leaves
the previous checkpoint loadable and nothing partial visible, and the next save to the same name succeeds and clears
what the killed one left. Each format, engine and sync/async save round-trips through S3 (one case by default, the
rest and Fabric are ``slow``); a full save to a URL is streamed (rank 0 never holds the whole model)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import SCENARIOS
from distributed.test_resume import STEPS_PER_EPOCH, _assert_same_run, _module, uninterrupted  # noqa: F401 - the fixture
from helpers import BLOCK
from lightning_gaudi_fsdp.checkpoint.commit import RECORD_KEY


def _committed(s3, folder: str) -> dict[str, str]:
    """The visible checkpoints under ``folder`` (name -> the generation its commit record names), after checking that
    every object there belongs to one of them: no partial or leftover generation."""
    client = s3.client()
    keys = s3.keys(folder)
    records = {}
    for key in keys:
        if "/" not in key and not key.startswith("."):
            record = json.loads(client.cat_file(f"{folder}/{key}".removeprefix("s3://")))
            assert record[RECORD_KEY] == 1, key
            records[key] = record["data"]
    owned = set(records) | set(records.values())
    assert [k for k in keys if k.split("/")[0] not in owned] == [], keys
    return records


def _nothing_in_the_working_directory(out) -> None:
    assert [p for p in SCENARIOS.rglob("s3:*")] == []  # the ranks' working directory: no URL became a folder
    assert [p for p in out.rglob("*") if p.name.endswith((":", ".ckpt"))] == []


def test_model_checkpoint_on_s3_then_ckpt_path_last_equals_an_uninterrupted_run(s3, scenario, uninterrupted):  # noqa: F811
    strategy = {"auto_wrap_policy": [BLOCK], "state_dict_type": "sharded"}
    k = STEPS_PER_EPOCH
    folder = s3.url("trainer")
    callback = {
        "dirpath": folder,
        "save_last": True,
        "save_top_k": 2,
        "monitor": "train_loss",
        "every_n_train_steps": 2,
    }
    straight = uninterrupted(strategy, _module())
    first = scenario({"strategy": strategy, "module": _module(), "max_steps": k, "model_checkpoint": callback})
    committed = _committed(s3, folder)
    assert sorted(committed)[-1] == "last.ckpt"
    assert len(committed) == 3, committed  # last.ckpt and the top 2; the replaced ones deleted whole
    assert all(data.startswith(f".{name}.gen-") for name, data in committed.items())
    _nothing_in_the_working_directory(first.out)
    resumed = scenario(
        {
            "strategy": strategy,
            "module": _module(),
            "max_steps": 2 * k,
            "ckpt_path": "last",
            "model_checkpoint": callback,
        }
    )
    assert resumed.rank(0)["first_step"] == k + 1  # from last.ckpt at step k, not from step 0
    _assert_same_run(resumed.final(), straight)
    # read by the fast sharded load (each rank's pieces straight from the shard objects), through the seam
    assert json.loads((resumed.out / "sharded_loads0.json").read_text()) == {"fast": 1, "torch": 0}
    _nothing_in_the_working_directory(resumed.out)


def test_a_rank_killed_mid_upload_leaves_the_previous_checkpoint_and_the_next_save_succeeds(
    s3,
    scenario,
    uninterrupted,  # noqa: F811
):
    strategy = {"auto_wrap_policy": [BLOCK], "state_dict_type": "local"}
    k = STEPS_PER_EPOCH
    folder = s3.url("killed")
    # at epoch boundaries (a resume from one is exact), each save replacing ckpt.ckpt (Lightning's ModelCheckpoint
    # without a monitor overwrites its one name); rank 1 uploads one object per save (its shard): the second, at
    # step 8, is cut off halfway
    callback = {"dirpath": folder, "filename": "ckpt", "save_top_k": -1, "every_n_train_steps": k}
    killed = scenario(
        {
            "strategy": strategy,
            "module": _module(),
            "max_steps": 2 * k,
            "model_checkpoint": callback,
            "kill_mid_upload": {"rank": 1, "nth": 2},
        },
        timeout=240,
        expect_ok=False,
    )
    assert killed.proc.returncode != 0
    assert (killed.out / "killed.json").exists()
    keys = s3.keys(folder)
    visible = sorted(k for k in keys if "/" not in k and not k.startswith("."))
    assert visible == ["ckpt.ckpt"], keys
    before = json.loads(s3.client().cat_file(f"{folder}/ckpt.ckpt".removeprefix("s3://")))["data"]
    generations = {k.split("/")[0] for k in keys if k.startswith(".ckpt.ckpt.gen-")}
    assert len(generations - {before}) == 1, keys  # what the cut-off save had uploaded, never committed
    # it loads (the killed save's generation is ignored), and the run goes on from it: its saves succeed, and the
    # next save under the name the killed one was writing clears what that one left
    resumed = scenario(
        {
            "strategy": strategy,
            "module": _module(),
            "max_steps": 2 * k,
            "model_checkpoint": callback,
            "ckpt_path": f"{folder}/ckpt.ckpt",
        }
    )
    assert resumed.rank(0)["first_step"] == k + 1  # from the step-k checkpoint the killed save left in place
    _assert_same_run(resumed.final(), uninterrupted(strategy, _module()))
    committed = _committed(s3, folder)  # every object belongs to a committed checkpoint: no leftover generation
    assert list(committed) == ["ckpt.ckpt"], committed
    assert committed["ckpt.ckpt"] not in generations  # the resumed run's step-8 save replaced it
    _nothing_in_the_working_directory(resumed.out)


MATRIX = [
    pytest.param(
        fmt, engine, async_save, marks=() if (fmt, engine, async_save) == ("full", 1, False) else pytest.mark.slow
    )
    for fmt in ("full", "sharded", "local")
    for engine in (1, 2)
    for async_save in (False, True)
]


@pytest.mark.parametrize(("fmt", "engine", "async_save"), MATRIX)
def test_trainer_save_checkpoint_to_s3_and_resume_from_it_in_every_format(
    s3,
    scenario,
    uninterrupted,  # noqa: F811
    fmt,
    engine,
    async_save,
):
    strategy = {"auto_wrap_policy": [BLOCK], "state_dict_type": fmt, "fsdp_version": engine, "async_save": async_save}
    k = STEPS_PER_EPOCH
    url = f"{s3.url(f'{fmt}-{engine}')}/x.ckpt"
    first = scenario(
        {"strategy": strategy, "module": _module(), "max_steps": k, "save_at_step": k, "save_path_in_loop": url}
    )
    assert sorted(_committed(s3, url.rsplit("/", 1)[0])) == ["x.ckpt"]
    _nothing_in_the_working_directory(first.out)
    if fmt == "full":  # streamed into the upload: rank 0 never held the whole model (see docs/checkpoints.md)
        assert json.loads((first.out / "streamed0.json").read_text()) == 1
    resumed = scenario({"strategy": strategy, "module": _module(), "max_steps": 2 * k, "ckpt_path": url})
    assert resumed.rank(0)["first_step"] == k + 1
    _assert_same_run(resumed.final(), uninterrupted(strategy, _module()))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("engine", "fmt", "background"), [(1, "sharded", False), (2, "full", True), (2, "local", False)]
)
def test_fabric_save_to_s3_and_load_from_it_equals_the_uninterrupted_run(s3, scenario, engine, fmt, background):
    from distributed.test_fabric import FABRIC, _strategy
    from distributed.test_resume import _assert_equal_nested

    folder = s3.url("fabric")
    strategy = {**_strategy(engine, fmt), "async_save": background}
    common = {"strategy": strategy, "clip_norm": 0.1, "epochs": 2}
    straight = scenario({**common, "save": f"{folder}/ckpt", "save_after_epoch": 1}, script=FABRIC)
    assert list(_committed(s3, folder)) == ["ckpt"]
    _nothing_in_the_working_directory(straight.out)
    resumed = scenario({**common, "load": f"{folder}/ckpt", "raw_checks": False}, script=FABRIC)
    a, b = straight.final(), resumed.final()
    _assert_equal_nested(b["weights"], a["weights"], "weights")
    _assert_equal_nested(b["optimizer"], a["optimizer"], "optimizer")
    assert b["scheduler"] == a["scheduler"]


@pytest.mark.slow
def test_a_sharded_checkpoint_on_s3_reshards_from_two_ranks_to_one(s3, scenario, tmp_path):
    """Saved by 2 ranks to S3, resumed by 1 from there: the run goes on exactly as from the same state converted
    (from S3) into a local full checkpoint."""
    from lightning_gaudi_fsdp.checkpoint.convert import convert

    strategy = {"auto_wrap_policy": [BLOCK], "state_dict_type": "sharded"}
    url, full = f"{s3.url('reshard')}/sharded", tmp_path / "full"
    scenario({"strategy": strategy, "module": _module(), "max_steps": 4, "save_path": url})
    assert convert(url, full, "full") == []
    one = {"devices": 1, "strategy": strategy, "module": _module(), "max_steps": 8}
    from_s3 = scenario({**one, "ckpt_path": url})
    from_full = scenario({**one, "ckpt_path": str(full)})
    assert json.loads((from_s3.out / "sharded_loads0.json").read_text()) == {"fast": 1, "torch": 0}
    _assert_same_run(from_s3.final(), from_full.final())
    assert from_s3.final()["step"] == 8


@pytest.mark.slow
def test_pretrained_weights_from_an_s3_directory_fill_each_ranks_shards_bitwise(s3, scenario, tmp_path):
    """A Hugging Face directory on S3 (several files, an index) as ``pretrained_weights`` on 2 ranks: what the shards
    hold is the files' tensors bitwise, and each rank holds about half (it read its own rows, through byte ranges)."""
    pytest.importorskip("transformers")
    from conftest import save_tiny_llama
    from distributed.test_pretrained import file_tensors, held_fraction

    local = save_tiny_llama(tmp_path / "llama")
    url = s3.url("llama")
    s3.client().put(str(local), url.removeprefix("s3://"), recursive=True)
    cfg = {"weights": url, "config": str(local), "engine": 2, "door": "fabric", "steps": 1, "reference": False}
    run = scenario(cfg, script="pretrained.py")
    loaded, expected = run.final()["loaded"], file_tensors(local)
    assert loaded.keys() == expected.keys()
    assert [k for k, v in expected.items() if not torch.equal(loaded[k], v)] == []
    assert all(0.3 < f < 0.7 for f in held_fraction(run))
    _nothing_in_the_working_directory(run.out)
