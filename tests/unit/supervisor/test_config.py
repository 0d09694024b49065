"""The configuration file: every mistake is reported with the file and the field, before anything starts."""

import json
import sys

import pytest
import yaml

from plugvisor.supervisor import config as config_

GOOD = """
kubeletDir: /tmp/pv-dp
hostRoot: /tmp/pv-root
metrics: {listen: "127.0.0.1:9400"}
resources:
  - name: example.com/fuse
    kind: generic
    paths: ["/dev/fuse"]
    count: 10
  - name: example.com/serial
    kind: generic
    paths: ["/dev/ttyUSB*"]
"""


def errors_of(document: str) -> str:
    with pytest.raises(config_.ConfigError) as caught:
        config_.parse_config(yaml.safe_load(document), source="node.yaml")
    return str(caught.value)


class TestParseConfig:
    def test_a_valid_file_gives_one_child_spec_per_resource_in_file_order(self):
        """Each resource becomes a `plugvisor plugin KIND` command with its kind keys as JSON."""
        config = config_.parse_config(yaml.safe_load(GOOD), source="node.yaml")
        specs = config_.child_specs(config)
        assert list(specs) == ["example.com/fuse", "example.com/serial"]
        args = specs["example.com/fuse"].args
        assert args[:4] == ("plugin", "generic", "--resource", "example.com/fuse")
        assert json.loads(args[args.index("--options-json") + 1]) == {"paths": ["/dev/fuse"], "count": 10}
        assert args[args.index("--kubelet-dir") + 1] == "/tmp/pv-dp"
        assert specs["example.com/fuse"].argv()[:3] == [sys.executable, "-m", "plugvisor"]

    def test_defaults_are_the_kubelets_directory_and_no_metrics(self):
        """Only ``resources`` is required."""
        config = config_.parse_config(
            {"resources": [{"name": "a.example/x", "kind": "generic", "paths": ["/dev/x"]}]}, source="n"
        )
        assert str(config.kubelet_dir) == "/var/lib/kubelet/device-plugins"
        assert config.metrics is None
        assert config.supervisor.spawner == "forkserver"

    def test_an_empty_metrics_mapping_binds_to_loopback(self):
        """The endpoint is on loopback unless the file says otherwise."""
        config = config_.parse_config(
            {"metrics": {}, "resources": [{"name": "a.example/x", "kind": "generic", "paths": ["/dev/x"]}]},
            source="n",
        )
        assert config.metrics is not None
        assert (config.metrics.host, config.metrics.port) == ("127.0.0.1", 9400)

    @pytest.mark.parametrize(
        ("document", "message"),
        [
            ("resources: []", "node.yaml: resources: List should have at least 1 item"),
            ("bogus: 1\nresources: [{name: a.com/b, kind: generic, paths: [/dev/x]}]", "node.yaml: bogus: unknown key"),  # noqa: E501
            ("resources: [{name: gpu, kind: generic, paths: [/dev/x]}]", "resources[0].name: Value error, 'gpu' has no domain"),  # noqa: E501
            ("resources: [{name: a.com/b, kind: nope}]", "resources[0].kind: unknown plugin kind 'nope'"),
            ("resources: [{name: a.com/b, kind: generic, paths: [/dev/x], count: 0}]", "resources[0].count: Input should be greater than or equal to 1"),  # noqa: E501
            ("resources: [{name: a.com/b, kind: generic, path: [/dev/x]}]", "resources[0].path: unknown key"),
            ("resources: [{name: a.com/b, kind: generic, paths: [dev/x]}]", "resources[0].paths[0].path: Value error, 'dev/x' must be an absolute path"),  # noqa: E501
            ("resources: [{name: a.com/b, kind: generic, paths: [/x]}, {name: a.com/b, kind: generic, paths: [/y]}]", "resources[1].name: a.com/b is already configured by resources[0]"),  # noqa: E501
            ("kubeletDir: relative\nresources: [{name: a.com/b, kind: generic, paths: [/x]}]", "kubeletDir: Value error, 'relative' must be an absolute path"),  # noqa: E501
            (f"kubeletDir: /{'d' * 80}\nresources: [{{name: a.com/b, kind: generic, paths: [/x]}}]", "kubeletDir: too long for the sockets of a.com/b"),  # noqa: E501
            ("metrics: {listen: nope}\nresources: [{name: a.com/b, kind: generic, paths: [/x]}]", "metrics.listen: Value error, 'nope' must be HOST:PORT"),  # noqa: E501
            ("supervisor: {restart: {initialDelay: 5, maxDelay: 1}}\nresources: [{name: a.com/b, kind: generic, paths: [/x]}]", "supervisor.restart: Value error, maxDelay must be at least initialDelay"),  # noqa: E501
            ("supervisor: {spawner: thread}\nresources: [{name: a.com/b, kind: generic, paths: [/x]}]", "supervisor.spawner: Input should be 'forkserver' or 'exec'"),  # noqa: E501
            ("- a\n- b", "node.yaml: (top level): expected a mapping with a 'resources' list, got list"),
            ("", "got an empty file"),
        ],
        ids=[
            "no-resources", "unknown-top-key", "bad-resource-name", "unknown-kind", "kind-key-range",
            "kind-key-typo", "kind-nested-value", "duplicate-name", "relative-dir", "socket-too-long",
            "bad-listen", "restart-order", "spawner-choice", "not-a-mapping", "empty",
        ],
    )  # fmt: skip
    def test_errors_name_the_file_and_the_field(self, document, message):
        """Every problem reads ``file: field: what was expected``."""
        assert message in errors_of(document)

    def test_every_problem_is_listed_not_only_the_first(self):
        """Problems in several entries are reported together, one line each."""
        text = errors_of(
            "resources: [{name: a.com/b, kind: generic, paths: [/x], count: 0}, {name: a.com/c, kind: nope}]"
        )
        assert len(text.splitlines()) == 2

    def test_unreadable_and_malformed_files_are_configuration_errors(self, tmp_path):
        """A missing file or broken YAML is reported like any other invalid configuration."""
        with pytest.raises(config_.ConfigError, match="cannot read"):
            config_.load_config(tmp_path / "missing.yaml")
        bad = tmp_path / "bad.yaml"
        bad.write_text("resources: [\n")
        with pytest.raises(config_.ConfigError, match="not valid YAML"):
            config_.load_config(bad)
