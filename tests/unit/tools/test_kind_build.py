"""tools/kind/build.py: bad input is refused in one line before anything runs; --status says what is there.

No network and no builds here: only the parts that decide what to do.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
GOOD = (REPO / "tools" / "kind" / "versions.toml").read_text()


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kind_build_tool", REPO / "tools" / "kind" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


kind = _load()


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """Both caches in tmp_path, empty, and a PATH that has Go and buildah (status checks both)."""
    monkeypatch.setenv("PLUGVISOR_KIND_CACHE", str(tmp_path / "kind"))
    monkeypatch.setenv("PLUGVISOR_K8S_CACHE", str(tmp_path / "kubernetes"))
    monkeypatch.setattr(kind.shutil, "which", lambda tool, **_: f"/usr/bin/{tool}")
    return tmp_path


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "cannot read it: No such file or directory"),
        (GOOD.replace('version = "v0.33.0"', 'version = "v0.33.0'), "not valid TOML"),
        (GOOD.replace("[coredns]", "[core-dns]"), "[coredns]: missing table"),
        (GOOD.replace('"v0.33.0"', '"../../../tmp/evil"'), "kind.version: expected a release tag"),
        (GOOD.replace('"v1.37.0"', "137"), "cri-tools.version: expected a release tag"),
        (GOOD.replace('"v0.0.30"', '"latest"'), "local-path-provisioner.version: expected a release tag"),
    ],
    ids=["missing", "toml-typo", "missing-table", "escaping-version", "number", "not-a-tag"],
)
def test_a_versions_file_it_cannot_use_is_named_with_the_key_that_is_wrong(tmp_path, content, expected):
    path = tmp_path / "versions.toml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(kind.UsageError, match=expected.replace("[", r"\[").replace("]", r"\]")) as error:
        kind.versions(path)
    assert str(path) in str(error.value)
    assert "\n" not in str(error.value)


def test_the_pinned_versions_are_release_tags():
    assert kind.versions() == {
        "kind": "v0.33.0",
        "cri-tools": "v1.37.0",
        "coredns": "v1.14.6",
        "local-path-provisioner": "v0.0.30",
    }


@pytest.mark.parametrize(
    ("text", "steps"),
    [("kind", ("kind",)), ("node,kind", ("kind", "node")), (" base , tools ", ("tools", "base"))],
)
def test_only_takes_steps_in_any_order_and_runs_them_in_build_order(text, steps):
    assert kind.parse_steps(text) == steps


@pytest.mark.parametrize(
    ("text", "named"),
    [("", "an empty step"), ("kind,cluster", "'cluster' is none of them"), ("node,", "an empty step")],
)
def test_only_refuses_a_step_it_does_not_know_naming_the_choices(text, named):
    with pytest.raises(kind.UsageError, match="expected one or more of kind, tools, base, node") as error:
        kind.parse_steps(text)
    assert named in str(error.value)


def test_bad_input_exits_2_with_one_line_and_touches_nothing(caches, capsys):
    assert kind.main(["--only", "everything"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("tools/kind/build.py: --only 'everything'")
    assert not (caches / "kind").exists()


def test_a_bad_versions_file_exits_2_before_anything(caches, capsys, monkeypatch, tmp_path):
    broken = tmp_path / "broken.toml"
    broken.write_text(GOOD.replace("[kind]", "[kinds]"))
    monkeypatch.setattr(kind, "VERSIONS", broken)
    assert kind.main(["--status"]) == 2
    assert "[kind]: missing table" in capsys.readouterr().err
    assert not (caches / "kind").exists()


def test_status_on_an_empty_cache_names_every_missing_piece_and_what_makes_it(caches, capsys):
    assert kind.main(["--status"]) == 1
    out = capsys.readouterr().out
    assert "Traceback" not in out
    lines = out.splitlines()
    assert all(line.startswith("missing: ") for line in lines)
    assert "missing: kind: not built (tools/kind/build.py --only kind)" in lines
    assert "missing: kubeadm: not built (tools/kind/build.py --only tools)" in lines
    assert any(
        "kubelet" in line and "images/pause.tar" in line and "tools/kubernetes/build.py builds them" in line
        for line in lines
    )
    assert any(
        line.startswith("missing: base image: no localhost_plugvisor_kind-base_v0.33.0.tar") for line in lines
    )
    assert any(
        line.startswith("missing: node image: no localhost_plugvisor_kind-node_v1.37.2.tar") for line in lines
    )


def test_status_names_a_missing_go_and_buildah(caches, capsys, monkeypatch):
    monkeypatch.setattr(kind.shutil, "which", lambda tool, **_: None)
    assert kind.main(["--status"]) == 1
    out = capsys.readouterr().out
    assert "missing: Go is not installed" in out
    assert "missing: buildah is not installed" in out


def test_status_with_everything_built_says_ready_and_exits_0(caches, capsys):
    kind_bin = caches / "kind" / "bin"
    kind_bin.mkdir(parents=True)
    for name in ("kind", "crictl", "kubeadm", "kubectl"):
        (kind_bin / name).write_text("")
    kubernetes_bin = caches / "kubernetes" / "bin"
    kubernetes_bin.mkdir(parents=True)
    for name in kind.KUBERNETES_CACHE_BINARIES:
        (kubernetes_bin / name).write_text("")
    (caches / "kubernetes" / "images").mkdir()
    (caches / "kubernetes" / "images" / "pause.tar").write_text("")
    archives = caches / "kind" / "archives"
    archives.mkdir()
    (archives / "localhost_plugvisor_kind-base_v0.33.0.tar").write_bytes(b"x" * 2_000_000)
    (archives / "localhost_plugvisor_kind-node_v1.37.2.tar").write_bytes(b"x" * 3_000_000)
    assert kind.main(["--status"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"built: kind: {kind_bin / 'kind'}" in lines
    assert f"built: node image: {archives / 'localhost_plugvisor_kind-node_v1.37.2.tar'} (3 MB)" in lines
    assert "ready: kind create cluster --image localhost/plugvisor/kind-node:v1.37.2" in lines[-3]
    assert "--kubeadm-patch" in lines[-2]
    assert lines[-1].startswith("  not in the node: kindnetd (the module proxy refuses sigs.k8s.io/kindnet")
    assert lines[-1].endswith("a stand-in does its job (docs/kind.md)")


def test_kubeadm_patch_prints_the_patches_and_builds_nothing(caches, capsys):
    assert kind.main(["--kubeadm-patch"]) == 0
    assert capsys.readouterr().out == kind.kubeadm_patch("v3.7.3")
    assert not (caches / "kind").exists()


GO = """package nodeimage

