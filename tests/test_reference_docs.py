"""The argument reference (docs/reference-arguments.md) agrees with the code: each strategy class's table lists exactly
its constructor's arguments, and each default in the table is the one its signature gives (read with
``inspect.signature``). A default changed in the code, or an argument added without its row, fails here."""

from __future__ import annotations

import inspect
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from lightning_gaudi_fsdp import fabric, strategy

PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference-arguments.md"


def _table(heading: str) -> dict[str, list[str]]:
    """The rows of the first table after ``heading``: argument name -> its cells (type, default, YAML, what)."""
    text = PAGE.read_text()
    start = text.index(heading)
    rows: dict[str, list[str]] = {}
    for line in text[start:].splitlines()[1:]:
        if line.startswith("## "):
            break
        match = re.match(r"\| `(\w+)` \|(.*)\|\s*$", line)
        if match:
            assert match.group(1) not in rows, f"{heading}: {match.group(1)} listed twice"
            rows[match.group(1)] = [cell.strip() for cell in match.group(2).split("|")]
    assert rows, f"no table under {heading!r}"
    return rows


def _documented_default(cell: str) -> Any:
    assert re.fullmatch(r"`[^`]+`", cell), f"a default is written as code: {cell!r}"
    return eval(cell.strip("`"), {"__builtins__": {}, "timedelta": timedelta})  # noqa: S307  (the project's docs)


def _named_parameters(cls: type) -> dict[str, Any]:
    parameters = inspect.signature(cls.__init__).parameters.values()
    return {p.name: p.default for p in parameters if p.name != "self" and p.kind is not p.VAR_KEYWORD}


DOORS = {
    "trainer": (
        "## Trainer: `lightning_gaudi_fsdp.GaudiFSDPStrategy`",
        lambda: _named_parameters(strategy.GaudiFSDPStrategy),
    ),
    "fabric": (
        "## Fabric: `lightning_gaudi_fsdp.fabric.GaudiFSDPStrategy`",
        lambda: _named_parameters(fabric.GaudiFSDPStrategy),
    ),
}


@pytest.mark.parametrize("door", list(DOORS))
def test_the_table_lists_every_argument_with_the_signatures_default(door):
    heading, defaults = DOORS[door]
    rows, actual = _table(heading), defaults()
    assert sorted(rows) == sorted(actual), "the table's arguments differ from the signature's"
    wrong = {
        name: (row[1], actual[name])
        for name, row in rows.items()
        if _documented_default(row[1]) != actual[name] or type(_documented_default(row[1])) is not type(actual[name])
    }
    assert wrong == {}, "documented default != signature default"


def test_the_yaml_column_spells_each_argument_by_its_name():
    for name, row in _table(DOORS["trainer"][0]).items():
        yaml = row[2]
        assert yaml.startswith("-") or yaml == "Python only" or yaml.startswith(f"`{name}:"), (name, yaml)
