"""Pod manifests: what the device manager reads is strict, the rest of a real Pod is accepted."""

from __future__ import annotations

import textwrap

import pytest

from plugvisor.emulators.kubelet import ContainerKind
from plugvisor.emulators.kubelet.manifest import ManifestError, parse_manifest

GOOD = textwrap.dedent(
    """
    apiVersion: v1
    kind: Pod
    metadata: {name: trainer, namespace: ml, labels: {app: x}, annotations: {a: b}}
    spec:
      restartPolicy: Never
      tolerations: [{operator: Exists}]
      volumes: [{name: v, emptyDir: {}}]
      initContainers:
      - {name: setup, image: busybox, resources: {limits: {example.com/gpu: 1}}}
      - {name: proxy, image: busybox, restartPolicy: Always, resources: {limits: {example.com/gpu: "1"}}}
      containers:
      - name: main
        image: busybox
        command: [sleep, "1"]
        env: [{name: A, value: b}]
        volumeMounts: [{name: v, mountPath: /v}]
        resources:
          limits: {example.com/gpu: 2, cpu: 500m, memory: 1Gi}
          requests: {example.com/gpu: 2, cpu: 100m}
    """
)


def pod(containers: str, spec_extra: str = "") -> str:
    return (
        f"apiVersion: v1\nkind: Pod\nmetadata: {{name: p}}\nspec:\n{spec_extra}  containers: {containers}\n"
    )


class TestValidManifests:
    def test_a_real_pod_loads_with_containers_in_admission_order(self) -> None:
        """Init containers come first; sidecars are init containers with restartPolicy Always."""
        spec = parse_manifest(GOOD, source="/pods/trainer.yaml")
        assert (spec.namespace, spec.name, spec.restart_policy) == ("ml", "trainer", "Never")
        assert [(c.name, c.kind) for c in spec.all_containers()] == [
            ("setup", ContainerKind.INIT),
            ("proxy", ContainerKind.SIDECAR),
            ("main", ContainerKind.APP),
        ]
        assert dict(spec.containers[0].limits) == {"example.com/gpu": 2}

    def test_the_uid_is_stable_per_content_source_and_node(self) -> None:
        """Like a static pod: same file, same UID; edited content or another file, another UID."""
        first = parse_manifest(GOOD, source="/pods/a.yaml")
        assert parse_manifest(GOOD, source="/pods/a.yaml").uid == first.uid
        assert parse_manifest(GOOD, source="/pods/b.yaml").uid != first.uid
        assert parse_manifest(GOOD.replace("sleep", "wait"), source="/pods/a.yaml").uid != first.uid
        assert parse_manifest(GOOD, source="/pods/a.yaml", node_name="other").uid != first.uid

    def test_an_explicit_uid_is_kept(self) -> None:
        """metadata.uid wins over the derived one."""
        text = pod("[{name: c, image: i}]").replace("{name: p}", "{name: p, uid: abc-123}")
        assert parse_manifest(text).uid == "abc-123"

    def test_a_limit_without_request_implies_it(self) -> None:
        """Requests default to limits for extended resources."""
        spec = parse_manifest(pod("[{name: c, image: i, resources: {limits: {example.com/gpu: 3}}}]"))
        assert dict(spec.containers[0].limits) == {"example.com/gpu": 3}


