"""The Gaudi runtime path, against a test double of ``habana_frameworks`` (tests/fakes) that records calls."""

from __future__ import annotations

import os
import re
import sys
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist

from conftest import FAKES, _drop_fake_modules, gaudi_double
from lightning_gaudi_fsdp import GaudiFSDPStrategy, gaudi

pytestmark = pytest.mark.versions  # also run on the older torch/Lightning pairings in CI


def test_without_the_bridge_nothing_is_available(monkeypatch):
    _drop_fake_modules()
    assert not gaudi.bridge_installed()
    assert gaudi.is_available() is False
    assert gaudi.device_count() == 0
    assert gaudi.bridge_version() is None
    assert gaudi.hccl_importable() is False
    with pytest.raises(
        RuntimeError,
        match=r"process_group_backend='hccl' needs 'habana_frameworks.torch.distributed"
        r".hccl', which failed to import",
    ):
        gaudi.import_hccl()


def test_probe_devices_and_version(fake_gaudi, monkeypatch):
    monkeypatch.setenv("FAKE_HPU_DEVICES", "4")
    assert gaudi.bridge_installed()
    assert gaudi.is_available() is True
    assert gaudi.device_count() == 4
    assert gaudi.bridge_version() == "1.21.0-fake"
    assert gaudi.current_device() == torch.device("hpu", 0)  # each process's own device, whichever it acquired


def test_lazy_mode_is_refused_with_the_fix(fake_gaudi, monkeypatch):
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    assert gaudi.is_lazy_mode()  # asked of the bridge, which read the variable when it loaded
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "0")  # too late: the bridge is loaded
    assert gaudi.is_lazy_mode()
    with pytest.raises(
        RuntimeError,
        match=r"FSDP cannot run on Gaudi in lazy mode.*Set PT_HPU_LAZY_MODE=0 in the "
        r"environment before Python starts",
    ):
        gaudi.ensure_eager_mode()


def test_eager_mode_passes(fake_gaudi, monkeypatch):
    monkeypatch.delenv("PT_HPU_LAZY_MODE", raising=False)
    gaudi.ensure_eager_mode()
    assert ("bridge_loaded", "eager") in fake_gaudi()


def test_import_hccl_registers_the_backend(fake_gaudi):
    gaudi.import_hccl()
    assert ("hccl_imported",) in fake_gaudi()
    assert "hccl" in dist.Backend.backend_list


def test_the_double_binds_a_process_group_to_hpu_0_only(fake_gaudi):
    gaudi.import_hccl()
    with pytest.raises(ValueError, match=r"device_id=device\(type='hpu', index=1\)\): the fake Gaudi bridge"):
        dist.init_process_group("hccl", device_id=torch.device("hpu", 1), rank=0, world_size=1, store=dist.HashStore())
    assert not dist.is_initialized()


def test_checkpoints_stage_into_pinned_host_memory_only_on_gaudi(fake_gaudi, monkeypatch):
    from lightning_gaudi_fsdp.checkpoint.background import BackgroundSaver

    assert gaudi.host_staging_allocator("cpu") is None  # on a CPU run nothing is pinned
    allocate = gaudi.host_staging_allocator("hpu")
    assert allocate is not None
    assert gaudi.host_staging_allocator("hpu") is allocate  # the same one each fit: the buffers are kept
    monkeypatch.setenv("FAKE_HPU_DEVICES", "0")
    assert gaudi.host_staging_allocator("hpu") is None  # the bridge sees no device
    saver = BackgroundSaver()
    saver.use_host_buffers(allocate)
    assert saver._stager._allocate is allocate


def test_launch_environment(monkeypatch):
    monkeypatch.setenv("PT_HPU_EAGER_PIPELINE_ENABLE", "")
    assert gaudi.launch_environment(None) == {"PT_HPU_LAZY_MODE": "0"}
    assert gaudi.launch_environment(False) == {"PT_HPU_LAZY_MODE": "0", "PT_HPU_EAGER_PIPELINE_ENABLE": "false"}
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    monkeypatch.delenv("PT_HPU_EAGER_PIPELINE_ENABLE", raising=False)
    gaudi.apply_launch_environment(True)
    assert os.environ["PT_HPU_LAZY_MODE"] == "0"
    assert os.environ["PT_HPU_EAGER_PIPELINE_ENABLE"] == "true"


