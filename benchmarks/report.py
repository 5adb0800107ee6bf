"""Tables, the summary against the targets, and the chart, from the results ``run.py`` measured."""

from __future__ import annotations

import argparse
import json
import operator
from pathlib import Path
from typing import Any

ENGINES = ("fsdp1", "fsdp2")
FORMATS = ("full", "sharded", "local")
RESUME_FORMATS = ("sharded", "local", "full")
_COMPARE = {"<=": operator.le, ">=": operator.ge}


def _row(
    measurement: str, values: dict[str, Any], target: tuple[str, float] | None, unit: str = "", *, last: bool = False
) -> dict[str, Any]:
    """One summary line: each engine's value (a number, a list of numbers, or None where it has no such
    measurement) and whether it meets ``target`` (every number of a list must; with ``last``, the last one: a
    target set at the largest size, the smaller ones shown for the growth)."""
    met: dict[str, bool | None] = {}
    for engine in ENGINES:
        value = values.get(engine)
        if target is None or value is None:
            met[engine] = None
            continue
        numbers = (value[-1:] if last else value) if isinstance(value, list) else [value]
        met[engine] = all(_COMPARE[target[0]](v, target[1]) for v in numbers)
    return {
        "measurement": measurement,
        **{engine: values.get(engine) for engine in ENGINES},
        "unit": unit,
        "target": None if target is None else f"{target[0]} {target[1]}",
        "met": met,
    }


