"""Staging into host buffers and the background saver, in one process (no process group); the 2-rank behaviour is
in tests/distributed/test_async_save.py and test_resume.py."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, namedtuple
from pathlib import Path

import pytest
import torch

from lightning_gaudi_fsdp.checkpoint import background, formats, staging
from lightning_gaudi_fsdp.checkpoint.background import BackgroundSaver
from lightning_gaudi_fsdp.checkpoint.staging import Defer, HostStager, StagedStateChanged
from lightning_gaudi_fsdp.checkpoint.storage import CheckpointSaveError

pytestmark = pytest.mark.versions

Pair = namedtuple("Pair", "a b")


def _alone(obj):
    return [obj]


def _checkpoint() -> dict:
    weight = torch.arange(6.0).reshape(2, 3)
    return {
        "state_dict": OrderedDict(weight=weight, tied=weight, bias=torch.zeros(3).t()),
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2, 3)}}, "lr": 0.1}],
        "loops": {"pair": Pair(torch.ones(1), [1, 2]), "names": ["a", "b"]},
        "epoch": 2,
    }


def test_staged_checkpoint_does_not_change_with_training_and_reuses_its_buffers():
    stager, checkpoint = HostStager(), _checkpoint()
    staged = stager.stage(checkpoint)
    model, optim = checkpoint["state_dict"], checkpoint["optimizer_states"][0]
    model["weight"].add_(100)  # training goes on: parameters, optimizer state and loop state change in place
    optim["state"][0]["exp_avg"].mul_(0)
    checkpoint["loops"]["names"].append("c")
    assert torch.equal(staged["state_dict"]["weight"], torch.arange(6.0).reshape(2, 3))
    assert torch.equal(staged["optimizer_states"][0]["state"][0]["exp_avg"], torch.ones(2, 3))
    assert staged["loops"]["names"] == ["a", "b"]
    assert staged["state_dict"]["tied"] is staged["state_dict"]["weight"]  # one tensor stays one tensor
    assert type(staged["state_dict"]) is OrderedDict
    assert isinstance(staged["loops"]["pair"], Pair)
    assert staged["epoch"] == 2
    assert stager.nbytes == (6 + 3 + 1 + 6 + 1) * 4

    pointers = {k: v.data_ptr() for k, v in staged["state_dict"].items()}
    again = stager.stage(checkpoint)  # the next save of the same model lands in the same buffers
    assert {k: v.data_ptr() for k, v in again["state_dict"].items()} == pointers
    assert torch.equal(again["state_dict"]["weight"], torch.arange(6.0).reshape(2, 3) + 100)

    checkpoint["state_dict"]["weight"] = torch.zeros(4)  # a changed shape gets a buffer of its own
    del checkpoint["optimizer_states"]
    third = stager.stage(checkpoint)
    assert third["state_dict"]["weight"].shape == (4,)
    assert stager.nbytes == (4 + 6 + 3 + 1) * 4  # buffers of entries that disappeared are dropped
    stager.release()
    assert stager.nbytes == 0


def test_staging_buffers_come_from_the_allocator_given_and_are_reused():
    made = []

    def allocate(shape, dtype):  # stands for page-locked memory on an accelerator
        made.append((tuple(shape), dtype))
        return torch.empty(shape, dtype=dtype)

    stager, checkpoint = HostStager(), _checkpoint()
    stager.stage(checkpoint)
    stager.use(allocate)  # buffers made otherwise are dropped
    assert stager.nbytes == 0
    staged = stager.stage(checkpoint)
    # weight (and its tie), bias, step, exp_avg and the loop's tensor: every buffer from the allocator
    assert sorted(made, key=str) == sorted(
        [((2, 3), torch.float32)] * 2 + [((3,), torch.float32), ((), torch.float32), ((1,), torch.float32)],
        key=str,
    )
    assert torch.equal(staged["state_dict"]["weight"], torch.arange(6.0).reshape(2, 3))
    stager.stage(checkpoint)
    assert len(made) == 5  # the next save reuses them
    stager.use(allocate)  # the same allocator again keeps them
    stager.stage(checkpoint)
    assert len(made) == 5


def test_deferred_copies_are_made_later_and_refuse_a_source_written_in_between():
    checkpoint = _checkpoint()
    weight, exp_avg = checkpoint["state_dict"]["weight"], checkpoint["optimizer_states"][0]["state"][0]["exp_avg"]
    bias = checkpoint["state_dict"]["bias"]
    live = {weight.untyped_storage().data_ptr(), exp_avg.untyped_storage().data_ptr()}
    stager = HostStager()
    staged, later = stager.stage_later(checkpoint, Defer(lambda t: t.untyped_storage().data_ptr() in live))
    assert [path for path, *_ in later.copies] == [
        ("state_dict", "weight"),
        ("optimizer_states", 0, "state", 0, "exp_avg"),
    ]
    assert later.nbytes == 2 * 6 * 4
    bias.add_(5)  # not deferred: copied before stage_later returned
    assert torch.equal(staged["state_dict"]["bias"], torch.zeros(3))
    later.run()  # nothing wrote the deferred sources: the copies are the state at the save
    assert torch.equal(staged["state_dict"]["weight"], torch.arange(6.0).reshape(2, 3))
    assert staged["state_dict"]["tied"] is staged["state_dict"]["weight"]
    assert torch.equal(staged["optimizer_states"][0]["state"][0]["exp_avg"], torch.ones(2, 3))

    staged, later = stager.stage_later(checkpoint, Defer(lambda t: t.untyped_storage().data_ptr() in live))
    with torch.no_grad():
        weight[0].mul_(2)  # an in-place write through a view, before the copy was made
    with pytest.raises(StagedStateChanged) as raised:
        later.run()
    assert str(raised.value).startswith(
        "'state_dict/weight' changed in place after save_checkpoint returned and before the background copy of the "
        "checkpoint was made; the copy would mix two training steps, so it is not written."
    )
    assert "needs async_save=False" in str(raised.value)

    # A parameter that reaches the saved memory through .data (as FSDP1's original parameters reach the flat
    # parameter) shares no version counter with it: it is watched by name.
    param = torch.nn.Parameter(torch.empty(0))
    param.data = weight.view(-1)[:3]
    picks = Defer(lambda t: t.untyped_storage().data_ptr() in live, watch=[("layer.weight", param)])
    staged, later = stager.stage_later(checkpoint, picks)
    before = weight._version
    with torch.no_grad():
        param.mul_(2)
    assert weight._version == before  # unchanged as far as the saved tensor can tell
    with pytest.raises(StagedStateChanged, match="^'layer.weight' changed in place"):
        later.run()

    # A tensor the writer fills itself (a streamed full checkpoint's placeholder) is staged as it is.
    placeholder = torch.empty(5)
    staged, later = stager.stage_later(
        {"w": placeholder, "b": bias}, Defer(lambda t: False, as_is=lambda t: t is placeholder)
    )
    assert staged["w"] is placeholder
    assert staged["b"] is not bias


def test_a_deferred_copy_overlaps_the_caller_and_a_source_written_before_it_fails_the_save(monkeypatch):
    saver, write = BackgroundSaver(), _SlowWrite()
    weight = torch.ones(4)
    saver.save({"w": weight}, Path("ok.ckpt"), write, rank=0, gather=_alone, defer=Defer(lambda t: True))
    saver.wait_staged(rank=0)  # the copy ran in the thread; the write waits for the test
    assert saver._job.staged.is_set()
    assert not saver._job.done.is_set()
    weight.add_(1)  # the optimizer step, after the copy: the checkpoint keeps the state at the save
    write.go.set()
    saver.wait(rank=0, gather=_alone)
    assert torch.equal(write.seen[0][0]["w"], torch.ones(4))

    gate, run = threading.Event(), staging.DeferredCopies.run

    def held(self):  # the background copy starts only once the test has written the source
        assert gate.wait(10)
        run(self)

    monkeypatch.setattr(staging.DeferredCopies, "run", held)
    second = _SlowWrite()
    second.go.set()
    saver.save({"w": weight}, Path("bad.ckpt"), second, rank=0, gather=_alone, defer=Defer(lambda t: True))
    with torch.no_grad():
        weight.add_(1)
    gate.set()
    saver._job.staged.wait(10)
    with pytest.raises(CheckpointSaveError) as raised:
        saver.finish(rank=0, gather=_alone)
    assert str(raised.value).startswith(
        "Cannot save checkpoint 'bad.ckpt': failed while copying the checkpoint in the background: "
        "StagedStateChanged: 'w' changed in place"
    )
    assert second.seen == []  # nothing was written


class _SlowWrite:
    """A write that waits until the test lets it go, recording what it saw."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.go, self.fail, self.seen = threading.Event(), fail, []

    def __call__(self, staged, gather, group) -> None:
        assert self.go.wait(10)
        self.seen.append((staged, gather("ok"), group))
        if self.fail is not None:
            raise self.fail


