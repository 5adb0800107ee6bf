"""Write a checkpoint (full, sharded or local, either engine) as a Hugging Face model or PEFT adapter directory.

:func:`export_hf` streams: it reads the tensors of one output file, writes that file and lets them go, so its
memory stays near one output file (``max_shard_size``), not the model. Output, as ``save_pretrained`` writes it:

- a model: ``model.safetensors``, or ``model-00001-of-0000N.safetensors`` files and ``model.safetensors.index.json``
  when it is larger than ``max_shard_size``; each file has the ``{"format": "pt"}`` header. The non-weight files of
  ``hf_config`` (``config.json``, ``generation_config.json``, tokenizer files...) are copied beside them.
- ``peft="adapter"``: ``adapter_model.safetensors`` and ``adapter_config.json`` (what ``PeftModel.save_pretrained``
  writes; one file, whatever the size). ``peft="merged"``: the base model with each LoRA adapter merged into its
  weight (``W + B @ A * scaling``, as PEFT's ``merge_and_unload``), as a plain model.

Names: the strategy records, in every checkpoint it writes, where the Hugging Face (or PEFT) model sits in the
LightningModule (``self.model`` -> ``"model."``) and, for a PEFT model, its adapter configurations (``LoraConfig``).
Without ``prefix`` that recorded prefix is removed from every key; ``prefix`` overrides it. For a PEFT model the
``base_model.model.`` wrapper and PEFT's ``base_layer`` segments are removed too.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch.nn import Module

from lightning_gaudi_fsdp.adapters.fsdp1_internals import clean_name
from lightning_gaudi_fsdp.checkpoint import commit, integrity, location, storage
from lightning_gaudi_fsdp.checkpoint.files import locate
from lightning_gaudi_fsdp.checkpoint.formats import HF_KEY
from lightning_gaudi_fsdp.checkpoint.hf_names import MODEL_INDEX, base_key, is_adapter_key
from lightning_gaudi_fsdp.checkpoint.tensor_source import TensorSource, open_source

PEFT_WRAPPER = "base_model.model."
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5")
_UNITS = {"GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}


# ------------------------------------------------------------------------------------------- at save time
def hf_model_record(model: Module) -> str | None:
    """Where the outermost Hugging Face model (``PreTrainedModel`` or ``PeftModel``) sits in ``model``, and the PEFT
    adapter configurations when it is a PEFT model, as a JSON string (safe to unpickle); None when there is none."""
    for name, module in model.named_modules():
        if not (hasattr(module, "save_pretrained") and hasattr(module, "config")):
            continue
        prefix = f"{clean_name(name)}." if clean_name(name) else ""
        configs = getattr(module, "peft_config", None)
        peft = {k: c.to_dict() for k, c in configs.items()} if isinstance(configs, dict) else None
        return json.dumps({"prefix": prefix, "peft": peft}, default=_jsonable, sort_keys=True)
    return None


def _jsonable(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        return sorted(value)
    return getattr(value, "value", str(value))


# --------------------------------------------------------------------------------------------- arguments
def resolve_dtype(value: str | None) -> torch.dtype | None:
    if value is None:
        return None
    if value not in DTYPES:
        raise ValueError(f"dtype={value!r} is not supported; expected one of {', '.join(map(repr, DTYPES))}")
    return DTYPES[value]


def resolve_shard_size(value: int | str) -> int:
    """Bytes from an int or a size such as ``"5GB"`` (10**9), ``"5GiB"`` (2**30), ``"500MB"``, ``"100KB"``."""
    text = str(value).strip().upper()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(GIB|MIB|KIB|GB|MB|KB|B)?", text)
    size = int(float(match[1]) * _UNITS[match[2] or "B"]) if match else 0
    if isinstance(value, bool) or size <= 0:
        raise ValueError(
            f"max_shard_size={value!r} is not a positive size; expected bytes as an integer or a number with a unit "
            "(KB, MB, GB, KiB, MiB, GiB), e.g. '5GB'"
        )
    return size


# ------------------------------------------------------------------------------------------------ planning
@dataclass
class _Out:
    """One output tensor: its name, the source tensors it is made of, and how."""

    name: str
    sources: list[str]
    nbytes: int
    make: Callable[[dict[str, torch.Tensor]], torch.Tensor]


def _adapter_config(src: TensorSource, record: dict[str, Any], hf_config: Path | None) -> tuple[str, dict[str, Any]]:
    configs = record.get("peft")
    if not configs and hf_config is not None and (hf_config / "adapter_config.json").is_file():
        configs = {"default": json.loads((hf_config / "adapter_config.json").read_text())}
    if not configs:
        raise ValueError(
            f"{src.path} records no PEFT adapter configuration (it was not saved by this strategy from a PeftModel); "
            "pass hf_config (--hf-config) a directory with the adapter_config.json of the training run"
        )
    if len(configs) != 1:
        raise ValueError(f"{src.path} holds adapters {sorted(configs)}; exporting supports exactly one adapter")
    name, config = next(iter(configs.items()))
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"peft_type={config.get('peft_type')!r} is not supported; only 'LORA' adapters export")
    return name, config


def _scaling(config: dict[str, Any], module: str, rank: int) -> float:
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():  # PEFT's per-module overrides
        if re.match(rf"(.*\.)?({pattern})$", module):
            alpha = value
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _plan(
    src: TensorSource,
    prefix: str,
    peft: Literal["adapter", "merged"] | None,
    dtype: torch.dtype | None,
    record: dict[str, Any],
    hf_config: Path | None,
) -> tuple[list[_Out], dict[str, Any] | None]:
    names = {}  # output-side name (prefix and PEFT wrapper removed) -> checkpoint key
    for key in src.entries:
        if key.startswith(prefix):
            name = key[len(prefix) :]
            names[name.removeprefix(PEFT_WRAPPER) if peft else name] = key
    if not names:
        raise ValueError(f"prefix={prefix!r} matches no key of {src.path} (first keys: {list(src.entries)[:3]})")
    adapters = [n for n in names if is_adapter_key(n)]
    if peft is None and adapters:
        raise ValueError(
            f"{src.path} holds LoRA adapter weights (e.g. {adapters[0]!r}); pass peft='adapter' (--peft adapter) "
            "for the adapters alone or peft='merged' (--peft merged) for the base with the adapters merged"
        )
    if peft is not None and not adapters:
        raise ValueError(f"peft={peft!r} needs a checkpoint of a PEFT model; {src.path} holds no LoRA adapter weights")

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    def nbytes(key: str) -> int:
        shape, source_dtype = src.entries[key]
        target = dtype if dtype is not None and source_dtype.is_floating_point else source_dtype
        return math.prod(shape) * target.itemsize

    if peft is None:
        return [_Out(n, [k], nbytes(k), lambda ts, k=k: cast(ts[k])) for n, k in names.items()], None
    adapter, config = _adapter_config(src, record, hf_config)
    if peft == "adapter":
        outs = [
            _Out(PEFT_WRAPPER + n.replace(f".{adapter}", ""), [k], nbytes(k), lambda ts, k=k: cast(ts[k]))
            for n, k in names.items()
            if is_adapter_key(n)
        ]
        return outs, config
    if config.get("lora_bias"):
        raise ValueError(
            "merging adapters trained with lora_bias=True is not supported; export them with peft='adapter'"
        )
    outs = []
    for n, k in names.items():
        if is_adapter_key(n):
            if "lora_magnitude_vector" in n.split("."):
                raise ValueError(f"{n!r}: merging DoRA adapters (lora_magnitude_vector) is not supported")
            continue
        layer, _, leaf = n.partition(".base_layer.")
        a_b = [f"{layer}.lora_A.{adapter}.weight", f"{layer}.lora_B.{adapter}.weight"]
        embedding = [f"{layer}.lora_embedding_A.{adapter}", f"{layer}.lora_embedding_B.{adapter}"]
        pair = a_b if a_b[0] in names else embedding if embedding[0] in names else None
        if not leaf or leaf != "weight" or pair is None:
            outs.append(_Out(base_key(n), [k], nbytes(k), lambda ts, k=k: cast(ts[k])))
            continue
        keys = [k, names[pair[0]], names[pair[1]]]
        scale = _scaling(config, layer, src.entries[keys[1]][0][0])
        transpose = pair is embedding or bool(config.get("fan_in_fan_out"))  # PEFT's orientation of B @ A
        merge = functools.partial(_merge, keys=keys, scaling=scale, transpose=transpose)
        outs.append(_Out(base_key(n), keys, nbytes(k), lambda ts, merge=merge: cast(merge(ts))))
    return outs, None


def _merge(tensors: dict[str, torch.Tensor], keys: list[str], scaling: float, transpose: bool) -> torch.Tensor:
    """``W + B @ A * scaling`` as PEFT merges it: the delta in float32 for half-precision weights, added in W's
    dtype."""
    weight, a, b = (tensors[k] for k in keys)
    if weight.dtype in (torch.float16, torch.bfloat16):
        a, b = a.float(), b.float()
    delta = b @ a
    delta = (delta.T if transpose else delta) * scaling
    return weight + delta.to(weight.dtype)


def _files(outs: list[_Out], max_bytes: int, stem: str) -> list[tuple[str, list[_Out]]]:
    """Group outputs in order like ``save_pretrained``: a tensor larger than the limit gets a file of its own."""
    groups: list[list[_Out]] = []
    current: list[_Out] = []
    size = 0
    for out in outs:
        if out.nbytes > max_bytes:
            groups.append([out])
            continue
        if current and size + out.nbytes > max_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(out)
        size += out.nbytes
    if current:
        groups.append(current)
    if len(groups) == 1:
        return [(f"{stem}.safetensors", groups[0])]
    n = len(groups)
    return [(f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]


# ------------------------------------------------------------------------------------------------- export
def export_hf(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    prefix: str | None = None,
    hf_config: str | os.PathLike[str] | None = None,
    dtype: str | None = None,
    max_shard_size: int | str = "5GB",
    peft: Literal["adapter", "merged"] | None = None,
    weights_only: bool = True,
    check_free_space: bool | None = None,
) -> list[str]:
    """Write checkpoint ``src`` as a Hugging Face directory ``dst`` (see the module docstring); returns notes.

    ``dtype``: ``"bf16"``, ``"fp16"`` or ``"fp32"`` for floating tensors (default: as saved). ``max_shard_size``:
    bytes or a size such as ``"5GB"``. ``hf_config``: a model directory whose ``config.json`` (required for a model
    export) and tokenizer and generation files are copied. ``dst`` appears only once complete; nothing is overwritten.
    ``src`` is unpickled with ``weights_only`` (see :mod:`.trust`)."""
    try:
        import safetensors  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "exporting to Hugging Face safetensors needs the safetensors package: pip install safetensors "
            "(or the package's examples extra)"
        ) from err
    src, dst = locate(src, "src"), location.local_path(dst, "dst", urls=False)  # the source may be at a URL
    config_dir = location.local_path(hf_config, "hf_config", urls=False) if hf_config is not None else None
    target_dtype = resolve_dtype(dtype)
    max_bytes = resolve_shard_size(max_shard_size)
    if peft not in (None, "adapter", "merged"):
        raise ValueError(f"peft={peft!r} is not supported; expected one of 'adapter', 'merged' (or none)")
    if config_dir is not None and not config_dir.is_dir():
        raise ValueError(f"hf_config={str(config_dir)!r} is not a directory")
    if config_dir is not None and peft != "adapter" and not (config_dir / "config.json").is_file():
        raise ValueError(f"hf_config={str(config_dir)!r} has no config.json")
    if dst.exists():
        raise FileExistsError(f"{dst} already exists; choose a new destination (nothing is overwritten)")
    verified: list[str] = []
    integrity.verify_offline(src, verified)  # before anything is read: damage raises CheckpointIntegrityError
    source = open_source(src, weights_only=weights_only)
    record = json.loads(source.rest.get(HF_KEY) or "{}")
    if prefix is None:
        prefix = record.get("prefix", "")
    outs, adapter_config = _plan(source, prefix, peft, target_dtype, record, config_dir)
    notes = verified
    if peft == "adapter":
        files = [("adapter_model.safetensors", outs)]
    else:
        files = _files(outs, max_bytes, "model")
        if config_dir is None:
            notes.append("no hf_config (--hf-config) given: no config.json written; from_pretrained needs one")
    staging = commit.staging_path(dst)

    def write() -> None:
        _write_files(source, files, staging)
        if adapter_config is not None:
            (staging / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2, sort_keys=True))
        if config_dir is not None and peft != "adapter":
            _copy_config(config_dir, staging, target_dtype)

    storage.write_atomically(
        dst, [write], directory=True, needed=lambda: sum(o.nbytes for o in outs), check_free_space=check_free_space
    )
    return notes


def _write_files(source: TensorSource, files: list[tuple[str, list[_Out]]], staging: Path) -> None:
    from safetensors.torch import save_file

    for file_name, group in files:
        wanted = dict.fromkeys(k for out in group for k in out.sources)
        inputs = source.read(wanted)
        tensors, storages = {}, set()
        for out in group:
            tensor = _owned(out.make(inputs))
            if tensor.untyped_storage().data_ptr() in storages:  # tied weights saved as one storage
                tensor = tensor.clone()
            storages.add(tensor.untyped_storage().data_ptr())
            tensors[out.name] = tensor
        del inputs
        save_file(tensors, str(staging / file_name), metadata={"format": "pt"})
        del tensors
    if len(files) > 1:
        index = {
            "metadata": {"total_size": sum(o.nbytes for _, g in files for o in g)},
            "weight_map": dict(sorted((o.name, name) for name, g in files for o in g)),
        }
        (staging / MODEL_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _owned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor with storage of its own (safetensors refuses tensors that share memory)."""
    t = t.detach().contiguous()
    if t.storage_offset() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def _copy_config(config_dir: Path, staging: Path, dtype: torch.dtype | None) -> None:
    """Every file of ``config_dir`` except weights (config, generation config, tokenizer...); with ``dtype``, the
    config's dtype entry says what the files now hold."""
    for item in sorted(config_dir.iterdir()):
        if not item.is_file() or item.name.endswith(WEIGHT_SUFFIXES) or item.name.endswith(".index.json"):
            continue
        if item.name.startswith("adapter_"):
            continue
        shutil.copy2(item, staging / item.name)
    config_file = staging / "config.json"
    if dtype is not None and config_file.is_file():
        config = json.loads(config_file.read_text())
        keys = [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]
        for key in keys:
            config[key] = str(dtype).removeprefix("torch.")
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
