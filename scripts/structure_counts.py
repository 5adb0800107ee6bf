"""Structural counts of the package, compared with a recorded ceiling: a regression fails.

Each count is a habit the architecture moves away from (see ``docs/architecture.md``):

- ``kwargs_reads_outside_doors``: reads of ``door.kwargs`` or ``strategy.kwargs`` (Lightning's dict of FSDP
  arguments) in ``engine/`` or any other module but the two front ends (``strategy.py``, ``fabric.py``): options
  come from the resolved configuration, not from Lightning's copy.
- ``engine_module_imports_outside_engine``: imports of ``engine.fsdp1*`` / ``engine.fsdp2*`` outside ``engine/``: a
  caller asks the engine object, chosen once, rather than an engine's module.
- ``engine_property_branches_in_doors``: ``if``/``while``/conditional-expression tests that read an attribute of the
  engine without calling it (``self._engine.shards_in_place``, ``engine.version``) in the front ends: a front end
  calls an engine method where it would branch on what the engine is. Asking the engine a question about a model
  (``self._engine.owns(model)``) is a call, not counted.
- ``lightning_option_reads_outside_doors``: reads, outside the front ends, of the attributes where Lightning keeps its
  own copy of an option (``_state_dict_type``, ``_activation_checkpointing_kwargs``, ``_device_mesh``,
  ``_process_group_backend``, ``_timeout``, ``sharding_strategy``, ``cpu_offload``, ``mixed_precision``) on a
  strategy: the package reads its resolved options (``door._config``) instead. Not counted: Lightning's
  ``mixed_precision_config``, which is no copy of an option but FSDP1's ``MixedPrecision`` from the
  ``mixed_precision`` argument or, without one, from the precision plugin (``precision="bf16-mixed"``), which the
  Trainer or Fabric sets after the strategy is built.
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
LIGHTNING_OPTION_ATTRIBUTES = {
    "_state_dict_type",
    "_activation_checkpointing_kwargs",
    "_device_mesh",
    "_process_group_backend",
    "_timeout",
    "sharding_strategy",
    "cpu_offload",
    "mixed_precision",
}
MAX_LINES = 500
STRATEGY_NAMES = {"door", "strategy"}  # how modules name the strategy they are handed
DOOR_MIXINS = {"_platform.py"}  # modules whose classes are mixed into the doors: there ``self`` is a strategy too
ENGINE_NAMES = {"engine", "_engine"}  # how the engine object is named (``self._engine``, a local ``engine``)


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
            called = {id(sub.func) for sub in ast.walk(node.test) if isinstance(sub, ast.Call)}
            for sub in ast.walk(node.test):
                if isinstance(sub, ast.Attribute) and id(sub) not in called and _is_engine(sub.value):
                    lines.append(node.lineno)
                    break
    return lines


def _is_engine(node: ast.expr) -> bool:
    """``self._engine`` or a local ``engine``."""
    if isinstance(node, ast.Name):
        return node.id in ENGINE_NAMES
    return (
        isinstance(node, ast.Attribute)
        and node.attr in ENGINE_NAMES
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def _attribute_reads(tree: ast.Module, names: set[str], owners: set[str]) -> list[int]:
    """Lines reading ``<owner>.<name>`` where the owner is a strategy (``owners``: ``door``, ``strategy``...)."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in names
        and isinstance(node.ctx, ast.Load)
        and isinstance(node.value, ast.Name)
        and node.value.id in owners
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
            owners = STRATEGY_NAMES | ({"self"} if name in DOOR_MIXINS else set())
            found["kwargs_reads_outside_doors"] += [f"{name}:{n}" for n in _attribute_reads(tree, {"kwargs"}, owners)]
            found["lightning_option_reads_outside_doors"] += [
                f"{name}:{n}" for n in _attribute_reads(tree, LIGHTNING_OPTION_ATTRIBUTES, owners)
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
