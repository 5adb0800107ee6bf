"""Fuzz the constructor: any value of any argument gives a strategy or one of our documented exceptions."""

from __future__ import annotations

import inspect
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_gaudi_fsdp import GaudiFSDPStrategy

# Names that cannot import a real module with side effects; enum-like words so some values are valid.
WORDS = st.sampled_from(
    [
        "full_shard",
        "NO_SHARD",
        "hybrid_shard",
        "backward_pre",
        "bf16",
        "float32",
        "sharded",
        "local",
        "full",
        "torch.nn.Linear",
        "torch.nn.Linearr",
        "x.y",
        "",
        "none",
        "hccl",
        "gloo",
    ]
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 10**7),
    st.floats(allow_nan=True),
    WORDS,
    st.text(alphabet="xyz_.0", max_size=8),
)
VALUES = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=3),
    st.tuples(SCALARS, SCALARS),
    st.dictionaries(
        st.one_of(WORDS, st.sampled_from(["param_dtype", "reduce_dtype", "keep_low_precision_grads"])),
        SCALARS,
        max_size=3,
    ),
)
ARGUMENTS = [
    name
    for name in inspect.signature(GaudiFSDPStrategy).parameters
    if name
    not in (
        "accelerator",
        "parallel_devices",
        "cluster_environment",
        "checkpoint_io",
        "precision_plugin",
        "process_group",
    )
]


@settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "400")),
    deadline=None,
    derandomize=not os.environ.get("FUZZ_EXAMPLES"),
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)
@given(st.dictionaries(st.sampled_from(ARGUMENTS), VALUES, max_size=4))
def test_only_documented_exceptions_come_out_of_the_constructor(kwargs):
    try:
        strategy = GaudiFSDPStrategy(**kwargs)
    except (ValueError, TypeError) as err:
        message = str(err)
        assert message, "an error must say what is wrong"
        assert any(name in message for name in kwargs) or "mutually exclusive" in message, message
        return
    assert strategy.parallel_devices is None  # a valid configuration touched no device
