"""Finding the API server and the node as client-go programs do, and saying what was tried when it fails."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from plugvisor.dra.kube.config import KubeConfigError, load_api_config, node_name


def kubeconfig(
    path: Path, *, name: str, server: str, current: str | None = None, ca: str | None = None
) -> Path:
    cluster: dict[str, object] = {"server": server}
    if ca is not None:
        cluster["certificate-authority"] = ca
    document: dict[str, object] = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": cluster}],
        "users": [{"name": name, "user": {"token": f"token-{name}"}}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
    }
    if current is not None:
        document["current-context"] = current
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(document))
    return path


def test_kubeconfig_files_merge_the_first_definition_winning(tmp_path: Path) -> None:
    first = kubeconfig(
        tmp_path / "a" / "config", name="lab", server="https://a:6443", current="lab", ca="ca.crt"
    )
    second = kubeconfig(tmp_path / "b" / "config", name="lab", server="https://b:6443", current="other")
    missing = tmp_path / "missing"

    config = load_api_config(env={"KUBECONFIG": f"{missing}:{first}:{second}"}, home=tmp_path)

    chosen = config.kubeconfig.get()
    assert chosen is not None
    assert chosen.cluster.server == "https://a:6443"
    assert chosen.cluster.certificate_auth == str(tmp_path / "a" / "ca.crt")  # relative to its own file
    assert config.source.startswith("KUBECONFIG=")


def test_an_explicit_kubeconfig_wins_over_the_service_account(tmp_path: Path) -> None:
    explicit = kubeconfig(tmp_path / "config", name="x", server="https://x:6443", current="x")
    env = {
        "KUBECONFIG": str(explicit),
        "KUBERNETES_SERVICE_HOST": "10.0.0.1",
        "KUBERNETES_SERVICE_PORT": "443",
    }

    config = load_api_config(env=env, service_account_dir=tmp_path / "sa")

    assert config.kubeconfig.get().cluster.server == "https://x:6443"  # type: ignore[union-attr]


def test_in_a_pod_the_service_account_is_used(tmp_path: Path) -> None:
    account = tmp_path / "sa"
    account.mkdir()
    (account / "token").write_text("sa-token")
    (account / "namespace").write_text("kube-system")
    (account / "ca.crt").write_text("not checked here")
    kubeconfig(tmp_path / ".kube" / "config", name="home", server="https://home:6443", current="home")
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}

    config = load_api_config(env=env, service_account_dir=account, home=tmp_path)

    chosen = config.kubeconfig.get()
    assert chosen is not None and chosen.user is not None
    assert chosen.cluster.server == "https://10.96.0.1:443"
    assert chosen.user.token_file == str(account / "token")  # re-read when the kubelet rotates it
    assert config.source == "in-cluster service account (10.96.0.1:443)"


def test_outside_a_pod_the_home_file_is_used(tmp_path: Path) -> None:
    kubeconfig(tmp_path / ".kube" / "config", name="home", server="https://home:6443", current="home")

    config = load_api_config(env={}, home=tmp_path)

    assert config.kubeconfig.get().cluster.server == "https://home:6443"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("nothing", "no API server configuration: KUBECONFIG is not set, this is not a pod"),
        ("pod-without-token", "in-cluster: KUBERNETES_SERVICE_HOST is set but"),
        ("no-current-context", "KUBECONFIG="),
        ("not-a-mapping", "expected a kubeconfig mapping, got list"),
    ],
)
def test_no_usable_configuration_is_one_error_saying_what_was_tried(
    tmp_path: Path, setup: str, message: str
) -> None:
    env: dict[str, str] = {}
    if setup == "pod-without-token":
        env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    elif setup == "no-current-context":
        env = {"KUBECONFIG": str(kubeconfig(tmp_path / "config", name="x", server="https://x"))}
    elif setup == "not-a-mapping":
        (tmp_path / "config").write_text("- a\n- b\n")
        env = {"KUBECONFIG": str(tmp_path / "config")}

    with pytest.raises(KubeConfigError, match=re.escape(message)):
        load_api_config(env=env, service_account_dir=tmp_path / "sa", home=tmp_path)


def test_the_node_name_comes_from_the_option_else_node_name() -> None:
    assert node_name("worker-1", env={"NODE_NAME": "other"}) == "worker-1"
    assert node_name(None, env={"NODE_NAME": "worker-2"}) == "worker-2"
    with pytest.raises(KubeConfigError, match="the node's name is unknown: set NODE_NAME"):
        node_name(None, env={})
    with pytest.raises(KubeConfigError, match="NODE_NAME: 'Worker_1' is not a lowercase DNS-1123 subdomain"):
        node_name(None, env={"NODE_NAME": "Worker_1"})


async def test_connect_gives_a_reader_and_a_publisher_sharing_one_client(tmp_path: Path) -> None:
    from plugvisor.dra.kube import connect

    from .fakeapi import FakeApi

    api = FakeApi(node="node-a")
    env = {"KUBECONFIG": str(kubeconfig(tmp_path / "config", name="x", server="https://x:6443", current="x"))}

    claims, slices = await connect(
        driver="gpu.plugvisor.io", node_name="node-a", env=env, transport=api.transport
    )
    await slices.publish([])
    assert await slices.wait_synced(30)
    await slices.withdraw()

    assert api.slices == {}
    assert ("GET", "/apis/resource.k8s.io/v1/resourceslices") in api.requests
    assert claims is not None
    with pytest.raises(KubeConfigError, match="the node's name: 'Node_A' is not a lowercase DNS-1123"):
        await connect(driver="gpu.plugvisor.io", node_name="Node_A", env=env)