const helperImage = "docker.io/kindest/helper:v1"

const manifest = `
image: ` + helperImage + `
args: [` + otherImage + `]
`
"""


def test_kinds_manifests_are_read_from_its_go_constants_with_our_image_names():
    text = kind.go_raw_string(GO, "manifest", {"otherImage": "plugvisor.local/other:1"})
    assert text == "\nimage: docker.io/kindest/helper:v1\nargs: [plugvisor.local/other:1]\n"


def test_a_manifest_naming_an_unknown_constant_is_refused():
    with pytest.raises(kind.UsageError, match="manifest names otherImage, which is no string constant"):
        kind.go_raw_string(GO, "manifest")
    with pytest.raises(kind.UsageError, match="no string constant absent"):
        kind.go_raw_string(GO, "absent")


def test_the_node_images_names_say_what_they_hold():
    names = kind.image_names("v1.37.2", "v3.7.3", kind.versions())
    assert names["kube-apiserver"] == "registry.k8s.io/kube-apiserver:v1.37.2"
    assert names["etcd"] == "registry.k8s.io/etcd:3.7.3-0"  # the etcd built, not kubeadm's default
    assert names["coredns"] == "registry.k8s.io/coredns/coredns:v1.14.6"
    assert names["local-path-provisioner"] == "plugvisor.local/local-path-provisioner:v0.0.30"
    assert names["pause"] == kind.kbuild.PAUSE_IMAGE


def test_the_kubeadm_patch_names_the_etcd_built_and_allows_cgroup_v1():
    patch = kind.kubeadm_patch("v3.7.3")
    assert 'imageTag: "3.7.3-0"' in patch
    assert "failCgroupV1: false" in patch


FAKE_KUBECTL = """#!/bin/sh
case "$*" in
  *"get node worker "*) printf '10.244.1.0/24' ;;
  *"get nodes"*) printf 'cp 10.244.0.0/24 172.18.0.4\\nworker 10.244.1.0/24 172.18.0.2\\njoining  \\n' ;;
esac
"""


def _sync(tmp_path, node, runs):
    """Run the kindnetd stand-in's pass ``runs`` times on node ``node``, kubectl and ip faked."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "kubectl").write_text(FAKE_KUBECTL)
    (bin_dir / "ip").write_text(f'#!/bin/sh\necho "$*" >> {tmp_path / "ip.log"}\n')
    for tool in ("kubectl", "ip"):
        (bin_dir / tool).chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "NODE_NAME": node,
        "KINDNET_CONF": str(tmp_path / "cni.conflist"),
    }
    script = kind.CNI_SYNC + "sync_once\n" * runs
    return subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, check=True)


def test_the_kindnetd_stand_in_writes_a_ptp_config_over_the_nodes_pod_cidr_once(tmp_path):
    result = _sync(tmp_path, "worker", runs=2)
    assert result.stdout.count("wrote") == 1  # the second pass finds it written
    config = json.loads((tmp_path / "cni.conflist").read_text())
    ptp, portmap = config["plugins"]
    assert ptp["type"] == "ptp"
    assert ptp["ipam"] == {
        "type": "host-local",
        "ranges": [[{"subnet": "10.244.1.0/24"}]],
        "routes": [{"dst": "0.0.0.0/0"}],
    }
    assert portmap == {"type": "portmap", "capabilities": {"portMappings": True}}


def test_the_kindnetd_stand_in_routes_to_every_other_nodes_pod_cidr_and_skips_itself(tmp_path):
    _sync(tmp_path, "worker", runs=1)
    # Not its own CIDR, and not a node without one yet.
    assert (tmp_path / "ip.log").read_text() == "route replace 10.244.0.0/24 via 172.18.0.4\n"


def test_the_kindnetd_stand_in_writes_nothing_before_its_node_has_a_pod_cidr(tmp_path):
    _sync(tmp_path, "joining", runs=1)
    assert not (tmp_path / "cni.conflist").exists()


def test_the_default_cni_manifest_runs_the_stand_in_with_the_rights_it_uses():
    documents = list(yaml.safe_load_all(kind.cni_manifest("plugvisor.local/kindnet-standin:v1.37.2")))
    role, _, account, daemonset = documents
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}]
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    container = pod["containers"][0]
    assert container["image"] == "plugvisor.local/kindnet-standin:v1.37.2"
    assert container["command"] == ["sh", "-c", kind.CNI_SCRIPT]
    assert {"name": "cni-cfg", "mountPath": "/etc/cni/net.d"} in container["volumeMounts"]
