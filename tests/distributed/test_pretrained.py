"""Pretrained Hugging Face weights into the shards (issue #17, weights in): a tiny Llama saved with
``save_pretrained`` in several files, loaded by 2 ranks through ``pretrained_weights`` on each engine and door,
bitwise the file's, then fine-tuned equal to one process that called ``from_pretrained``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def save_llama(where: Path, max_shard_size: str = "20KB", dtype: torch.dtype = torch.float32, **overrides) -> Path:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, **overrides})).to(dtype)
    model.save_pretrained(where, max_shard_size=max_shard_size)
    return where


def file_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(safetensors_torch.load_file(file))
    return tensors


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return save_llama(tmp_path_factory.mktemp("llama") / "tiny")


def held_fraction(run, ranks: int = 2) -> list[float]:
    total = sum(t.numel() for t in run.final()["loaded"].values())
    return [run.rank(r)["held"] / total for r in range(ranks)]


@pytest.mark.parametrize("door", ["trainer", "fabric"])
@pytest.mark.parametrize("engine", [1, 2])
def test_two_ranks_load_their_shards_bitwise_and_fine_tune_like_from_pretrained(scenario, llama_dir, engine, door):
    assert len(list(llama_dir.glob("model-*.safetensors"))) > 2  # split into several files, with an index
    prefix = "" if door == "fabric" else "model."
    run = scenario({"weights": str(llama_dir), "prefix": prefix, "engine": engine, "door": door, "steps": 3},
                   script="pretrained.py")
    final = run.final()
    expected = file_tensors(llama_dir)
    assert final["loaded"].keys() == expected.keys()
    different = [k for k, v in expected.items() if not torch.equal(final["loaded"][k], v)]
    assert different == []  # what the shards held before the first step, gathered: bitwise the file
    for r in range(2):
        info = run.rank(r)
        assert info["meta_after_configure_model"] is True  # the strategy built the parameters on meta
        assert info["rotary_ok"] is True  # buffers (not in the file) computed as a plain construction does
    assert all(0.3 < f < 0.7 for f in held_fraction(run))  # each rank holds about half, never the full model
    reference = final["reference"]
    for key, value in reference["weights"].items():
        torch.testing.assert_close(final["final"][key], value, rtol=1e-5, atol=1e-5, msg=key)
    assert not all(torch.equal(final["final"][k], v) for k, v in expected.items())  # training moved the weights
