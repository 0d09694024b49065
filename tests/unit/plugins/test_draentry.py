"""``plugvisor plugin KIND --mode dra``: the dispatch to the DRA command, and its own refusals."""

from pathlib import Path

import pytest
from click.testing import CliRunner

from plugvisor.plugins import draentry, entry, entrycommon


@pytest.mark.parametrize(
    ("args", "dra"),
    [
        (["gpu", "--mode", "dra"], True),
        (["gpu", "--mode=dra"], True),
        (["gpu", "--mode", "device-plugin"], False),
        (["gpu"], False),
        (["gpu", "--", "--mode", "dra"], False),
        (["gpu", "--mode"], False),
        (["dra"], False),
    ],
)
def test_only_an_explicit_dra_mode_is_the_dra_command(args, dra):
    assert entrycommon.wants_dra(args) is dra


def test_plugin_help_names_the_modes_and_dra_help_its_own_options():
    runner = CliRunner()
    plain = runner.invoke(entry.plugin_command, ["gpu", "--help"])
    assert "--mode [device-plugin|dra]" in plain.output and "--driver" not in plain.output
    dra = runner.invoke(entry.plugin_command, ["gpu", "--mode", "dra", "--help"])
    assert dra.exit_code == 0
    for option in ("--driver", "--node-name", "--cdi-dir", "--objects-dir", "--host-root", "--options-json"):
        assert option in dra.output
    for device_plugin_only in ("--resource", "--on-kubelet-restart", "--registration", "--metrics-listen"):
        assert device_plugin_only not in dra.output


def test_without_an_api_client_the_driver_says_how_to_run_without_one(monkeypatch, capsys):
    monkeypatch.setattr(draentry, "KUBE_MODULE", "plugvisor.dra.no_such_module")
    with pytest.raises(SystemExit) as stopped:
        draentry._connect("gpu.example.com", "node-1", None, Path("/run/kubelet.sock"))
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert "no Kubernetes API client" in error and "give --objects-dir DIR" in error


def test_main_runs_the_dra_command_as_a_child_of_the_agent_would(tmp_path, capsys):
    """entry.prepare, what the fork server calls (its child runs the result), reaches the DRA command too."""
    code = entry.prepare(
        ["plugin", "gpu", "--mode", "dra", "--driver", "UPPER", "--kubelet-dir", str(tmp_path / "dp")]
    )()
    assert code == 2
    assert "DRA driver name 'UPPER' is not a DNS subdomain" in capsys.readouterr().err
