"""Peak memory of offline conversions, one process: anonymous memory (what the conversion itself allocates; pages
of memory-mapped checkpoint files are the kernel's page cache and are left out), sampled every few milliseconds."""

from __future__ import annotations

from pathlib import Path

from common import PeakSampler, load_config, write_json

from lightning_gaudi_fsdp.checkpoint.convert import convert, describe


def main() -> None:
    cfg = load_config()
    out = Path(cfg["out"])
    results = {}
    for src, dst, to in cfg["conversions"]:
        model_bytes = describe(src)["bytes"]
        with PeakSampler() as sampler:
            convert(src, dst, to)
        results[f"{Path(src).name}->{to}"] = {"model_bytes": model_bytes, "peak_added": sampler.peak - sampler.base}
    write_json(out, "memory.json", results)


if __name__ == "__main__":
    main()
