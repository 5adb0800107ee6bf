"""A save that fails on real storage says why, on every rank: one 2-rank run on a small tmpfs goes through a full disk
for each format (writing, and refused before writing), a read-only remount and a directory removed mid-save, then ends
as a user's run would, with ModelCheckpoint's save failing on a full disk."""

from __future__ import annotations

import json
import os
import re
import time

import torch

from helpers import BLOCK
from lightning_gaudi_fsdp.checkpoint.convert import load_full_state

FORMATS = ("full", "sharded", "local")
BOUND_S = 150  # the whole run: start-up, 8 cases of two saves each, a few steps
EXIT_BOUND_S = 30  # from the last, uncaught failure to every process gone
KIB = r"[\d.]+ KiB"


def _expected(case: dict, root) -> str:
    """A pattern for what every rank must say about ``case`` (after the checkpoint's path)."""
    fmt, cause = case["fmt"], case["cause"]
    writers = "rank 0" if fmt == "full" else "ranks 0, 1"
    if cause == "full_disk" and case["check"]:
        return f"{writers} refused before writing: no space left on {root}: needed about {KIB}, {KIB} free"
    if cause == "full_disk":
        # full: rank 0 writes the file, and rank 1 its own pieces into it (written in place), and may fail first
        failed = "ranks? 0(, 1)?" if fmt == "full" else "ranks? [01](, 1)?"
        # the errors follow in brackets: "OSError: [Errno 28] No space left on device", or for a sharded save, whose
        # errors torch's distributed checkpoint passes between ranks without their chain, torch's "unexpected pos"
        errors = r"\((OSError: \[Errno 28\] No space left on device|RuntimeError: .*unexpected pos)"
        return rf"{failed} failed while writing: no space left on {root}: needed about {KIB}, {KIB} free {errors}"
    if cause == "read_only":
        return f"rank 0 failed while preparing: {root} is a read-only file system"
    return rf"ranks? (0, )?1 failed while writing: directory '{root}/{case['name']}/sub' no longer exists"


def test_failed_saves_name_the_cause_on_every_rank(scenario, small_tmpfs):
    root = small_tmpfs("8m")
    cases = [
        *({"name": f"{fmt}-disk-full", "fmt": fmt, "cause": "full_disk", "check": False} for fmt in FORMATS),
        *({"name": f"{fmt}-refused", "fmt": fmt, "cause": "full_disk", "check": True} for fmt in FORMATS),
        {"name": "sharded-read-only", "fmt": "sharded", "cause": "read_only", "check": True},
        {"name": "local-vanished", "fmt": "local", "cause": "vanish", "check": True, "rank": 1},
    ]
    started = time.monotonic()
    run = scenario(
        {
            "root": str(root),
            "cases": cases,
            "final": {"fmt": "sharded", "check": False},
            "strategy": {"auto_wrap_policy": [BLOCK], "timeout": 60},
            "module": {"width": 128, "n_samples": 64},  # checkpoints of about 0.6 MiB
        },
        script="save_failures.py",
        expect_ok=False,
        timeout=BOUND_S + 60,
    )
    ended = time.time()
    assert time.monotonic() - started < BOUND_S
    stderr = run.proc.stderr
    assert (run.out / "cases1.json").exists(), stderr[-3000:]
    per_rank = [json.loads((run.out / f"cases{rank}.json").read_text()) for rank in (0, 1)]
    for case in cases:
        records = [results[case["name"]] for results in per_rank]
        assert [r["error"] for r in records] == ["CheckpointSaveError"] * 2, (case, records)
        assert records[0]["message"] == records[1]["message"], case  # one error, the same on every rank
        path = root / case["name"] / "sub" / "next.ckpt"
        pattern = re.escape(f"Cannot save checkpoint '{path}': ") + _expected(case, root)
        assert re.match(pattern, records[0]["message"]), (pattern, records[0]["message"])
        assert "Nothing was committed" in records[0]["message"]
        if not case["check"] or case["cause"] != "full_disk":  # a write failed: its own exception is chained there
            assert any(r["chained"] for r in records), case
        assert all(r["seconds"] < 10 for r in records), records
        assert set(records[0]["left"]) <= {"sub"}, records[0]["left"]  # nothing partial, not even hidden
        assert records[0]["good_step"] == 1  # the previous checkpoint is intact and loads

    # The run's own end: ModelCheckpoint's second save fails on a full disk, every rank raises and exits.
    assert run.proc.returncode != 0
    failing = root / "mc" / "epoch=0-step=2.ckpt"
    said = re.findall(rf"\.CheckpointSaveError: Cannot save checkpoint '{re.escape(str(failing))}': ([^\n]*)", stderr)
    assert len(said) == 2, stderr[-4000:]  # each rank's traceback (a heartbeat line may repeat it)
    assert said[0] == said[1]
    assert re.match(rf"ranks? [01](, 1)? failed while writing: no space left on {root}", said[0]), said[0]
    (run.out / "stderr.txt").write_text(stderr)
    for secondary in ("Connection closed by peer", "Parent directory", "stopped without reporting"):
        assert secondary not in stderr
    final_started = max(json.loads((run.out / f"final_started{rank}.json").read_text()) for rank in (0, 1))
    assert ended - final_started < EXIT_BOUND_S, f"{ended - final_started:.1f}s"
    # ModelCheckpoint kept the previous checkpoint (it deletes it only after a successful save), intact; nothing else
    assert sorted(p.name for p in (root / "mc").iterdir()) == ["epoch=0-step=1.ckpt"]
    assert load_full_state(root / "mc" / "epoch=0-step=1.ckpt")[0]["global_step"] == 1


def test_a_full_save_into_a_path_that_is_not_valid_text_succeeds(scenario, tmp_path):
    """A directory name with bytes that do not decode (``os.fsdecode(b"ckpt-\\xff")``, as a non-UTF-8 file name
    reads in Python): the streamed full save names its file to the other ranks in bytes (``os.fsencode``), so the
    2-rank save is written, whole, instead of failing on rank 0 while the other rank waits for the name."""
    ckpt = tmp_path / os.fsdecode(b"ckpt-\xff") / "model.ckpt"
    cfg = {"strategy": {"auto_wrap_policy": [BLOCK], "timeout": 30}, "max_steps": 2, "save_path": str(ckpt)}
    run = scenario(cfg, timeout=120)
    saved = {k.removeprefix("net."): v for k, v in torch.load(ckpt, weights_only=True)["state_dict"].items()}
    final = run.final()["weights"]
    assert sorted(saved) == sorted(final)
    for key, value in final.items():
        assert torch.equal(saved[key], value), key
