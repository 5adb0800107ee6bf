"""Fine-tuning a Hugging Face Llama on 2 CPU ranks per engine: PEFT LoRA over a frozen base trains like one process,
resumes exactly from every format, and every format exports to a directory ``transformers``/``peft`` load.

One 4-step run per engine (and per model kind) saves all three formats after step 2, the end of the first epoch:
it is the uninterrupted run the resumes are compared with and the source of the exports."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from lightning_gaudi_fsdp import cli
from lightning_gaudi_fsdp.checkpoint.convert import describe, load_full_state
from lightning_gaudi_fsdp.checkpoint.formats import PARAM_ID_NAMES_KEY
from lightning_gaudi_fsdp.checkpoint.hf_names import base_key, is_adapter_key

pytest.importorskip("peft")
sys.path.insert(0, str(Path(__file__).parents[1] / "scenarios"))
from peft_train import SEQ, TINY_LLAMA, build_model  # noqa: E402

FORMATS = ("full", "sharded", "local")
STEPS = 4  # 2 steps per epoch (8 samples, 2 per rank, 2 ranks); checkpoints at step 2
SAVE_AT = 2
SLOW = pytest.mark.slow


def _cases(default: set[tuple[int, str]]) -> list:
    """Every (engine, format); those not in ``default`` are marked slow (CI budget, issue #18)."""
    return [
        pytest.param(engine, fmt, marks=() if (engine, fmt) in default else SLOW)
        for engine in (1, 2)
        for fmt in FORMATS
    ]


def _paths(root: Path) -> dict[str, str]:
    return {fmt: str(root / (f"{fmt}.ckpt" if fmt == "full" else fmt)) for fmt in FORMATS}


ENGINES = pytest.mark.parametrize("engine", [1, 2])


@pytest.fixture(scope="module")
def lora_reference(tmp_path_factory):
    from conftest import run_script

    cfg = {"strategy": "reference", "max_steps": STEPS, "module": {"batch_size": 4}}
    return run_script("peft_train.py", cfg, tmp_path_factory.mktemp("reference")).final()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``trained(engine, lora)``: the 2-rank run of that engine and model kind (run once per module) and the paths
    of its checkpoints, by format."""
    from conftest import run_script

    runs: dict[tuple[int, bool], tuple] = {}

    def get(engine: int, lora: bool) -> tuple:
        if (engine, lora) not in runs:
            tmp = tmp_path_factory.mktemp(f"{'lora' if lora else 'plain'}-fsdp{engine}")
            cfg = {
                "strategy": {"fsdp_version": engine},
                "module": {"lora": lora},
                "max_steps": STEPS,
                "save": _paths(tmp),
                "save_at": SAVE_AT,
            }
            runs[engine, lora] = (run_script("peft_train.py", cfg, tmp), _paths(tmp))
        return runs[engine, lora]

    return get


@pytest.fixture(scope="module")
def hf_config(tmp_path_factory):
    """A model directory as from_pretrained reads it, without weights: config, generation config, a tokenizer file."""
    from transformers import GenerationConfig, LlamaConfig

    where = tmp_path_factory.mktemp("hf-config")
    LlamaConfig(**TINY_LLAMA).save_pretrained(where)
    GenerationConfig(max_new_tokens=5).save_pretrained(where)
    (where / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    return where


def _unprefixed(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("model."): v for k, v in weights.items()}


def _trained_model(weights: dict[str, torch.Tensor], lora: bool) -> torch.nn.Module:
    model = build_model(lora)
    model.load_state_dict(_unprefixed(weights), strict=True)
    return model.eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(input_ids=ids).logits


def _export(src: str, dst: Path, *args: str) -> None:
    assert cli.main(["convert", src, str(dst), "--to", "hf", *args]) == 0


# ------------------------------------------------------------------------------------------------- training
@pytest.mark.versions
@ENGINES
def test_lora_trains_adapters_like_one_process_and_leaves_the_base_bitwise(engine, trained, lora_reference):
    run, _ = trained(engine, lora=True)
    initial, final = torch.load(run.out / "initial.pt"), run.final()["weights"]
    reference = lora_reference["weights"]
    assert sorted(final) == sorted(reference)
    adapters = [k for k in final if is_adapter_key(k)]
    assert len(adapters) == 2 * 3 * TINY_LLAMA["num_hidden_layers"]  # A and B of q_proj, v_proj, down_proj per layer
    for rank in (0, 1):
        assert run.rank(rank)["frozen_with_grad"] == []  # frozen base parameters never got a gradient
    for key in final:
        if is_adapter_key(key):
            torch.testing.assert_close(final[key], reference[key], atol=1e-5, rtol=0, msg=lambda m, k=key: f"{k}: {m}")
        else:
            assert torch.equal(final[key], initial[key]), f"frozen {key} changed"
    assert all(not torch.equal(final[k], initial[k]) for k in adapters if ".lora_B." in k)  # adapters trained
    assert any(".base_layer." in k for k in final)  # PEFT's naming, kept in the checkpoint


@ENGINES
@pytest.mark.parametrize("fmt", FORMATS)
def test_saved_checkpoint_holds_adapter_optimizer_state_and_the_lora_config(engine, trained, fmt):
    _, paths = trained(engine, lora=True)
    hf_model = describe(paths[fmt])["hf_model"]  # recorded at save time, shown by `inspect`, used by `convert --to hf`
    assert hf_model["prefix"] == "model."
    assert hf_model["peft"]["default"]["r"] == 4
    checkpoint, _ = load_full_state(paths[fmt])
    state = checkpoint["optimizer_states"][0]["state"]
    names = [checkpoint[PARAM_ID_NAMES_KEY][i] for i in state] if fmt == "full" else list(state)
    assert len(names) == 2 * 3 * TINY_LLAMA["num_hidden_layers"]
    assert all(is_adapter_key(n) for n in names), [n for n in names if not is_adapter_key(n)]


@pytest.mark.parametrize(("engine", "fmt"), _cases({(1, "local"), (2, "sharded")}))
def test_lora_resume_from_each_format_equals_the_uninterrupted_run(scenario, engine, trained, fmt):
    run, paths = trained(engine, lora=True)
    cfg = {"strategy": {"fsdp_version": engine}, "max_steps": STEPS, "ckpt_path": paths[fmt]}
    resumed, straight = scenario(cfg, script="peft_train.py").final(), run.final()
    assert resumed["step"] == straight["step"] == STEPS
    for key, value in straight["weights"].items():
        assert torch.equal(resumed["weights"][key], value), key
    for pid, entry in straight["optimizer"]["state"].items():
        for name, value in entry.items():
            assert torch.equal(resumed["optimizer"]["state"][pid][name], value), (pid, name)


# ------------------------------------------------------------------------------------------------- export
@pytest.mark.parametrize(("engine", "fmt"), _cases({(1, "full"), (2, "local")}))
def test_adapter_export_loads_with_peft_and_gives_the_trained_logits(engine, trained, fmt, tmp_path):
    from peft import PeftModel

    run, paths = trained(engine, lora=True)
    at_save = torch.load(run.out / "at_save.pt")
    _export(paths[fmt], tmp_path / "adapter", "--peft", "adapter")
    trained = _trained_model(at_save, lora=True)
    expected = tmp_path / "expected"
    trained.save_pretrained(expected)  # what PEFT itself writes for the trained model
    assert json.loads((tmp_path / "adapter/adapter_config.json").read_text())["r"] == 4
    loaded = PeftModel.from_pretrained(build_model(lora=False), tmp_path / "adapter").eval()
    assert torch.equal(_logits(loaded), _logits(trained))
    from safetensors.torch import load_file

    ours = load_file(tmp_path / "adapter/adapter_model.safetensors")
    theirs = load_file(expected / "adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.versions
@pytest.mark.parametrize(("engine", "fmt"), _cases({(1, "local"), (2, "sharded")}))
def test_merged_export_equals_merge_and_unload(engine, trained, fmt, hf_config, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    run, paths = trained(engine, lora=True)
    at_save = torch.load(run.out / "at_save.pt")
    out = tmp_path / "merged"
    _export(paths[fmt], out, "--peft", "merged", "--hf-config", str(hf_config), "--max-shard-size", "40KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert files == sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    assert all(name.endswith(f"-of-{len(files):05d}.safetensors") for name in files)
    with safe_open(out / files[0], "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert {"config.json", "generation_config.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    expected = _trained_model(at_save, lora=True).merge_and_unload()
    got, want = merged.state_dict(), expected.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    trained = _trained_model(at_save, lora=True)
    torch.testing.assert_close(_logits(merged), _logits(trained), atol=1e-5, rtol=0)


@pytest.mark.parametrize(("engine", "fmt"), _cases(set()))  # the default run exports a plain model in test_hf_export
def test_plain_llama_export_loads_with_from_pretrained(engine, trained, fmt, hf_config, tmp_path):
    from transformers import AutoModelForCausalLM

    run, paths = trained(engine, lora=False)
    at_save = _unprefixed(torch.load(run.out / "at_save.pt"))
    _export(paths[fmt], tmp_path / "hf", "--hf-config", str(hf_config))  # the prefix recorded at save time
    assert (tmp_path / "hf/model.safetensors").is_file()
    assert not (tmp_path / "hf/model.safetensors.index.json").exists()  # one file under 5GB
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    state = model.state_dict()
    assert sorted(state) == sorted(at_save)
    assert all(torch.equal(state[k], at_save[k]) for k in at_save)
    assert all(base_key(k) == k for k in state)


def test_use_orig_params_false_with_lora_fails_naming_the_argument(scenario):
    """FSDP1 with use_orig_params=False flattens a decoder layer's frozen base and trainable adapters into one
    parameter, which torch refuses; the error says which argument to change (no silent switch)."""
    cfg = {"strategy": {"fsdp_version": 1, "use_orig_params": False}, "max_steps": 1}
    run = scenario(cfg, script="peft_train.py", expect_ok=False)
    assert run.proc.returncode != 0
    logs = run.proc.stdout + run.proc.stderr + "".join(p.read_text() for p in run.out.glob("rank*.stderr"))
    assert (
        "use_orig_params=False cannot shard 'model.base_model.model.model.layers.0': one FSDP unit mixes frozen "
        "(requires_grad=False) and trainable parameters" in logs
    )
    assert "pass use_orig_params=True (the default)" in logs


@pytest.mark.parametrize("engine", [pytest.param(1, marks=SLOW), 2])
def test_fabric_lora_trains_like_one_process_and_exports(scenario, engine, lora_reference, tmp_path):
    """The same fine-tune through Fabric's door: frozen base bitwise, adapters equal one process, and its sharded
    checkpoint exports an adapter PEFT loads (the model is Fabric's root: no prefix recorded or needed). Loaded back
    with fabric.load, it returns nothing of the package's bookkeeping (issue 28, item 3)."""
    from peft import PeftModel

    ckpt = tmp_path / "fabric-sharded"
    cfg = {"strategy": {"fsdp_version": engine, "state_dict_type": "sharded"}, "save": str(ckpt), "save_at": SAVE_AT}
    run = scenario(cfg, script="peft_fabric.py")
    initial, final = torch.load(run.out / "initial.pt"), torch.load(run.out / "final.pt")
    reference = _unprefixed(lora_reference["weights"])
    assert sorted(final) == sorted(reference)
    assert run.rank(0)["frozen_with_grad"] == run.rank(1)["frozen_with_grad"] == []
    for rank in (0, 1):  # fabric.load of the checkpoint just saved: no bookkeeping (the HF record) comes back
        assert run.rank(rank)["loaded"] == {"remainder": [], "state": ["model", "optimizer"]}
    for key, value in final.items():
        if is_adapter_key(key):
            torch.testing.assert_close(value, reference[key], atol=1e-5, rtol=0, msg=lambda m, k=key: f"{k}: {m}")
        else:
            assert torch.equal(value, initial[key]), f"frozen {key} changed"
    _export(str(ckpt), tmp_path / "adapter", "--peft", "adapter")
    loaded = PeftModel.from_pretrained(build_model(lora=False), tmp_path / "adapter").eval()
    trained = build_model(lora=True)
    trained.load_state_dict(torch.load(run.out / "at_save.pt"))
    assert torch.equal(_logits(loaded), _logits(trained.eval()))
