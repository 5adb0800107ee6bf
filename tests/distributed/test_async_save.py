"""async_save=True in 2-rank runs: a failed background write raises on every rank, top-k rotation removes an older
checkpoint only after the newer one committed, and on Lightning's defaults a run saving in the background resumes in a
later epoch exactly. (Exact resume: test_resume.py; a kill mid-write: test_damage.py.)

The other scenarios run without Lightning's logger and progress bar (``QUIET_TRAINER``): what they check is on disk
and in each rank's output, and each launched run would otherwise add a ``lightning_logs/version_N``."""

from __future__ import annotations

import json
import re

from distributed.test_resume import resumes_in_a_later_epoch
from helpers import BLOCK
from lightning_gaudi_fsdp.checkpoint.convert import describe


def _strategy(fmt: str, **extra):
    return {"auto_wrap_policy": [BLOCK], "state_dict_type": fmt, "async_save": True, "timeout": 60, **extra}


def test_a_failed_background_write_raises_on_every_rank_at_the_next_save_and_at_the_end_of_fit(
    scenario, small_tmpfs, tmp_path
):
    """Step 2 saves onto a full disk in the background; step 3's save raises that failure (caught here); step 4 saves
    onto the full disk again, and the end of fit raises, uncaught, on both ranks."""
    root = small_tmpfs("256k")
    first, later, good = root / "a" / "step2.ckpt", root / "c" / "step4.ckpt", tmp_path / "good" / "step3.ckpt"
    run = scenario(
        {
            "strategy": _strategy("sharded", check_free_space=False),  # fail while writing, not refused before
            "module": {"width": 128, "n_samples": 64},  # checkpoints of about 0.6 MiB
            "max_steps": 4,
            "save_at_step": [2, 3, 4],
            "save_paths_in_loop": {"2": str(first), "3": str(good), "4": str(later)},
            "catch_save_errors_at": [3],
        },
        expect_ok=False,
        timeout=120,
    )
    assert run.proc.returncode != 0
    saves = [json.loads((run.out / f"saves{rank}.json").read_text()) for rank in (0, 1)]
    for records in saves:
        assert [(r["step"], r["error"] is None) for r in records] == [(2, True), (3, False), (4, True)], records
        assert records[0]["seconds"] < 5  # the save itself returned at once; the write failed later
    said = [records[1]["error"] for records in saves]
    assert said[0] == said[1]  # one message on every rank
    cause = rf"ranks? [01](, 1)? failed while writing: no space left on {root}"
    assert re.match(re.escape(f"Cannot save checkpoint '{first}': ") + cause, said[0]), said[0]
    assert not good.exists()  # the save that reported the failure did not start
    for rank in (0, 1):
        stderr = (run.out / f"rank{rank}.stderr").read_text()
        raised = rf"\.CheckpointSaveError: Cannot save checkpoint '{re.escape(str(later))}': ([^\n]*)"  # its traceback
        final = re.findall(raised, stderr)
        assert final, stderr[-3000:]
        assert re.match(cause, final[0]), final[0]
        assert "written in the background (async_save=True)" in stderr
    # nothing partial is left, not even hidden: rank 0 removed the staging directories
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == ["a", "c"]


def test_a_parameter_written_before_the_background_copy_fails_that_save_on_every_rank(scenario, tmp_path):
    """Parameters and AdamW state are copied after save_checkpoint returns, while the next forward and backward run;
    a hook writing a parameter in place before that copy (here right after the save, the copy starting 1 s late)
    must not get a checkpoint that mixes two steps: the save fails on every rank, nothing is committed."""
    ckpt = tmp_path / "step2.ckpt"
    run = scenario(
        {
            "strategy": _strategy("sharded"),
            "module": {"n_samples": 64},
            "max_steps": 3,
            "save_at_step": 2,
            "save_path_in_loop": str(ckpt),
            "write_params_after_save": True,
            "slow_copies": 1.0,
        },
        expect_ok=False,
        timeout=120,
    )
    assert run.proc.returncode != 0
    for rank in (0, 1):
        stderr = (run.out / f"rank{rank}.stderr").read_text()
        raised = re.findall(r"\.CheckpointSaveError: (Cannot save checkpoint [^\n]*)", stderr)
        assert raised, stderr[-3000:]
        assert re.match(
            re.escape(f"Cannot save checkpoint '{ckpt}': ")
            + r"ranks? [01](, 1)? failed while copying the checkpoint in the background: StagedStateChanged: "
            + r"'[\w.]+'( and \d+ more)? changed in place after save_checkpoint returned",
            raised[0],
        ), raised[0]
    assert not ckpt.exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing staged left either


def test_top_k_rotation_removes_the_older_checkpoint_only_after_the_newer_one_committed(scenario, tmp_path):
    dirpath = tmp_path / "ckpts"
    run = scenario(
        {
            "strategy": _strategy("sharded"),
            "module": {"n_samples": 64},
            "max_steps": 5,
            "model_checkpoint": {"dirpath": str(dirpath), "save_top_k": 1, "every_n_train_steps": 1},
            "slow_writes": 0.2,  # each write starts 0.2 s after Lightning asked to remove the older checkpoint
            "record_events": True,
        }
    )
    events = json.loads((run.out / "events0.json").read_text())
    names = [f"epoch=0-step={s}.ckpt" for s in range(1, 6)]
    assert [name for kind, name, _ in events if kind == "commit"] == names  # one at a time, in order
    assert [name for kind, name, _ in events if kind == "remove"] == names[:-1]
    order = [(kind, name) for kind, name, _ in events]
    for older, newer in zip(names, names[1:], strict=False):
        assert order.index(("remove", older)) > order.index(("commit", newer)), order
    assert sorted(p.name for p in dirpath.iterdir()) == [names[-1]]  # the newest, and nothing staged
    assert describe(dirpath / names[-1])["global_step"] == 5
    assert json.loads((run.out / "rank0.json").read_text())["global_step"] == 5


def test_on_lightning_defaults_background_saves_resume_in_a_later_epoch_exactly(scenario, tmp_path):
    """Lightning's logger, ModelCheckpoint (a save at each epoch's end, the older one removed once the newer has
    committed), progress bar and validation, with every save written in the background: the checkpoint of step 9
    (the third epoch's first batch) resumes the third epoch where it stopped, bitwise equal to the run that went on."""
    strategy = _strategy("sharded", fsdp_version=1)
    resumes_in_a_later_epoch(scenario, tmp_path, strategy, saves=(9,), defaults=True)
