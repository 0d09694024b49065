"""A node's install (the release image's: the dra extra, not the emulators one) runs everything a node runs,
and says which extra the rest needs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .node_install import FIX, RUN_CLI, plugvisor_without_the_extra, run_without_the_extra


@pytest.mark.parametrize("command", ["run", "plugin generic", "status", "export supervisord", "lab create"])
def test_a_node_install_has_every_command_a_node_runs(tmp_path, command):
    result = plugvisor_without_the_extra(tmp_path, *command.split(), "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Usage: plugvisor")


def test_a_node_install_runs_the_hardware_lab(tmp_path):
    """The lab overlay's DaemonSet runs `plugvisor lab` in the release image, which has no extra."""
    lab = tmp_path / "lab"
    for argv in (
        ["lab", "create", str(lab), "--profile", "small"],
        ["lab", "fault", str(lab), "gpu0", "aer-fatal"],
        ["lab", "vfs", str(lab), "nic0", "0"],
    ):
        result = plugvisor_without_the_extra(tmp_path, *argv)
        assert result.returncode == 0, f"plugvisor {' '.join(argv)}: {result.stderr}"
    shown = plugvisor_without_the_extra(tmp_path, "lab", "show", str(lab), "--json")
    assert shown.returncode == 0, shown.stderr
    assert "aer-fatal" in shown.stdout


@pytest.mark.parametrize(
    ("argv", "part"),
    [
        (["kubelet", "--dir", "dp"], "the emulated kubelet"),
        (["kubelet", "--help"], "the emulated kubelet"),
        (["demo", "--no-live"], "the emulated kubelet"),
    ],
)
def test_an_emulator_command_without_the_extra_says_which_to_install_in_one_line(tmp_path, argv, part):
    result = plugvisor_without_the_extra(tmp_path, *argv)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"plugvisor {argv[0]}: {part} needs plugvisor's 'emulators' extra "
        f"(kubernetes_validate is not installed): {FIX}"
    ]
    assert not (tmp_path / "dp").exists()  # nothing started


def test_the_demo_without_its_terminal_view_names_the_extra(tmp_path):
    """A broken install with the emulated kubelet's dependencies but without rich says the same."""
    code = "sys.modules['rich'] = None\n" + RUN_CLI.format(argv=["demo", "--no-live"])
    result = subprocess.run(
        [sys.executable, "-c", "import sys\n" + code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"plugvisor demo: the demo needs plugvisor's 'emulators' extra (rich is not installed): {FIX}"
    ]


@pytest.mark.parametrize("module", ["plugvisor.emulators.kubelet", "plugvisor.testing"])
def test_importing_the_emulated_kubelet_without_the_extra_raises_an_import_error_naming_it(tmp_path, module):
    """A library user gets an ImportError (so optional-import probes keep working) with the same line."""
    code = (
        "import json\n"
        "try:\n"
        f"    import {module}\n"
        "except ImportError as error:\n"
        "    print(json.dumps([type(error).__name__, error.name, str(error)]))\n"
    )
    result = run_without_the_extra(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [
        "MissingExtraError",
        "kubernetes_validate",
        f"the emulated kubelet needs plugvisor's 'emulators' extra (kubernetes_validate is not installed): "
        f"{FIX}",
    ]
