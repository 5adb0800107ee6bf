"""The storage seam (``checkpoint/files.py``) and the commit record of URL checkpoints (``checkpoint/commit.py``), on a
local folder and on a real S3 server (SeaweedFS, the ``s3`` fixture): the same calls read and write both, a URL save is
visible only once its commit record is written, an overwrite keeps the previous checkpoint until then, the next save
cleans up what an interrupted one left, and removal deletes a checkpoint whole. ``inspect`` and ``convert`` take
``s3://`` URLs; a missing bucket or refused credentials stop ``fit`` before training. Multi-process saves and resumes
from S3 are in ``tests/distributed/test_s3.py``."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_gaudi_fsdp import GaudiFSDPStrategy
from lightning_gaudi_fsdp.checkpoint import commit, files, formats, storage
from lightning_gaudi_fsdp.checkpoint.loading import read_full_model_state
from lightning_gaudi_fsdp.checkpoint.location import CheckpointURLError
from lightning_gaudi_fsdp.cli import main
from tiny_module import Tiny


def _checkpoint(step: int) -> dict[str, Any]:
    return {"state_dict": {"w": torch.arange(6.0) + step}, "optimizer_states": [], "global_step": step, "epoch": 0}


def _save(url: str, step: int) -> None:
    formats.save("full", _checkpoint(step), url, rank=0, world_size=1, gather=lambda obj: [obj])


@pytest.fixture
def cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    where = tmp_path / "cwd"
    where.mkdir()
    monkeypatch.chdir(where)
    return where


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_the_seam_reads_and_writes_local_paths_and_urls_alike(request, tmp_path, cwd, kind):
    root_text = str(tmp_path / "root") if kind == "local" else request.getfixturevalue("s3").url("seam")
    root = files.locate(root_text, "path")
    assert files.is_remote(root) == (kind == "s3")
    assert str(root) == root_text
    if kind == "local":
        (root / "a").mkdir(parents=True)  # an object store has no folders to make
    with files.open_write(root / "a" / "one.bin") as f:
        f.write(b"x" * 1000)
    with files.open_write(root / "two.bin") as f:
        f.write(b"y" * 24)
    with files.open_read(root / "a" / "one.bin") as f:
        assert f.read() == b"x" * 1000
    assert files.exists(root / "two.bin")
    assert files.is_file(root / "two.bin")
    assert files.is_dir(root / "a")
    assert not files.exists(root / "three.bin")
    assert files.listdir(root) == ["a", "two.bin"]
    assert (files.size(root / "two.bin"), files.size(root)) == (24, 1024)
    files.remove(root / "a")
    files.remove(root / "a")  # absent: nothing to do
    assert files.listdir(root) == ["two.bin"]
    assert list(cwd.iterdir()) == []  # nothing under the working directory (no folder named "s3:")


def test_file_urls_stay_local_paths_and_what_cannot_be_honoured_is_refused(tmp_path):
    assert files.locate(f"file://{tmp_path}/x.ckpt", "path") == tmp_path / "x.ckpt"
    with pytest.raises(CheckpointURLError, match=r"^fabric.save: path='memory://b/x': a 'memory://' file system"):
        files.locate("memory://b/x", "path", "fabric.save")
    with pytest.raises(CheckpointURLError, match=r"^path='nosuch://b/x': no fsspec file system is known for"):
        files.locate("nosuch://b/x", "path")
    with pytest.raises(CheckpointURLError, match=r"^path='s3:/b/x' has a folder named 's3:'"):
        files.locate("s3:/b/x", "path")


def test_a_url_save_is_visible_once_committed_and_an_overwrite_keeps_the_previous_until_then(s3, cwd):
    folder = s3.url("commit")
    url = f"{folder}/x.ckpt"
    _save(url, 1)
    names = s3.keys(folder)
    assert [names[1], names[0][: len(".x.ckpt.gen-")], len(names)] == ["x.ckpt", ".x.ckpt.gen-", 2], names
    record = json.loads(s3.client().cat_file(url.removeprefix("s3://")))
    assert record[commit.RECORD_KEY] == 1
    assert record["data"] == names[0]
    assert record["directory"] is False
    assert torch.equal(read_full_model_state(url)["w"], torch.arange(6.0) + 1)

    def half_then_fail(staging: Any) -> None:
        with files.open_write(staging) as handle:
            handle.write(b"\x80" * 1000)
        raise OSError("the upload broke off")

    where = files.locate(url, "path")
    staging = commit.staging_path(where, "broken")
    with pytest.raises(storage.CheckpointSaveError, match="the upload broke off"):
        storage.write_atomically(
            url, [lambda: half_then_fail(staging)], directory=False, needed=lambda: 0, staging=staging
        )
    assert s3.keys(folder) == names  # the failed save's generation is gone, the record and its data unchanged
    assert torch.equal(read_full_model_state(url)["w"], torch.arange(6.0) + 1)
    # what a SIGKILLed save leaves: objects under a generation no record names; readers skip it, the next save drops it
    s3.client().pipe_file(f"{folder}/.x.ckpt.gen-killed/__1_0.distcp".removeprefix("s3://"), b"\x80" * 100)
    assert torch.equal(read_full_model_state(url)["w"], torch.arange(6.0) + 1)
    _save(url, 2)
    after = s3.keys(folder)
    assert [after[1], len(after)] == ["x.ckpt", 2], after  # the killed save's generation and the replaced one gone
    assert after[0] not in (names[0], ".x.ckpt.gen-killed"), after
    assert torch.equal(read_full_model_state(url)["w"], torch.arange(6.0) + 2)
    assert list(cwd.iterdir()) == []


def test_a_name_without_a_commit_record_is_no_checkpoint_and_removal_deletes_a_checkpoint_whole(s3):
    folder = s3.url("remove")
    s3.client().pipe_file(f"{folder}/.y.ckpt.gen-killed/meta.pt".removeprefix("s3://"), b"\x80" * 100)
    with pytest.raises(formats.CheckpointError, match="the save was interrupted before it was committed"):
        read_full_model_state(f"{folder}/y.ckpt")
    _save(f"{folder}/x.ckpt", 1)
    assert main(["convert", f"{folder}/x.ckpt", f"{folder}/x.sharded", "--to", "sharded"]) == 0
    sharded = [n for n in s3.keys(folder) if n.startswith(".x.sharded.gen-")]
    assert any(n.endswith("/.metadata") for n in sharded), sharded
    commit.remove_checkpoint(files.locate(f"{folder}/x.sharded", "path"))
    assert not [n for n in s3.keys(folder) if "x.sharded" in n]
    assert any(n == "x.ckpt" for n in s3.keys(folder))


def test_inspect_and_convert_take_s3_urls(s3, tmp_path, cwd):
    folder = s3.url("cli")
    _save(f"{folder}/x.ckpt", 3)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["inspect", f"{folder}/x.ckpt"]) == 0
    assert "full" in out.getvalue()
    assert main(["convert", f"{folder}/x.ckpt", f"{folder}/y", "--to", "sharded"]) == 0
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["inspect", f"{folder}/y"]) == 0
    assert main(["convert", f"{folder}/y", str(tmp_path / "back.ckpt"), "--to", "full"]) == 0
    assert torch.equal(read_full_model_state(tmp_path / "back.ckpt")["w"], torch.arange(6.0) + 3)
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    assert main(["convert", f"{folder}/y", str(tmp_path / "hf"), "--to", "hf"]) == 0  # export_hf from S3
    assert torch.equal(load_file(tmp_path / "hf" / "model.safetensors")["w"], torch.arange(6.0) + 3)
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize("problem", ["bucket", "credentials"])
def test_a_missing_bucket_or_refused_credentials_stop_fit_before_training(s3, cwd, monkeypatch, problem):
    from lightning.pytorch.callbacks import ModelCheckpoint

    dirpath = "s3://no-such-bucket/run" if problem == "bucket" else s3.url("creds")
    if problem == "credentials":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    _fresh_clients()
    module = Tiny()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=GaudiFSDPStrategy(),
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        callbacks=[ModelCheckpoint(dirpath=dirpath)],
    )
    try:
        with pytest.raises(CheckpointURLError) as caught:
            trainer.fit(module)
    finally:
        monkeypatch.undo()
        _fresh_clients()
    expected = (
        f"ModelCheckpoint: dirpath='{dirpath}': the bucket 'no-such-bucket' does not exist or is not reachable"
        if problem == "bucket"
        else f"ModelCheckpoint: dirpath='{dirpath}': access refused (PermissionError: "
    )
    assert str(caught.value).startswith(expected), str(caught.value)
    assert trainer.global_step == 0
    assert list(cwd.iterdir()) == []


def _fresh_clients() -> None:
    """New S3 clients from here on (they read the credentials when made)."""
    import s3fs

    files._file_system.cache_clear()
    s3fs.S3FileSystem.clear_instance_cache()


def test_lightnings_client_sees_a_url_checkpoint_once_committed(s3):
    """``ModelCheckpoint.file_exists`` asks fsspec's default client of the protocol, which caches folder listings: a
    listing made before the save (``ModelCheckpoint`` lists its folder at setup) must not hide the committed
    checkpoint from it, nor show a removed one."""
    import fsspec

    folder = s3.url("listing")
    client = fsspec.filesystem("s3")  # the client Lightning's get_filesystem(dirpath) returns
    client.pipe_file(f"{folder}/other.bin".removeprefix("s3://"), b"x")
    assert len(client.ls(folder.removeprefix("s3://"))) == 1  # a listing it now keeps
    _save(f"{folder}/x.ckpt", 1)
    assert client.exists(f"{folder}/x.ckpt")
    commit.remove_checkpoint(files.locate(f"{folder}/x.ckpt", "path"))
    assert not client.exists(f"{folder}/x.ckpt")


def test_pretrained_safetensors_at_a_url_read_the_same_rows_as_the_local_files(s3, tmp_path):
    """A Hugging Face directory on S3 (several files and an index): every key's shape, dtype and any rows read
    through byte ranges equal what ``safe_open`` reads from the same local files."""
    pytest.importorskip("transformers")
    from conftest import save_tiny_llama
    from lightning_gaudi_fsdp.checkpoint.pretrained_source import Source, resolve

    local = save_tiny_llama(tmp_path / "llama")
    url = s3.url("llama")
    s3.client().put(str(local), url.removeprefix("s3://"), recursive=True)
    here, there = Source(resolve(local)), Source(resolve(url))
    assert resolve(url).files
    assert all(files.is_remote(f) for f in resolve(url).files)
    assert there.meta == here.meta
    for key, (shape, _) in here.meta.items():
        rows = shape[0] if shape else 1
        for start, stop in ((0, rows), (rows // 3, rows // 2 + 1)):
            assert torch.equal(there.rows(key, start, stop), here.rows(key, start, stop)), (key, start, stop)


@pytest.mark.slow  # about 50 s: the clients' retries, and a second server
def test_the_server_stopping_mid_save_fails_it_naming_the_url_and_after_a_restart_the_next_save_succeeds(
    s3, tmp_path, monkeypatch
):
    """A server of its own, killed while a save uploads: the save raises :class:`CheckpointSaveError` naming the URL
    within a bounded time (s3fs's and botocore's own retries), the previous checkpoint is there once the server is
    back, and the next save succeeds and clears what the failed one left."""
    import time

    from s3_server import running

    with running(tmp_path / "own") as server:
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
        _fresh_clients()
        try:
            url = f"{server.url('stopped')}/x.ckpt"
            _save(url, 1)
            staging = commit.staging_path(files.locate(url, "path"), "cut")

            def cut_off() -> None:
                with files.open_write(staging) as handle:
                    handle.write(b"\x80" * 1000)
                    server.stop()  # the rest goes nowhere: the upload fails when the file is closed
                    handle.write(b"\x80" * 1000)

            started = time.monotonic()
            with pytest.raises(storage.CheckpointSaveError) as caught:
                storage.write_atomically(url, [cut_off], directory=False, needed=lambda: 0, staging=staging)
            took = time.monotonic() - started
            assert str(caught.value).startswith(f"Cannot save checkpoint '{url}': failed while writing: ")
            assert f"check that '{url}' is reachable and writable" in str(caught.value)
            assert took < 120, took
            server.start()
            assert torch.equal(read_full_model_state(url)["w"], torch.arange(6.0) + 1)
            _save(url, 2)
            assert torch.equal(read_full_model_state(url)["w"], torch.arange(6.0) + 2)
            assert len(server.keys(url.rsplit("/", 1)[0])) == 2  # the record and its generation: nothing left over
        finally:
            monkeypatch.undo()
            _fresh_clients()