def test_compile_backend_per_device(fake_gaudi):
    assert gaudi.default_compile_backend("hpu") == "hpu_backend"
    assert gaudi.default_compile_backend("cpu") == "aot_eager"
    gaudi.prepare_compile_backend("hpu_backend")
    compiled = torch.compile(lambda x: x * 2 + 1, backend="hpu_backend")
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 3.0))
    assert any(event[0] == "hpu_backend_compiled" for event in fake_gaudi())


DOORS = pytest.mark.parametrize("door", ["trainer", "fabric"])


def _hpu_strategy(door: str, strategy: Any = None, **kwargs: Any) -> Any:
    """The strategy of a 2-device ``Trainer`` or ``Fabric`` (``door``) on ``accelerator="hpu"``, as built before any
    process starts; ``strategy``: an instance or a registered name (a default ``GaudiFSDPStrategy`` of the door)."""
    from lightning_gaudi_fsdp import fabric

    if door == "trainer":
        strategy = strategy if strategy is not None else GaudiFSDPStrategy()
        return L.Trainer(accelerator="hpu", devices=2, strategy=strategy, logger=False, **kwargs).strategy
    strategy = strategy if strategy is not None else fabric.GaudiFSDPStrategy()
    return L.Fabric(accelerator="hpu", devices=2, strategy=strategy, **kwargs).strategy


def _door_strategy_class(door: str) -> Any:
    from lightning_gaudi_fsdp import fabric

    return GaudiFSDPStrategy if door == "trainer" else fabric.GaudiFSDPStrategy


@DOORS
@pytest.mark.parametrize("device_id", [1, "hpu:3", torch.device("hpu", 1), "cpu"])
def test_a_device_id_other_than_hpu_0_is_refused_on_gaudi_before_any_process(fake_gaudi, monkeypatch, door, device_id):
    monkeypatch.delenv("PT_HPU_LAZY_MODE", raising=False)
    expected = (
        rf"device_id={re.escape(repr(device_id))} is not supported on Gaudi: each process addresses the device the "
        r"bridge gave it as hpu:0 \(index based device selection is not supported on HPU\); expected None, 0, 'hpu', "
        r"'hpu:0' or torch.device\('hpu', 0\)"
    )
    with pytest.raises(ValueError, match=expected):
        _hpu_strategy(door, _door_strategy_class(door)(device_id=device_id))
    for accepted in (None, 0, "hpu", "hpu:0", torch.device("hpu", 0)):
        assert _hpu_strategy("trainer", GaudiFSDPStrategy(device_id=accepted))._fsdp_device() == torch.device("hpu", 0)


@DOORS
def test_hpu_uses_hccl_the_bridge_device_and_the_eager_environment(fake_gaudi, monkeypatch, door):
    monkeypatch.setenv("PT_HPU_EAGER_PIPELINE_ENABLE", "true")
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "")  # monkeypatch restores both variables after the test
    monkeypatch.delenv("PT_HPU_LAZY_MODE")
    strategy = _hpu_strategy(door, _door_strategy_class(door)(eager_pipeline=False), precision="bf16-mixed")
    assert strategy._get_process_group_backend() == "hccl"
    assert strategy.root_device == torch.device("hpu", 0)  # every process addresses its own device as hpu:0
    if door == "trainer":
        assert strategy._fsdp_device() == torch.device("hpu", 0)  # always a device, never an index
    with pytest.raises(RuntimeError, match="index based device selection is not supported on HPU"):
        torch.hpu.set_device(1)  # the double refuses what the bridge refuses
    # the launcher is configured when the door is built, before any process
    assert os.environ["PT_HPU_LAZY_MODE"] == "0"
    assert os.environ["PT_HPU_EAGER_PIPELINE_ENABLE"] == "false"
    plugin = strategy.precision_plugin if door == "trainer" else strategy.precision
    plugin.set_device_type(strategy.root_device.type)
    assert plugin.device_type == "hpu"  # autocast on the device in use


@DOORS
def test_hpu_refuses_gloo_and_lazy_mode_before_any_process(fake_gaudi, monkeypatch, door):
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")  # read once, when the bridge loads
    with pytest.raises(RuntimeError, match="FSDP cannot run on Gaudi in lazy mode"):
        _hpu_strategy(door, "gaudi_fsdp")
    with pytest.raises(ValueError, match="process_group_backend='gloo' is not supported on Gaudi; expected 'hccl'"):
        _hpu_strategy(door, _door_strategy_class(door)(process_group_backend="gloo"))


