"""Activation checkpointing inside Hugging Face models: transformers 4.x builds a KV cache in training, which a
recomputed layer would append to twice; the strategy turns it off in training only."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_LLAMA
from lightning_gaudi_fsdp import module_options
from lightning_gaudi_fsdp._activation_checkpointing import apply_activation_checkpointing

pytestmark = pytest.mark.versions  # also run on the older torch/Lightning pairings in CI

transformers = pytest.importorskip("transformers")
LAYER = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"


def _llama(use_cache: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY_LLAMA, use_cache=use_cache)
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("use_cache", [True, False])
def test_checkpointed_llama_trains_like_the_plain_model_and_evaluation_keeps_the_cache(use_cache):
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    plain = _llama(use_cache)
    plain(input_ids=tokens, labels=tokens, use_cache=False).loss.backward()

    model = _llama(use_cache)
    switched = apply_activation_checkpointing(model, module_options.resolve_activation_checkpointing_policy([LAYER]))
    assert sorted(switched) == (["", "model"] if use_cache else [])
    model.train()
    loss = model(input_ids=tokens, labels=tokens).loss  # no use_cache argument: the config's default applies
    loss.backward()  # transformers 4.x without the switch: CheckpointError (recomputed tensor metadata differs)
    recomputed = sum(type(m).__name__ == "CheckpointWrapper" for m in model.modules())
    assert recomputed == 2
    grads = dict(plain.named_parameters())
    for name, param in model.named_parameters():
        clean = name.replace("._checkpoint_wrapped_module", "")
        torch.testing.assert_close(param.grad, grads[clean].grad, rtol=1e-5, atol=1e-6, msg=clean)

    model.eval()
    with torch.no_grad():
        out = model(input_ids=tokens)  # evaluation and generation keep the user's setting
    assert (out.past_key_values is not None) is use_cache
