"""``lightning-gaudi-fsdp`` (also ``python -m lightning_gaudi_fsdp``): inspect, convert, doctor.

Each command parses its arguments, calls library functions, prints, and returns an exit code: 0 on success, 1 when
``doctor`` finds a blocking problem, 2 for a bad path, format or argument, or a checkpoint refused as unsafe (one line
on stderr; also for a missing optional package such as ``safetensors`` for ``convert --to hf``), 3 when a
checkpoint's bytes do not match the checksums recorded when it was saved (``inspect``, ``inspect --verify``,
``convert``). ``inspect`` and ``convert`` unpickle checkpoints safely unless ``--trust-checkpoint`` is given.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def _progress(items: Iterable[T], description: str, total: int) -> Iterable[T]:
    from tqdm import tqdm

    return tqdm(items, desc=description, total=total, unit="step", file=sys.stderr, leave=False)


def _table(rows: Sequence[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def _trusting(args: argparse.Namespace, path: str) -> bool:
    """Whether to read ``path`` with ``weights_only=False``; says so on stderr when it does."""
    if args.trust_checkpoint:
        print(
            f"lightning-gaudi-fsdp {args.command}: --trust-checkpoint: reading {path} with weights_only=False; "
            "any code pickled in it runs",
            file=sys.stderr,
        )
    return bool(args.trust_checkpoint)


def _writers(info: dict[str, Any]) -> str:
    """The ``world size (writer)`` row: any for a full file (it loads at any size), the recorded number of ranks
    that wrote a sharded or local checkpoint, "unknown" where none was recorded."""
    if info["format"] == "full":
        return "any (full file)"
    return "unknown" if info["world_size"] is None else str(info["world_size"])


def _cmd_inspect(args: argparse.Namespace) -> int:
    from lightning_gaudi_fsdp.checkpoint import checksum, integrity
    from lightning_gaudi_fsdp.checkpoint.convert import describe
    from lightning_gaudi_fsdp.checkpoint.space import human_bytes

    integrity.format_of(args.path)  # a bad path says so before anything is read (a file listed but missing: named)
    verified = integrity.verify(args.path)  # the "not verified" line is the table's row
    checked = f"verified ({checksum.ALGORITHM})" if verified else "none recorded: not verified"
    if args.verify:
        print(_table([("path", str(args.path)), ("checksums", checked)]))
        return 0
    info = describe(args.path, weights_only=not _trusting(args, args.path))
    info["checksums"] = checked
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    rows = [
        ("path", info["path"]),
        ("format", info["format"]),
        ("layout", "Fabric (entries of the saved state)" if info["layout"] == "fabric" else "Trainer"),
        ("engine (writer)", info["engine"]),
        ("world size (writer)", _writers(info)),
        ("parameters", f"{info['parameters']:,}"),
        ("bytes", human_bytes(info["bytes"])),
        ("dtypes", ", ".join(f"{k} ({v:,})" for k, v in info["dtypes"].items()) or "-"),
        ("optimizer state", "yes" if info["optimizer"] else "no"),
        ("epoch / step", f"{info['epoch']} / {info['global_step']}"),
        ("lightning", str(info.get("lightning_version"))),
        ("checksums", checked),
    ]
    hf = info.get("hf_model")
    if hf is not None:  # what `convert --to hf` uses by default
        peft = hf.get("peft") or {}
        adapters = ", ".join(f"{name} (LoRA r={c.get('r')}, alpha={c.get('lora_alpha')})" for name, c in peft.items())
        rows += [
            ("hugging face model", f"under {hf.get('prefix')!r}" + (f"; PEFT adapters: {adapters}" if adapters else ""))
        ]
    if info["format"] == "local":
        rows += [("sharding strategy", str(info["sharding_strategy"]))]
        if info["fsdp_units"] is not None:
            rows += [("FSDP units", str(info["fsdp_units"]))]
        rows += [(f"version {k}", v) for k, v in info["versions"].items()]
    print(_table(rows))
    return 0


_HF_ONLY = ("prefix", "hf_config", "dtype", "max_shard_size", "peft")


def _cmd_convert(args: argparse.Namespace) -> int:
    if args.to == "hf":
        from lightning_gaudi_fsdp.checkpoint.hf_export import export_hf

        notes = export_hf(
            args.src,
            args.dst,
            prefix=args.prefix,
            hf_config=args.hf_config,
            dtype=args.dtype,
            max_shard_size="5GB" if args.max_shard_size is None else args.max_shard_size,
            peft=args.peft,
            weights_only=not _trusting(args, args.src),
        )
        what = {"adapter": "PEFT adapter", "merged": "merged Hugging Face model"}.get(args.peft, "Hugging Face model")
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        print(f"wrote {what} {args.dst}")
        return 0
    given = [f"--{name.replace('_', '-')}" for name in _HF_ONLY if getattr(args, name) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} only apply to --to hf, not --to {args.to}")
    from lightning_gaudi_fsdp.checkpoint.convert import convert

    notes = convert(args.src, args.dst, args.to, progress=_progress, weights_only=not _trusting(args, args.src))
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"wrote {args.to} checkpoint {args.dst}")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from lightning_gaudi_fsdp import _doctor

    checks = _doctor.run_checks(args.accelerator)
    print(_doctor.render(checks))
    return 0 if all(c.ok or not c.blocking for c in checks) else 1


def _add_trust_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="unpickle the checkpoint without restriction (weights_only=False): only for a source you trust, since "
        "a checkpoint can run code when loaded. Without it, files needing more than tensors and plain values are "
        "refused",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-gaudi-fsdp", description="Checkpoint tools and environment checks for Lightning FSDP on Gaudi."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="describe a full, sharded or local checkpoint")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print the description as JSON")
    p.add_argument(
        "--verify",
        action="store_true",
        help="only verify the checkpoint against the checksums recorded when it was saved (exit code 3 on damage)",
    )
    _add_trust_flag(p)
    p.set_defaults(func=_cmd_inspect)
    p = sub.add_parser("convert", help="convert a checkpoint offline (no process group, no device)")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--to", required=True, choices=["full", "sharded", "hf"])
    hf = p.add_argument_group("--to hf", "write a Hugging Face directory (safetensors, config) for from_pretrained")
    hf.add_argument("--prefix", help="removed from every key (default: where the model sat, recorded at save time)")
    hf.add_argument("--hf-config", help="model directory whose config.json, tokenizer and generation files are copied")
    hf.add_argument("--dtype", help="bf16, fp16 or fp32 for floating tensors (default: as saved)")
    hf.add_argument("--max-shard-size", help="largest safetensors file, e.g. 5GB (default), 500MB, 2GiB")
    hf.add_argument("--peft", help="for a PEFT model: adapter (adapter_model.safetensors) or merged (plain model)")
    _add_trust_flag(p)
    p.set_defaults(func=_cmd_convert)
    p = sub.add_parser("doctor", help="check this machine for FSDP on Gaudi (or a CPU rehearsal)")
    p.add_argument(
        "--accelerator",
        choices=["auto", "hpu", "cpu"],
        default="auto",
        help="what the run will use (auto: hpu when the Habana bridge is installed, else cpu)",
    )
    p.set_defaults(func=_cmd_doctor)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, OSError, ImportError) as err:  # CheckpointError is a ValueError, CheckpointSaveError an OSError
        print(f"lightning-gaudi-fsdp {args.command}: error: {err}", file=sys.stderr)
        return 3 if _damaged(err) else 2


def _damaged(error: BaseException) -> bool:
    """Whether ``error`` says a checkpoint's bytes are not those saved (its module is loaded if it was raised)."""
    integrity = sys.modules.get("lightning_gaudi_fsdp.checkpoint.integrity")
    return integrity is not None and isinstance(error, integrity.CheckpointIntegrityError)