def test_doctor_with_a_healthy_and_a_lazy_bridge(fake_gaudi, monkeypatch, capsys):
    from lightning_gaudi_fsdp.cli import main

    monkeypatch.delenv("PT_HPU_LAZY_MODE", raising=False)
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "target accelerator" in out
    assert "hpu" in out
    assert "1.21.0-fake" in out
    assert "This machine can run GaudiFSDPStrategy with accelerator='hpu'." in out


def test_doctor_reports_lazy_mode_with_exit_code_1(fake_gaudi, monkeypatch, capsys):
    from lightning_gaudi_fsdp.cli import main

    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    assert main(["doctor", "--accelerator", "hpu"]) == 1
    out = capsys.readouterr().out
    assert "fix: execution mode: set PT_HPU_LAZY_MODE=0 before starting Python" in out


def test_doctor_on_a_cpu_machine_for_hpu_says_why(capsys):
    from lightning_gaudi_fsdp.cli import main

    _drop_fake_modules()
    assert main(["doctor", "--accelerator", "hpu"]) == 1
    assert "fix: Habana bridge: run inside Intel's Gaudi PyTorch container" in capsys.readouterr().out


PAIRING_FIX = (
    "fix: torch + Lightning: use torch >= 2.6 (Gaudi software 1.21 or newer; on Gaudi keep the container's torch) "
    "with `pip install 'lightning>=2.5.1,<2.7'`; the README's support table lists what CI tests"
)


@pytest.mark.parametrize(
    ("torch_version", "lightning_version", "line", "fix"),
    [
        pytest.param(
            "2.6.0+cpu",
            "2.5.1",
            "[ok  ] torch + Lightning  Gaudi software 1.21's torch; "
            "CI: representative suite (torch 2.6.0 + Lightning 2.5.1 + transformers 4.57)",
            None,
            id="tested-pairing",
        ),
        pytest.param(
            "2.11.0",
            "2.6.6",
            "[ok  ] torch + Lightning  Gaudi software 1.24.1's torch; "
            "CI: representative suite (torch 2.11.0 + Lightning 2.6.6)",
            None,
            id="gaudi-1.24",
        ),
        pytest.param(
            "2.5.1",
            "2.5.1",
            "[warn] torch + Lightning  torch 2.5.1 is older than the supported 2.6 (Gaudi software 1.21)",
            PAIRING_FIX,
            id="torch-too-old",
        ),
        pytest.param(
            "2.13.0",
            "2.7.0",
            "[warn] torch + Lightning  Lightning 2.7.0 is outside the supported range >=2.5.1,<2.7",
            PAIRING_FIX,
            id="lightning-outside-range",
        ),
        pytest.param(
            "2.15.0",
            "2.6.6",
            "[ok  ] torch + Lightning  newer than the newest tested torch (2.13); expected to work",
            None,
            id="torch-newer-than-tested",
        ),
    ],
)
def test_doctor_reports_the_torch_lightning_pairing(monkeypatch, capsys, torch_version, lightning_version, line, fix):
    """The pairing line never blocks: outside the tested pairings doctor warns, says what to do and still exits 0."""
    from lightning_gaudi_fsdp import _doctor, _report
    from lightning_gaudi_fsdp.cli import main

    _drop_fake_modules()
    monkeypatch.setattr(
        _report,
        "versions",
        lambda: {"torch": torch_version, "lightning": lightning_version, "lightning-gaudi-fsdp": "0.1.0"},
    )
    check = _doctor._pairing(torch_version, lightning_version)
    assert _doctor.render([check]).splitlines()[0] == line

    assert main(["doctor", "--accelerator", "cpu"]) == 0
    out = capsys.readouterr().out
    # In the full report the name column is padded to the longest check name.
    status, _, value = line.partition(" torch + Lightning  ")
    assert re.search(rf"^{re.escape(status)} torch \+ Lightning +{re.escape(value)}$", out, re.MULTILINE), out
    fixes = [text for text in out.splitlines() if text.startswith("fix: torch + Lightning")]
    assert fixes == ([fix] if fix else [])
    assert "This machine can run GaudiFSDPStrategy with accelerator='cpu'." in out