class TestInvalidManifests:
    @pytest.mark.parametrize(
        ("text", "message"),
        [
            pytest.param("apiVersion: apps/v1\nkind: Deployment\n", "not a Pod", id="not-a-pod"),
            pytest.param("- a\n- b\n", "expected a mapping", id="a-list"),
            pytest.param("[1", "not valid YAML", id="broken-yaml"),
            pytest.param("kind: Pod\n---\nkind: Pod\n", "exactly one Pod document", id="two-documents"),
            pytest.param(
                pod(
                    "[{name: c, image: i, resources: "
                    "{limits: {example.com/gpu: 1}, requests: {example.com/gpu: 2}}}]"
                ),
                "must be equal to example.com/gpu limit of 1",
                id="requests-differ",
            ),
            pytest.param(
                pod("[{name: c, image: i, resources: {requests: {example.com/gpu: 1}}}]"),
                "Limit must be set for non overcommitable resources",
                id="request-without-limit",
            ),
            pytest.param(
                pod("[{name: c, image: i, resources: {limits: {example.com/gpu: 500m}}}]"),
                "must be an integer",
                id="fractional-device",
            ),
            pytest.param(
                pod("[{name: c, image: i, limits: {}}]"),
                "spec.containers[0]: Additional properties are not allowed ('limits' was unexpected)",
                id="typo-in-container",
            ),
            pytest.param(
                pod("[{name: c, image: i, resources: {limts: {}}}]"),
                "spec.containers[0].resources: Additional properties are not allowed "
                "('limts' was unexpected)",
                id="typo-in-resources",
            ),
            pytest.param(
                pod("[{name: c, image: i}]", "  nodeSelecter: {}\n"), "'nodeSelecter'", id="typo-in-spec"
            ),
            pytest.param(
                pod("[{name: c, image: i, command: [sleep, 1]}]"),
                "spec.containers[0].command[1]: 1 is not of type 'string'",
                id="wrong-type",
            ),
            pytest.param(
                pod("[{name: c, image: i, resources: {limits: {example.com/good: -1}}}]"),
                'spec.containers[0].resources.limits[example.com/good]: Invalid value: "-1": '
                "must be greater than or equal to 0",
                id="negative-extended-resource",
            ),
            pytest.param(
                pod("[{name: C_1, image: i}]"),
                'spec.containers[0].name: Invalid value: "C_1": a lowercase RFC 1123 label must consist of',
                id="bad-container-name",
            ),
            pytest.param(
                pod("[{name: c, image: i}, {name: c, image: i}]"), "Duplicate value", id="duplicate-names"
            ),
            pytest.param(
                pod("[{name: c, image: i, restartPolicy: Always}]"), "non-init containers", id="app-restart"
            ),
            pytest.param(pod("[]"), "at least 1 item", id="no-containers"),
        ],
    )
    def test_kubernetes_would_refuse_it_and_so_do_we(self, text: str, message: str) -> None:
        """Each mistake raises ManifestError naming the field and the rule."""
        with pytest.raises(ManifestError, match=None) as raised:
            parse_manifest(text, source="/pods/x.yaml")
        assert message in str(raised.value)
        assert str(raised.value).startswith("/pods/x.yaml: ")


class TestKubeletVersions:
    SIDECAR = pod("[{name: c, image: i}]").replace(
        "  containers:", "  initContainers: [{name: s, image: i, restartPolicy: Always}]\n  containers:"
    )

    def test_sidecars_are_unknown_to_the_1_26_schema(self) -> None:
        """Kubernetes 1.26: an init container's restartPolicy is not a field yet."""
        with pytest.raises(ManifestError) as raised:
            parse_manifest(self.SIDECAR, kubelet_version="1.26")
        assert "('restartPolicy' was unexpected) (Kubernetes 1.26 Pod schema)" in str(raised.value)

    @pytest.mark.parametrize("version", ["1.29", "1.35"])
    def test_sidecars_are_pods_from_1_29_on(self, version: str) -> None:
        spec = parse_manifest(self.SIDECAR, kubelet_version=version)
        assert spec.init_containers[0].kind is ContainerKind.SIDECAR

    def test_an_unknown_version_is_named_with_the_supported_ones(self) -> None:
        with pytest.raises(
            ValueError, match=r"kubelet version '1\.20' is not supported: choose one of 1\.26, "
        ):
            parse_manifest(pod("[{name: c, image: i}]"), kubelet_version="1.20")


class TestStaticPods:
    def test_a_static_pod_is_named_after_the_node(self) -> None:
        """The kubelet's file source names a static pod <name>-<node name>."""
        spec = parse_manifest(pod("[{name: c, image: i}]"), node_name="Node-7", static=True)
        assert spec.name == "p-node-7"

    def test_a_pod_from_the_api_keeps_its_name(self) -> None:
        assert parse_manifest(pod("[{name: c, image: i}]"), node_name="node-7").name == "p"
