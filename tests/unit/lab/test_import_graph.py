"""The lab's modules import each other one way: no circle, and the kind registry knows no kind.

Read from the source with :mod:`ast`, as import-linter reads it: every ``import``
of a ``plugvisor.emulators.lab`` module, at the top or inside a function, is an
arrow; imports under ``if TYPE_CHECKING:`` are for the checker only and are not.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

import plugvisor.emulators.lab

PACKAGE = "plugvisor.emulators.lab"
FOLDER = Path(plugvisor.emulators.lab.__file__).parent
MODULES = frozenset(p.stem for p in FOLDER.glob("*.py")) - {"__init__"}
KIND_MODULES = ("gpu", "fpga", "nic", "extension")


def _type_checking_only(tree: ast.Module) -> set[int]:
    """The ids of nodes inside ``if TYPE_CHECKING:`` blocks."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in {"TYPE_CHECKING", "typing.TYPE_CHECKING"}:
            found |= {id(inner) for stmt in node.body for inner in ast.walk(stmt)}
    return found


def imports(source: str) -> set[str]:
    """The lab modules that ``source`` (a module's text) imports when it runs."""
    tree = ast.parse(source)
    skipped = _type_checking_only(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            if node.module == PACKAGE:
                found |= {alias.name for alias in node.names if alias.name in MODULES}
            elif node.module.startswith(f"{PACKAGE}."):
                found.add(node.module.removeprefix(f"{PACKAGE}.").split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            found |= {alias.name for alias in node.names if alias.name in MODULES} | (
                {node.module.split(".")[0]} if node.module else set()
            )
        elif isinstance(node, ast.Import):
            found |= {
                alias.name.removeprefix(f"{PACKAGE}.").split(".")[0]
                for alias in node.names
                if alias.name.startswith(f"{PACKAGE}.")
            }
    return found


def graph() -> dict[str, set[str]]:
    """Every lab module -> the lab modules it imports."""
    return {m: imports((FOLDER / f"{m}.py").read_text(encoding="utf-8")) - {m} for m in sorted(MODULES)}


def test_the_reader_sees_function_level_imports_and_skips_type_checking_ones() -> None:
    """The check would be worthless if a lazy import inside a function escaped it."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from plugvisor.emulators.lab import errors, kinds\n"
        "if TYPE_CHECKING:\n"
        "    from plugvisor.emulators.lab.state import LabState\n"
        "def f() -> None:\n"
        "    from plugvisor.emulators.lab.extension import PciAdapter\n"
        "    import plugvisor.emulators.lab.gpu\n"
    )
    assert imports(source) == {"errors", "kinds", "extension", "gpu"}


def test_a_circle_is_found_when_there_is_one() -> None:
    """The same sorter the real check uses refuses a two-module circle."""
    with pytest.raises(graphlib.CycleError):
        tuple(graphlib.TopologicalSorter({"kinds": {"state"}, "state": {"kinds"}}).static_order())


def test_the_lab_modules_import_each_other_one_way() -> None:
    """No lab module reaches, directly or through others, back to itself."""
    try:
        tuple(graphlib.TopologicalSorter(graph()).static_order())
    except graphlib.CycleError as exc:
        pytest.fail(f"the lab's modules import each other in a circle: {' -> '.join(exc.args[1])}")


@pytest.mark.parametrize("low", ["kinds", "state", "profiles"])
def test_the_registry_state_and_profiles_reach_no_kind_module(low: str) -> None:
    """Kinds register themselves; what looks them up never imports one, not even through another module."""
    edges = graph()
    reached: set[str] = set()
    todo = [low]
    while todo:
        for target in edges[todo.pop()] - reached:
            reached.add(target)
            todo.append(target)
    assert reached.isdisjoint(KIND_MODULES), sorted(reached & set(KIND_MODULES))


def test_the_registry_imports_nothing_of_the_lab_but_its_errors() -> None:
    """It sits at the bottom, so any module may look a kind up."""
    assert graph()["kinds"] == {"errors"}
