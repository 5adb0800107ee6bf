"""Pretrained Hugging Face weights into the shards (issue #17, weights in): a tiny Llama saved with
``save_pretrained`` in several files, loaded by 2 ranks through ``pretrained_weights`` on each engine and door,
bitwise the file's, then fine-tuned equal to one process that called ``from_pretrained``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from conftest import save_tiny_llama as save_llama  # noqa: E402


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


# both engines and both doors in the default run; the other pairs, and FSDP1 with flat parameters only
# (use_orig_params=False), with -m slow (CI budget, issue #18)
FLAT = {"use_orig_params": False}
ENGINE_DOOR = [
    pytest.param(1, "trainer", {}, id="1-trainer"),
    pytest.param(2, "fabric", {}, id="2-fabric"),
    pytest.param(2, "trainer", {}, marks=pytest.mark.slow, id="2-trainer"),
    pytest.param(1, "fabric", {}, marks=pytest.mark.slow, id="1-fabric"),
    pytest.param(1, "trainer", FLAT, marks=pytest.mark.slow, id="1-trainer-flat"),
    pytest.param(1, "fabric", FLAT, marks=pytest.mark.slow, id="1-fabric-flat"),
]


@pytest.mark.parametrize(("engine", "door", "strategy"), ENGINE_DOOR)
def test_two_ranks_load_their_shards_bitwise_and_fine_tune_like_from_pretrained(
    scenario, llama_dir, engine, door, strategy
):
    assert len(list(llama_dir.glob("model-*.safetensors"))) > 2  # split into several files, with an index
    prefix = "" if door == "fabric" else "model."
    trainer = door == "trainer"
    cfg = {"weights": str(llama_dir), "prefix": prefix, "engine": engine, "door": door, "steps": 3}
    cfg["strategy"] = strategy
    run = scenario({**cfg, "then_validate": trainer}, script="pretrained.py")
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
    if trainer:  # a later trainer.validate loads the file again; with ckpt_path the checkpoint overrides it
        val = [run.rank(r)["validate_losses"][0] for r in range(2)]
        assert run.rank(0)["validate_meta_after_configure_model"] is True
        assert sum(val) / 2 == pytest.approx(reference["val_loss"], rel=1e-5)
        validated = torch.load(run.out / "validate.pt")
        assert all(torch.equal(validated[k], v) for k, v in expected.items())
        resumed = torch.load(run.out / "resumed.pt")
        assert all(torch.equal(resumed[k], v) for k, v in final["final"].items())
        from_checkpoint = torch.load(run.out / "from_checkpoint.pt")  # a checkpoint as pretrained_weights
        assert all(torch.equal(from_checkpoint[k], v) for k, v in final["final"].items())
        for stage in ("test", "predict"):  # trainer.test / trainer.predict load the file into the shards too
            held_in_stage = torch.load(run.out / f"{stage}.pt")
            assert all(torch.equal(held_in_stage[k], v) for k, v in expected.items()), stage


@pytest.mark.parametrize("engine", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_peft_model_gets_the_base_weights_of_a_plain_directory_on_two_ranks(scenario, llama_dir, engine):
    """``get_peft_model`` in ``configure_model``: ``base_layer`` names match the file's, adapters start as PEFT
    starts them and equal what one process draws with the same seed (any world size)."""
    peft = pytest.importorskip("peft")
    from lightning_gaudi_fsdp.checkpoint import hf_names, pretrained

    cfg = {"weights": str(llama_dir), "prefix": "model.base_model.model.", "engine": engine, "peft": True}
    run = scenario({**cfg, "stage": "validate"}, script="pretrained.py")
    loaded = run.final()["loaded"]
    expected = file_tensors(llama_dir)
    base = {k: v for k, v in loaded.items() if not hf_names.is_adapter_key(k)}
    assert {hf_names.base_key(k).removeprefix("base_model.model.") for k in base} == expected.keys()
    assert all(
        torch.equal(v, expected[hf_names.base_key(k).removeprefix("base_model.model.")]) for k, v in base.items()
    )
    adapters = {k: v for k, v in loaded.items() if hf_names.is_adapter_key(k)}
    assert len(adapters) == 8
    assert all(torch.count_nonzero(v) == 0 for k, v in adapters.items() if ".lora_B." in k)
    torch.manual_seed(7)  # the scenario's seed: one process draws the same adapters
    with pretrained.parameters_on_meta():
        alone = peft.get_peft_model(
            transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(llama_dir)),
            peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        )
    plan = pretrained.plan(alone, pretrained.resolve(llama_dir, "base_model.model."))
    for module in alone.modules():
        pretrained.empty_init(torch.device("cpu"))(module)
    pretrained.load(alone, plan)
    assert all(torch.equal(v, alone.state_dict()[k]) for k, v in adapters.items())
    assert all(run.rank(r)["meta_after_configure_model"] for r in range(2))


def test_a_file_that_does_not_fit_fails_on_every_rank_before_training(scenario, llama_dir):
    cfg = {"weights": str(llama_dir), "prefix": "", "engine": 1, "expect_error": True}
    run = scenario(cfg, script="pretrained.py")
    errors = [json.loads((run.out / f"error{r}.json").read_text()) for r in range(2)]
    assert [e["type"] for e in errors] == ["PretrainedWeightsError"] * 2
    assert errors[0]["message"] == errors[1]["message"]
    assert errors[0]["message"].startswith(
        f"pretrained_weights={str(llama_dir)!r} does not fit the model (pretrained_prefix=''); 21 file key(s) match "
        "no parameter: 'lm_head.weight' (model-00006-of-00006.safetensors)"
    )
    assert errors[0]["message"].endswith("pretrained_prefix='model.' would match 21 of 21 file keys")
    assert not (run.out / "rank0.json").exists()  # no step ran


@pytest.mark.parametrize("engine", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_each_rank_adds_well_below_one_model_of_memory_while_loading(scenario, tmp_path, engine):
    """A ~100 MB Llama in 4 files: building it under ``fabric.init_module()`` and ``setup_module`` (which reads the
    rank's slices) adds about the rank's shard plus one decoder layer, not a model copy (``from_pretrained`` on
    every rank adds more than one; see the benchmark)."""
    big = {"vocab_size": 1024, "hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 12}
    weights = save_llama(tmp_path / "big", max_shard_size="30MB", **big)
    model_bytes = sum(t.numel() * 4 for t in file_tensors(weights).values())
    assert model_bytes > 80e6
    assert len(list(weights.glob("*.safetensors"))) == 3
    # large blocks mmap'ed and returned to the OS when freed: the peak counts live tensors, not glibc's cache
    cfg = {"weights": str(weights), "engine": engine, "door": "fabric", "steps": 0, "reference": False}
    run = scenario({**cfg, "mmap_threshold": 65536, "gather": False}, script="pretrained.py")
    for r in range(2):
        info = run.rank(r)
        ratio = info["peak_added"] / model_bytes
        assert ratio < 0.75, f"rank {r} added {ratio:.2f} models of memory while loading"
        assert 0.45 < info["held"] * 4 / model_bytes < 0.55  # of which its shard is half
        assert info["meta_after_configure_model"] is True


def test_ignored_modules_get_the_files_weights_too(scenario, llama_dir):
    """FSDP1 leaves ``ignored_modules`` unmanaged, so they stay on the meta device while the units are filled: the
    strategy loads them whole from the file as well (a parameter left on meta fails training far from the cause)."""
    ignored = "model.model.norm"  # the LightningModule holds the Llama as self.model
    cfg = {"weights": str(llama_dir), "prefix": "model.", "engine": 1, "door": "trainer", "steps": 1}
    run = scenario({**cfg, "strategy": {"ignored_modules": [ignored]}}, script="pretrained.py")
    final = run.final()
    expected = file_tensors(llama_dir)
    assert final["loaded"].keys() == expected.keys()
    assert not final["loaded"]["model.norm.weight"].is_meta
    different = [k for k, v in expected.items() if not torch.equal(final["loaded"][k], v)]
    assert different == []  # the ignored norm included: bitwise the file's
    assert all(math.isfinite(loss) for r in range(2) for loss in run.rank(r)["losses"])
