"""The documentation is tested: the site builds with ``mkdocs build --strict`` (no broken links or anchors), every
Python snippet of the README and of ``docs/`` runs in this process (CPU, small sizes) or, marked compile-only with
its reason, compiles, and every YAML snippet is a config the LLaMA example's LightningCLI accepts (``--print_config``).

Snippets are found by Sybil's Markdown parsers (``sybil.parsers.markdown``); the snippets of one page share one
namespace, in page order, and ``<!-- invisible-code-block: python -->`` comments hold setup a reader need not see.
A snippet is marked by the HTML comment on the line before its fence:

- ``<!-- docs-test: compile-only (why) -->``: a Python snippet that needs Gaudi, several processes or files that are
  not here; it is compiled, not run (``tests/test_examples.py`` runs the examples themselves).
- ``<!-- docs-test: yaml-only (why) -->``: YAML that is not a LightningCLI config (a Kubernetes manifest); it is
  parsed as YAML only.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

sybil = pytest.importorskip("sybil", reason="the docs extra is not installed (pip install -e '.[docs]')")
from sybil.parsers.markdown import CodeBlockParser  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REHEARSAL = ROOT / "examples" / "configs" / "llama_cpu_rehearsal.yaml"
MARKER = re.compile(r"<!-- docs-test: (compile-only|yaml-only) \((.+)\) -->\s*$")


def _marker(example: Any) -> str | None:
    before = example.document.text[: example.region.start].rstrip("\n").rsplit("\n", 1)[-1]
    match = MARKER.search(before)
    return match.group(1) if match else None


def _where(example: Any) -> str:
    return f"{Path(example.path).relative_to(ROOT)}:{example.line}"


def _evaluate_python(example: Any) -> None:
    code = compile(example.parsed, _where(example), "exec")
    if _marker(example) != "compile-only":
        exec(code, example.namespace)  # noqa: S102  (the project's own documentation)


def _merge(base: dict, snippet: dict) -> dict:
    """``snippet`` over ``base``; a snippet's strategy replaces the base's whole (its init_args are complete)."""
    merged = copy.deepcopy(base)
    for key, value in snippet.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and key != "strategy":
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


_EXAMPLE: dict[str, Any] = {}


def _llama_example() -> Any:
    if "module" not in _EXAMPLE:
        spec = importlib.util.spec_from_file_location("llama_fsdp_docs", ROOT / "examples" / "llama_fsdp.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _EXAMPLE["module"] = module
    return _EXAMPLE["module"]


def _evaluate_yaml(example: Any, tmp_dir: Path) -> None:
    snippet = yaml.safe_load(example.parsed)
    if _marker(example) == "yaml-only":
        return
    assert isinstance(snippet, dict), f"{_where(example)}: not a LightningCLI config: {snippet!r}"
    config = tmp_dir / f"snippet-{example.line}.yaml"
    config.write_text(yaml.safe_dump(_merge(yaml.safe_load(REHEARSAL.read_text()), snippet)))
    out, err, argv = io.StringIO(), io.StringIO(), sys.argv
    sys.argv = [str(ROOT / "examples" / "llama_fsdp.py")]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
            _llama_example().main(["fit", "--config", str(config), "--print_config"])
    finally:
        sys.argv = argv
    assert exited.value.code in (0, None), f"{_where(example)}: LightningCLI refused it:\n{err.getvalue()[-2000:]}"
    printed = yaml.safe_load(out.getvalue())
    if "strategy" in snippet.get("trainer", {}):
        strategy, shown = snippet["trainer"]["strategy"], printed["trainer"]["strategy"]
        if isinstance(strategy, dict):  # a registered name (`strategy: gaudi_fsdp`) is printed as given
            strategy, shown = strategy["class_path"], shown["class_path"]
        assert shown == strategy, _where(example)


def _parsers(tmp_dir: Path) -> list[Any]:
    return [
        CodeBlockParser(language="python", evaluator=_evaluate_python),
        CodeBlockParser(language="yaml", evaluator=lambda example: _evaluate_yaml(example, tmp_dir)),
    ]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_snippets_run_or_compile_and_configs_parse(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # whatever a snippet writes lands here
    environ = dict(os.environ)  # a Trainer built by a snippet marks this process as a launcher; undone after
    try:
        for example in sybil.Sybil(_parsers(tmp_path)).parse(page):
            example.evaluate()
    finally:
        os.environ.clear()
        os.environ.update(environ)


def test_code_fences_name_a_known_language():
    """Python and YAML blocks are tested; any other fence names a language that is not Python or a config."""
    allowed = {"python", "yaml", "bash", "text", "console", "toml"}
    for page in PAGES:
        for match in re.finditer(r"^ *```(\S*)", page.read_text(), re.MULTILINE):
            language = match.group(1)
            assert language == "" or language in allowed, f"{page.name}: fence language {language!r}"


def test_readme_links_point_at_files_that_exist():
    """The README is read on GitHub and PyPI, outside the site: its relative links are checked here."""
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert links, "no links found"
    assert missing == []


@pytest.mark.skipif(shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None, reason="no mkdocs")
def test_site_builds_strict(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "site" / "benchmarks" / "results" / "latest.png").is_file()
