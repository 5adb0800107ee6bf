"""A checkpoint location that cannot be honoured (a URL no fsspec file system opens, an unknown protocol, a chain, an
in-process ``memory://`` store, a URL where an argument takes none yet, a URL flattened into a local path) is refused
at every entry point with one message naming the call, the argument and the value, before anything is read or written.
Before, ``trainer.save_checkpoint("s3://...")`` wrote a folder named ``s3:`` under the working directory and reported
success, and resuming, ``inspect`` and ``pretrained_weights`` read that folder back. URLs that are honoured (``s3://``
against a real server) are tested in ``tests/checkpoint/test_files.py`` and
``tests/distributed/test_object_storage.py``."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_gaudi_fsdp import GaudiFSDPStrategy
from lightning_gaudi_fsdp.checkpoint.location import CheckpointURLError, local_path
from lightning_gaudi_fsdp.cli import main
from lightning_gaudi_fsdp.fabric import GaudiFSDPStrategy as FabricStrategy
from tiny_module import Tiny

URL = "s3://ckpt/run/x.ckpt"
UNKNOWN = "nosuch://ckpt/run/x.ckpt"
MEMORY = "memory://ckpt/run"
CHAIN = "simplecache::s3://ckpt/run/x.ckpt"
ADVICE = (
    "this argument takes a local path or a URL of the form protocol://bucket/path that an installed fsspec file system "
    "opens (s3:// with lightning-gaudi-fsdp[s3]), and nothing was read or written; see docs/checkpoints.md, "
    '"Checkpoints on object storage"'
)


LOCAL_ONLY = (
    "this argument takes a local path (or a file:// URL) only, not a URL yet, and nothing was read or written. Pass a "
    "local path, or the path where the bucket is mounted as a file system; see docs/checkpoints.md, "
    '"Where checkpoints go"'
)


def refused(argument: str, value: str, call: str = "", advice: str = ADVICE) -> str:
    """The message of :func:`local_path` (and of :func:`.files.locate` for a chain); ``advice``: ``LOCAL_ONLY`` for
    an argument that takes no URL yet."""
    scheme = re.match(r"[^:/]+(://|::)", value).group(0)  # type: ignore[union-attr]
    return f"{call}: " * bool(call) + f"{argument}={value!r} is a URL ({scheme!r}): {advice}"


def unknown(argument: str, value: str, call: str = "") -> str:
    return (
        f"{call}: " * bool(call)
        + f"{argument}={value!r}: no fsspec file system is known for 'nosuch://' URLs; {ADVICE}"
    )


def in_process(argument: str, value: str, call: str = "") -> str:
    return (
        f"{call}: " * bool(call) + f"{argument}={value!r}: a 'memory://' file system lives inside one process, where "
        f"the other ranks and a later run cannot read it; {ADVICE}"
    )


def tree(root: Path) -> dict[str, bytes | None]:
    """Every file and folder under ``root`` (a file with its bytes)."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in root.rglob("*")}


@pytest.fixture
def cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    where = tmp_path / "cwd"
    where.mkdir()
    monkeypatch.chdir(where)
    return where


@pytest.fixture
def misdirected(cwd: Path) -> Path:
    """A real checkpoint where a save to ``URL`` used to put it: ``<cwd>/s3:/ckpt/run/x.ckpt``; and a good one."""
    module = Tiny()
    ckpt = {"state_dict": module.state_dict(), "global_step": 1, "epoch": 0, "optimizer_states": []}
    for path in (cwd / "s3:/ckpt/run/x.ckpt", cwd / "good.ckpt"):
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(ckpt, path)
    return cwd / "s3:/ckpt/run/x.ckpt"


