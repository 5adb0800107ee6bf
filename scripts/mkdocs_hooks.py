"""MkDocs hook: publish ``benchmarks/results`` (the JSON of each run and its chart) with the site, from where
``benchmarks/run.py`` writes them, so the benchmarks page links them without a copy under ``docs/``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results"


def on_files(files: Files, config: Any) -> Files:
    for path in sorted((ROOT / RESULTS).glob("*")):
        if path.suffix in (".json", ".png"):
            files.append(File(f"{RESULTS}/{path.name}", str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files
