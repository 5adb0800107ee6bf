"""``convert --to hf`` / ``export_hf`` on checkpoints built in this process (no process group): file layout as
``save_pretrained`` writes it, dtypes, names, and every bad argument as a one-line error with exit code 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from lightning_gaudi_fsdp import cli
from lightning_gaudi_fsdp.checkpoint.hf_export import HF_KEY, export_hf, hf_model_record, resolve_shard_size
from lightning_gaudi_fsdp.checkpoint.hf_names import base_key, is_adapter_key

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parents[1] / "scenarios"))
from peft_train import TINY_LLAMA, build_model  # noqa: E402


class Holder(torch.nn.Module):
    """Where a LightningModule keeps the Hugging Face model: ``self.model``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model


def _checkpoint(path: Path, model: torch.nn.Module, record: bool = True) -> Path:
    """A full checkpoint as the strategy writes it (keys under ``model.``, the Hugging Face record)."""
    holder = Holder(model)
    ckpt = {"state_dict": holder.state_dict(), "global_step": 2}
    if record:
        ckpt[HF_KEY] = hf_model_record(holder)
    torch.save(ckpt, path)
    return path


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    where = tmp_path_factory.mktemp("plain")
    model = build_model(lora=False)
    model.config.save_pretrained(where / "config")
    return model, _checkpoint(where / "plain.ckpt", model), where / "config"


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    pytest.importorskip("peft")
    model = build_model(lora=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # as after training: B = 0 would make every merge a no-op
    return model, _checkpoint(tmp_path_factory.mktemp("lora") / "lora.ckpt", model)


def test_base_key_and_is_adapter_key():
    assert base_key("model.layers.0.self_attn.q_proj.base_layer.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert base_key("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert base_key("model.embed_tokens.base_layer.weight") == "model.embed_tokens.weight"
    for key in ("q_proj.lora_A.default.weight", "q_proj.lora_B.x.weight", "emb.lora_embedding_A.default"):
        assert is_adapter_key(key)
    assert is_adapter_key("q_proj.lora_magnitude_vector.default.weight")
    assert not is_adapter_key("q_proj.base_layer.weight")
    assert not is_adapter_key("model.lora_Alpha.weight")  # a segment, not a substring


@pytest.mark.parametrize(
    ("value", "expected"), [("5GB", 5 * 10**9), ("2GiB", 2 * 2**30), ("500MB", 5 * 10**8), ("40kb", 40_000), (123, 123)]
)
def test_max_shard_size_units(value, expected):
    assert resolve_shard_size(value) == expected


def test_record_names_the_model_and_its_lora_config(lora):
    record = json.loads(hf_model_record(Holder(lora[0])))
    assert record["prefix"] == "model."
    assert record["peft"]["default"]["r"] == 4
    assert sorted(record["peft"]["default"]["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    assert json.loads(hf_model_record(Holder(build_model(lora=False))))["peft"] is None
    assert hf_model_record(torch.nn.Linear(2, 2)) is None


def test_split_files_match_save_pretrained(plain, tmp_path):
    from safetensors import safe_open

    model, ckpt, config = plain
    export_hf(ckpt, tmp_path / "ours", hf_config=config, max_shard_size="40KB")
    model.save_pretrained(tmp_path / "theirs", max_shard_size="40KB")
    ours = json.loads((tmp_path / "ours/model.safetensors.index.json").read_text())
    theirs = json.loads((tmp_path / "theirs/model.safetensors.index.json").read_text())
    assert ours["weight_map"] == theirs["weight_map"]  # same keys, same files, same names
    assert ours["metadata"]["total_size"] == theirs["metadata"]["total_size"]
    for file in sorted(set(ours["weight_map"].values())):
        with safe_open(tmp_path / "ours" / file, "pt") as f:
            assert f.metadata() == {"format": "pt"}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())


def test_dtype_converts_floating_tensors_and_the_config_says_so(plain, tmp_path):
    from safetensors.torch import load_file

    model, ckpt, config = plain
    assert cli.main(["convert", str(ckpt), str(tmp_path / "bf16"), "--to", "hf", "--hf-config", str(config),
                     "--dtype", "bf16"]) == 0  # fmt: skip
    tensors = load_file(tmp_path / "bf16/model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    want = model.state_dict()
    assert all(torch.equal(tensors[k], want[k].to(torch.bfloat16)) for k in want)
    written = json.loads((tmp_path / "bf16/config.json").read_text())
    assert "bfloat16" in {written.get("torch_dtype"), written.get("dtype")}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16


def test_explicit_prefix_overrides_the_recorded_one(plain, tmp_path):
    model, _, config = plain
    bare = _checkpoint(tmp_path / "bare.ckpt", model, record=False)  # e.g. written by Lightning's own strategy
    export_hf(bare, tmp_path / "hf", prefix="model.", hf_config=config)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert sorted(loaded.state_dict()) == sorted(model.state_dict())


def test_adapter_config_from_hf_config_when_not_recorded(lora, tmp_path):
    peft = pytest.importorskip("peft")
    model, _ = lora
    bare = _checkpoint(tmp_path / "bare.ckpt", model, record=False)
    model.save_pretrained(tmp_path / "run")  # the training run's adapter_config.json
    export_hf(bare, tmp_path / "adapter", prefix="model.", hf_config=tmp_path / "run", peft="adapter")
    loaded = peft.PeftModel.from_pretrained(build_model(lora=False), tmp_path / "adapter")
    want = model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())


def _cli_error(capsys, *args: str) -> str:
    code = cli.main(["convert", *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1, err  # one line
    assert err.startswith("lightning-gaudi-fsdp convert: error: ")
    return err


def test_bad_arguments_are_one_line_errors(plain, lora, tmp_path, capsys):
    _, ckpt, config = plain
    dst = str(tmp_path / "out")
    assert "dtype='int8' is not supported; expected one of 'bf16', 'fp16', 'fp32'" in _cli_error(
        capsys, str(ckpt), dst, "--to", "hf", "--dtype", "int8"
    )
    assert "max_shard_size='5 lots' is not a positive size" in _cli_error(
        capsys, str(ckpt), dst, "--to", "hf", "--max-shard-size", "5 lots"
    )
    assert "peft='adapter' needs a checkpoint of a PEFT model" in _cli_error(
        capsys, str(ckpt), dst, "--to", "hf", "--peft", "adapter"
    )
    assert "peft='all' is not supported; expected one of 'adapter', 'merged'" in _cli_error(
        capsys, str(ckpt), dst, "--to", "hf", "--peft", "all"
    )
    assert f"hf_config={str(tmp_path / 'nowhere')!r} is not a directory" in _cli_error(
        capsys, str(ckpt), dst, "--to", "hf", "--hf-config", str(tmp_path / "nowhere")
    )
    assert f"hf_config={str(tmp_path)!r} has no config.json" in _cli_error(
        capsys, str(ckpt), dst, "--to", "hf", "--hf-config", str(tmp_path)
    )
    assert "pass peft='adapter' (--peft adapter)" in _cli_error(capsys, str(lora[1]), dst, "--to", "hf")
    assert "--dtype, --peft only apply to --to hf, not --to full" in _cli_error(
        capsys, str(ckpt), dst, "--to", "full", "--dtype", "bf16", "--peft", "merged"
    )
    assert "prefix='nope.' matches no key" in _cli_error(capsys, str(ckpt), dst, "--to", "hf", "--prefix", "nope.")
    assert not Path(dst).exists()
    (tmp_path / "taken").mkdir()
    assert "already exists" in _cli_error(capsys, str(ckpt), str(tmp_path / "taken"), "--to", "hf")


def test_tied_embeddings_export(tmp_path):
    """A model whose output layer shares the embedding's storage (saved once by torch.save) exports and reloads."""
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY_LLAMA, "tie_word_embeddings": True}))
    model.config.save_pretrained(tmp_path / "config")
    ckpt = _checkpoint(tmp_path / "tied.ckpt", model)
    export_hf(ckpt, tmp_path / "hf", hf_config=tmp_path / "config")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize(
    "lora_config",
    [
        {"target_modules": ["embed_tokens", "q_proj"]},  # an embedding adapter: B @ A transposed
        {"target_modules": ["q_proj", "v_proj"], "use_rslora": True, "alpha_pattern": {"v_proj": 16}},
        {"target_modules": ["k_proj"], "rank_pattern": {"k_proj": 2}},
    ],
    ids=["embedding", "rslora-alpha-pattern", "rank-pattern"],
)
def test_merged_export_equals_merge_and_unload_for_lora_variants(lora_config, tmp_path):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, **lora_config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.normal_()
    ckpt = _checkpoint(tmp_path / "lora.ckpt", model)
    base.config.save_pretrained(tmp_path / "config")
    export_hf(ckpt, tmp_path / "merged", hf_config=tmp_path / "config", peft="merged")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    want = model.merge_and_unload().state_dict()
    assert sorted(loaded) == sorted(want)
    assert all(torch.equal(loaded[k], want[k]) for k in want), [k for k in want if not torch.equal(loaded[k], want[k])]
