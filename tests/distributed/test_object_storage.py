"""A checkpoint URL that cannot be honoured (an unknown protocol; ``memory://``, which no other process sees) through
both doors on 2 ranks: every rank raises the same error naming the call and the URL, nothing is written (before,
``trainer.save_checkpoint("s3://...")`` made a folder ``s3:`` in the working directory, and a fit or ``fabric.load``
from the same string read it back), and the good checkpoints saved before stay as they were. URLs that are honoured
(``s3://``, against a real server) are in ``test_s3.py``."""

from __future__ import annotations

import json

URL = "nosuch://ckpt/run/x.ckpt"
MEMORY = "memory://ckpt/run"
ADVICE = (
    "this argument takes a local path or a URL of the form protocol://bucket/path that an installed fsspec file system "
    "opens (s3:// with lightning-gaudi-fsdp[s3]), and nothing was read or written; see docs/checkpoints.md, "
    '"Checkpoints on object storage"'
)
UNKNOWN = f"no fsspec file system is known for 'nosuch://' URLs; {ADVICE}"
IN_PROCESS = (
    "a 'memory://' file system lives inside one process, where the other ranks and a later run cannot read it; "
    + ADVICE
)


def test_urls_are_refused_on_every_rank_of_both_doors_and_nothing_is_written(scenario):
    run = scenario(
        {"url": URL, "strategy": {"auto_wrap_policy": ["common.Block"]}, "module": {"n_samples": 32}},
        script="object_storage.py",
    )
    ranks = [json.loads((run.out / f"urls{rank}.json").read_text()) for rank in (0, 1)]
    expected = {
        "trainer": {
            "trainer.save_checkpoint": f"trainer.save_checkpoint: filepath='{URL}': {UNKNOWN}",
            "trainer.validate": f"trainer.validate: ckpt_path='{URL}': {UNKNOWN}",
            "trainer.fit": f"trainer.fit: ckpt_path='{URL}': {UNKNOWN}",
            "ModelCheckpoint": f"ModelCheckpoint: dirpath='{MEMORY}': {IN_PROCESS}",
            "ModelCheckpoint, last": f"ModelCheckpoint: dirpath='{MEMORY}': {IN_PROCESS}",
        },
        "fabric": {
            "fabric.save": f"fabric.save: path='{URL}': {UNKNOWN}",
            "fabric.load": f"fabric.load: path='{URL}': {UNKNOWN}",
        },
    }
    for rank, records in enumerate(ranks):
        for door, calls in expected.items():
            for call, message in calls.items():
                assert records[door][call] == {"error": "CheckpointURLError", "message": message}, (rank, call)
            assert records[door]["good unchanged"], (rank, door)  # byte for byte as saved before the refusals
        assert records["trainer"]["file://"] == {"error": None}  # a file:// URL names a local path: saved there
        assert records["trainer"]["file:// saved"]
    assert ranks[0]["trainer"]["good step"] == 1
    assert [r["fabric"]["good step"] for r in ranks] == [3, 3]
    # nowhere under the ranks' working directory or the run's folder did a URL become a folder (s3:, memory:)
    assert [p for p in run.out.rglob("*") if p.name.endswith(":")] == []