def test_save_returns_at_once_and_removals_wait_for_the_commit():
    saver, write, order = BackgroundSaver(), _SlowWrite(), []
    saver.save({"w": torch.ones(2)}, Path("new.ckpt"), write, rank=0, gather=_alone)
    assert saver.in_flight
    saver.defer_removal(lambda: order.append("removed old"))
    assert order == []  # asked right after save_checkpoint returned: the new one is not written yet
    write.go.set()
    saver.finish(rank=0, gather=_alone)
    assert order == ["removed old"]
    staged, gathered, group = write.seen[0]
    assert torch.equal(staged["w"], torch.ones(2))
    assert (gathered, group) == (["ok"], None)  # no process group here: the thread's gather is this rank alone
    saver.defer_removal(lambda: order.append("now"))  # nothing in flight: at once
    assert order == ["removed old", "now"]


def test_after_finish_no_save_thread_is_left_holding_what_it_wrote():
    """The thread's last act drops its references (to the staged copy, the background group): ``finish`` returns only
    after that, so the group is destroyed by one thread alone (on torch 2.6 a destroy racing gloo's destructor in the
    save thread hung the run)."""
    go, released = threading.Event(), threading.Event()

    class Write:  # the last reference to it is the thread's: dropped as the thread ends
        def __call__(self, staged, gather, group) -> None:
            assert go.wait(10)

        def __del__(self) -> None:
            time.sleep(0.3)
            released.set()

    saver = BackgroundSaver()
    saver.save({"w": torch.ones(2)}, Path("new.ckpt"), Write(), rank=0, gather=_alone)
    go.set()
    saver.finish(rank=0, gather=_alone)
    assert released.is_set()
    assert not [t for t in threading.enumerate() if t.name.startswith("checkpoint save")]


