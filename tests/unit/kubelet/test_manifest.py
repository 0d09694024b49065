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
        assert parse_manifest(GOOD.replace("sleep", "true"), source="/pods/a.yaml").uid != first.uid
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
                pod("[{name: c, image: i, limits: {}}]"), "unknown field(s) 'limits'", id="typo-in-container"
            ),
            pytest.param(
                pod("[{name: c, image: i, resources: {limts: {}}}]"),
                "resources.limts: unknown field",
                id="typo-in-resources",
            ),
            pytest.param(
                pod("[{name: c, image: i}]", "  nodeSelecter: {}\n"), "'nodeSelecter'", id="typo-in-spec"
            ),
            pytest.param(pod("[{name: C_1, image: i}]"), "DNS-1123 label", id="bad-container-name"),
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
