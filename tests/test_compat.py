"""The torch/Lightning version layer: the supported pairings and the one-process DCP save on every torch."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lightning_gaudi_fsdp import _compat

pytestmark = pytest.mark.versions  # the dcp_save branch differs between torch 2.6 and later


@pytest.mark.parametrize(
    ("torch_version", "lightning_version", "expected"),
    [
        (
            "2.6.0+cpu",
            "2.5.1",
            (
                True,
                "Gaudi software 1.21's torch; CI: representative suite "
                "(torch 2.6.0 + Lightning 2.5.1 + transformers 4.57)",
            ),
        ),
        ("2.7.1", "2.5.1", (True, "Gaudi software 1.22's torch; CI: not run (between the tested 2.6 and 2.9)")),
        (
            "2.9.1",
            "2.5.1",
            (
                True,
                "Gaudi software 1.23's torch; CI: representative suite, FSDP2 included (torch 2.9.1 + Lightning 2.5.1)",
            ),
        ),
        ("2.10.0", "2.6.6", (True, "Gaudi software 1.24.0's torch; CI: not run (between the tested 2.9 and 2.11)")),
        (
            "2.11.0",
            "2.6.6",
            (True, "Gaudi software 1.24.1's torch; CI: representative suite (torch 2.11.0 + Lightning 2.6.6)"),
        ),
        ("2.13.0+cpu", "2.6.6", (True, "CI: full suite (torch 2.13.0 + Lightning 2.6.6 + transformers 5)")),
        (
            "2.13.0",
            "2.5.1",
            (True, "CI tests torch 2.13 only with Lightning 2.6.6; Lightning 2.5.1 is within the supported range"),
        ),
        ("2.8.0", "2.6.6", (True, "within the supported range, not a pairing CI tests")),
        ("2.15.0", "2.6.6", (True, "newer than the newest tested torch (2.13); expected to work")),
        # a pre-release or local build counts as its release, as Lightning compares torch
        (
            "2.6.0a0+git1234",
            "2.5.1",
            (
                True,
                "Gaudi software 1.21's torch; CI: representative suite "
                "(torch 2.6.0 + Lightning 2.5.1 + transformers 4.57)",
            ),
        ),
        ("2.5.1", "2.5.1", (False, "torch 2.5.1 is older than the supported 2.6 (Gaudi software 1.21)")),
        ("2.13.0", "2.7.0", (False, "Lightning 2.7.0 is outside the supported range >=2.5.1,<2.7")),
        ("2.13.0", "2.7.0rc1", (False, "Lightning 2.7.0rc1 is outside the supported range >=2.5.1,<2.7")),
        ("2.6.0", "2.5.0", (False, "Lightning 2.5.0 is outside the supported range >=2.5.1,<2.7")),
        (
            "2.13.0",
            "unknown",
            (False, "cannot read the versions (torch '2.13.0', Lightning 'unknown'): Invalid version: 'unknown'"),
        ),
    ],
)
def test_check_pairing(torch_version, lightning_version, expected):
    assert _compat.check_pairing(torch_version, lightning_version) == expected


def test_the_dcp_save_gate_matches_the_running_torch():
    """``TORCH_GREATER_EQUAL_2_7`` picks the public ``no_dist`` exactly where ``dcp.save`` has it (torch >= 2.7);
    elsewhere (torch 2.6) the private entry point ``dcp_save`` calls instead takes ``no_dist``."""
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    public_has_no_dist = "no_dist" in inspect.signature(dcp.save).parameters
    assert _compat.TORCH_GREATER_EQUAL_2_7 is public_has_no_dist
    assert _compat.TORCH_GREATER_EQUAL_2_7 is (torch.__version__ >= "2.7")
    if not public_has_no_dist:
        assert "no_dist" in inspect.signature(_save_state_dict).parameters


@pytest.mark.filterwarnings("ignore:torch.distributed is .* assuming the intent is to save in a single process")
def test_dcp_save_without_a_process_group_round_trips(tmp_path):
    """One process, no process group (offline conversion): a real DCP checkpoint that loads back equal, on the branch
    the running torch takes (CI runs this on torch 2.6 and later)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    assert not dist.is_initialized()
    state = {
        "model": {"layer.weight": torch.randn(4, 3), "layer.bias": torch.arange(4, dtype=torch.bfloat16)},
        "optimizer_0": {"state": {"layer.weight": {"exp_avg": torch.ones(4, 3), "step": torch.tensor(7.0)}}},
    }
    _compat.dcp_save(state, tmp_path / "ckpt", no_dist=True)

    assert (tmp_path / "ckpt" / ".metadata").is_file()
    dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "full.pt")
    loaded = torch.load(tmp_path / "full.pt", weights_only=True)
    torch.testing.assert_close(loaded, state, rtol=0, atol=0)
    assert loaded["model"]["layer.bias"].dtype == torch.bfloat16


def test_add_note_on_python_without_add_note_keeps_the_note_in_the_message():
    """Python 3.10 (which the package supports) has no ``BaseException.add_note``: the note still reaches the user."""
    from lightning_gaudi_fsdp import _compat

    class Py310Error(RuntimeError):
        def __getattribute__(self, name: str):
            if name == "add_note":
                raise AttributeError(name)
            return super().__getattribute__(name)

    error = Py310Error("collective timed out")
    _compat.add_note(error, "rank 1 failed first with: boom")
    assert str(error) == "collective timed out\nrank 1 failed first with: boom"
    assert error.__notes__ == ["rank 1 failed first with: boom"]
    native = RuntimeError("collective timed out")
    _compat.add_note(native, "rank 1 failed first with: boom")
    assert str(native) == "collective timed out"  # 3.11+: printed under the traceback instead
    assert native.__notes__ == ["rank 1 failed first with: boom"]
