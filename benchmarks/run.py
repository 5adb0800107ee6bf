"""Run the benchmarks side by side and print ratios: ``python benchmarks/run.py [--smoke] [--world-size N]``.

Both engines are measured in the same run: FSDP1 (``GaudiFSDPStrategy(fsdp_version=1)``, torch
``FullyShardedDataParallel``) and FSDP2 (``fsdp_version=2``, torch ``fully_shard``).

1. Step time: median step time of Trainer + GaudiFSDPStrategy over a hand-written loop of the same engine (the same
   model, wrapping, settings and data), and Trainer FSDP2 over Trainer FSDP1; the four contenders alternate,
   ``--rounds`` times, each round starting with the next one. Targets <= 1.05. Also the bytes each rank holds after
   the run, Trainer over hand-written loop (1.0: the strategy shards as the loop does).
2. Memory per rank: bytes of parameters, gradients and AdamW state each rank holds after an optimizer step, for
   NO_SHARD (FSDP1 only; FSDP2 always shards), SHARD_GRAD_OP and FULL_SHARD at world sizes 1, 2, 4, against the
   1/N limit (FSDP1's NO_SHARD total / N) plus the largest unsharded unit. Target: within 5%.
3. Checkpoints, per engine: save/load time and bytes of full, sharded and local against torch.save of the same full
   state and plain fsync'd writes of the same bytes (the disk's limit), measured in that engine's run; loading the
   sharded one at world sizes 1 and 4. Targets: full save <= 1.5 x torch.save, sharded and local saves >= 0.5 of
   the disk's rate, rank 0 memory added by a full save <= 1.3 x the state's bytes. Each format is also saved with
   ``async_save=True`` in the same round: the time the save blocks the training loop (state dicts built and staged
   into host buffers reused from round to round, plus the wait before the next optimizer step for the copies made
   during that step's forward and backward) over the synchronous save's time, target <= 0.1 for every format, and
   the host memory the staging buffers hold. Every contender runs one round first that is not counted (its first
   write lands in memory the machine has not used yet, several times slower; not in ``--smoke``). And a full save
   made inside ``fit`` (at the end of a step, as a checkpoint callback makes it) against ``torch.save`` without
   CRC32s + fsync of the same state, in turn at the end of each step, paired per step (issue 31's target, <= 1.2);
   no file is deleted while they are timed (a write right after a large file was deleted is slower, see
   ``worker.checkpoint_in_fit``). Each save, async save and load runs again in the same round with
   ``verify_checkpoints=False`` (which of the two goes first alternates by round): save with checksums / without,
   per format and for the async save (target <= 1.05; ``full`` on 2 ranks is the streamed save), and resume
   (``strategy.load_checkpoint``) verified / not (target <= 1.10), paired per round; the async save's blocked time
   with / without is shown too (it should stay where it is).
4. Pretrained weights in, per engine: peak host memory each rank adds while a Hugging Face Llama (saved in bf16
   with ``save_pretrained`` in several files) is built in fp32 and its weights put into the shards, with
   ``pretrained_weights`` (meta construction, each rank reads its slices) and without the strategy's help
   (``from_pretrained`` on every rank, then sharding), against the model's fp32 bytes: anonymous memory (what the
   rank allocates) and resident memory with the file pages it maps. Target: anonymous memory with
   ``pretrained_weights`` <= 0.75 of one model per rank at 2 ranks (its shard is 0.5). ``--smoke`` measures FSDP1
   only, and only when asked for (``--smoke --only pretrained``).

5. Resume, per engine (see ``resume.py``): the time ``fit(ckpt_path=...)`` adds before the first step (against the
   same fit from a fresh model, side by side) over ``torch.load`` of that rank's share of the same state from one
   file, for ``sharded`` and ``local`` checkpoints of a transformers Llama of width 256 with AdamW, at 8 and 80
   decoder layers (80 is a 70B Llama's layer count: 723 tensors), 2 ranks; and the 80-layer sharded checkpoint
   resumed at 1 and 4 ranks over the same resume at 2; and the memory a rank needs only while it restores (its peak
   anonymous memory in that window minus what it holds at the first step) over its share. Targets: <= 1.5 (resume),
   <= 2 (reshard), <= 0.25 (memory). Not in
   ``--smoke`` unless asked for (``--smoke --only resume``: 2 and 4 layers of width 32).

Writes ``benchmarks/results/latest.json`` (with a ``summary`` of every ratio against its target) and
``benchmarks/results/latest.png``. Runs on CPU with gloo (each measurement in its own processes); the numbers are
ratios measured in one run, not absolute targets. ``BENCH_PROFILE=full|sharded|local`` writes a cProfile of rank 0's
save of that format per engine (its last round) to ``BENCH_PROFILE_DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import report  # noqa: E402

SCHEMA = 2  # 2: both engines side by side
RESULTS = HERE / "results"
ENGINES = ("fsdp1", "fsdp2")
SHARDINGS = {"fsdp1": ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"), "fsdp2": ("SHARD_GRAD_OP", "FULL_SHARD")}
WORLD_SIZES = (1, 2, 4)
TARGETS = {"step_ratio": 1.05, "memory_ratio": 1.05}
PRETRAINED_TARGET = 0.75  # peak added per rank / model bytes, 2 ranks
PRETRAINED_SIZES = {  # vocab, hidden, layers, intermediate, heads: ~0.1 M and ~70 M parameters
    "smoke": (256, 64, 2, 128, 4),
    "full": (8192, 768, 8, 2048, 12),
}
RESUME_LAYERS = {"smoke": (2, 4), "full": (8, 80)}
RESUME_WIDTH = {"smoke": 32, "full": 256}
RESUME_TARGETS = {"resume_vs_torch_load": 1.5, "reshard_vs_same_size": 2.0, "restore_extra_vs_share": 0.25}
CHECKPOINT_TARGETS = {
    "full_save_vs_torch_save": 1.5,
    "full_save_vs_plain_torch_save": 1.2,  # issue 31: against torch.save + fsync without CRC32s, as the save writes
    "throughput_vs_disk": 0.5,
    "full_peak_rss_vs_state": 1.3,
    "async_blocked_vs_sync": 0.1,
    "checksums_save": 1.05,  # issue 43: save with checksums / without (verify_checkpoints), per format
    "checksums_resume": 1.10,  # resume with verification / without
}


def _worker(
    mode: str, cfg: dict[str, Any], tmp: Path, timeout: float = 1800, env: dict[str, str] | None = None
) -> dict[str, Any]:
    cfg = dict(cfg, result=str(tmp / f"{mode}-{time.monotonic_ns()}.json"))
    cfg_file = tmp / "cfg.json"
    cfg_file.write_text(json.dumps(cfg))
    proc = subprocess.run(
        [sys.executable, str(HERE / "worker.py"), mode, str(cfg_file)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp,
        env=None if env is None else {**os.environ, **env},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark worker {mode} failed:\n{proc.stderr[-4000:]}")
    return json.loads(Path(cfg["result"]).read_text())


def _median_step(result: dict[str, Any], warmup: int) -> float:
    # a step takes as long as its slowest rank
    per_step = zip(*(r["step_times"] for r in result["ranks"]), strict=True)
    return statistics.median(max(step) for i, step in enumerate(per_step) if i >= warmup)


def _median_cpu(result: dict[str, Any], warmup: int) -> float:
    # CPU seconds of a step, all ranks together: the work done, which other jobs on the machine do not stretch
    per_step = zip(*(r["step_cpu"] for r in result["ranks"]), strict=True)
    return statistics.median(sum(step) for i, step in enumerate(per_step) if i >= warmup)


def _held_total(ranks: list[dict[str, Any]]) -> int:
    return max(r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"] for r in ranks)


def bench_overhead(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    cfg = {"size": "smoke" if args.smoke else "overhead", "world_size": args.world_size, "steps": args.steps}
    contenders = [(engine, kind) for engine in ENGINES for kind in ("lightning", "raw")]
    medians: dict[str, list[float]] = {f"{engine}/{kind}": [] for engine, kind in contenders}
    cpu: dict[str, list[float]] = {f"{engine}/{kind}": [] for engine, kind in contenders}
    held: dict[str, int] = {}
    for round_ in range(args.rounds):
        # each round starts with the next contender, so none always runs first (or right after a given other)
        for engine, kind in contenders[round_ % len(contenders) :] + contenders[: round_ % len(contenders)]:
            result = _worker(f"{kind}_steps", dict(cfg, engine=engine), tmp)
            medians[f"{engine}/{kind}"].append(_median_step(result, warmup=2))
            cpu[f"{engine}/{kind}"].append(_median_cpu(result, warmup=2))
            held[f"{engine}/{kind}"] = _held_total(result["ranks"])
    return derive_overhead({"target": TARGETS["step_ratio"], "rounds": medians, "cpu_rounds": cpu, "held_bytes": held})


def _paired(numerators: list[float], denominators: list[float]) -> float:
    """The median over rounds of each round's ratio: the two sides of a ratio ran minutes apart at most, so a slow
    spell of the shared machine stretches both."""
    return statistics.median(n / d for n, d in zip(numerators, denominators, strict=True))


def derive_overhead(results: dict[str, Any]) -> dict[str, Any]:
    """Step times (medians over rounds) and ratios (paired per round) from the measured rounds."""
    wall, cpu, held = results["rounds"], results["cpu_rounds"], results["held_bytes"]
    for engine in ENGINES:
        lightning, raw = f"{engine}/lightning", f"{engine}/raw"
        results[engine] = {
            "lightning_step_s": statistics.median(wall[lightning]),
            "raw_step_s": statistics.median(wall[raw]),
            "ratio": _paired(wall[lightning], wall[raw]),
            "lightning_cpu_s": statistics.median(cpu[lightning]),
            "raw_cpu_s": statistics.median(cpu[raw]),
            "cpu_ratio": _paired(cpu[lightning], cpu[raw]),
            # the strategy must shard as the hand-written loop does: 1.0 when it holds the same bytes
            "held_vs_raw": held[lightning] / held[raw],
        }
    results["fsdp2_vs_fsdp1"] = _paired(wall["fsdp2/lightning"], wall["fsdp1/lightning"])
    results["fsdp2_vs_fsdp1_cpu"] = _paired(cpu["fsdp2/lightning"], cpu["fsdp1/lightning"])
    return results


def bench_memory(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    size = "smoke" if args.smoke else "memory"
    configs = [(engine, sharding) for engine in ENGINES for sharding in SHARDINGS[engine]]
    rows: dict[str, dict[str, Any]] = {engine: {} for engine in ENGINES}
    # the smoke run skips the single process: sharding at 2 and 4 ranks is what it checks
    world_sizes = WORLD_SIZES[1:] if args.smoke else WORLD_SIZES
    for world_size in world_sizes:
        # one process per rank measures every configuration in turn (a process start costs more than a config)
        cfg = {"size": size, "world_size": world_size, "steps": 1, "configs": configs}
        ranks = _worker("memory", cfg, tmp)["ranks"]
        for engine, sharding in configs:
            held = [r[f"{engine}:{sharding}"] for r in ranks]
            rows[engine][f"{sharding}@{world_size}"] = {
                "params": max(h["param_bytes"] for h in held),
                "grads": max(h["grad_bytes"] for h in held),
                "optim": max(h["optim_bytes"] for h in held),
                "total": _held_total(held),
            }
    largest_unit = _largest_unit_bytes(size)
    for world_size in world_sizes:
        # FSDP2 has no NO_SHARD: FSDP1's unsharded total is the full model for both engines
        limit = rows["fsdp1"][f"NO_SHARD@{world_size}"]["total"] / world_size + largest_unit
        for engine in ENGINES:
            for sharding in ("SHARD_GRAD_OP", "FULL_SHARD"):
                row = rows[engine][f"{sharding}@{world_size}"]
                row["ratio_to_limit"] = row["total"] / limit
    return {"rows": rows, "largest_unit_bytes": largest_unit, "target": TARGETS["memory_ratio"]}


def _largest_unit_bytes(size: str) -> int:
    from models import build

    model = build(size)
    layer = sum(p.numel() for p in model.layers[0].parameters())
    root = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("layers."))
    return 4 * max(layer, root)


def derive_checkpoint(result: dict[str, Any]) -> dict[str, Any]:
    """One engine's medians over the rounds (the largest memory increase), and its ratios to the baselines, paired
    per round: each round saves every format and then runs torch.save and the plain writes."""
    for name in ("full", "sharded", "local", "torch_save", "torch_save_plain", "disk"):
        if name not in result:  # a result written before the checksum-free baseline
            continue
        rounds = result[name]["rounds"] if isinstance(result[name], dict) else result[name]
        row: dict[str, Any] = {"rounds": rounds, "bytes": rounds[-1]["bytes"]}
        for key in ("save_s", "load_s"):
            if key in rounds[0]:
                row[key] = statistics.median(r[key] for r in rounds)
        if "rank0_peak_rss" in rounds[0]:
            row["rank0_peak_rss"] = max(r["rank0_peak_rss"] for r in rounds)
        result[name] = row

    def seconds(name: str) -> list[float]:
        return [r["save_s"] for r in result[name]["rounds"]]

    def rates(name: str) -> list[float]:
        return [r["bytes"] / r["save_s"] for r in result[name]["rounds"]]

    for fmt in ("full", "sharded", "local"):
        result[fmt]["throughput_vs_disk"] = _paired(rates(fmt), rates("disk"))
        background = result["async"][fmt]
        result[fmt]["async"] = {
            "rounds": background,
            "blocked_s": statistics.median(r["blocked_s"] for r in background),
            "save_s": statistics.median(r["save_s"] for r in background),
            "staging_bytes": max(r["staging_bytes"] for r in background),
            # of the staged bytes, those copied in the background while the next forward and backward ran
            "deferred_bytes": max(r.get("deferred_bytes", 0) for r in background),
            "copy_wait_s": statistics.median(r.get("copy_wait_s", 0.0) for r in background),
            # the time training waits for an async save, against the same save done synchronously in that round
            "blocked_vs_sync": _paired([r["blocked_s"] for r in background], seconds(fmt)),
        }
    if "unverified" in result:  # the same saves and loads without checksums, paired per round
        for fmt in ("full", "sharded", "local"):
            off, async_off, background = (
                result["unverified"][fmt],
                result["async_unverified"][fmt],
                result["async"][fmt],
            )
            result[fmt]["checksums"] = {
                "save_s_without": statistics.median(r["save_s"] for r in off),
                "load_s_without": statistics.median(r["load_s"] for r in off),
                "save_ratio": _paired(seconds(fmt), [r["save_s"] for r in off]),
                "load_ratio": _paired([r["load_s"] for r in result[fmt]["rounds"]], [r["load_s"] for r in off]),
                "async_save_ratio": _paired([r["save_s"] for r in background], [r["save_s"] for r in async_off]),
                "async_blocked_ratio": _paired(
                    [r["blocked_s"] for r in background], [r["blocked_s"] for r in async_off]
                ),
            }
        del result["unverified"], result["async_unverified"]
    del result["async"]
    result["full"]["save_vs_torch_save"] = _paired(seconds("full"), seconds("torch_save"))
    if "torch_save_plain" in result:
        result["full"]["save_vs_plain_torch_save"] = _paired(seconds("full"), seconds("torch_save_plain"))
    result["full"]["peak_rss_vs_state"] = result["full"]["rank0_peak_rss"] / result["state_bytes"]
    return result


def bench_checkpoint(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    size = "smoke" if args.smoke else "checkpoint"
    results: dict[str, Any] = {"world_size": args.world_size, "targets": CHECKPOINT_TARGETS}
    for engine in ENGINES:
        ckdir = tmp / f"ckpts-{engine}"
        ckdir.mkdir()
        cfg = {"size": size, "world_size": args.world_size, "dir": str(ckdir), "engine": engine, "rounds": args.rounds}
        cfg["warmup"] = 0 if args.smoke else 1  # one round of every contender first, not counted
        results[engine] = derive_checkpoint(_worker("checkpoint", cfg, tmp))
        results[engine]["reshard_load_s"] = {}
        # its own files: nothing is deleted while timed; one step in --smoke
        in_fit = _worker("checkpoint_in_fit", dict(cfg, rounds=1) if args.smoke else cfg, tmp)
        results[engine]["in_fit"] = {
            "rounds": in_fit,
            "save_vs_plain_torch_save": _paired(in_fit["full"], in_fit["torch_save_plain"]),
        }
    for world_size in (1, 4):
        ckpts = {engine: str(tmp / f"ckpts-{engine}" / "ckpt-sharded") for engine in ENGINES}
        loads = _worker("load_sharded", {"size": size, "world_size": world_size, "ckpts": ckpts}, tmp)["load_s"]
        for engine in ENGINES:
            results[engine]["reshard_load_s"][f"{args.world_size}->{world_size}"] = loads[engine]
    return results


def _save_llama(size: str, where: Path) -> int:
    """A randomly initialised Llama saved in bf16 (as most published checkpoints are) with ``save_pretrained`` in
    several files; returns the bytes of its fp32 parameters (what the benchmark loads it into)."""
    import torch
    import transformers

    vocab, hidden, layers, intermediate, heads = PRETRAINED_SIZES[size]
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=heads,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(where, max_shard_size="50MB" if size == "full" else "200KB")
    return sum(p.numel() * 4 for p in model.parameters())


def bench_pretrained(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    size = "smoke" if args.smoke else "full"
    weights = tmp / "llama-hf"
    model_bytes = _save_llama(size, weights)
    engines = ENGINES[:1] if args.smoke else ENGINES
    out: dict[str, Any] = {"model_bytes": model_bytes, "world_size": args.world_size, "target": PRETRAINED_TARGET}
    for engine in engines:
        out[engine] = {}
        for contender in ("strategy", "from_pretrained"):
            cfg = {"engine": engine, "contender": contender, "weights": str(weights), "world_size": args.world_size}
            # freed large blocks go back to the OS: the peak counts live memory, not glibc's cache
            ranks = _worker("pretrained_load", cfg, tmp, env={"MALLOC_MMAP_THRESHOLD_": "65536"})["ranks"]
            peak = max(r["peak_added"] for r in ranks)
            resident = max(r["peak_resident_added"] for r in ranks)
            out[engine][contender] = {
                "ranks": ranks,
                "peak_added": peak,
                "peak_vs_model": peak / model_bytes,
                "peak_resident_added": resident,
                "resident_vs_model": resident / model_bytes,
                "shard_bytes": max(r["shard_bytes"] for r in ranks),
                "load_s": max(r["load_s"] for r in ranks),
            }
    return out


def bench_resume(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    size = "smoke" if args.smoke else "full"
    layers = RESUME_LAYERS[size]
    out: dict[str, Any] = {"world_size": args.world_size, "layers": list(layers), "targets": RESUME_TARGETS}
    for engine in ENGINES:
        out[engine] = {}
        for n in layers:
            ckdir = tmp / f"resume-{engine}-{n}"
            ckdir.mkdir()
            cfg = {
                "engine": engine,
                "layers": n,
                "width": RESUME_WIDTH[size],
                "world_size": args.world_size,
                "formats": ["sharded", "local", "full"],
                "dir": str(ckdir),
                "rounds": args.rounds,
                "memory": True,
            }
            result = _worker("resume", cfg, tmp)
            row: dict[str, Any] = {"share_bytes": result["share_bytes"]}
            for fmt, rounds in result["rows"].items():
                extra = result["restore_extra"][fmt]
                row[fmt] = {
                    "rounds": rounds,
                    "added_s": statistics.median(r["added_s"] for r in rounds),
                    "torch_load_s": statistics.median(r["torch_load_s"] for r in rounds),
                    "vs_torch_load": _paired([r["added_s"] for r in rounds], [r["torch_load_s"] for r in rounds]),
                    "restore_extra": extra,
                    "restore_extra_vs_share": extra / result["share_bytes"],
                }
            out[engine][str(n)] = row
        n = layers[-1]
        same = out[engine][str(n)]["sharded"]["added_s"]
        out[engine]["reshard"] = {}
        for world_size in (1, 4):
            ckpt = str(tmp / f"resume-{engine}-{n}" / f"{engine}-sharded")
            cfg = {
                "engine": engine,
                "layers": n,
                "width": RESUME_WIDTH[size],
                "world_size": world_size,
                "ckpts": {"sharded": ckpt},
                "dir": str(tmp),
                "rounds": 1,
            }
            added = _worker("resume", cfg, tmp)["rows"]["sharded"][0]["added_s"]
            key = f"{args.world_size}->{world_size}"
            out[engine]["reshard"][key] = {"added_s": added, "vs_same_size": added / same}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; seconds, for CI")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the overhead contenders")
    parser.add_argument("--steps", type=int, default=12, help="steps per overhead run (the first 2 are warm-up)")
    parser.add_argument("--only", choices=["overhead", "memory", "checkpoint", "pretrained", "resume"], action="append")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.steps = min(args.rounds, 1), min(args.steps, 4)
    # --smoke leaves the pretrained and resume sections out unless asked for (--only ...): their workers import
    # transformers
    wanted = args.only or ["overhead", "memory", "checkpoint", *([] if args.smoke else ["pretrained", "resume"])]
    benches = {
        "overhead": bench_overhead,
        "memory": bench_memory,
        "checkpoint": bench_checkpoint,
        "pretrained": bench_pretrained,
        "resume": bench_resume,
    }
    results: dict[str, Any] = {"schema": SCHEMA}
    with tempfile.TemporaryDirectory() as tmp:
        for name in wanted:
            print(f"running {name} ...", flush=True)
            started = time.monotonic()
            results[name] = benches[name](args, Path(tmp))
            results[name]["args"] = {k: str(v) for k, v in vars(args).items()}
            print(f"  {name}: {time.monotonic() - started:.0f} s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    latest = args.out / "latest.json"
    if args.only and latest.exists():
        previous = json.loads(latest.read_text())
        if previous.get("schema") == SCHEMA:
            # a partial re-run updates its own sections and keeps the others (each records its own arguments)
            results = {**previous, **results}
    results["summary"] = report.summary(results)
    report.print_tables(results)
    latest.write_text(json.dumps(results, indent=1) + "\n")
    report.chart(results, args.out / "latest.png")
    print(f"\nwrote {args.out / 'latest.json'} and {args.out / 'latest.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
