"""Peak memory of offline conversions, one process: anonymous memory (what the conversion itself allocates; pages
of memory-mapped checkpoint files are the kernel's page cache and are left out), sampled every few milliseconds."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from common import load_config, status_bytes, write_json

from lightning_gaudi_fsdp.checkpoint.convert import convert, describe
from lightning_gaudi_fsdp.checkpoint.hf_export import export_hf


class PeakSampler:
    def __init__(self) -> None:
        self.base = status_bytes("RssAnon")
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, status_bytes("RssAnon"))
            time.sleep(0.002)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, status_bytes("RssAnon"))


def main() -> None:
    cfg = load_config()
    out = Path(cfg["out"])
    results = {}
    for src, dst, to in cfg["conversions"]:
        model_bytes = describe(src)["bytes"]
        with PeakSampler() as sampler:
            convert(src, dst, to)
        results[f"{Path(src).name}->{to}"] = {"model_bytes": model_bytes, "peak_added": sampler.peak - sampler.base}
    for src, dst, kwargs in cfg.get("exports", []):  # export_hf streams: about one output file in memory
        model_bytes = describe(src)["bytes"]
        with PeakSampler() as sampler:
            export_hf(src, dst, **kwargs)
        largest = max(f.stat().st_size for f in Path(dst).glob("*.safetensors"))
        results[f"{Path(src).name}->hf"] = {
            "model_bytes": model_bytes,
            "largest_file": largest,
            "files": len(list(Path(dst).glob("*.safetensors"))),
            "peak_added": sampler.peak - sampler.base,
        }
    write_json(out, "memory.json", results)


if __name__ == "__main__":
    main()
