"""The configuration file: every mistake is reported with the file and the field, before anything starts."""

import json
import sys
from pathlib import Path

import pytest
import yaml
from structlog.testing import capture_logs

from plugvisor.plugins.fpga import Family, FpgaOptions
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

    def test_the_agents_children_take_their_resources_over_from_plugins_started_by_hand(self):
        """A standalone plugin refuses a resource someone serves; the agent's children are its owners."""
        specs = config_.child_specs(config_.parse_config(yaml.safe_load(GOOD), source="node.yaml"))
        assert all("--replace" in spec.args for spec in specs.values())

    def test_a_resource_sets_its_rescan_interval_for_its_child(self):
        """``rescanInterval`` is the framework's: it becomes --rescan-interval, not a kind option."""
        document = GOOD.replace("    count: 10\n", "    count: 10\n    rescanInterval: 2.5\n")
        specs = config_.child_specs(config_.parse_config(yaml.safe_load(document), source="node.yaml"))
        fuse, serial = specs["example.com/fuse"].args, specs["example.com/serial"].args
        assert fuse[fuse.index("--rescan-interval") + 1] == "2.5"
        assert "rescanInterval" not in json.loads(fuse[fuse.index("--options-json") + 1])
        assert "--rescan-interval" not in serial  # the plugin's own default
        for value, expected in (("0", "greater than or equal to 0.05"), (".inf", "a finite number")):
            entry = f"{{name: a.com/b, kind: generic, paths: [/x], rescanInterval: {value}}}"
            message = f"resources[0].rescanInterval: Input should be {expected}"
            assert message in errors_of(f"resources: [{entry}]")

    @pytest.mark.parametrize(
        ("document", "message"),
        [
            ("resource: []", "node.yaml: resource: unknown key; did you mean `resources`?"),
            ("resources: [{name: a.com/b, kind: gpu, matc: {}}]", "resources[0].matc: unknown key; did you mean `match`?"),  # noqa: E501
            ("resources: [{name: a.com/b, kind: gpu, match: {vendor: []}}]", "resources[0].match.vendor: unknown key; did you mean `vendors`?"),  # noqa: E501
            ("resources: [{name: a.com/b, kind: generic, paths: [/x], registraton: x}]", "resources[0].registraton: unknown key; did you mean `registration`?"),  # noqa: E501
            ("resources: [{name: a.com/b, kind: generic, paths: [/x], zzz: 1}]", "resources[0].zzz: unknown key (check the spelling)"),  # noqa: E501
            ("supervisor: {restrat: {}}\nresources: [{name: a.com/b, kind: generic, paths: [/x]}]", "supervisor.restrat: unknown key; did you mean `restart`?"),  # noqa: E501
        ],
        ids=["top", "kind-key", "kind-nested-key", "our-key-in-an-entry", "nothing-close", "nested-own-key"],
    )  # fmt: skip
    def test_an_unknown_key_names_the_nearest_known_one(self, document, message):
        """A typo is the usual reason for an unknown key: the error says which key was probably meant."""
        assert message in errors_of(document)

    def test_no_message_carries_pydantics_prefix(self):
        """pydantic prefixes a validator's message with "Value error, "; the user never sees it."""
        text = errors_of(
            "kubeletDir: relative\nmetrics: {listen: nope}\n"
            "resources: [{name: gpu, kind: generic, paths: [/x]}]"
        )
        assert text.count("\n") == 2 and "Value error" not in text, text

    def test_each_resource_chooses_its_registration_mode(self):
        """``registration`` is the framework's, not the kind's: it goes to --registration, not the options."""
        document = GOOD.replace("    count: 10\n", "    count: 10\n    registration: plugin-watcher\n")
        specs = config_.child_specs(config_.parse_config(yaml.safe_load(document), source="node.yaml"))
        fuse, serial = specs["example.com/fuse"].args, specs["example.com/serial"].args
        assert fuse[fuse.index("--registration") + 1] == "plugin-watcher"
        assert "registration" not in json.loads(fuse[fuse.index("--options-json") + 1])
        assert serial[serial.index("--registration") + 1] == "kubelet-sock"
        assert "resources[0].registration: Input should be 'kubelet-sock' or 'plugin-watcher'" in errors_of(
            "resources: [{name: a.com/b, kind: generic, paths: [/x], registration: watcher}]"
        )

    @pytest.mark.parametrize(
        ("kubelet_dir", "registry"),
        [
            ("/var/lib/kubelet/device-plugins", "/var/lib/kubelet/plugins_registry"),  # the kubelet's root
            ("/tmp/dp", "/tmp/dp.plugins_registry"),  # where `plugvisor kubelet --dir /tmp/dp` watches
        ],
    )
    def test_plugin_watcher_children_serve_where_the_plugins_and_the_emulated_kubelet_look(
        self, kubelet_dir, registry
    ):
        document = f"kubeletDir: {kubelet_dir}\nresources: [{{name: a.com/b, kind: generic, paths: [/x]}}]"
        config = config_.parse_config(yaml.safe_load(document), source="node.yaml")
        assert str(config.plugins_registry) == registry

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
            ("resources: [{name: gpu, kind: generic, paths: [/dev/x]}]", "resources[0].name: 'gpu' has no domain"),  # noqa: E501
            ("resources: [{name: a.com/b, kind: nope}]", "resources[0].kind: unknown plugin kind 'nope'"),
            ("resources: [{name: a.com/b, kind: generic, paths: [/dev/x], count: 0}]", "resources[0].count: Input should be greater than or equal to 1"),  # noqa: E501
            ("resources: [{name: a.com/b, kind: generic, path: [/dev/x]}]", "resources[0].path: unknown key; did you mean `paths`?"),  # noqa: E501
            ("resources: [{name: a.com/b, kind: generic, paths: [dev/x]}]", "resources[0].paths[0].path: 'dev/x' must be an absolute path"),  # noqa: E501
            ("resources: [{name: a.com/b, kind: generic, paths: [/x]}, {name: a.com/b, kind: generic, paths: [/y]}]", "resources[1].name: a.com/b is already configured by resources[0]"),  # noqa: E501
            ("kubeletDir: relative\nresources: [{name: a.com/b, kind: generic, paths: [/x]}]", "kubeletDir: 'relative' must be an absolute path"),  # noqa: E501
            (f"kubeletDir: /{'d' * 80}\nresources: [{{name: a.com/b, kind: generic, paths: [/x]}}]", "kubeletDir: too long for the sockets of a.com/b"),  # noqa: E501
            # Short enough for kubelet.sock's directory; not for plugins_registry beside it, 17 bytes longer.
            (f"kubeletDir: /{'d' * 70}\nresources: [{{name: a.com/b, kind: generic, paths: [/x], registration: plugin-watcher}}]", "kubeletDir: too long for the sockets of a.com/b"),  # noqa: E501
            ("metrics: {listen: nope}\nresources: [{name: a.com/b, kind: generic, paths: [/x]}]", "metrics.listen: 'nope' must be HOST:PORT"),  # noqa: E501
            ("supervisor: {restart: {initialDelay: 5, maxDelay: 1}}\nresources: [{name: a.com/b, kind: generic, paths: [/x]}]", "supervisor.restart: maxDelay must be at least initialDelay"),  # noqa: E501
            ("supervisor: {spawner: thread}\nresources: [{name: a.com/b, kind: generic, paths: [/x]}]", "supervisor.spawner: Input should be 'forkserver' or 'exec'"),  # noqa: E501
            ("- a\n- b", "node.yaml: (top level): expected a mapping with a 'resources' list, got list"),
            ("", "got an empty file"),
        ],
        ids=[
            "no-resources", "unknown-top-key", "bad-resource-name", "unknown-kind", "kind-key-range",
            "kind-key-typo", "kind-nested-value", "duplicate-name", "relative-dir", "socket-too-long",
            "registry-socket-too-long",
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


class TestBounds:
    """What a configuration may hold is bounded: a clear error at once, not minutes and gigabytes."""

    def test_too_many_resources_is_refused_before_validating_any(self):
        entries = [{"name": f"a.com/r{i}", "kind": "generic", "paths": ["/x"]} for i in range(200_000)]
        with pytest.raises(config_.ConfigError, match="200000 entries; at most 256 resources per node"):
            config_.parse_config({"resources": entries}, source="node.yaml")

    def test_a_huge_resource_name_gives_a_short_error(self):
        with pytest.raises(config_.ConfigError) as caught:
            config_.parse_config({"resources": [{"name": "x" * 20_000_000, "kind": "generic"}]}, source="n")
        assert len(str(caught.value)) < 1000 and "(20000000 characters)" in str(caught.value)

    @pytest.mark.parametrize(
        ("document", "message"),
        [
            (
                '{"kubeletDir": "/a\\u0000b", "resources": []}',
                "kubeletDir: '/a\\x00b' contains a NUL",
            ),
            ('{"hostRoot": "/' + "h" * 5000 + '", "resources": []}', "longer than 4096 bytes"),
            ('{"supervisor": {"runtimeDir": "run"}, "resources": []}', "must be an absolute path"),
            (
                '{"supervisor": {"runtimeDir": "/' + "r" * 100 + '"}, "resources": []}',
                "too long for the status",
            ),
            ('{"supervisor": {"restart": {"maxDelay": 1e300}}, "resources": []}', "restart.maxDelay"),
            ('{"supervisor": {"restart": {"maxDelay": ".inf"}}, "resources": []}', "restart.maxDelay"),
        ],
    )
    def test_paths_and_numbers_are_bounded(self, document, message):
        assert message in errors_of(document)

    def test_kind_options_too_large_for_a_command_line_are_refused(self):
        entry = {"name": "a.com/r", "kind": "generic", "paths": ["/dev/x" + "y" * 100 for _ in range(1000)]}
        assert "at most 65536 are allowed" in errors_of(json.dumps({"resources": [entry]}))


class TestLoadConfig:
    def test_a_file_with_a_byte_that_is_not_utf8_is_a_configuration_error(self, tmp_path):
        path = tmp_path / "node.yaml"
        path.write_bytes(GOOD.encode().replace(b"fuse\n", b"fu\xffse\n", 1))
        with pytest.raises(
            config_.ConfigError, match=r"node.yaml: line \d+, column \d+: byte 0xff is not UTF-8"
        ):
            config_.load_config(path)

    def test_a_repeated_key_is_a_configuration_error(self, tmp_path):
        path = tmp_path / "node.yaml"
        path.write_text("resources:\n  - {name: a.com/b, kind: generic, paths: [/x], count: 1, count: 5}\n")
        with pytest.raises(config_.ConfigError, match="duplicate key 'count'"):
            config_.load_config(path)

    def test_the_node_check_names_an_uncreatable_kubelet_dir_and_a_missing_host_root(self, tmp_path):
        (tmp_path / "file").write_text("")
        path = tmp_path / "node.yaml"
        path.write_text(
            f"kubeletDir: {tmp_path}/file/dp\nhostRoot: {tmp_path}/nothing\n"
            "resources: [{name: a.com/b, kind: generic, paths: [/x]}]\n"
        )
        config_.load_config(path)  # the file itself is fine
        with pytest.raises(config_.ConfigError) as caught:
            config_.load_node_config(path)
        assert str(caught.value).splitlines() == [
            f"{path}: kubeletDir: {tmp_path}/file/dp: cannot create it: Not a directory",
            f"{path}: hostRoot: {tmp_path}/nothing: does not exist; "
            "expected the host's / (or an emulated lab root)",
        ]


class TestMonitoring:
    def test_monitoring_is_on_by_default_with_a_5s_poll_for_the_whole_agent(self):
        config = config_.parse_config(yaml.safe_load(GOOD), source="node.yaml")
        assert config.monitoring.enabled
        assert config.monitoring.pod_resources_interval == 5.0
        assert config.monitoring.pod_resources_socket is None

    @pytest.mark.parametrize(
        ("section", "field"),
        [
            ("{podResourcesInterval: 0}", "monitoring.podResourcesInterval"),
            ("{telemetryInterval: -1}", "monitoring.telemetryInterval"),
            ("{pollEvery: 5}", "monitoring.pollEvery"),
        ],
    )
    def test_bad_monitoring_values_name_the_field(self, section, field):
        assert field in errors_of(GOOD + f"monitoring: {section}\n")


DRA = """
kubeletDir: /var/lib/kubelet/device-plugins
hostRoot: /host
specRoot: /
nodeName: worker-1
resources:
  - {name: gpu.plugvisor.io, kind: gpu, mode: dra, match: {vendors: ["0x10de"]}}
  - {name: plugvisor.io/fuse, kind: generic, paths: ["/dev/fuse"]}
"""


class TestDraMode:
    def test_a_dra_resource_is_named_by_its_driver_and_runs_the_dra_driver_command(self):
        config = config_.parse_config(yaml.safe_load(DRA), source="node.yaml")
        specs = config_.child_specs(config, log_format="json")

        spec = specs["gpu.plugvisor.io"]
        assert spec.mode == "dra"
        assert spec.args[:6] == ("plugin", "gpu", "--mode", "dra", "--driver", "gpu.plugvisor.io")
        args = {
            option: spec.args[spec.args.index(option) + 1] for option in spec.args if option.startswith("--")
        }
        assert args["--kubelet-dir"] == "/var/lib/kubelet/device-plugins"
        assert args["--node-name"] == "worker-1"
        assert args["--spec-root"] == "/"
        assert json.loads(args["--options-json"]) == {"match": {"vendors": ["0x10de"]}}
        assert "--replace" in spec.args
        assert "--on-kubelet-restart" not in spec.args  # the plugin watcher re-dials a DRA driver
        assert specs["plugvisor.io/fuse"].mode == "device-plugin"

    def test_the_driver_sockets_are_where_the_kubelet_looks_relative_to_its_root(self):
        config = config_.parse_config(yaml.safe_load(DRA), source="node.yaml")

        registration, dra = config_.dra_socket_paths(config.kubelet_dir, "gpu.plugvisor.io")

        assert str(registration) == "/var/lib/kubelet/plugins_registry/gpu.plugvisor.io-reg.sock"
        assert str(dra) == "/var/lib/kubelet/plugins/gpu.plugvisor.io/dra.sock"

    def test_beside_an_emulated_kubelets_directory_the_driver_sockets_are_where_it_looks(self):
        """`plugvisor kubelet --dir /tmp/dp` watches /tmp/dp.plugins_registry; nodes share nothing."""
        registration, dra = config_.dra_socket_paths(Path("/tmp/dp"), "gpu.plugvisor.io")

        assert str(registration) == "/tmp/dp.plugins_registry/gpu.plugvisor.io-reg.sock"
        assert str(dra) == "/tmp/dp.plugins/gpu.plugvisor.io/dra.sock"

    @pytest.mark.parametrize(
        ("entry", "message"),
        [
            (
                "{name: plugvisor.io/gpu, kind: gpu, mode: dra}",
                "node.yaml: resources[0].name: DRA driver name 'plugvisor.io/gpu' is not a DNS subdomain",
            ),
            (
                "{name: gpu.plugvisor.io, kind: gpu}",
                "node.yaml: resources[0].name: 'gpu.plugvisor.io' has no domain",
            ),
            (
                "{name: gpu.plugvisor.io, kind: gpu, mode: dra, registration: kubelet-sock}",
                "node.yaml: resources[0]: a DRA driver registers through the kubelet's plugin "
                "watcher: leave out registration",
            ),
            (
                "{name: plugvisor.io/gpu, kind: gpu, mode: csi}",
                "node.yaml: resources[0].mode: expected device-plugin or dra, got 'csi'",
            ),
        ],
        ids=[
            "dra-named-like-a-resource",
            "resource-named-like-a-driver",
            "dra-on-kubelet-sock",
            "unknown-mode",
        ],
    )
    def test_a_wrong_name_or_mode_names_the_entry(self, entry, message):
        errors = errors_of(f"resources:\n  - {entry}\n")

        assert message in errors
        assert len(errors.splitlines()) == 1

    def test_a_driver_name_too_long_for_the_sockets_is_refused(self):
        name = "a" * 60 + ".io"
        entry = f"{{name: {name}, kind: gpu, mode: dra}}"
        errors = errors_of(f"kubeletDir: /{'k' * 40}/device-plugins\nresources:\n  - {entry}\n")

        assert "too long for the sockets of " + name in errors

    def test_the_fpga_kinds_family_is_still_taken_under_its_old_name_mode_with_a_warning(self):
        """fpga's `mode: af|region|xilinx` predates DRA's `mode`: it means `family`, and the file says so."""
        document = "resources:\n  - {name: plugvisor.io/fpga, kind: fpga, mode: region}\n"
        with capture_logs() as logs:
            config = config_.parse_config(yaml.safe_load(document), source="node.yaml")

        (resource,) = config.resources
        assert not resource.dra and resource.options == {"mode": "region"}
        assert config_.child_specs(config)["plugvisor.io/fpga"].args[:2] == ("plugin", "fpga")
        (warning,) = [entry for entry in logs if entry["event"] == "deprecated_key"]
        assert warning["use"] == "family: region"
        assert FpgaOptions.model_validate(resource.options).family is Family.REGION

    @pytest.mark.parametrize(
        ("entry", "message"),
        [
            (
                "{name: plugvisor.io/fpga, kind: fpga, mode: dra2}",
                "node.yaml: resources[0].mode: expected device-plugin or dra, got 'dra2'",
            ),
            (
                "{name: plugvisor.io/fpga, kind: fpga, mode: af, family: region}",
                "give the family once: 'family' ('region'), not also its old name 'mode' ('af')",
            ),
        ],
        ids=["not-a-family-either", "both-spellings"],
    )
    def test_an_fpga_mode_that_is_neither_an_api_nor_a_family_is_refused(self, entry, message):
        assert message in errors_of(f"resources:\n  - {entry}\n")

    def test_a_node_name_must_be_a_node_name(self):
        errors = errors_of(
            "nodeName: Worker_1\nresources:\n  - {name: gpu.plugvisor.io, kind: gpu, mode: dra}\n"
        )

        assert "node.yaml: nodeName: 'Worker_1' is not a lowercase DNS-1123 subdomain" in errors
