"""The bare-metal unit: valid for systemd, hardened below a stated exposure, consistent with node.yaml."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from plugvisor.supervisor.config import parse_config

from .conftest import FIGURES, REPO

UNIT = REPO / "deploy/systemd/plugvisor.service"
DRA_DROP_IN = REPO / "deploy/systemd/plugvisor.service.d/dra.conf"
NODE_YAML = REPO / "deploy/systemd/node.yaml"
EXPOSURE_BOUND = 2.5
"""`systemd-analyze security` rates 0 (locked down) to 10 (unsafe); the unit is kept at or below this."""

needs_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed on this machine"
)


def _service(text: str | None = None) -> configparser.SectionProxy:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(UNIT.read_text() if text is None else text)
    return parser["Service"]


def _installed_unit(tmp_path: Path, *, dra: bool = False) -> Path:
    """The unit as installed with plugvisor where this environment has it (verify checks ExecStart exists);
    with ``dra``, the DRA drop-in's settings after the unit's, as systemd applies a drop-in (one file:
    systemd-analyze security --offline reads no drop-in directory)."""
    plugvisor = Path(sys.executable).parent / "plugvisor"
    assert plugvisor.exists()
    unit = tmp_path / "plugvisor.service"
    text = UNIT.read_text().replace("/usr/local/bin/plugvisor", str(plugvisor))
    if dra:
        text += "\n" + DRA_DROP_IN.read_text()
    unit.write_text(text)
    return unit


@needs_analyze
@pytest.mark.parametrize("dra", [False, True], ids=["unit", "with-dra-drop-in"])
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path, dra: bool) -> None:
    """No unknown setting, no bad value, an executable ExecStart."""
    result = subprocess.run(
        ["systemd-analyze", "verify", str(_installed_unit(tmp_path, dra=dra))],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    complaints = [line for line in result.stderr.splitlines() if "plugvisor.service" in line]
    assert result.returncode == 0, result.stderr
    assert complaints == []


@needs_analyze
@pytest.mark.parametrize("dra", [False, True], ids=["unit", "with-dra-drop-in"])
def test_the_sandbox_keeps_the_exposure_below_the_bound(tmp_path: Path, dra: bool) -> None:
    """`systemd-analyze security` rates the unit at most EXPOSURE_BOUND (the figure is printed), the DRA
    drop-in too (it opens IP to the API server, and three directories)."""
    result = subprocess.run(
        [
            "systemd-analyze",
            "security",
            "--offline=true",
            "--no-pager",
            str(_installed_unit(tmp_path, dra=dra)),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    if "--offline" in result.stderr and result.returncode != 0:
        pytest.skip(f"this systemd-analyze cannot rate a unit file offline (systemd < 250): {result.stderr}")
    found = re.search(r"Overall exposure level for plugvisor\.service: (\d+\.\d+) (\w+)", result.stdout)
    assert found, result.stdout + result.stderr
    exposure = float(found[1])
    FIGURES.append(
        f"systemd-analyze security plugvisor.service{' + dra.conf' if dra else ''}: {exposure} {found[2]}"
        f" (bound {EXPOSURE_BOUND})"
    )
    assert exposure <= EXPOSURE_BOUND, result.stdout


def test_the_unit_writes_only_where_the_example_configuration_needs() -> None:
    """ReadWritePaths covers the kubelet directory of node.yaml; the runtime directory is systemd's."""
    service = _service()
    config = parse_config(yaml.safe_load(NODE_YAML.read_text()), source=str(NODE_YAML))
    writable = [path.removeprefix("-") for path in service["ReadWritePaths"].split()]
    assert writable == [str(config.kubelet_dir)]
    assert service["ProtectSystem"] == "strict"
    assert f"PLUGVISOR_RUNTIME_DIR=/run/{service['RuntimeDirectory']}" == service["Environment"]
    assert "--config /etc/plugvisor/node.yaml" in service["ExecStart"]
    assert config.metrics is not None
    assert config.metrics.host in ("127.0.0.1", "localhost"), (
        "IPAddressAllow=localhost assumes a loopback listener"
    )
    assert service["IPAddressAllow"] == "localhost"


def test_the_unit_allows_exactly_the_socket_families_the_agent_uses() -> None:
    """Unix (kubelet, children), IP (metrics), netlink (uevents); no capability at all."""
    service = _service()
    assert service["RestrictAddressFamilies"].split() == ["AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"]
    assert service["CapabilityBoundingSet"] == ""
    assert service["NoNewPrivileges"] == "yes"
    assert service["Type"] == "notify"


def test_the_device_policy_lets_nvml_open_nvidias_device_nodes_and_nothing_else() -> None:
    """DevicePolicy=closed refuses every device node the agent opens, but NVML (the gpu kind) opens
    /dev/nvidiactl and /dev/nvidia<N> read-write (major 195, nvidia-frontend in /proc/devices) and reads
    /dev/nvidia-caps/* on MIG GPUs: exactly those two groups are allowed, the caps read-only."""
    service = _service()
    assert service["DevicePolicy"] == "closed"
    allowed = [
        line.split("=", 1)[1].strip()
        for line in UNIT.read_text().splitlines()
        if line.startswith("DeviceAllow=")
    ]
    assert allowed == ["char-nvidia-frontend rw", "char-nvidia-caps r"]
    assert service.get("PrivateDevices", "no") == "no", "a private /dev has no NVIDIA node to open"


def _dra_service() -> dict[str, list[str]]:
    """The unit's [Service] settings with the DRA drop-in applied as systemd does: lists append, and an empty
    assignment resets a list."""
    settings: dict[str, list[str]] = {}
    for text in (UNIT.read_text(), DRA_DROP_IN.read_text()):
        section = None
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("["):
                section = line
                continue
            if section != "[Service]":
                continue
            key, _, value = line.partition("=")
            settings[key] = [] if value == "" else [*settings.get(key, []), value]
    return settings


def test_the_dra_drop_in_gives_a_driver_what_the_sandbox_kept_from_it() -> None:
    """A DRA driver reads a kubeconfig (ProtectHome hides ~/.kube), reaches the API server off loopback
    (IPAddressDeny=any), and writes the kubelet's plugin directories and the CDI directory."""
    service = _dra_service()
    config = parse_config(yaml.safe_load(NODE_YAML.read_text()), source=str(NODE_YAML))
    kubelet_root = config.kubelet_dir.parent
    writable = {p.removeprefix("-") for line in service["ReadWritePaths"] for p in line.split()}
    assert writable >= {
        str(config.kubelet_dir),
        str(kubelet_root / "plugins"),
        str(kubelet_root / "plugins_registry"),
        "/run/cdi",  # /var/run/cdi resolved: ProtectSystem= works on real paths
    }
    environment = dict(line.split("=", 1) for line in service["Environment"])
    assert environment["KUBECONFIG"].startswith("/etc/")  # not under /root or /home: ProtectHome=yes stays
    assert service["ProtectHome"] == ["yes"]
    assert service.get("IPAddressDeny", []) == []
    assert "NODE_NAME" in environment