def test_a_failed_background_save_raises_at_the_next_save_and_keeps_the_older_checkpoint():
    saver, order = BackgroundSaver(), []
    write = _SlowWrite(fail=OSError(28, "No space left on device"))
    saver.save({"w": torch.ones(2)}, Path("/ckpts/new.ckpt"), write, rank=0, gather=_alone)
    saver.defer_removal(lambda: order.append("removed old"))
    write.go.set()
    with pytest.raises(CheckpointSaveError) as raised:
        saver.save({"w": torch.ones(2)}, Path("/ckpts/next.ckpt"), _SlowWrite(), rank=0, gather=_alone)
    message = str(raised.value)
    assert message.startswith("Cannot save checkpoint '/ckpts/new.ckpt': failed while writing in the background")
    assert "No space left on device" in message
    assert isinstance(raised.value.__cause__, OSError)
    assert order == []  # the older checkpoint stays: its replacement never committed
    assert not saver.in_flight  # the failed save is reported once; the next save did not start
    saver.finish(rank=0, gather=_alone)


def test_a_failure_at_the_end_of_fit_raises_on_every_rank_with_each_ranks_account():
    saver, write = BackgroundSaver(), _SlowWrite(fail=RuntimeError("boom"))
    write.go.set()
    saver.save({}, Path("c.ckpt"), write, rank=0, gather=_alone)
    peer = background.storage.failures_of(OSError(30, "Read-only file system"), 1, background.STAGE)

    def gather(obj):  # rank 1 failed too, for its own reason
        return [obj, peer]

    with pytest.raises(
        CheckpointSaveError,
        match=r"ranks 0, 1 failed while writing in the background: RuntimeError: boom; OSError: \[Errno 30\] Read-only",
    ):
        saver.finish(rank=0, gather=gather)
    assert not saver.active


def test_after_an_interrupted_run_a_failure_is_logged_not_raised(caplog):
    saver, write = BackgroundSaver(), _SlowWrite(fail=RuntimeError("peer gone"))
    write.go.set()
    saver.save({}, Path("c.ckpt"), write, rank=0, gather=_alone)
    with caplog.at_level(logging.ERROR):
        saver.finish(rank=0, gather=None, interrupted=True)  # type: ignore[arg-type] - no collective may run
    assert "the background save of 'c.ckpt' failed: peer gone" in caplog.text


def test_a_save_waits_for_the_one_in_flight_and_says_so_when_that_takes_long(monkeypatch, caplog):
    monkeypatch.setattr(background, "LONG_WAIT_S", 0.05)
    saver, first = BackgroundSaver(), _SlowWrite()
    saver.save({}, Path("first.ckpt"), first, rank=0, gather=_alone)
    threading.Timer(0.3, first.go.set).start()
    second = _SlowWrite()
    second.go.set()
    with caplog.at_level(logging.WARNING):
        blocked = saver.save({}, Path("second.ckpt"), second, rank=0, gather=_alone)
    assert blocked >= 0.25  # it waited for the first one
    assert first.seen  # which had finished before the second began
    assert "the save of 'second.ckpt' waits for the background save of 'first.ckpt'" in caplog.text
    saver.finish(rank=0, gather=_alone)
    assert second.seen


def test_a_real_save_appears_only_once_committed(tmp_path):
    saver, go = BackgroundSaver(), threading.Event()
    real = formats.save_file

    def held(obj, file, **kwargs):
        assert go.wait(10)
        real(obj, file, **kwargs)

    path = tmp_path / "model.ckpt"
    checkpoint = {"state_dict": {"w": torch.arange(4.0)}, "global_step": 3}

    def write(staged, gather, group):
        formats.save_file = held
        try:
            formats.save("full", staged, path, rank=0, world_size=1, gather=gather, process_group=group)
        finally:
            formats.save_file = real

    saver.save(checkpoint, path, write, rank=0, gather=_alone)
    checkpoint["state_dict"]["w"].zero_()
    assert not path.exists()  # nothing under the final name while the write is in flight
    go.set()
    saver.finish(rank=0, gather=_alone)
    saved = torch.load(path, weights_only=True)
    assert torch.equal(saved["state_dict"]["w"], torch.arange(4.0))
    assert saved["global_step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"]