def test_local_path_takes_paths_and_file_urls_and_refuses_every_other_url(tmp_path):
    assert local_path("/data/run/x.ckpt", "path") == Path("/data/run/x.ckpt")
    assert local_path(tmp_path / "a:b" / "x", "path") == tmp_path / "a:b" / "x"  # a colon alone is no URL
    assert local_path("runs/a::b", "path") == Path("runs/a::b")  # nor an unknown protocol's "::"
    assert local_path(f"file://{tmp_path}/x.ckpt", "path") == tmp_path / "x.ckpt"
    assert local_path(f"local://{tmp_path}/x.ckpt", "path") == tmp_path / "x.ckpt"
    for url in (URL, "gs://b/x", "hf://meta-llama/Llama-3.1-8B", "memory://x", "simplecache::s3://b/x", "file::/x"):
        with pytest.raises(CheckpointURLError) as caught:
            local_path(url, "path", "fabric.save")
        assert str(caught.value) == refused("path", url, "fabric.save")
    # a URL already flattened into a local path (pathlib, or Lightning's ModelCheckpoint for "file://")
    for flat, folder in ((Path(URL), "s3:"), (f"{tmp_path}/file:{tmp_path}/mc", "file:")):
        with pytest.raises(CheckpointURLError) as caught:
            local_path(flat, "dirpath")
        assert str(caught.value).startswith(
            f"dirpath={str(flat)!r} has a folder named {folder!r}: a {folder[:-1] + '://'!r} URL flattened into a "
            "local path (pathlib.Path('s3://b/x') is 's3:/b/x'; Lightning's ModelCheckpoint turns "
            "dirpath='file:///x' into a folder 'file:' under the working directory): this argument takes a local path"
        )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["inspect", UNKNOWN], unknown("path", UNKNOWN)),
        (["inspect", CHAIN], refused("path", CHAIN)),
        (["convert", UNKNOWN, "out.ckpt", "--to", "sharded"], unknown("src", UNKNOWN)),
        (["convert", "good.ckpt", f"{MEMORY}/y.ckpt", "--to", "full"], in_process("dst", f"{MEMORY}/y.ckpt")),
        (["convert", UNKNOWN, "hf-out", "--to", "hf"], unknown("src", UNKNOWN)),
        (["convert", "good.ckpt", "gs://models/hf", "--to", "hf"], refused("dst", "gs://models/hf", advice=LOCAL_ONLY)),
        (
            ["convert", "good.ckpt", "hf-out", "--to", "hf", "--hf-config", "hf://org/m"],
            refused("hf_config", "hf://org/m", advice=LOCAL_ONLY),
        ),
    ],
)
def test_inspect_and_convert_refuse_what_they_cannot_honour_in_one_line_with_exit_code_2(
    misdirected, cwd, argv, message
):
    before = tree(cwd)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    assert (code, err.getvalue()) == (2, f"lightning-gaudi-fsdp {argv[0]}: error: {message}\n")
    assert tree(cwd) == before  # nothing written (no new s3: or gs: folder), the checkpoints as they were


@pytest.mark.parametrize("door", [GaudiFSDPStrategy, FabricStrategy])
@pytest.mark.parametrize(
    ("url", "message"),
    [
        (UNKNOWN, unknown("pretrained_weights", UNKNOWN, "GaudiFSDPStrategy")),
        (CHAIN, refused("pretrained_weights", CHAIN, "GaudiFSDPStrategy")),
        ("s3:/ckpt/run/x.ckpt", "GaudiFSDPStrategy: pretrained_weights='s3:/ckpt/run/x.ckpt' has a folder named 's3:'"),
    ],
)
def test_pretrained_weights_that_cannot_be_honoured_are_refused_at_construction(misdirected, door, url, message):
    with pytest.raises(CheckpointURLError) as caught:
        door(pretrained_weights=url)
    assert str(caught.value).startswith(message), str(caught.value)


@pytest.mark.parametrize(
    "case",
    ["ckpt_path", "dirpath", "dirpath, last", "default_root_dir", "file:// dirpath"],
)
def test_fit_refuses_url_locations_before_any_process_starts(misdirected, cwd, case):
    """Checked by the launcher (every fit process runs it first): no process group, no step, nothing written."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    memory = MEMORY
    kwargs: dict[str, Any] = dict(logger=False)
    ckpt_path: str | None = None
    if case == "ckpt_path":
        ckpt_path, expected = UNKNOWN, unknown("ckpt_path", UNKNOWN, "trainer.fit")
    elif case.startswith("dirpath"):
        kwargs["callbacks"] = [ModelCheckpoint(dirpath=memory)]
        ckpt_path = "last" if case.endswith("last") else None
        expected = in_process("dirpath", memory, "ModelCheckpoint")
    elif case == "default_root_dir":  # where the default ModelCheckpoint saves
        kwargs["default_root_dir"] = memory
        expected = in_process("default_root_dir", memory, "Trainer")
    else:  # Lightning flattens it to <cwd>/file:<tmp>/mc
        kwargs["callbacks"] = [ModelCheckpoint(dirpath=f"file://{cwd.parent}/mc")]
        expected = f"ModelCheckpoint: dirpath='{cwd}/file:{cwd.parent}/mc' has a folder named 'file:'"
    module = Tiny()
    initial = {k: v.clone() for k, v in module.state_dict().items()}
    before = tree(cwd)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=GaudiFSDPStrategy(),
        max_steps=2,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    with pytest.raises(CheckpointURLError) as caught:
        trainer.fit(module, ckpt_path=ckpt_path)
    assert str(caught.value).startswith(expected), str(caught.value)
    assert not torch.distributed.is_initialized()  # refused before the process group (and any other rank) started
    assert trainer.global_step == 0
    assert all(torch.equal(v, initial[k]) for k, v in module.state_dict().items())
    assert tree(cwd) == before
