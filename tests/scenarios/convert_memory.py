"""Peak memory of offline conversions, one process: anonymous memory (what the conversion itself allocates; pages
of memory-mapped checkpoint files are the kernel's page cache and are left out), sampled every few milliseconds."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path

from common import PeakSampler, load_config, write_json

from lightning_gaudi_fsdp.checkpoint.convert import convert, describe
from lightning_gaudi_fsdp.checkpoint.hf_export import export_hf


def measure_export(src: str, dst: str, kwargs: dict) -> dict:
    model_bytes = describe(src)["bytes"]
    with PeakSampler() as sampler:
        export_hf(src, dst, **kwargs)
    files = list(Path(dst).glob("*.safetensors"))
    return {
        "model_bytes": model_bytes,
        "largest_file": max(f.stat().st_size for f in files),
        "files": len(files),
        "peak_added": sampler.peak - sampler.base,
    }


def in_fresh_process(measure: Callable[[], dict], out: Path) -> dict:
    """Run ``measure`` in a child forked from this process before it allocated anything: memory an earlier
    measurement freed stays resident in this process's heap and would hide what a later one allocates."""
    result = out / ".measured.json"
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            result.write_text(json.dumps(measure()))
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError("the measuring child process failed")
    return json.loads(result.read_text())


def main() -> None:
    cfg = load_config()
    out = Path(cfg["out"])
    results = {}
    for src, dst, to in cfg.get("conversions", []):
        model_bytes = describe(src)["bytes"]
        with PeakSampler() as sampler:
            convert(src, dst, to)
        results[f"{Path(src).name}->{to}"] = {"model_bytes": model_bytes, "peak_added": sampler.peak - sampler.base}
    for src, dst, kwargs in cfg.get("exports", []):  # export_hf streams: about one output file in memory
        results[f"{Path(src).name}->hf"] = in_fresh_process(functools.partial(measure_export, src, dst, kwargs), out)
    write_json(out, "memory.json", results)


if __name__ == "__main__":
    main()
