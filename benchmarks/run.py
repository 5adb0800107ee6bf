"""Run the benchmarks side by side and print ratios: ``python benchmarks/run.py [--smoke] [--world-size N]``.

1. Step overhead: median step time of Trainer + GaudiFSDPStrategy over a hand-written torch FSDP loop with the same
   model, settings and data; the contenders alternate, ``--rounds`` times. Target <= 1.05.
2. Memory per rank: bytes of parameters, gradients and AdamW state each rank holds for NO_SHARD, SHARD_GRAD_OP and
   FULL_SHARD at world sizes 1, 2, 4, against the 1/N limit plus the largest unsharded unit. Target: within 5%.
3. Checkpoints: save/load time and bytes of full, sharded and local against torch.save of the same full state and
   plain fsync'd writes of the same bytes (the disk's limit); loading the sharded one at world sizes 1 and 4.

Writes ``benchmarks/results/latest.json`` and ``benchmarks/results/latest.png``. Runs on CPU with gloo (each
measurement in its own processes); the numbers are ratios measured in one run, not absolute targets.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def _worker(mode: str, cfg: dict[str, Any], tmp: Path, timeout: float = 1800) -> dict[str, Any]:
    cfg = dict(cfg, result=str(tmp / f"{mode}-{time.monotonic_ns()}.json"))
    cfg_file = tmp / "cfg.json"
    cfg_file.write_text(json.dumps(cfg))
    proc = subprocess.run(
        [sys.executable, str(HERE / "worker.py"), mode, str(cfg_file)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark worker {mode} failed:\n{proc.stderr[-4000:]}")
    return json.loads(Path(cfg["result"]).read_text())


def _median_step(result: dict[str, Any], warmup: int) -> float:
    # a step takes as long as its slowest rank
    per_step = zip(*(r["step_times"] for r in result["ranks"]), strict=True)
    return statistics.median(max(step) for i, step in enumerate(per_step) if i >= warmup)


def bench_overhead(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    cfg = {"size": "smoke" if args.smoke else "overhead", "world_size": args.world_size, "steps": args.steps}
    medians: dict[str, list[float]] = {"lightning": [], "raw": []}
    for _ in range(args.rounds):
        for name, mode in (("lightning", "lightning_steps"), ("raw", "raw_steps")):
            medians[name].append(_median_step(_worker(mode, cfg, tmp), warmup=2))
    lightning, raw = statistics.median(medians["lightning"]), statistics.median(medians["raw"])
    return {
        "lightning_step_s": lightning,
        "raw_step_s": raw,
        "ratio": lightning / raw,
        "target": 1.05,
        "rounds": medians,
    }


def bench_memory(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    size = "smoke" if args.smoke else "memory"
    rows: dict[str, dict[str, Any]] = {}
    for world_size in (1, 2, 4):
        for sharding in ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"):
            cfg = {"size": size, "world_size": world_size, "steps": 1, "count_memory": True, "sharding": sharding}
            ranks = _worker("memory", cfg, tmp)["ranks"]
            rows[f"{sharding}@{world_size}"] = {
                "params": max(r["param_bytes"] for r in ranks),
                "grads": max(r["grad_bytes"] for r in ranks),
                "optim": max(r["optim_bytes"] for r in ranks),
                "total": max(r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"] for r in ranks),
                "peak_rss": max(r["peak_rss"] for r in ranks),
            }
    largest_unit = _largest_unit_bytes(size)
    for world_size in (1, 2, 4):
        full = rows[f"NO_SHARD@{world_size}"]["total"]
        limit = full / world_size + largest_unit
        for sharding in ("SHARD_GRAD_OP", "FULL_SHARD"):
            row = rows[f"{sharding}@{world_size}"]
            row["ratio_to_limit"] = row["total"] / limit
    return {"rows": rows, "largest_unit_bytes": largest_unit, "target": 1.05}


def _largest_unit_bytes(size: str) -> int:
    sys.path.insert(0, str(HERE))
    from models import build

    model = build(size)
    layer = sum(p.numel() for p in model.layers[0].parameters())
    root = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("layers."))
    return 4 * max(layer, root)


def bench_checkpoint(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    size = "smoke" if args.smoke else "checkpoint"
    ckdir = tmp / "ckpts"
    ckdir.mkdir()
    result = _worker("checkpoint", {"size": size, "world_size": args.world_size, "dir": str(ckdir)}, tmp)
    disk_rate = result["disk"]["bytes"] / result["disk"]["save_s"]
    for fmt in ("full", "sharded", "local"):
        row = result[fmt]
        row["throughput_vs_disk"] = (row["bytes"] / row["save_s"]) / disk_rate
    result["full"]["save_vs_torch_save"] = result["full"]["save_s"] / result["torch_save"]["save_s"]
    result["full"]["peak_rss_vs_state"] = result["full"]["rank0_peak_rss"] / result["state_bytes"]
    result["reshard_load_s"] = {}
    for world_size in (1, 4):
        cfg = {"size": size, "world_size": world_size, "ckpt": str(ckdir / "ckpt-sharded")}
        result["reshard_load_s"][f"{args.world_size}->{world_size}"] = _worker("load_sharded", cfg, tmp)["load_s"]
    return result


def _print_tables(results: dict[str, Any]) -> None:
    if "overhead" in results:
        o = results["overhead"]
        print("\n== step overhead (median step, slowest rank)")
        print(f"Trainer + GaudiFSDPStrategy  {o['lightning_step_s'] * 1e3:9.1f} ms")
        print(f"hand-written FSDP loop       {o['raw_step_s'] * 1e3:9.1f} ms")
        print(f"ratio                        {o['ratio']:9.3f}   (target <= {o['target']})")
    if "memory" in results:
        m = results["memory"]
        print("\n== memory per rank (bytes held: params + grads + AdamW state)")
        print(f"{'config':22} {'params':>12} {'grads':>12} {'optim':>12} {'total':>12} {'ratio to 1/N limit':>20}")
        for key, row in m["rows"].items():
            ratio = f"{row['ratio_to_limit']:.3f}" if "ratio_to_limit" in row else "-"
            print(f"{key:22} {row['params']:12,} {row['grads']:12,} {row['optim']:12,} {row['total']:12,} {ratio:>20}")
    if "checkpoint" in results:
        c = results["checkpoint"]
        print(f"\n== checkpoints ({c['state_bytes'] / 2**30:.2f} GiB of weights + AdamW state)")
        print(f"{'format':12} {'save s':>9} {'load s':>9} {'MiB':>9} {'vs disk':>9}")
        for fmt in ("full", "sharded", "local"):
            row = c[fmt]
            print(
                f"{fmt:12} {row['save_s']:9.2f} {row['load_s']:9.2f} {row['bytes'] / 2**20:9.1f} "
                f"{row['throughput_vs_disk']:9.2f}"
            )
        print(
            f"{'torch.save':12} {c['torch_save']['save_s']:9.2f} {c['torch_save']['load_s']:9.2f} "
            f"{c['torch_save']['bytes'] / 2**20:9.1f}"
        )
        print(f"{'disk (fsync)':12} {c['disk']['save_s']:9.2f} {'':>9} {c['disk']['bytes'] / 2**20:9.1f} {1.0:9.2f}")
        print(
            f"full save / torch.save: {c['full']['save_vs_torch_save']:.2f} (target <= 1.5); "
            f"rank 0 peak RSS added by the save / state bytes: {c['full']['peak_rss_vs_state']:.2f} (target <= 1.3)"
        )
        for key, seconds in c["reshard_load_s"].items():
            print(f"sharded load at world size {key}: {seconds:.2f} s")


def _chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    if "memory" in results:
        rows = results["memory"]["rows"]
        labels = list(rows)
        axes[0].bar(range(len(labels)), [rows[k]["total"] / 2**20 for k in labels], color="tab:blue")
        axes[0].set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=8)
        axes[0].set_ylabel("MiB held per rank")
        axes[0].set_title("Memory per rank (params + grads + AdamW)")
    if "checkpoint" in results:
        c = results["checkpoint"]
        names = ["full", "sharded", "local", "torch_save", "disk"]
        where = range(len(names))
        axes[1].bar(
            [i - 0.2 for i in where], [c[n]["save_s"] for n in names], width=0.4, color="tab:orange", label="save"
        )
        axes[1].bar(
            [i + 0.2 for i in where[:4]],
            [c[n]["load_s"] for n in names[:4]],
            width=0.4,
            color="tab:green",
            label="load",
        )
        axes[1].set_xticks(list(where), names)
        axes[1].set_ylabel("seconds")
        axes[1].set_title("Checkpoint save / load")
        axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; seconds, for CI")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the overhead contenders")
    parser.add_argument("--steps", type=int, default=12, help="steps per overhead run (the first 2 are warm-up)")
    parser.add_argument("--only", choices=["overhead", "memory", "checkpoint"], action="append")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.steps = min(args.rounds, 1), min(args.steps, 4)
    wanted = args.only or ["overhead", "memory", "checkpoint"]
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in wanted:
            print(f"running {name} ...", flush=True)
            results[name] = {"overhead": bench_overhead, "memory": bench_memory, "checkpoint": bench_checkpoint}[name](
                args, Path(tmp)
            )
    _print_tables(results)
    args.out.mkdir(parents=True, exist_ok=True)
    latest = args.out / "latest.json"
    if args.only and latest.exists():
        # a partial re-run updates its own sections and keeps the others
        results = {**json.loads(latest.read_text()), **results}
    latest.write_text(json.dumps(results, indent=1))
    _chart(results, args.out / "latest.png")
    print(f"\nwrote {args.out / 'latest.json'} and {args.out / 'latest.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
