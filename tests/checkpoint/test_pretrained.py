"""``pretrained_weights`` without processes: argument checks at construction (both doors, YAML), matching a model to
a file with every error message, PEFT's names, and reading (bf16 into fp32, one file, a checkpoint) into a plain
model, compared with what ``transformers`` loads."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_gaudi_fsdp import GaudiFSDPStrategy
from lightning_gaudi_fsdp.checkpoint import hf_names, pretrained
from lightning_gaudi_fsdp.checkpoint.pretrained import PretrainedWeightsError
from lightning_gaudi_fsdp.fabric import GaudiFSDPStrategy as FabricStrategy

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from conftest import TINY_LLAMA as TINY  # noqa: E402
from conftest import save_tiny_llama as save_llama  # noqa: E402

ACCEPTED = (
    "expected a Hugging Face model directory (model.safetensors or model.safetensors.index.json), a .safetensors "
    "file or a checkpoint of this strategy (full file, sharded or local directory)"
)
DOORS = [GaudiFSDPStrategy, FabricStrategy]


def on_meta(build):
    with pretrained.parameters_on_meta():
        return build()


def materialise_and_load(model: nn.Module, weights: pretrained.Weights) -> pretrained.Plan:
    plan = pretrained.plan(model, weights)
    init = pretrained.empty_init(torch.device("cpu"))
    for module in model.modules():
        init(module)
    pretrained.load(model, plan)
    return plan


def llama(**overrides) -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, **overrides}))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return save_llama(tmp_path_factory.mktemp("llama") / "tiny")


def test_peft_names():
    key = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert hf_names.base_key(key) == "base_model.model.model.layers.0.self_attn.q_proj.weight"
    assert hf_names.base_key("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert hf_names.is_adapter_key("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight")
    assert hf_names.is_adapter_key("m.embed_tokens.lora_embedding_B.default")
    assert hf_names.is_adapter_key("m.q_proj.lora_magnitude_vector.default.weight")
    assert not hf_names.is_adapter_key(key)


@pytest.mark.parametrize("door", DOORS, ids=["trainer", "fabric"])
def test_bad_arguments_fail_at_construction_naming_the_value(door, tmp_path, llama_dir):
    missing = tmp_path / "nope"
    with pytest.raises(
        PretrainedWeightsError, match=re.escape(f"pretrained_weights={str(missing)!r} does not exist; {ACCEPTED}")
    ):
        door(pretrained_weights=str(missing))
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        PretrainedWeightsError,
        match=re.escape(
            f"pretrained_weights={str(tmp_path / 'empty')!r} is a directory without model.safetensors, "
            f"model.safetensors.index.json or a checkpoint's metadata; {ACCEPTED}"
        ),
    ):
        door(pretrained_weights=str(tmp_path / "empty"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-1-of-2.safetensors"}}))
    with pytest.raises(
        PretrainedWeightsError,
        match=re.escape(
            f"pretrained_weights={str(broken)!r}: model.safetensors.index.json names model-1-of-2.safetensors, "
            "which is missing"
        ),
    ):
        door(pretrained_weights=str(broken))
    with pytest.raises(ValueError, match=re.escape("pretrained_prefix='model.' needs pretrained_weights")):
        door(pretrained_prefix="model.")
    with pytest.raises(TypeError, match=re.escape("pretrained_prefix=3 must be a string (e.g. 'model.' or '')")):
        door(pretrained_weights=str(llama_dir), pretrained_prefix=3)
    with pytest.raises(ValueError, match="param_init_fn and pretrained_weights cannot be combined"):
        door(pretrained_weights=str(llama_dir), param_init_fn=lambda m: None)
    with pytest.raises(ValueError, match="sync_module_states=True and pretrained_weights cannot be combined"):
        door(pretrained_weights=str(llama_dir), sync_module_states=True)


def test_pretrained_weights_from_yaml(llama_dir):
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(GaudiFSDPStrategy, "strategy")
    config = parser.parse_string(f"strategy:\n  pretrained_weights: {llama_dir}\n  pretrained_prefix: model.\n")
    strategy = GaudiFSDPStrategy(**config.strategy.as_dict())
    assert strategy._config.pretrained == pretrained.Weights(
        llama_dir, "safetensors", strategy._config.pretrained.files, "model."
    )
    assert len(strategy._config.pretrained.files) > 2
    assert "pretrained_prefix: model." in parser.dump(config)


def test_keys_that_do_not_fit_are_listed_with_the_prefix_that_would_match(llama_dir):
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = llama()

    weights = pretrained.resolve(llama_dir)
    with pytest.raises(PretrainedWeightsError) as err:
        pretrained.plan(on_meta(Wrapper), weights)
    assert str(err.value) == (
        f"pretrained_weights={str(llama_dir)!r} does not fit the model (pretrained_prefix=''); 21 file key(s) match "
        "no parameter: 'lm_head.weight' (model-00006-of-00006.safetensors), 'model.layers.1.input_layernorm.weight' "
        "(model-00006-of-00006.safetensors), 'model.layers.1.mlp.down_proj.weight' "
        "(model-00006-of-00006.safetensors) and 18 more; 21 parameter(s) no file key covers: "
        "'model.model.embed_tokens.weight', 'model.model.layers.0.self_attn.q_proj.weight', "
        "'model.model.layers.0.self_attn.k_proj.weight' and 18 more; pretrained_prefix='model.' would match 21 of "
        "21 file keys"
    )
    assert len(pretrained.plan(on_meta(Wrapper), pretrained.resolve(llama_dir, "model.")).entries) == 21
    # one parameter more than the file has (a third layer): named alone, no prefix to suggest
    with pytest.raises(PretrainedWeightsError) as err:
        pretrained.plan(on_meta(lambda: llama(num_hidden_layers=3)), weights)
    assert str(err.value).startswith(
        f"pretrained_weights={str(llama_dir)!r} does not fit the model (pretrained_prefix=''); 9 parameter(s) no "
        "file key covers: 'model.layers.2.self_attn.q_proj.weight', 'model.layers.2.self_attn.k_proj.weight', "
        "'model.layers.2.self_attn.v_proj.weight' and 6 more"
    )


def test_shape_and_dtype_that_cannot_convert_name_the_file_and_key(llama_dir, tmp_path):
    with pytest.raises(PretrainedWeightsError) as err:
        pretrained.plan(on_meta(lambda: llama(intermediate_size=48)), pretrained.resolve(llama_dir))
    index = json.loads((llama_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert str(err.value) == (
        f"pretrained_weights={str(llama_dir)!r}: file {index['model.layers.0.mlp.gate_proj.weight']!r} key "
        "'model.layers.0.mlp.gate_proj.weight' has shape [64, 32] but parameter 'model.layers.0.mlp.gate_proj.weight' "
        "has shape [48, 32]"
    )
    file = tmp_path / "ints.safetensors"
    safetensors_torch.save_file({"weight": torch.ones(2, 3, dtype=torch.int64), "bias": torch.ones(2)}, file)
    with pytest.raises(PretrainedWeightsError) as err:
        pretrained.plan(nn.Linear(3, 2), pretrained.resolve(file))
    assert str(err.value) == (
        f"pretrained_weights={str(file)!r}: file 'ints.safetensors' key 'weight' has dtype int64, which does not "
        "convert to parameter 'weight' of dtype float32 (only floating-point dtypes convert to each other)"
    )


def test_meta_construction_keeps_buffers_and_loads_bitwise_what_transformers_loads(tmp_path):
    """bf16 file into fp32 parameters, as ``from_pretrained(dtype=float32)`` converts it; a single file too."""
    split = save_llama(tmp_path / "bf16", dtype=torch.bfloat16)
    single = save_llama(tmp_path / "one", dtype=torch.bfloat16, max_shard_size="5GB") / "model.safetensors"
    loaded = transformers.LlamaForCausalLM.from_pretrained(split, dtype=torch.float32)
    expected = loaded.state_dict()
    for source in (split, single):
        model = on_meta(llama)
        assert all(p.is_meta for p in model.parameters())
        torch.testing.assert_close(model.model.rotary_emb.inv_freq, loaded.model.rotary_emb.inv_freq, rtol=0, atol=0)
        materialise_and_load(model, pretrained.resolve(source))
        state = model.state_dict()
        assert all(state[k].dtype == torch.float32 for k in expected)
        assert [k for k, v in expected.items() if not torch.equal(state[k], v)] == []


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_a_checkpoint_of_this_strategy_is_a_source(tmp_path, llama_dir, fmt):
    """A full checkpoint (Lightning's layout: ``state_dict`` under the LightningModule's names), and the sharded one
    ``convert`` makes of it."""
    from lightning_gaudi_fsdp.checkpoint.convert import convert

    reference = transformers.LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    checkpoint = tmp_path / "run.ckpt"
    state = {f"model.{k}": v for k, v in reference.state_dict().items()}
    torch.save({"state_dict": state, "global_step": 5, "pytorch-lightning_version": "2.6.6"}, checkpoint)
    if fmt == "sharded":
        convert(checkpoint, tmp_path / "sharded", "sharded")
        checkpoint = tmp_path / "sharded"

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = llama()

    model = on_meta(Wrapper)
    weights = pretrained.resolve(checkpoint)
    assert weights.kind == "checkpoint"
    materialise_and_load(model, weights)
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in model.model.state_dict().items())


def test_peft_base_weights_load_from_a_plain_directory_and_adapters_start_as_peft_starts_them(llama_dir):
    peft = pytest.importorskip("peft")

    def build() -> nn.Module:
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        return peft.get_peft_model(llama(), config)

    model = on_meta(build)
    plan = materialise_and_load(model, pretrained.resolve(llama_dir, "base_model.model."))
    adapters = {k for k, e in plan.entries.items() if e.adapter is not None}
    assert len(adapters) == 8
    assert all(hf_names.is_adapter_key(k) for k in adapters)
    files = transformers.LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).state_dict()
    for name, param in model.named_parameters():
        if "lora_B" in name:
            assert torch.count_nonzero(param) == 0, name
        elif "lora_A" in name:
            bound = 1 / math.sqrt(param.shape[1])  # kaiming_uniform(a=sqrt(5)) as nn.Linear and PEFT
            assert 0 < param.abs().max() <= bound, name
            assert param.unique().numel() == param.numel(), name  # drawn, not constant
        else:
            assert torch.equal(param, files[hf_names.base_key(name).removeprefix("base_model.model.")]), name
            assert not param.requires_grad  # PEFT froze the base
    other_rank = on_meta(build)  # another rank (or world size) draws the same adapters
    materialise_and_load(other_rank, pretrained.resolve(llama_dir, "base_model.model."))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other_rank.parameters(), strict=True))


def test_adapters_whose_initialisation_needs_the_base_weights_are_refused(llama_dir):
    peft = pytest.importorskip("peft")

    def build() -> nn.Module:
        config = peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True)
        return peft.get_peft_model(llama(), config)

    with pytest.raises(PretrainedWeightsError) as err:
        pretrained.plan(on_meta(build), pretrained.resolve(llama_dir, "base_model.model."))
    assert str(err.value) == (
        f"pretrained_weights={str(llama_dir)!r}: parameter "
        "'base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector.default.weight' is a PEFT adapter "
        "whose initialisation (DoRA magnitude) needs the base weights; with pretrained_weights, adapters support "
        "init_lora_weights=True, False or 'gaussian'"
    )


_OPENED: list[str] | None = None  # while a test counts: every file path opened (the audit hook cannot be removed)


def _count_opens(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], str | bytes | Path):
        _OPENED.append(str(args[0] if not isinstance(args[0], bytes) else args[0].decode()))


def test_a_sharded_checkpoint_source_reads_its_metadata_once_not_per_tensor(tmp_path):
    """Issue 31: ``pretrained_weights`` from a sharded checkpoint reads ``.metadata`` (several MB at a 70B model's 723
    tensors) once, not once per tensor read. Counted with an audit hook on ``open``, the weights checked bitwise."""
    global _OPENED
    import sys

    from lightning_gaudi_fsdp.checkpoint.convert import convert

    reference = llama(num_hidden_layers=6)
    state = {f"model.{k}": v for k, v in reference.state_dict().items()}
    torch.save({"state_dict": state, "global_step": 1, "pytorch-lightning_version": "2.6.6"}, tmp_path / "run.ckpt")
    convert(tmp_path / "run.ckpt", tmp_path / "sharded", "sharded")

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = llama(num_hidden_layers=6)

    model = on_meta(Wrapper)
    sys.addaudithook(_count_opens)
    _OPENED = []
    try:
        materialise_and_load(model, pretrained.resolve(tmp_path / "sharded"))
        opened = list(_OPENED)
    finally:
        _OPENED = None
    assert len(state) > 50
    assert [Path(p).name for p in opened].count(".metadata") == 1, opened
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in model.model.state_dict().items())
