"""Saves that fail, in one process on real storage: the cause in plain words, the size estimate and the free-space
check, clean-up, commit, and ``convert`` writing its output. The same protocol across ranks: tests/distributed."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import pickle
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from lightning_gaudi_fsdp.checkpoint import commit, formats, space, storage
from lightning_gaudi_fsdp.checkpoint.convert import convert, load_full_state
from lightning_gaudi_fsdp.checkpoint.storage import CheckpointSaveError, Failure

FORMATS = ("full", "sharded", "local")
KIB = r"[\d.]+ KiB"
NOTHING_COMMITTED = "Nothing was committed: a checkpoint already under this name is unchanged."


def _checkpoint(step: int = 1, width: int = 128) -> dict:
    """A Lightning-like checkpoint of about 0.6 MiB: weights and AdamW state of three layers."""
    g = torch.Generator().manual_seed(step)
    shapes = {
        f"net.{i}.{k}": (width, width) if k == "weight" else (width,) for i in range(3) for k in ("weight", "bias")
    }
    state = {name: torch.randn(*shape, generator=g) for name, shape in shapes.items()}
    moments = {
        i: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(*s, generator=g), "exp_avg_sq": torch.rand(*s)}
        for i, s in enumerate(shapes.values())
    }
    optimizer = {"state": moments, "param_groups": [{"lr": 0.01, "params": list(range(len(shapes)))}]}
    return {"state_dict": state, "optimizer_states": [optimizer], "epoch": 0, "global_step": step}


def _save(fmt: str, path: Path, step: int = 1, **kwargs) -> Path:
    return formats.save(fmt, _checkpoint(step), path, rank=0, world_size=1, gather=lambda obj: [obj], **kwargs)


def _saved_step(path: Path) -> int:
    """The step of the checkpoint at ``path``, read back in full."""
    if formats.detect_format(path) == "local":  # these synthetic ones have no FSDP layout to assemble: read the files
        torch.load(path / formats.local_shard_name(0), weights_only=True)
        return torch.load(path / formats.LOCAL_TRAINER_STATE, weights_only=True)["global_step"]
    return load_full_state(path)[0]["global_step"]


def _bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# ------------------------------------------------------------------------------------------------ estimate, switch
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_estimate_is_close_to_what_a_save_writes(tmp_path, fmt):
    written = _bytes(_save(fmt, tmp_path / "x.ckpt"))
    assert 0.95 < formats.bytes_to_write(fmt, _checkpoint(), rank=0) / written < 1.1


def test_the_estimate_counts_a_shared_storage_once_and_a_dcp_tensor_by_its_elements():
    base = torch.zeros(1000)
    views = {"a": base[:500], "b": base[500:], "all": base}
    # torch.save writes the 4000-byte storage once; DCP writes each tensor's own elements (2000 + 2000 + 4000)
    assert space.estimate_bytes(views) - space.estimate_bytes({"all": base}) < 1000
    assert space.estimate_bytes(views, tensors="elements") - space.estimate_bytes({}, tensors="elements") > 8000


@pytest.mark.parametrize("check", [True, False])
def test_a_size_estimate_that_fails_skips_the_free_space_check_with_a_warning(tmp_path, caplog, check):
    """A sparse tensor has no storage to count: the estimate raises instead of returning the partial count of what
    came before it (about 4 KiB for the ~0.6 MiB written here), and the save goes ahead unchecked, saying so when the
    check was asked for."""
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 9]]), torch.ones(2), (10,))
    checkpoint = {"sparse": sparse, **_checkpoint()}
    with pytest.raises(NotImplementedError, match="Cannot access storage of SparseTensorImpl"):
        space.estimate_bytes(checkpoint)
    path = tmp_path / "x.ckpt"
    with caplog.at_level(logging.WARNING, logger=storage.__name__):
        formats.save("full", checkpoint, path, rank=0, world_size=1, gather=lambda obj: [obj], check_free_space=check)
    expected = (
        f"[rank 0] the free-space check before saving {str(path)!r} did not run: the size of this rank's part could "
        "not be estimated (NotImplementedError: Cannot access storage of SparseTensorImpl); saving without it"
    )
    assert caplog.messages == ([expected] if check else [])
    assert torch.equal(torch.load(path, weights_only=True)["sparse"].to_dense(), sparse.to_dense())


def test_the_free_space_check_is_on_unless_the_argument_or_the_environment_turns_it_off(monkeypatch):
    monkeypatch.delenv(space.CHECK_FREE_SPACE_ENV, raising=False)
    assert space.check_free_space_enabled() is True
    for off in ("0", "false", "OFF", " no "):
        monkeypatch.setenv(space.CHECK_FREE_SPACE_ENV, off)
        assert space.check_free_space_enabled() is False
    assert space.check_free_space_enabled(True) is True  # the argument wins over the environment
    monkeypatch.setenv(space.CHECK_FREE_SPACE_ENV, "1")
    assert space.check_free_space_enabled() is True
    assert space.check_free_space_enabled(False) is False


# ---------------------------------------------------------------------------------------------------- the message
def test_the_message_names_the_path_each_cause_once_with_its_ranks_and_what_to_do():
    no_space = "no space left on /scratch: needed about 4.2 MiB, 1.1 MiB free"
    enospc = "OSError: [Errno 28] No space left on device"
    failures = [
        Failure(1, "failed while writing", no_space, enospc, "free space on /scratch or save elsewhere"),
        Failure(0, "failed while writing", no_space, enospc, "free space on /scratch or save elsewhere"),
        Failure(3, "failed while writing", "", "RuntimeError: boom", "see the error chained on the failed rank"),
    ]
    err = CheckpointSaveError("/scratch/x.ckpt", failures, world_size=4)
    assert str(err) == (
        f"Cannot save checkpoint '/scratch/x.ckpt': ranks 0, 1 failed while writing: {no_space} ({enospc}); rank 3 "
        f"failed while writing: RuntimeError: boom. {NOTHING_COMMITTED} To do: free space on /scratch or save "
        "elsewhere; see the error chained on the failed rank."
    )
    assert isinstance(err, OSError)  # the command line reports it in one line
    assert str(pickle.loads(pickle.dumps(err))) == str(err)  # noqa: S301 - our own bytes
    alone = CheckpointSaveError("/scratch/x.ckpt", failures[1:2], world_size=1)
    assert str(alone).startswith(f"Cannot save checkpoint '/scratch/x.ckpt': failed while writing: {no_space}")
    assert space.human_bytes(4404019) == "4.2 MiB"
    assert space.human_bytes(512) == "512 B"


# ------------------------------------------------------------------------------------------- real storage, 1 rank
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("check", [True, False], ids=["refused", "write-fails"])
def test_a_full_disk_fails_with_its_numbers_and_leaves_the_previous_checkpoint(small_tmpfs, fmt, check):
    root = small_tmpfs("1m")  # holds one checkpoint, not two
    path = _save(fmt, root / "last.ckpt", step=1)
    stage = "refused before writing" if check else "failed while writing"
    with pytest.raises(CheckpointSaveError) as info:
        _save(fmt, path, step=2, check_free_space=check)  # the same name, as ModelCheckpoint's save_last does
    message = str(info.value)
    assert re.match(
        rf"Cannot save checkpoint '{path}': {stage}: no space left on {root}: needed about {KIB}, {KIB} free", message
    )
    assert NOTHING_COMMITTED in message
    if check:
        assert "LIGHTNING_GAUDI_FSDP_CHECK_FREE_SPACE=0" in message
        assert info.value.__cause__ is None
    else:
        assert "Errno 28" in message
        assert info.value.__cause__ is not None  # the write's own error, chained
    assert os.listdir(root) == ["last.ckpt"]  # no staging left, hidden or not
    assert _saved_step(path) == 1


def test_a_read_only_file_system_fails_before_writing(small_tmpfs):
    root = small_tmpfs("1m")
    _save("full", root / "good.ckpt")
    subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
    try:
        with pytest.raises(CheckpointSaveError, match=rf": failed while preparing: {root} is a read-only file system"):
            _save("sharded", root / "next.ckpt")
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(root)], check=True)
    assert os.listdir(root) == ["good.ckpt"]


def test_a_directory_the_user_cannot_write_says_permission_denied(small_tmpfs):
    home = small_tmpfs("1m") / "runs"
    home.mkdir()
    # root bypasses permission bits; the immutable flag stops root too
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(home)], capture_output=True).returncode:
        pytest.skip("cannot make a directory immutable here (chattr missing, or the file system lacks the flag)")
    try:
        with pytest.raises(CheckpointSaveError, match=rf": failed while writing: permission denied for '{home}/"):
            _save("full", home / "next.ckpt")
    finally:
        subprocess.run(["chattr", "-i", str(home)], check=True)
    assert os.listdir(home) == []


@pytest.mark.parametrize("fmt", ["full", "local"])
def test_a_directory_removed_while_writing_says_so(tmp_path, monkeypatch, fmt):
    home = tmp_path / "runs"
    real = formats.save_file

    def removed_first(obj, file, **kwargs):
        shutil.rmtree(home, ignore_errors=True)
        real(obj, file, **kwargs)

    monkeypatch.setattr(formats, "save_file", removed_first)
    with pytest.raises(CheckpointSaveError, match=rf": failed while writing: directory '{home}' no longer exists"):
        _save(fmt, home / "next.ckpt")
    assert os.listdir(tmp_path) == []


def test_a_write_error_without_errno_is_explained_from_the_target(small_tmpfs, monkeypatch):
    # torch's own file writer says only "unexpected pos": look at the file system instead
    root = small_tmpfs("1m")
    monkeypatch.setattr(formats, "save_file", lambda obj, file, **kwargs: _fill_and_fail(root))
    with pytest.raises(CheckpointSaveError, match=rf": failed while writing: no space left on {root}: needed about"):
        _save("full", root / "next.ckpt", check_free_space=False)


def _fill_and_fail(root: Path) -> None:
    with open(root / "ballast", "wb") as handle, pytest.raises(OSError, match="No space left"):
        handle.write(b"\0" * 2**21)
    raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")


# ------------------------------------------------------------------------------------------ across ranks, simulated
def test_a_healthy_rank_raises_the_failed_ranks_cause_and_rank_0_cleans_up_after_everyone(tmp_path):
    """Rank 0's own write works; rank 1 reports a full disk: rank 0 raises rank 1's error, then (and only then)
    removes the staging location."""
    path = tmp_path / "x.ckpt"
    theirs = Failure(1, "failed while writing", "no space left on /scratch", "OSError: [Errno 28] ...", "free space")
    seen: list[bool] = []

    def gather(obj):
        seen.append(commit.staging_path(path).exists())
        # preparing: rank 1 plans like rank 0; writing: rank 1's write failed
        return [obj, obj] if len(seen) == 1 else [obj, (None, [theirs])]

    def write() -> None:
        (commit.staging_path(path) / "rank_00000.pt").write_bytes(b"ok")

    with pytest.raises(CheckpointSaveError) as info:
        storage.write_atomically(path, [write], directory=True, needed=lambda: 0, gather=gather)
    assert str(info.value).startswith(f"Cannot save checkpoint '{path}': rank 1 failed while writing: no space left")
    assert info.value.__cause__ is None  # nothing failed here
    assert seen == [True, True]  # the staging location still existed while the ranks exchanged their outcome
    assert os.listdir(tmp_path) == []


def test_ranks_in_pods_of_one_node_sharing_a_volume_are_checked_against_its_free_space_together(small_tmpfs):
    """Two pods on one node mount the same volume: their host names differ, but they run under one kernel (boot id)
    and write to one device. A save that each pod's part alone fits, and both together do not, is refused before
    writing, as one file system holding both parts."""
    root = small_tmpfs("1m")
    path = root / "last.ckpt"
    needed = int(0.6 * space.free_bytes(root))

    def gather(obj):
        plan, reports = obj
        if isinstance(plan, space.Plan):  # preparing: the other pod's rank measured the same volume
            other = dataclasses.replace(plan, rank=1, target=dataclasses.replace(plan.target, host="trainer-pod-1"))
            return [obj, (other, reports)]
        return [obj, obj]

    def write() -> None:
        commit.staging_path(path).write_bytes(b"\0" * needed)

    with pytest.raises(CheckpointSaveError) as info:
        storage.write_atomically(path, [write], directory=False, needed=lambda: needed, gather=gather)
    assert re.match(
        rf"Cannot save checkpoint '{path}': ranks 0, 1 refused before writing: no space left on {root}: "
        r"needed about 1\.\d MiB, 1\.0 MiB free",
        str(info.value),
    ), str(info.value)
    assert os.listdir(root) == []


def test_a_distributed_checkpoint_error_is_charged_to_the_rank_that_raised_it(tmp_path):
    class CheckpointException(BaseException):  # torch's: raised on every rank, carrying each failed rank's error
        def __init__(self, failures: dict) -> None:
            super().__init__("CheckpointException ranks:dict_keys([1])")
            self.failures = failures

    def write() -> None:
        raise CheckpointException({1: (OSError(errno.EROFS, "Read-only file system"), None)})

    with pytest.raises(CheckpointSaveError, match=r"rank 1 failed while writing: .* is a read-only file system"):
        storage.write_atomically(
            tmp_path / "x.ckpt", [write], directory=True, needed=lambda: 0, gather=lambda o: [o, o]
        )


def test_when_a_peer_is_lost_during_the_exchange_this_ranks_own_failure_is_still_logged(tmp_path, caplog):
    def gather(obj):
        if obj[1]:  # the write step, after this rank's own failure
            raise RuntimeError("Connection closed by peer [127.0.0.1]:29500")
        return [obj, obj]

    def write() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        storage.write_atomically(tmp_path / "x.ckpt", [write], directory=True, needed=lambda: 0, gather=gather)
    assert "failed while writing: OSError: [Errno 28] No space left on device" in caplog.text


def test_commit_puts_the_previous_checkpoint_back_when_the_rename_fails(tmp_path, monkeypatch):
    path = tmp_path / "x.ckpt"
    path.mkdir()
    (path / "meta.pt").write_text("previous")
    staging = commit.prepare_staging(path, directory=True)
    (staging / "meta.pt").write_text("new")
    real = os.replace

    def failing(src, dst):
        if Path(src) == staging:
            raise OSError(errno.EIO, "Input/output error")
        real(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(OSError, match="Input/output error"):
        commit.commit(staging, path)
    assert (path / "meta.pt").read_text() == "previous"
    assert sorted(os.listdir(tmp_path)) == [".x.ckpt.partial", "x.ckpt"]


def test_recover_on_every_rank_at_once_restores_the_checkpoint_without_an_error(tmp_path, monkeypatch):
    """Two ranks sharing a file system both find ``.x.ckpt.old`` after a crash between commit's renames; the one
    that loses the race must see the checkpoint restored, not a FileNotFoundError."""
    path = tmp_path / "x.ckpt"
    old = tmp_path / ".x.ckpt.old"
    old.mkdir()
    (old / "meta.pt").write_text("previous")
    real = os.replace

    def other_rank_first(src, dst):
        real(src, dst)  # the other rank's restore lands between this rank's check and its rename
        real(src, dst)

    monkeypatch.setattr(os, "replace", other_rank_first)
    commit.recover(path)
    assert (path / "meta.pt").read_text() == "previous"
    assert sorted(os.listdir(tmp_path)) == ["x.ckpt"]


# ----------------------------------------------------------------------------------------------------- convert
@pytest.mark.parametrize("to", ["full", "sharded"])
def test_convert_into_a_full_disk_says_so_and_leaves_nothing(small_tmpfs, tmp_path, capsys, to):
    from lightning_gaudi_fsdp.cli import main

    src = tmp_path / "src.ckpt"
    formats.save_file(_checkpoint(), src)
    root = small_tmpfs("128k")  # less than the weights alone (a sharded output drops this optimizer state)
    dst = root / "dst.ckpt"
    prefix = f"Cannot save checkpoint '{dst}': "
    with pytest.raises(
        CheckpointSaveError, match=re.escape(prefix) + f"refused before writing: no space left on {root}"
    ):
        convert(src, dst, to)
    with pytest.raises(CheckpointSaveError, match=re.escape(prefix) + f"failed while writing: no space left on {root}"):
        convert(src, dst, to, check_free_space=False)
    assert os.listdir(root) == []
    assert main(["convert", str(src), str(dst), "--to", to]) == 2
    assert capsys.readouterr().err.startswith(f"lightning-gaudi-fsdp convert: error: {prefix}refused before writing")


@pytest.mark.versions
def test_archives_are_written_without_checksums_inside_and_torchs_setting_comes_back(tmp_path):
    """``zip_checksums(False)`` (a checkpoint save with ``checkpoint_crc32=False``): no CRC32 in what torch.save
    writes inside, in the training loop's thread or a background save's; afterwards torch's own setting is what it
    was, whichever it was. torch.load reads either archive."""
    import threading
    import zipfile

    def save(name: str) -> Path:
        torch.save({"w": torch.arange(4.0)}, tmp_path / name)
        return tmp_path / name

    def checksummed(path: Path) -> bool:
        return zipfile.ZipFile(path).testzip() is None

    def background_save() -> None:
        with storage.zip_checksums(False):
            save("background.pt")

    assert torch.serialization.get_crc32_options() is True  # torch's default
    with storage.zip_checksums(False):
        first = save("first.pt")
    thread = threading.Thread(target=background_save)
    thread.start()
    thread.join()
    assert not checksummed(first)
    assert not checksummed(tmp_path / "background.pt")
    assert checksummed(save("after.pt"))  # the user's torch.save writes them again
    with storage.zip_checksums(True):
        assert checksummed(save("asked.pt"))
    assert torch.equal(torch.load(first, weights_only=True)["w"], torch.arange(4.0))

    torch.serialization.set_crc32_options(False)  # a user who turned them off keeps them off
    try:
        with storage.zip_checksums(False):
            pass
        with storage.zip_checksums(True):  # checkpoint_crc32=True writes them all the same
            assert checksummed(save("asked_anyway.pt"))
        assert torch.serialization.get_crc32_options() is False
    finally:
        torch.serialization.set_crc32_options(True)


def test_the_restore_line_appears_only_for_a_restore_of_5_s_or_more(tmp_path):
    """A quick restore prints nothing; a long one names the checkpoint and its format, the bytes on disk (every file of
    a directory), the ranks that read it and the rate."""
    from lightning_gaudi_fsdp.checkpoint.loading import PendingLoad, restore_note

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "__0_0.distcp").write_bytes(b"\0" * 3 * 1024**2)
    (ckpt / "__1_0.distcp").write_bytes(b"\0" * 3 * 1024**2)
    (ckpt / ".metadata").write_bytes(b"\0" * 1024)
    pending = PendingLoad(fmt="sharded", path=ckpt, rest={})
    assert restore_note(pending, 4.99, world_size=2) is None
    assert restore_note(pending, 6.0, world_size=2) == (
        f"lightning_gaudi_fsdp: restored the sharded checkpoint {str(ckpt)!r} (6.0 MiB on disk, read by 2 rank(s)) "
        "in 6.0 s: 1.0 MiB/s"
    )
