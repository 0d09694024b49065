"""The two commands of a plugin process: one options object each, and modules that never import each other.

``plugins.entry`` (device plugin) and ``plugins.draentry`` (DRA driver) share
``plugins.entrycommon``; the dispatch of ``--mode dra`` reaches the DRA command
by name, so neither module names the other in an import, even one inside a
function (which import-linter sees too, but a test says it where it is read).
"""

import ast
import dataclasses
from pathlib import Path

import pytest

import plugvisor.plugins
from plugvisor.plugins import draentry, entry, entrycommon

PLUGINS = Path(plugvisor.plugins.__file__).parent


def imported_modules(module: str) -> set[str]:
    """Every module an import statement of ``plugvisor.plugins.<module>`` names, at any depth."""
    tree = ast.parse((PLUGINS / f"{module}.py").read_text(), filename=f"{module}.py")
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(["plugvisor.plugins", *([base] if base else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize(
    ("module", "other"),
    [("entry", "draentry"), ("draentry", "entry"), ("entrycommon", "entry"), ("entrycommon", "draentry")],
)
def test_a_command_module_never_imports_the_other(module, other):
    assert f"plugvisor.plugins.{other}" not in imported_modules(module)


@pytest.mark.parametrize("module", ["entry", "draentry"])
def test_both_command_modules_build_on_the_shared_one(module):
    assert "plugvisor.plugins.entrycommon" in imported_modules(module)


def test_the_dispatch_names_the_dra_command_it_runs():
    module, attribute = entrycommon.DRA_COMMAND
    assert module == draentry.__name__
    assert getattr(draentry, attribute) is draentry.dra_plugin_command


@pytest.mark.parametrize(
    ("command", "options"),
    [(entry.plugin_command, entry.PluginOptions), (draentry.dra_plugin_command, draentry.DriverOptions)],
)
def test_each_command_fills_its_options_object_with_exactly_its_parameters(command, options):
    assert {param.name for param in command.params} == {field.name for field in dataclasses.fields(options)}


def test_the_options_objects_are_frozen(tmp_path):
    context = entry.plugin_command.make_context("plugin", ["generic", "--host-root", str(tmp_path)])
    options = entry.PluginOptions(**context.params)
    assert options.host_root == tmp_path
    assert options.resource_name == "plugvisor.io/generic"
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.kind = "gpu"  # type: ignore[misc]
