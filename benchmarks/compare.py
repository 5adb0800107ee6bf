"""Compare source trees side by side: ``python benchmarks/compare.py TREE_A TREE_B [--only steps|checkpoint]``.

The same measurement runs on each tree in turn (the package imported from ``TREE/src`` by ``PYTHONPATH``; the
benchmark code is this one for every tree), round by round, each round starting with the next tree, and each number
of a tree after the first is printed over the first tree's of the same round: the median of those ratios over the
rounds, and their spread (min to max). For the before/after checks of a change ("the step time and checkpoint
benchmarks are unchanged side by side"): make a detached worktree of the older commit and pass both trees.

- ``steps``: median step time of ``Trainer`` + ``GaudiFSDPStrategy`` (``worker.py lightning_steps``, the overhead
  section's model), per engine; and CPU seconds per step.
- ``checkpoint``: ``worker.py save_resume`` (``--size``: ``checkpoint``, 7 layers of width 1024, or ``units80``, about
  the same 1.2 GiB state in 80 layers): per format, a save into a new path, a save over it, and its load
  (``strategy.load_checkpoint``: what ``fit(ckpt_path=...)`` runs); each tree's own ratios to ``torch.save`` + fsync
  (full) and to ``torch.load`` of the rank's share (sharded, local) or of the whole file (full) are printed too.

Writes every round to ``--out`` (JSON).
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
sys.path.insert(0, str(HERE))
import run  # noqa: E402

# each tree's own ratio: (name, numerator, denominator)
OWN_RATIOS = (
    ("full save / torch.save + fsync", "full_save_s", "torch_save_plain_s"),
    ("full save over the last / torch.save + fsync", "full_overwrite_s", "torch_save_plain_s"),
    ("full load / torch.load of the file", "full_load_s", "torch_load_full_s"),
    ("sharded load / torch.load of the share", "sharded_load_s", "torch_load_share_s"),
    ("local load / torch.load of the share", "local_load_s", "torch_load_share_s"),
)


def _describe(tree: Path) -> str:
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "src"], capture_output=True, text=True)
    return f"{tree} ({head.stdout.strip() or '?'}{', src modified' if dirty.stdout.strip() else ''})"


def _measure(section: str, tree: Path, engine: str, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    env = {"PYTHONPATH": str(tree / "src")}
    if section == "steps":
        cfg = {"size": "smoke" if args.smoke else "overhead", "world_size": args.world_size, "steps": args.steps}
        result = run._worker("lightning_steps", dict(cfg, engine=engine), tmp, env=env)
        metrics = {"step_s": run._median_step(result, warmup=2), "step_cpu_s": run._median_cpu(result, warmup=2)}
    else:
        ckdir = Path(tempfile.mkdtemp(dir=tmp))
        cfg = {"size": "smoke" if args.smoke else args.size, "world_size": args.world_size, "engine": engine}
        cfg.update(dir=str(ckdir), rounds=args.inner_rounds, formats=args.formats)
        result = run._worker("save_resume", cfg, tmp, env=env)
        rows = result["rows"]
        # the first save of a fresh process apart; the later rounds' medians
        metrics = {f"first {k}": v for k, v in rows[0].items() if k.endswith("_s")}
        later = rows[1:] or rows
        metrics.update({k: statistics.median(r[k] for r in later) for k in rows[0] if k.endswith("_s")})
        for name, num, den in OWN_RATIOS:
            if num in rows[0] and den in rows[0]:
                metrics[name] = statistics.median(r[num] / r[den] for r in later)
                metrics[f"first {name}"] = rows[0][num] / rows[0][den]
    if result["package"] is None or not Path(result["package"]).is_relative_to(tree):
        raise RuntimeError(f"measured {result['package']}, not the tree {tree}")
    return metrics


def compare(args: argparse.Namespace) -> dict[str, Any]:
    trees = [Path(t).resolve() for t in args.trees]
    out: dict[str, Any] = {"trees": [_describe(t) for t in trees], "args": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory() as tmp:
        for section in args.only or ["steps", "checkpoint"]:
            rounds: dict[str, list[list[dict[str, float]]]] = {e: [[] for _ in trees] for e in args.engines}
            for round_ in range(args.rounds):
                order = list(range(len(trees)))
                order = order[round_ % len(trees) :] + order[: round_ % len(trees)]
                for engine in args.engines:
                    for i in order:
                        started = time.monotonic()
                        rounds[engine][i].append(_measure(section, trees[i], engine, args, Path(tmp)))
                        # every measurement so far, in case the run is cut short
                        args.out.with_suffix(".partial.json").write_text(json.dumps({**out, section: rounds}))
                        print(f"  {section} {engine} round {round_} tree {i}: {time.monotonic() - started:.0f} s")
            out[section] = {engine: _ratios(per_tree) for engine, per_tree in rounds.items()}
            _print(section, out[section], trees)
    return out


def _ratios(per_tree: list[list[dict[str, float]]]) -> dict[str, Any]:
    first = per_tree[0]
    rows: dict[str, Any] = {}
    for key in first[0]:
        row: dict[str, Any] = {"median": [statistics.median(r[key] for r in tree) for tree in per_tree]}
        for i, tree in enumerate(per_tree[1:], start=1):
            paired = [b[key] / a[key] for a, b in zip(first, tree, strict=True) if a[key] > 0]
            if paired:
                row[f"tree{i}/tree0"] = {"median": statistics.median(paired), "min": min(paired), "max": max(paired)}
        rows[key] = row
    return {"rows": rows, "rounds": per_tree}


def _print(section: str, result: dict[str, Any], trees: list[Path]) -> None:
    print(f"\n== {section}: " + "; ".join(f"tree {i}: {t}" for i, t in enumerate(trees)))
    for engine, data in result.items():
        print(
            f"{engine.upper():<6} {'measurement':<52} "
            + " ".join(f"{'tree ' + str(i):>9}" for i in range(len(trees)))
            + "   ratio to tree 0 (min-max)"
        )
        for key, row in data["rows"].items():
            values = " ".join(f"{v:9.3f}" for v in row["median"])
            ratios = "  ".join(
                f"{r['median']:.3f} ({r['min']:.2f}-{r['max']:.2f})" for k, r in row.items() if k.startswith("tree")
            )
            print(f"{'':<6} {key:<52} {values}   {ratios}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", type=Path, help="source trees (each with src/lightning_gaudi_fsdp)")
    parser.add_argument("--only", choices=["steps", "checkpoint"], action="append")
    parser.add_argument("--engines", nargs="+", choices=run.ENGINES, default=list(run.ENGINES))
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the trees in turn")
    parser.add_argument("--steps", type=int, default=12, help="steps per steps run (the first 2 are warm-up)")
    parser.add_argument("--size", choices=["checkpoint", "units80"], default="checkpoint")
    parser.add_argument(
        "--formats", nargs="+", choices=["full", "sharded", "local"], default=["full", "sharded", "local"]
    )
    parser.add_argument("--inner-rounds", type=int, default=2, help="save/load rounds per checkpoint process")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; seconds, for CI")
    parser.add_argument("--out", type=Path, default=run.RESULTS / "compare-latest.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.steps, args.inner_rounds = min(args.rounds, 1), min(args.steps, 4), min(args.inner_rounds, 2)
    if len(args.trees) < 2:
        parser.error("give two source trees or more")
    for tree in args.trees:
        if not (tree / "src" / "lightning_gaudi_fsdp").is_dir():
            parser.error(f"trees: {str(tree)!r} has no src/lightning_gaudi_fsdp")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = compare(args)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".partial.json").unlink(missing_ok=True)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
