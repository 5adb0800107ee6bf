"""Mutation check: break one feature at a time in a copy of the tree and see that the tests named for it fail.

Each mutation replaces one exact piece of code (in ``src/`` or in the Gaudi double) in a temporary copy of the
repository's tracked files, runs the tests that should catch it against that copy (``PYTHONPATH`` points at the
copy's ``src``), and reports it as *killed* (a named test failed) or *survived* (they all passed: a feature the suite
does not really check). The working tree is never modified.

    python scripts/mutation_check.py              # every mutation (about 10 minutes on a 2-core machine)
    python scripts/mutation_check.py --list       # names, files and the tests each one runs
    python scripts/mutation_check.py --only fake-hccl-accepts-avg --only resume-without-optimizer-state

Exit status: 0 when every mutation was killed, 1 when one survived, 2 when a mutation no longer applies (its code
moved: update it here).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str  # the defect it plants, in a user's words
    path: str  # relative to the repository root
    old: str  # must occur exactly once
    new: str
    tests: tuple[str, ...]  # pytest arguments: node ids, or a file followed by "-k", "expression"


MUTATIONS = (
    Mutation(
        "resume-without-optimizer-state",
        "a resume restores the weights but skips the optimizer state",
        "src/lightning_gaudi_fsdp/checkpoint/loading.py",
        "strict=strict, load_optimizers=load_optimizers\n",
        "strict=strict, load_optimizers=False\n",
        (
            "tests/distributed/test_failures.py::"
            "test_a_rank_killed_mid_training_stops_the_others_and_the_last_checkpoint_loads[trainer]",
        ),
    ),
    Mutation(
        "fsdp2-one-unit-summed",
        "FSDP2 sums one unit's gradients over the ranks instead of averaging them",
        "src/lightning_gaudi_fsdp/engine/fsdp2.py",
        '    if door.process_group_backend == "hccl":\n        force_sum_reductions(model)\n',
        '    if door.process_group_backend == "hccl":\n        force_sum_reductions(model)\n'
        "    from torch.distributed.fsdp import FSDPModule\n"
        "    unit = next(m for m in model.modules() if isinstance(m, FSDPModule) and m is not model)\n"
        "    unit.set_force_sum_reduction_for_comms(True)\n"
        "    unit.set_gradient_divide_factor(1.0)\n",
        ("tests/distributed/test_training.py::test_two_ranks_match_one_process_on_the_global_batch[2-FULL_SHARD-2]",),
    ),
    Mutation(
        "fsdp2-one-unit-avg",
        "one FSDP2 unit keeps torch's AVG reduce-scatter, which HCCL does not offer",
        "src/lightning_gaudi_fsdp/engine/fsdp2_apply.py",
        "    for module in model.modules():\n        if isinstance(module, FSDPModule):\n",
        "    for module in model.modules():\n        if isinstance(module, FSDPModule) and module is not model:\n",
        ("tests/test_gaudi.py::test_reductions_on_hccl_use_only_the_ops_hccl_offers",),
    ),
    Mutation(
        "fake-hccl-accepts-avg",
        "the Gaudi double's hccl accepts AVG, which real HCCL refuses",
        "tests/fakes/habana_frameworks/torch/distributed/hccl.py",
        "_HCCL_OPS = {dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX}",
        "_HCCL_OPS = {dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX, dist.ReduceOp.AVG}",
        ("tests/test_gaudi.py::test_reductions_on_hccl_use_only_the_ops_hccl_offers",),
    ),
    Mutation(
        "bf16-mixed-without-autocast",
        "bf16-mixed runs without autocast on the device in use (Lightning's own FSDPPrecision on a CPU or Gaudi)",
        "src/lightning_gaudi_fsdp/precision.py",
        "            return torch.autocast(self.device_type, dtype=dtype)\n",
        '            return torch.autocast("cuda", dtype=dtype)\n',  # Lightning's FSDPPrecision
        # the parity with one process alone does not catch it: FSDP's bf16 parameters compute in bf16 anyway
        ("tests/distributed/test_training.py::test_trainer_bf16_mixed_autocasts_on_the_cpu[1]",),
    ),
    Mutation(
        "hpu-kernel-probe-always-true",
        "doctor's probe of FSDP2's HPU kernels answers yes whatever torch registered",
        "src/lightning_gaudi_fsdp/adapters/torch_internals.py",
        '    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(op, "HPU"))\n',
        "    return True\n",
        ("tests/test_adapters.py::test_has_hpu_kernel_tells_an_op_with_an_hpu_kernel_from_one_without",),
    ),
    Mutation(
        "doctor-never-imports-lightning-habana",
        "doctor says an installed lightning-habana imports without trying",
        "src/lightning_gaudi_fsdp/_doctor.py",
        '        importlib.import_module("lightning_habana")\n',
        "        pass\n",
        ("tests/test_lightning_habana.py::test_doctor_reports_a_broken_lightning_habana",),
    ),
    Mutation(
        "pool-ranks-outlive-their-worker",
        "the scenario pool's server and ranks outlive a pytest worker killed hard",
        "tests/_pool.py",
        "        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)\n",
        "        pass\n",
        ("tests/test_pool.py::test_the_pool_bounds_each_scenario_and_dies_with_a_worker_killed_hard",),
    ),
)


def _copy_tree(dst: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        src = ROOT / os.fsdecode(name)
        if src.is_file():
            target = dst / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)


def _apply(tree: Path, mutation: Mutation) -> None:
    path = tree / mutation.path
    text = path.read_text()
    if text.count(mutation.old) != 1:
        raise LookupError(f"{mutation.name}: the code it replaces occurs {text.count(mutation.old)} times in {path}")
    path.write_text(text.replace(mutation.old, mutation.new))


def run(mutation: Mutation, timeout_s: float) -> tuple[str, float, str]:
    """``("killed" | "survived" | "error", seconds, the tail of pytest's output)``."""
    with tempfile.TemporaryDirectory(prefix=f"mutation-{mutation.name}-") as tmp:
        tree = Path(tmp) / "tree"
        _copy_tree(tree)
        _apply(tree, mutation)
        env = {**os.environ, "PYTHONPATH": str(tree / "src")}
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            *mutation.tests,
            "-q",
            "-x",
            "-p",
            "no:randomly",
            "-p",
            "no:cacheprovider",
        ]
        cmd += ["--basetemp", str(Path(tmp) / "pytest"), "--timeout", str(int(timeout_s))]
        started = time.monotonic()
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        seconds = time.monotonic() - started
        tail = (proc.stdout + proc.stderr)[-1500:]
        if proc.returncode == 0:
            return "survived", seconds, tail
        if proc.returncode == 1:  # tests ran and failed
            return "killed", seconds, tail
        return "error", seconds, tail  # collection error, no test selected...


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", choices=[m.name for m in MUTATIONS], help="run this one (repeat)")
    parser.add_argument("--list", action="store_true", help="list the mutations and their tests, run nothing")
    parser.add_argument("--timeout", type=float, default=300, help="pytest-timeout per test (default 300 s)")
    parser.add_argument("--verbose", action="store_true", help="show pytest's output for every mutation")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.what}\n  in {m.path}\n  tests: {' '.join(m.tests)}")
        return 0
    status = 0
    for m in chosen:
        try:
            verdict, seconds, tail = run(m, args.timeout)
        except LookupError as err:
            print(f"STALE     {m.name}: {err}", flush=True)
            status = max(status, 2)
            continue
        print(f"{verdict.upper():9} {m.name} ({seconds:.0f} s): {m.what}", flush=True)
        if verdict != "killed" or args.verbose:
            print("    " + tail.replace("\n", "\n    "), flush=True)
        if verdict != "killed":
            status = max(status, 1)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
