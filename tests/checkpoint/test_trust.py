"""Checkpoints from untrusted sources, offline (no process group): every loader refuses a file that would run code,
before it runs; the opt-outs load it; the project's own and Lightning's checkpoints load under the safe default.

A crafted file's payload would create a marker file (``touch``); each test asserts on that marker. The Trainer's
resume path runs in ``tests/distributed/test_untrusted.py``.
"""

from __future__ import annotations

import contextlib
import enum
import io
import json
import os
import pickle
import re
import shlex
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gaudi_fsdp.checkpoint import convert, formats, integrity, loading, trust
from lightning_gaudi_fsdp.cli import main
from lightning_gaudi_fsdp.engine import fsdp1_io
from lightning_gaudi_fsdp.engine.fsdp1 import FSDP1

# What save_hyperparameters commonly holds: plain values, containers, a path and numpy scalars.
HPARAMS: dict[str, Any] = {
    "lr": 0.01,
    "layers": 2,
    "name": "tiny",
    "flag": True,
    "nothing": None,
    "sizes": [4, 3],
    "betas": (0.9, 0.99),
    "options": {"warmup": 2, "tags": ["a", "b"]},
    "data_dir": Path("/data/train"),
    "scale": np.float64(0.5),
    "seed": np.int64(3),
}


class Tiny(L.LightningModule):
    def __init__(self, **hparams: Any) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[1, 3])  # its state holds a Counter
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Color(enum.Enum):
    RED = 1


COLOR = f"{Color.__module__}.{Color.__qualname__}"


class Payload:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


@pytest.fixture(scope="module")
def own(tmp_path_factory) -> dict[str, Path]:
    """One real Lightning checkpoint (ModelCheckpoint and EarlyStopping state, a scheduler, the hyper-parameters
    above), written in each of our formats offline."""
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    tmp = tmp_path_factory.mktemp("own")
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
    callbacks = [ModelCheckpoint(dirpath=tmp / "mc", monitor="train_loss"), EarlyStopping("train_loss", patience=9)]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,  # the checkpoint's pickled contents are under test, not where a logger puts it
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Tiny(**HPARAMS)
    trainer.fit(module, data)
    full = tmp / "full.ckpt"
    trainer.save_checkpoint(full)  # Lightning's own layout: our full format
    ckpt = torch.load(full, weights_only=False)  # written just above
    ckpt[formats.PARAM_ID_NAMES_KEY] = [n for n, _ in module.named_parameters()]
    torch.save(ckpt, full)
    sharded = tmp / "sharded.ckpt"
    unverified = integrity.NOT_VERIFIED.format(path=str(full))  # Lightning's own file records no checksums
    assert convert.convert(full, sharded, "sharded") == [unverified]
    return {"full": full, "sharded": sharded, "local": _local_from(ckpt, tmp / "local.ckpt")}


def _local_from(ckpt: dict[str, Any], path: Path) -> Path:
    """A one-rank local checkpoint of an unwrapped model: no flat parameters, every tensor under its own name."""
    path.mkdir()
    rest = {k: v for k, v in ckpt.items() if k not in ("state_dict", "optimizer_states")}
    shard = {"model": ckpt["state_dict"], "optimizer_states": ckpt["optimizer_states"]}
    torch.save(shard, path / formats.local_shard_name(0))
    torch.save(rest, path / formats.LOCAL_TRAINER_STATE)
    meta = {"format": "local", "format_version": 1, "world_size": 1, "flat_params": [], "fsdp_units": []}
    (path / formats.LOCAL_METADATA).write_text(json.dumps(meta))
    return path