def summary(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    if "overhead" in results:
        o = results["overhead"]
        target = ("<=", o["target"])
        rows.append(_row("step time, Trainer / hand-written loop", {e: o[e]["ratio"] for e in ENGINES}, target))
        rows.append(_row("step time, Trainer FSDP2 / Trainer FSDP1", {"fsdp2": o["fsdp2_vs_fsdp1"]}, target))
        # CPU seconds per step (all ranks): not a target, a check that does not depend on how busy the machine was
        rows.append(
            _row("CPU time per step, Trainer / hand-written loop", {e: o[e]["cpu_ratio"] for e in ENGINES}, None)
        )
        rows.append(_row("CPU time per step, Trainer FSDP2 / Trainer FSDP1", {"fsdp2": o["fsdp2_vs_fsdp1_cpu"]}, None))
        rows.append(_row("bytes held, Trainer / hand-written loop", {e: o[e]["held_vs_raw"] for e in ENGINES}, None))
    if "memory" in results:
        m = results["memory"]
        sizes = sorted({int(key.rpartition("@")[2]) for key in m["rows"]["fsdp1"]})
        for sharding in ("FULL_SHARD", "SHARD_GRAD_OP"):
            values = {e: [m["rows"][e][f"{sharding}@{n}"]["ratio_to_limit"] for n in sizes] for e in ENGINES}
            name = f"{sharding} bytes per rank / (full / N + largest unit), N = {', '.join(map(str, sizes))}"
            rows.append(_row(name, values, ("<=", m["target"])))
    if "checkpoint" in results:
        c = results["checkpoint"]
        t = c["targets"]
        engines = [e for e in ENGINES if e in c]

        def per_engine(get: Any) -> dict[str, Any]:
            return {e: get(c[e]) for e in engines}

        rows += [
            _row(
                "full save / torch.save",
                per_engine(lambda r: r["full"]["save_vs_torch_save"]),
                ("<=", t["full_save_vs_torch_save"]),
            ),
            _row(
                "full save / torch.save without CRC32s",
                per_engine(lambda r: r["full"].get("save_vs_plain_torch_save")),
                ("<=", t["full_save_vs_plain_torch_save"]) if "full_save_vs_plain_torch_save" in t else None,
            ),
            _row(
                "full save inside fit / torch.save without CRC32s (paired per step)",
                per_engine(lambda r: r.get("in_fit", {}).get("save_vs_plain_torch_save")),
                ("<=", t["full_save_vs_plain_torch_save"]) if "full_save_vs_plain_torch_save" in t else None,
            ),
            _row(
                "rank 0 memory added by a full save / state bytes",
                per_engine(lambda r: r["full"]["peak_rss_vs_state"]),
                ("<=", t["full_peak_rss_vs_state"]),
            ),
        ]
        for fmt in ("sharded", "local", "full"):
            target = (">=", t["throughput_vs_disk"]) if fmt != "full" else None
            values = per_engine(lambda r, f=fmt: r[f]["throughput_vs_disk"])
            rows.append(_row(f"{fmt} save throughput / plain fsync'd writes", values, target))
        for fmt in ("sharded", "local", "full"):
            target = ("<=", t["async_blocked_vs_sync"])  # full: streamed in the background
            values = per_engine(lambda r, f=fmt: r[f]["async"]["blocked_vs_sync"])
            rows.append(_row(f"{fmt} save: blocked time, async / sync", values, target))
        if "checksums_save" in t and "checksums" in c[engines[0]]["full"]:
            for fmt in ("full", "sharded", "local"):  # full at 2 ranks and more: the streamed save
                checks = (
                    (f"{fmt} save, checksums / without", "save_ratio", ("<=", t["checksums_save"])),
                    (f"{fmt} async save, checksums / without", "async_save_ratio", ("<=", t["checksums_save"])),
                    (f"{fmt} async save blocked time, checksums / without", "async_blocked_ratio", None),
                    (f"{fmt} resume, verified / not", "load_ratio", ("<=", t["checksums_resume"])),
                )
                for name, key, target in checks:
                    rows.append(_row(name, per_engine(lambda r, f=fmt, k=key: r[f]["checksums"][k]), target))
        staging = per_engine(lambda r: max(r[f]["async"]["staging_bytes"] / r[f]["bytes"] for f in FORMATS))
        rows.append(_row("rank 0 host staging buffers of an async save / checkpoint bytes (largest)", staging, None))
        for fmt in ("full", "sharded", "local"):
            rows.append(_row(f"{fmt} load", per_engine(lambda r, f=fmt: r[f]["load_s"]), None, "s"))
        torch_load = per_engine(lambda r: r["torch_save"]["load_s"])
        rows.append(_row("torch.load of the same full state", torch_load, None, "s"))
        for key in c[engines[0]]["reshard_load_s"]:
            values = per_engine(lambda r, k=key: r["reshard_load_s"][k])
            rows.append(_row(f"sharded checkpoint loaded at world size {key}", values, None, "s"))
    if "pretrained" in results:
        p = results["pretrained"]
        engines = [e for e in ENGINES if e in p]
        for contender, label, target in (
            ("strategy", "with pretrained_weights", ("<=", p["target"])),
            ("from_pretrained", "from_pretrained on every rank", None),
        ):
            values = {e: p[e][contender]["peak_vs_model"] for e in engines}
            rows.append(_row(f"pretrained load, peak anonymous memory per rank / model, {label}", values, target))
            values = {e: p[e][contender]["resident_vs_model"] for e in engines}
            rows.append(_row(f"pretrained load, peak resident memory per rank / model, {label}", values, None))
    if "resume" in results:
        r = results["resume"]
        engines = [e for e in ENGINES if e in r]
        measured = r[engines[0]][str(r["layers"][0])]
        for fmt in (f for f in RESUME_FORMATS if f in measured):  # full: results from before it was measured lack it
            values = {e: [r[e][str(n)][fmt]["vs_torch_load"] for n in r["layers"]] for e in engines}
            layers = " and ".join(map(str, r["layers"]))
            baseline = "torch.load on rank 0 + scatter" if fmt == "full" else "torch.load of the rank's share"
            # issue 31 sets the target at the largest model (80 layers, a 70B Llama's layer count); the smaller one
            # shows the growth (its fixed costs of tens of milliseconds against a torch.load of as little)
            name = f"{fmt} resume: time added / {baseline}, {layers} layers (target at {r['layers'][-1]})"
            rows.append(_row(name, values, ("<=", r["targets"]["resume_vs_torch_load"]), last=True))
            values = {e: [r[e][str(n)][fmt].get("restore_extra_vs_share") for n in r["layers"]] for e in engines}
            values = {e: v if None not in v else None for e, v in values.items()}  # results from before it was measured
            name = f"{fmt} resume: memory only while restoring / the rank's share, {layers} layers"
            target = None if fmt == "full" else ("<=", r["targets"].get("restore_extra_vs_share", 0.25))
            rows.append(_row(name, values, target))
        for key in r[engines[0]]["reshard"]:
            values = {e: r[e]["reshard"][key]["vs_same_size"] for e in engines}
            name = f"sharded resume {key} ranks / same-size resume, {r['layers'][-1]} layers"
            rows.append(_row(name, values, ("<=", r["targets"]["reshard_vs_same_size"])))
    return rows


def _format(value: Any, unit: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return ", ".join(_format(v, unit) for v in value)
    return f"{value:.2f} s" if unit == "s" else f"{value:.3f}"


def _verdict(row: dict[str, Any]) -> str:
    verdicts = [f"{e.upper()} {'met' if row['met'][e] else 'MISSED'}" for e in ENGINES if row["met"][e] is not None]
    return "; ".join(verdicts)


def print_tables(results: dict[str, Any]) -> None:
    if "overhead" in results:
        o = results["overhead"]
        print("\n== step time (median step, slowest rank)")
        print(f"{'':34} {'FSDP1':>10} {'FSDP2':>10}")
        for kind, label in (("lightning_step_s", "Trainer + GaudiFSDPStrategy"), ("raw_step_s", "hand-written loop")):
            print(f"{label:34} {o['fsdp1'][kind] * 1e3:7.1f} ms {o['fsdp2'][kind] * 1e3:7.1f} ms")
        print(f"{'ratio Trainer / hand-written':34} {o['fsdp1']['ratio']:10.3f} {o['fsdp2']['ratio']:10.3f}")
        print("CPU seconds per step, all ranks together:")
        for kind, label in (("lightning_cpu_s", "Trainer + GaudiFSDPStrategy"), ("raw_cpu_s", "hand-written loop")):
            print(f"{label:34} {o['fsdp1'][kind] * 1e3:7.1f} ms {o['fsdp2'][kind] * 1e3:7.1f} ms")
        print(f"{'ratio Trainer / hand-written':34} {o['fsdp1']['cpu_ratio']:10.3f} {o['fsdp2']['cpu_ratio']:10.3f}")
    if "memory" in results:
        m = results["memory"]
        print("\n== memory per rank (bytes held: params + grads + AdamW state)")
        print(f"{'config':26} {'params':>12} {'grads':>12} {'optim':>12} {'total':>12} {'ratio to 1/N limit':>20}")
        for engine in ENGINES:
            for key, row in m["rows"][engine].items():
                ratio = f"{row['ratio_to_limit']:.3f}" if "ratio_to_limit" in row else "-"
                print(
                    f"{engine.upper() + ' ' + key:26} {row['params']:12,} {row['grads']:12,} {row['optim']:12,} "
                    f"{row['total']:12,} {ratio:>20}"
                )
    if "checkpoint" in results:
        c = results["checkpoint"]
        for engine in (e for e in ENGINES if e in c):
            r = c[engine]
            print(f"\n== {engine.upper()} checkpoints ({r['state_bytes'] / 2**30:.2f} GiB of weights + AdamW state)")
            print(
                f"{'format':12} {'save s':>9} {'load s':>9} {'MiB':>9} {'vs disk':>9} {'async blocked s':>16} "
                f"{'async total s':>14} {'staging MiB':>12}"
            )
            for fmt in FORMATS:
                row, background = r[fmt], r[fmt]["async"]
                print(
                    f"{fmt:12} {row['save_s']:9.2f} {row['load_s']:9.2f} {row['bytes'] / 2**20:9.1f} "
                    f"{row['throughput_vs_disk']:9.2f} {background['blocked_s']:16.2f} {background['save_s']:14.2f} "
                    f"{background['staging_bytes'] / 2**20:12.1f}"
                )
            for name, label in (("torch_save", "torch.save"), ("torch_save_plain", "  no CRC32")):
                base = r.get(name)
                if base is not None:
                    print(f"{label:12} {base['save_s']:9.2f} {base['load_s']:9.2f} {base['bytes'] / 2**20:9.1f}")
            disk = r["disk"]
            print(f"{'disk (fsync)':12} {disk['save_s']:9.2f} {'':>9} {disk['bytes'] / 2**20:9.1f} {1.0:9.2f}")
    if "pretrained" in results:
        p = results["pretrained"]
        print(
            f"\n== pretrained weights in ({p['model_bytes'] / 2**20:.1f} MiB fp32 model from a bf16 file, "
            f"{p['world_size']} ranks; peak host memory a rank adds while building and loading)"
        )
        print(
            f"{'engine / contender':26} {'shard MiB':>10} {'anon MiB':>10} {'anon/model':>11} {'resident MiB':>13} "
            f"{'res./model':>11} {'s':>7}"
        )
        for engine in (e for e in ENGINES if e in p):
            for contender in ("strategy", "from_pretrained"):
                row = p[engine][contender]
                print(
                    f"{engine.upper() + ' ' + contender:26} {row['shard_bytes'] / 2**20:10.1f} "
                    f"{row['peak_added'] / 2**20:10.1f} {row['peak_vs_model']:11.2f} "
                    f"{row['peak_resident_added'] / 2**20:13.1f} {row['resident_vs_model']:11.2f} {row['load_s']:7.2f}"
                )
    if "resume" in results:
        r = results["resume"]
        print(f"\n== resume ({r['world_size']} ranks; time fit(ckpt_path) adds before the first step, slowest rank)")
        print(
            f"{'engine / layers':18} {'share MiB':>10} {'torch.load s':>13} {'sharded s':>10} {'x':>7} "
            f"{'local s':>9} {'x':>7} {'load+scatter s':>15} {'full s':>8} {'x':>7} "
            f"{'restore mem x share (sharded, local, full)':>43}"
        )
        nothing = {"torch_load_s": float("nan"), "added_s": float("nan"), "vs_torch_load": float("nan")}
        for engine in (e for e in ENGINES if e in r):
            for n in r["layers"]:
                row = r[engine][str(n)]
                full = row.get("full", nothing)
                print(
                    f"{engine.upper() + ' ' + str(n):18} {row['share_bytes'] / 2**20:10.1f} "
                    f"{row['sharded']['torch_load_s']:13.2f} {row['sharded']['added_s']:10.2f} "
                    f"{row['sharded']['vs_torch_load']:7.2f} {row['local']['added_s']:9.2f} "
                    f"{row['local']['vs_torch_load']:7.2f} {full['torch_load_s']:15.2f} {full['added_s']:8.2f} "
                    f"{full['vs_torch_load']:7.2f} "
                    f"{_format([row.get(f, {}).get('restore_extra_vs_share') for f in RESUME_FORMATS], 'x'):>43}"
                )
            for key, row in r[engine]["reshard"].items():
                print(
                    f"{engine.upper() + ' ' + key:18} sharded resume {row['added_s']:.2f} s, "
                    f"{row['vs_same_size']:.2f} x same size"
                )
    rows = summary(results)
    if rows:
        width = max(len(row["measurement"]) for row in rows)
        print("\n== summary, FSDP1 vs FSDP2")
        print(f"{'measurement':{width}} {'FSDP1':>22} {'FSDP2':>22} {'target':>8}  verdict")
        for row in rows:
            print(
                f"{row['measurement']:{width}} {_format(row['fsdp1'], row['unit']):>22} "
                f"{_format(row['fsdp2'], row['unit']):>22} {row['target'] or '-':>8}  {_verdict(row)}"
            )


def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    widths = {"overhead": 1, "memory": 2, "checkpoint": 2, "resume": 1.5}
    panels = [name for name in widths if name in results]
    if not panels:
        return
    fig, axes_list = plt.subplots(
        1,
        len(panels),
        figsize=(4.5 * sum(widths[n] for n in panels) + 2, 4.8),
        squeeze=False,
        gridspec_kw={"width_ratios": [widths[n] for n in panels]},
    )
    axes = dict(zip(panels, axes_list[0], strict=True))
    colors = {"fsdp1": "tab:blue", "fsdp2": "tab:orange"}
    if "overhead" in results:
        o = results["overhead"]
        for i, kind in enumerate(("lightning_step_s", "raw_step_s")):
            for j, engine in enumerate(ENGINES):
                axes["overhead"].bar(
                    i + (j - 0.5) * 0.4,
                    o[engine][kind] * 1e3,
                    width=0.4,
                    color=colors[engine],
                    label=engine.upper() if i == 0 else None,
                )
        axes["overhead"].set_xticks([0, 1], ["Trainer", "hand-written"])
        axes["overhead"].set_ylabel("ms per step (median, slowest rank)")
        axes["overhead"].set_title("Step time")
        axes["overhead"].set_ylim(top=axes["overhead"].get_ylim()[1] * 1.25)  # room for the legend above the bars
        axes["overhead"].legend(loc="upper center", ncols=2)
    if "memory" in results:
        rows = results["memory"]["rows"]
        labels = list(rows["fsdp1"])
        for j, engine in enumerate(ENGINES):
            where = [i + (j - 0.5) * 0.4 for i, key in enumerate(labels) if key in rows[engine]]
            heights = [rows[engine][key]["total"] / 2**20 for key in labels if key in rows[engine]]
            axes["memory"].bar(where, heights, width=0.4, color=colors[engine], label=engine.upper())
        fsdp1 = list(rows["fsdp1"].values())
        limits = [(i, row["total"] / row["ratio_to_limit"]) for i, row in enumerate(fsdp1) if "ratio_to_limit" in row]
        axes["memory"].scatter(
            [i for i, _ in limits],
            [limit / 2**20 for _, limit in limits],
            marker="_",
            s=900,
            color="black",
            label="full / N + largest unit",
        )
        axes["memory"].set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=8)
        axes["memory"].set_ylabel("MiB held per rank")
        axes["memory"].set_title("Memory per rank (params + grads + AdamW); FSDP2 has no NO_SHARD")
        axes["memory"].set_ylim(top=axes["memory"].get_ylim()[1] * 1.25)
        axes["memory"].legend(loc="upper center", ncols=3, fontsize=8)
    if "checkpoint" in results:
        c = results["checkpoint"]
        # torch_save_plain: torch.save without zip CRC32s, as the package writes (in runs that measured it)
        names = ["full", "sharded", "local", "torch_save", "torch_save_plain", "disk"]
        names = [n for n in names if any(n in c[e] for e in ENGINES if e in c)]
        engines = [e for e in ENGINES if e in c]
        width = 0.8 / (2 * len(engines))
        for j, engine in enumerate(engines):
            for k, (what, hatch) in enumerate((("save_s", ""), ("load_s", "//"))):
                offset = (2 * j + k - len(engines) + 0.5) * width
                present = [i for i, n in enumerate(names) if what in c[engine][n]]
                axes["checkpoint"].bar(
                    [i + offset for i in present],
                    [c[engine][names[i]][what] for i in present],
                    width=width,
                    color=colors[engine],
                    hatch=hatch,
                    edgecolor="white",
                    label=f"{engine.upper()} {what[:4]}",
                )
        axes["checkpoint"].set_xticks(range(len(names)), names)
        axes["checkpoint"].set_ylabel("seconds")
        axes["checkpoint"].set_title("Checkpoint save / load, medians (baselines measured in each engine's run)")
        axes["checkpoint"].legend(fontsize=8)
    if "resume" in results:
        _resume_panel(axes["resume"], results["resume"], colors)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _resume_panel(ax: Any, resume: dict[str, Any], colors: dict[str, str]) -> None:
    """Seconds a resume adds before the first step, per format and engine, at the largest layer count, beside its
    baseline (``torch.load`` of the rank's share; for ``full``, ``torch.load`` on rank 0 plus a scatter)."""
    layers = str(max(int(n) for n in resume["layers"]))
    formats = list(RESUME_FORMATS)
    engines = [e for e in ENGINES if e in resume and layers in resume[e]]
    width = 0.8 / (2 * max(len(engines), 1))
    for j, engine in enumerate(engines):
        rows = resume[engine][layers]
        for k, (what, hatch, label) in enumerate((("added_s", "", "resume"), ("torch_load_s", "//", "baseline"))):
            offset = (2 * j + k - len(engines) + 0.5) * width
            present = [i for i, f in enumerate(formats) if what in rows.get(f, {})]
            ax.bar(
                [i + offset for i in present],
                [rows[formats[i]][what] for i in present],
                width=width,
                color=colors[engine],
                hatch=hatch,
                edgecolor="white",
                label=f"{engine.upper()} {label}",
            )
    ax.set_xticks(range(len(formats)), formats)
    ax.set_ylabel("seconds")
    ax.set_title(f"Resume at {layers} layers vs torch.load (full: + scatter)")
    ax.legend(fontsize=8)


def merge_results(paths: list[Path]) -> dict[str, Any]:
    """The sections of several result files of ``run.py``, later files first: the chart of runs made with ``--only``.
    A file holding one section's results alone (``overhead-quiet.json``) counts as the ``overhead`` section."""
    merged: dict[str, Any] = {}
    for path in paths:
        data = json.loads(path.read_text())
        merged.update(
            {"overhead": data} if "schema" not in data and "lightning_step_s" in data.get("fsdp1", {}) else data
        )
    return merged


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Draw the chart of saved benchmark results (run.py draws latest.png).")
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("results", type=Path, nargs="+", help="JSON files written by run.py; later ones win")
    parser.add_argument("--sections", nargs="+", help="draw only these (overhead, memory, checkpoint, resume)")
    args = parser.parse_args(argv)
    results = merge_results(args.results)
    chart({k: v for k, v in results.items() if args.sections is None or k in args.sections}, args.out)


if __name__ == "__main__":
    main()
