"""Structural counts of the package, compared with a recorded ceiling: a regression fails.

Each count is a habit the architecture moves away from (see ``docs/architecture.md``):

- ``kwargs_reads_outside_doors``: reads of ``door.kwargs`` or ``strategy.kwargs`` (Lightning's dict of FSDP
  arguments) in ``engine/`` or any other module but the two front ends (``strategy.py``, ``fabric.py``): options
  come from the resolved configuration, not from Lightning's copy.
- ``engine_module_imports_outside_engine``: imports of ``engine.fsdp1*`` / ``engine.fsdp2*`` outside ``engine/``: a
  caller asks the engine object, chosen once, rather than an engine's module.
- ``engine_property_branches_in_doors``: ``if`` tests on ``self._engine.<attribute>`` in the front ends: a front end
  calls an engine method where it would branch on what the engine is.
- ``lightning_option_reads_outside_doors``: reads of Lightning's private option attributes (``_state_dict_type``,
  ``_activation_checkpointing_kwargs``, ``_device_mesh``) outside the front ends.
- ``modules_over_500_lines``: modules longer than 500 lines.

Run ``python scripts/structure_counts.py`` (prints each count with where it occurs, exit code 1 when a count is above
its ceiling in ``scripts/structure_ceilings.json``). After a change that lowers a count, lower its ceiling with
``--update``; raising one needs a reason in the commit message.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "lightning_gaudi_fsdp"
CEILINGS = Path(__file__).with_name("structure_ceilings.json")
DOORS = {"strategy.py", "fabric.py"}
LIGHTNING_OPTION_ATTRIBUTES = {"_state_dict_type", "_activation_checkpointing_kwargs", "_device_mesh"}
MAX_LINES = 500
STRATEGY_NAMES = {"door", "strategy", "self"}  # how modules name the strategy they are handed


def _relative(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _is_engine_module(name: str) -> bool:
    parts = name.split(".")
    if "engine" not in parts:
        return False
    return any(part.startswith(("fsdp1", "fsdp2")) for part in parts[parts.index("engine") + 1 :])


def _engine_imports(tree: ast.Module) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            lines += [node.lineno for alias in node.names if _is_engine_module(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if _is_engine_module(module) or (
                module.split(".")[-1] == "engine" and any(a.name.startswith(("fsdp1", "fsdp2")) for a in node.names)
            ):
                lines.append(node.lineno)
    return lines


def _engine_branches(tree: ast.Module) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If | ast.IfExp | ast.While):
            for sub in ast.walk(node.test):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Attribute)
                    and sub.value.attr == "_engine"
                    and isinstance(sub.value.value, ast.Name)
                    and sub.value.value.id == "self"
                ):
                    lines.append(node.lineno)
                    break
    return lines


def _attribute_reads(tree: ast.Module, names: set[str]) -> list[int]:
    """Lines reading ``<owner>.<name>`` where the owner is a strategy (``door``, ``strategy``, ``self``)."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in names
        and isinstance(node.ctx, ast.Load)
        and isinstance(node.value, ast.Name)
        and node.value.id in STRATEGY_NAMES
    ]


def counts() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {
        "kwargs_reads_outside_doors": [],
        "engine_module_imports_outside_engine": [],
        "engine_property_branches_in_doors": [],
        "lightning_option_reads_outside_doors": [],
        "modules_over_500_lines": [],
    }
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _relative(path)
        text = path.read_text()
        tree = ast.parse(text, str(path))
        in_door = name in DOORS
        in_engine = name.startswith("engine/")
        if not in_door:
            found["kwargs_reads_outside_doors"] += [f"{name}:{n}" for n in _attribute_reads(tree, {"kwargs"})]
            found["lightning_option_reads_outside_doors"] += [
                f"{name}:{n}" for n in _attribute_reads(tree, LIGHTNING_OPTION_ATTRIBUTES)
            ]
        else:
            found["engine_property_branches_in_doors"] += [f"{name}:{n}" for n in _engine_branches(tree)]
        if not in_engine:
            found["engine_module_imports_outside_engine"] += [f"{name}:{n}" for n in _engine_imports(tree)]
        lines = text.count("\n")
        if lines > MAX_LINES:
            found["modules_over_500_lines"].append(f"{name} ({lines} lines)")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="lower the recorded ceilings to today's counts")
    args = parser.parse_args(argv)
    found = counts()
    ceilings: dict[str, int] = json.loads(CEILINGS.read_text()) if CEILINGS.exists() else {}
    failed = False
    for key, places in found.items():
        ceiling = ceilings.get(key)
        verdict = "" if ceiling is None else f" (ceiling {ceiling})"
        if ceiling is not None and len(places) > ceiling:
            verdict += "  REGRESSION"
            failed = True
        print(f"{key}: {len(places)}{verdict}")
        for place in places:
            print(f"    {place}")
    if args.update:
        CEILINGS.write_text(
            json.dumps({k: min(len(v), ceilings.get(k, len(v))) for k, v in found.items()}, indent=2) + "\n"
        )
        print(f"ceilings written to {CEILINGS.relative_to(ROOT)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