def _check_load(path: Path, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> loading.PendingLoad:
    # An unwrapped model: FSDP's state-dict context plays no part in what is unpickled (the distributed test runs
    # the real thing), so it is a no-op here.
    monkeypatch.setattr(fsdp1_io, "state_dict_context", lambda *a, **k: contextlib.nullcontext())
    return loading.check_load(
        path, Tiny(), engine=FSDP1(), world_size=1, rank=0, device_type="cpu", strict=True, **kwargs
    )


# ------------------------------------------------------------------------------------------- own checkpoints load
def test_own_checkpoint_needs_the_allowlist_and_loads_with_it(own):
    blocked = torch.serialization.get_unsafe_globals_in_checkpoint(own["full"])
    assert "pathlib.PosixPath" in blocked  # the hyper-parameters need it...
    assert any("multiarray.scalar" in name for name in blocked)
    ckpt = trust.load_file(own["full"], own["full"], "the checkpoint file")  # ...and loading allows it
    assert ckpt["hyper_parameters"] == HPARAMS
    assert [type(v) for v in ckpt["hyper_parameters"].values()] == [type(v) for v in HPARAMS.values()]
    assert any(isinstance(v, dict) and "best_model_score" in v for v in ckpt["callbacks"].values())


@pytest.mark.parametrize("fmt", ["full", "sharded", "local"])
def test_own_checkpoints_load_safely_and_equal_an_unrestricted_load(own, fmt, monkeypatch):
    path = own[fmt]
    pending = _check_load(path, monkeypatch)
    assert pending.rest["hyper_parameters"] == HPARAMS
    assert convert.describe(path)["global_step"] == 2
    safe, _ = convert.load_full_state(path)
    trusted, _ = convert.load_full_state(path, weights_only=False)
    _assert_bitwise(safe, trusted)
    assert safe["lr_schedulers"] == trusted["lr_schedulers"]


def _assert_bitwise(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _assert_bitwise(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_bitwise(x, y)
    else:
        assert a == b


def test_users_own_allowlist_is_honoured_and_kept(tmp_path):
    path = tmp_path / "enum.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"color": Color.RED, "data_dir": Path("/d")}}, path)
    with pytest.raises(trust.UnsafeCheckpointError, match=rf"needs {re.escape(COLOR)}, which safe loading"):
        trust.load_file(path, path, "the checkpoint file")
    with torch.serialization.safe_globals([Color, Path]):
        loaded = trust.load_file(path, path, "the checkpoint file")
        assert Path in torch.serialization.get_safe_globals()  # not removed by our own allowlist leaving
    assert loaded["hyper_parameters"]["color"] is Color.RED


# ------------------------------------------------------------------------------------------ crafted checkpoints
def _bad_copy(own: dict[str, Path], fmt: str, target: str, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of our ``fmt`` checkpoint whose ``target`` file carries a payload; returns it and the marker."""
    marker = tmp_path / f"ran-{fmt}-{target}"
    path = tmp_path / own[fmt].name
    (shutil.copytree if own[fmt].is_dir() else shutil.copy)(own[fmt], path)
    if target == ".metadata":  # torch reads this one with plain pickle
        with open(path / target, "rb") as f:
            metadata = pickle.load(f)  # noqa: S301 - written by this test module
        metadata.payload = Payload(marker)
        with open(path / target, "wb") as f:
            pickle.dump(metadata, f)
    elif target == "entry":  # a non-tensor entry of the distributed checkpoint (an optimizer hyper-parameter)
        shutil.rmtree(path)
        ckpt = torch.load(own["full"], weights_only=False)
        ckpt["optimizer_states"][0]["param_groups"][0]["payload"] = Payload(marker)
        path.mkdir()
        formats.save_sharded(convert._sharded_from_full(ckpt, []), path, rank=0, world_size=None, no_dist=True)
        shutil.copy(own["sharded"] / formats.SHARDED_METADATA, path)  # the payload only in the entry
    else:
        file = path if path.is_file() else path / target
        ckpt = torch.load(file, weights_only=False)
        ckpt["payload"] = Payload(marker)
        torch.save(ckpt, file)
    if path.is_dir():  # crafted without checksums: verification is not what stops it
        (path / integrity.MANIFEST).unlink(missing_ok=True)
    assert not marker.exists()
    return path, marker


BAD = [
    ("full", "full.ckpt"),
    ("sharded", "meta.pt"),
    ("sharded", ".metadata"),
    ("sharded", "entry"),
    ("local", "trainer_state.pt"),
    ("local", "rank_00000.pt"),
]
BLOCKED = "posix.system" if os.name == "posix" else "nt.system"


@pytest.mark.parametrize(("fmt", "target"), BAD)
def test_every_loader_refuses_before_the_payload_runs(own, tmp_path, monkeypatch, capsys, fmt, target):
    path, marker = _bad_copy(own, fmt, target, tmp_path)
    shown = "__0_0.distcp" if target == "entry" else target  # the file that holds the payload
    expected = rf"\({re.escape(shown)}\) needs {BLOCKED}, which safe loading \(weights_only=True\) refuses"
    with pytest.raises(trust.UnsafeCheckpointError, match=expected) as err:
        _check_load(path, monkeypatch)
    assert str(path) in str(err.value)
    assert "--trust-checkpoint" in str(err.value)
    assert "weights_only=False" in str(err.value)
    with pytest.raises(trust.UnsafeCheckpointError, match=expected):
        convert.convert(path, tmp_path / "out", "full")
    assert not (tmp_path / "out").exists()
    assert main(["convert", str(path), str(tmp_path / "out"), "--to", "sharded"]) == 2
    if target != "entry":  # inspect reads the metadata and trainer state, never the optimizer entries
        with pytest.raises(trust.UnsafeCheckpointError, match=expected):
            convert.describe(path)
        assert main(["inspect", str(path)]) == 2
    err_text = capsys.readouterr().err
    assert BLOCKED in err_text
    assert not marker.exists()


@pytest.mark.parametrize(("fmt", "target"), BAD)
def test_opting_out_loads_the_checkpoint_and_runs_its_payload(own, tmp_path, monkeypatch, capsys, fmt, target):
    path, marker = _bad_copy(own, fmt, target, tmp_path)
    assert main(["convert", str(path), str(tmp_path / "out"), "--to", "full", "--trust-checkpoint"]) == 0
    assert "--trust-checkpoint: reading" in capsys.readouterr().err
    assert marker.exists()  # the opt-out is real: this is what a trusted load does
    marker.unlink()
    if target != "entry":
        assert main(["inspect", str(path), "--trust-checkpoint"]) == 0
        assert "weights_only=False" in capsys.readouterr().err
        assert marker.exists()
        marker.unlink()
        _check_load(path, monkeypatch, weights_only=False)
        assert marker.exists()


def test_lightning_checkpoint_with_an_unusual_type_is_refused_with_the_way_to_allow_it(own, tmp_path, capsys):
    path = tmp_path / "enum.ckpt"
    ckpt = torch.load(own["full"], weights_only=False)
    ckpt["hyper_parameters"]["color"] = Color.RED
    torch.save(ckpt, path)
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert f"needs {COLOR}" in err
    assert "torch.serialization.add_safe_globals" in err


@pytest.mark.parametrize("weights_only", [True, False])
def test_a_kept_distributed_reader_reads_the_metadata_once_for_many_reads(tmp_path, weights_only):
    """A checkpoint read a tensor at a time (``pretrained_weights``, ``convert --to hf``) keeps one reader: its
    metadata file is read once. After the first read the file may even vanish; a fresh reader then fails."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    saved = {"model": {f"w{i}": torch.randn(8, 4) for i in range(4)}}
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    reader = trust.storage_reader(tmp_path, weights_only=weights_only)
    for i in range(4):
        out = {"model": {f"w{i}": torch.empty(8, 4)}}
        trust.read_distributed(tmp_path, out, DefaultLoadPlanner(), weights_only=weights_only, reader=reader)
        assert torch.equal(out["model"][f"w{i}"], saved["model"][f"w{i}"])
        (tmp_path / ".metadata").unlink(missing_ok=True)
    with pytest.raises(Exception, match=r"\.metadata"):
        trust.read_distributed(tmp_path, {"model": {"w0": torch.empty(8, 4)}}, DefaultLoadPlanner())


# ----------------------------------------------------------------------- tensor entries read without torch.load
TENSORS = {
    "matrix": torch.randn(5, 3),
    "transposed": torch.randn(4, 6).t(),
    "view with offset": torch.randn(10)[3:7],
    "scalar step": torch.tensor(7.0),
    "empty": torch.zeros(0, 3),
    "bf16": torch.randn(8).bfloat16(),
    "int64": torch.arange(6).view(2, 3),
}


def _archive(obj: Any) -> bytearray:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return bytearray(buffer.getvalue())


@pytest.mark.parametrize("name", TENSORS)
def test_tensor_entries_decode_bitwise_as_torch_load_reads_them(name):
    """A sharded resume decodes each DCP tensor entry (one ``torch.save`` archive) itself: same values, dtype,
    shape and strides as ``torch.load(..., weights_only=True)``."""
    data = _archive(TENSORS[name])
    decoded = trust.tensor_from_archive(data)
    loaded = torch.load(io.BytesIO(data), weights_only=True)
    assert decoded is not None
    assert (decoded.dtype, decoded.shape, decoded.stride()) == (loaded.dtype, loaded.shape, loaded.stride())
    assert torch.equal(decoded, loaded)


def test_tensor_entry_decoder_runs_nothing_and_leaves_other_archives_to_torch_load(tmp_path):
    marker = tmp_path / "ran"
    for obj in (Payload(marker), [torch.ones(2), Payload(marker)], {"step": 3}):
        assert trust.tensor_from_archive(_archive(obj)) is None
    assert trust.tensor_from_archive(bytearray(b"not an archive" * 4)) is None
    assert not marker.exists()


def test_sharded_pieces_read_each_box_of_the_saved_tensors(tmp_path):
    """``fast_load.read_pieces`` reads the boxes a rank lists straight into its tensors, from files written by DCP."""
    from lightning_gaudi_fsdp import _compat
    from lightning_gaudi_fsdp.checkpoint import fast_load

    saved = {"model": {"w": torch.randn(6, 4), "b": torch.randn(4)}, "optimizer_0": {"step": torch.tensor(3.0)}}
    _compat.dcp_save(saved, tmp_path, no_dist=True)
    metadata = trust.storage_reader(tmp_path).read_metadata()
    rows, corner, step = torch.empty(3, 4), torch.empty(1, 2), torch.empty(())
    pieces = {"model.w": [((2, 0), rows), ((5, 2), corner)], "optimizer_0.step": [((), step)]}
    assert fast_load.read_pieces(tmp_path, metadata, pieces)
    assert torch.equal(rows, saved["model"]["w"][2:5])
    assert torch.equal(corner, saved["model"]["w"][5:6, 2:4])
    assert torch.equal(step, saved["optimizer_0"]["step"])
    with pytest.raises(RuntimeError, match=r"Missing key in checkpoint state_dict: model\.nothing"):
        fast_load.read_pieces(tmp_path, metadata, {"model.nothing": [((0,), torch.empty(1))]})