def test_importing_the_package_never_imports_habana_frameworks():
    import subprocess

    code = "import sys, lightning_gaudi_fsdp; print(any(m.startswith('habana_frameworks') for m in sys.modules))"
    env = {**os.environ, "PYTHONPATH": str(FAKES)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_reductions_on_hccl_use_only_the_ops_hccl_offers(scenario):
    """Over the double's hccl (gloo underneath, refusing AVG as HCCL does): FSDP2's default reduce-scatter and
    Lightning's mean are refused; the strategy's mean and FSDP2 with the forced SUM reduction give the right values."""
    run = scenario({"devices": 2}, script="hccl_reductions.py")
    for rank in (0, 1):
        info = run.rank(rank)
        assert info["backend"] == "hccl"
        assert info["avg_refused"] is True  # the double really refuses AVG
        assert info["lightning_mean_refused"] is True
        assert info["strategy_mean"] == 1.5
        assert info["strategy_sum"] == 3.0
        assert info["fabric_lightning_mean_refused"] is True  # and so Fabric's door sums and divides too
        assert info["fabric_mean"] == 1.5
        if info["force_sum_available"]:
            assert info["fsdp2_default_refused"] is True
            assert info["fsdp2_sum_max_grad_error"] < 1e-6


def test_fsdp2_on_a_torch_without_sum_reductions_is_refused_at_construction(monkeypatch):
    from lightning_gaudi_fsdp import _compat

    monkeypatch.setattr(_compat, "FSDP2_FORCE_SUM_REDUCTION", False)
    with pytest.raises(ValueError, match=r"fsdp_version=2 needs torch >= 2.8 \(this is torch [\d.]+\): before 2.8"):
        GaudiFSDPStrategy(fsdp_version=2)
    GaudiFSDPStrategy(fsdp_version=1)  # FSDP1 reduces with SUM and divide factors: allowed on every torch


def test_doctor_says_whether_the_fsdp2_engine_can_run(monkeypatch):
    from lightning_gaudi_fsdp import _compat, _doctor

    def line() -> str:
        rendered = _doctor.render(_doctor.run_checks("cpu"))
        return next(row for row in rendered.splitlines() if "FSDP2 engine" in row and not row.startswith("fix"))

    if _compat.FSDP2_FORCE_SUM_REDUCTION:
        assert line().endswith("available: fully_shard (HPU kernels not checked for a cpu target)")
        assert line().startswith("[ok  ]")
    monkeypatch.setattr(_compat, "FSDP2_FORCE_SUM_REDUCTION", False)
    assert line() == (
        f"[warn] FSDP2 engine (fsdp_version=2)  not on torch {_compat.TORCH_VERSION} (needs >= 2.8); "
        "fsdp_version=1 only"
    )
    rendered = _doctor.render(_doctor.run_checks("cpu"))
    assert "This machine can run GaudiFSDPStrategy with accelerator='cpu'." in rendered  # a warning, not blocking


@pytest.mark.parametrize("kernels", [True, False])
def test_doctor_judges_fsdp2s_hpu_kernels_only_for_an_hpu_target(fake_gaudi, monkeypatch, capsys, kernels):
    """A torch without FSDP2's HPU kernels (this one has them: the probe stands in for another build) is a warning for
    ``--accelerator hpu`` only; a CPU rehearsal never runs those kernels."""
    from lightning_gaudi_fsdp import _compat, _doctor
    from lightning_gaudi_fsdp.cli import main

    if not _compat.FSDP2_FORCE_SUM_REDUCTION:
        pytest.skip("the FSDP2 engine needs torch >= 2.8")
    monkeypatch.setattr(_doctor, "fsdp2_hpu_kernels", lambda: kernels)
    fix = "fix: FSDP2 engine (fsdp_version=2): this torch registers no HPU kernels for FSDP2's copy-in ops"

    def engine_line(out: str) -> str:
        return next(row for row in out.splitlines() if "FSDP2 engine" in row and not row.startswith("fix"))

    assert main(["doctor", "--accelerator", "cpu"]) == 0
    out = capsys.readouterr().out
    assert engine_line(out) == (
        "[ok  ] FSDP2 engine (fsdp_version=2)  available: fully_shard (HPU kernels not checked for a cpu target)"
    )
    assert fix not in out
    assert main(["doctor", "--accelerator", "hpu"]) == 0  # the fake bridge is healthy; a warning never blocks
    out = capsys.readouterr().out
    status, state = ("ok  ", "registered") if kernels else ("warn", "missing")
    assert engine_line(out) == (
        f"[{status}] FSDP2 engine (fsdp_version=2)  available: fully_shard, SUM reductions on hccl, HPU kernels {state}"
    )
    assert (fix in out) is not kernels


_HOST_GATHER_SCRIPT = """
import json, sys, tempfile
import torch, torch.distributed as dist
import habana_frameworks.torch.distributed.hccl  # the double: an "hccl" backend, which runs over gloo here
from lightning_gaudi_fsdp.engine import fsdp2_state
from lightning_gaudi_fsdp.engine.pieces import carries_host_tensors

seen = {}
for backend in ("gloo", "hccl"):
    dist.init_process_group(backend, init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    seen[backend] = {"carries": carries_host_tensors()}
    if tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 8):  # the FSDP2 engine's torch
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(torch.nn.Linear(4, 4))  # shards in host memory
        seen[backend]["fsdp2_gathers_itself"] = fsdp2_state._gathers_to_rank0(model)
    dist.destroy_process_group()
print(json.dumps(seen))
"""


def test_shards_offloaded_to_host_memory_are_gathered_by_torch_on_hccl(tmp_path):
    """With ``cpu_offload`` on Gaudi the shards sit in host memory, but ``hccl`` carries device tensors: a full
    state is then gathered by torch's state dicts (which bring the shards to the device), not by the package's host
    gathers, which stay on gloo (the CPU rehearsal)."""
    import json
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKES), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", _HOST_GATHER_SCRIPT], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["gloo"]["carries"] is True
    assert seen["hccl"]["carries"] is False
    if "fsdp2_gathers_itself" in seen["gloo"]:
        assert seen["gloo"]["fsdp2_gathers_itself"] is True
        assert seen["hccl"]["fsdp2_gathers_itself"] is False


