"""The GPU node selectors the deployment files suggest lead to the nodes the GPUs are on.

Node Feature Discovery labels a node `feature.node.kubernetes.io/pci-<class><subclass>_<vendor>.present` for
each PCI function of a listed class. A comment that gives a GPU the wrong class leaves the DaemonSet with no
node to run on (AMD's MI300X is a processing accelerator, class 12, not a 3D controller, 0302), so every GPU
model of the lab's catalog, whose identities are the real parts', must find its label in what the chart's
values and the gpu overlay tell the operator to use.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from plugvisor.emulators.lab.catalog import GPUS

REPO = Path(__file__).resolve().parents[2]
_LABEL = re.compile(r"pci-([0-9a-f]{4})_([0-9a-f]{4})")


def _gpu_section_of_the_values() -> str:
    text = (REPO / "deploy/helm/plugvisor/values.yaml").read_text()
    return text[text.index("\n  gpu:\n") : text.index("\n  nic:\n")]


def _gpu_overlay() -> str:
    overlay = REPO / "deploy/kubernetes/overlays/gpu"
    return (overlay / "kustomization.yaml").read_text() + (overlay / "patch-node-selector.yaml").read_text()


@pytest.mark.parametrize("where", ["values.yaml kinds.gpu", "overlays/gpu"])
@pytest.mark.parametrize("model", sorted(GPUS))
def test_each_gpu_models_nfd_label_is_the_one_the_files_suggest(model: str, where: str) -> None:
    text = _gpu_section_of_the_values() if where.startswith("values") else _gpu_overlay()
    identity = GPUS[model].identity
    label = f"pci-{identity.class_code >> 8:04x}_{identity.vendor:04x}"
    suggested = {f"pci-{c}_{v}" for c, v in _LABEL.findall(text)}
    assert label in suggested, f"{where}: {model} is on nodes labelled {label}, not {sorted(suggested)}"