def test_on_a_bound_hccl_group_background_saves_and_module_sync_work_as_on_gaudi(scenario):
    """Two ranks on the double, its default group bound to ``hpu:0`` as Lightning binds it and its ``hccl`` carrying
    ``hpu`` tensors only, as Intel's: the background saver's group forms and gathers (torch's ``new_group`` would
    inherit the binding and ask gloo for an ``hpu`` backend), and ``sync_module_states`` gives every rank rank 0's
    weights (a broadcast of host tensors over ``hccl`` fails on Gaudi)."""
    from packaging.version import Version

    if Version(L.__version__) < Version("2.6"):  # its _setup_distributed passes no device_id to init_process_group
        pytest.skip("Lightning < 2.6 does not bind the default process group to the device: not this case")
    run = scenario({"devices": 2}, script="gaudi_bound.py")  # ranks started as torchrun would (no relaunch)
    for rank in (0, 1):
        info = run.rank(rank)
        assert (info["backend"], info["bound"]) == ("hccl", "hpu:0")
        assert "No backend type associated with device type cpu" in info["cpu_over_hccl"]  # the double is strict
        assert info["background_error"] is None
        assert info["background_gather"] == [0, 1]
        assert info["broadcast_error"] is None
        assert info["after_sync"] == run.rank(0)["before_sync"]
    assert run.rank(1)["before_sync"] != run.rank(0)["before_sync"]


def test_the_double_is_undone_for_the_tests_after_it():
    """What the double patches (collectives that refuse AVG, the ``hccl`` backend, ``torch.hpu``, the dynamo
    backend) must not leak into the tests that run after a Gaudi test in the same process."""
    from torch._dynamo.backends.registry import _COMPILER_FNS

    before = (dist.all_reduce, dist.init_process_group, list(dist.Backend.backend_list))
    with pytest.MonkeyPatch.context() as mp, gaudi_double(mp):
        import habana_frameworks.torch  # noqa: F401
        import habana_frameworks.torch.distributed.hccl  # noqa: F401
        import habana_frameworks.torch.dynamo.compile_backend  # noqa: F401

        assert dist.all_reduce is not before[0]
        assert "hccl" in dist.Backend.backend_list
        assert hasattr(torch, "hpu")
        assert "hpu_backend" in _COMPILER_FNS
    assert (dist.all_reduce, dist.init_process_group, list(dist.Backend.backend_list)) == before
    assert not hasattr(dist.Backend, "HCCL")
    assert "hccl" not in dist.Backend._plugins
    assert "HCCL" not in dist.Backend._plugins
    assert not hasattr(torch, "hpu")
    assert "hpu_backend" not in _COMPILER_FNS
    assert "habana_frameworks" not in sys.modules
