"""Bad input to every command: exit 2 with one clear message naming the input, never a traceback.

Each case here was a traceback, a hang or a silent acceptance before (issue 9, section 5,
and the adversarial pass recorded in the closing note).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def plugvisor(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "plugvisor", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **(env or {})},
    )


def assert_usage_error(result: subprocess.CompletedProcess, *expected: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    for text in expected:
        assert text in result.stderr, result.stderr


@pytest.fixture
def files(short_dir: Path) -> dict[str, Path]:
    not_utf8 = short_dir / "not-utf8.yaml"
    not_utf8.write_bytes(b"resources:\n  - {name: example.com/null, kind: generic, paths: [/dev/nu\xffll]}\n")
    repeated = short_dir / "repeated.yaml"
    repeated.write_text(
        "resources:\n  - {name: example.com/null, kind: generic, paths: [/dev/null], count: 1, count: 5}\n"
    )
    options_not_utf8 = short_dir / "options-not-utf8.yaml"
    options_not_utf8.write_bytes(b"paths: [/dev/null]\ncount: \xff\n")
    options_repeated = short_dir / "options-repeated.yaml"
    options_repeated.write_text("paths: [/dev/null]\ncount: 1\ncount: 5\n")
    (short_dir / "file").write_text("")
    return {
        "not_utf8": not_utf8,
        "repeated": repeated,
        "options_not_utf8": options_not_utf8,
        "options_repeated": options_repeated,
        "file": short_dir / "file",
    }


class TestConfigurationFiles:
    @pytest.mark.parametrize("command", [["run"], ["export", "supervisord"], ["status"]])
    def test_a_byte_that_is_not_utf8_is_named_with_the_file(self, files, command, short_dir):
        result = plugvisor(
            *command, "--config", str(files["not_utf8"]), env={"PLUGVISOR_RUNTIME_DIR": str(short_dir)}
        )
        assert_usage_error(result, f"{files['not_utf8']}: line 2, column 60: byte 0xff is not UTF-8")

    @pytest.mark.parametrize("command", [["run"], ["export", "supervisord"]])
    def test_a_repeated_key_is_an_error_naming_key_and_line(self, files, command):
        result = plugvisor(*command, "--config", str(files["repeated"]))
        assert_usage_error(result, f"{files['repeated']}: line 2", "duplicate key 'count'")

    @pytest.mark.parametrize(
        ("name", "expected"),
        [("options_not_utf8", "byte 0xff is not UTF-8"), ("options_repeated", "duplicate key 'count'")],
    )
    def test_the_options_file_of_a_single_plugin_too(self, files, short_dir, name, expected):
        result = plugvisor(
            "plugin", "generic", "--kubelet-dir", str(short_dir / "dp"), "--options-file", str(files[name])
        )
        assert_usage_error(result, "--options-file", str(files[name]), expected)

    def test_options_json_nested_absurdly_deep(self, short_dir):
        result = plugvisor(
            "plugin", "generic", "--kubelet-dir", str(short_dir / "dp"), "--options-json", "[" * 100_000
        )
        assert_usage_error(result, "--options-json", "nested too deeply")

    def test_options_json_with_a_key_twice(self, short_dir):
        """Which of two counts was meant? node.yaml refuses a repeated key, and so does its JSON form."""
        options = '{"paths": ["/dev/null"], "count": 1, "count": 5}'
        dp = str(short_dir / "dp")
        result = plugvisor("plugin", "generic", "--kubelet-dir", dp, "--options-json", options)
        assert_usage_error(result, "--options-json", "duplicate key 'count'")


HUGE = "9" * 5000
"""5,000 digits: beyond Python's int-str conversion limit (4300), a bare ValueError in every reader."""


class TestAnIntegerTooLongToConvert:
    @pytest.mark.parametrize("command", [["run"], ["export", "supervisord"], ["status"]])
    def test_in_the_node_configuration_it_is_named_with_file_field_and_line(self, command, short_dir):
        config = short_dir / "node.yaml"
        config.write_text(
            f"supervisor: {{runtimeDir: {short_dir}/run}}\n"
            f"resources:\n  - {{name: example.com/null, kind: generic, paths: [/dev/null], count: {HUGE}}}\n"
        )
        result = plugvisor(*command, "--config", str(config))
        assert_usage_error(
            result, f"{config}: resources[0].count: line 3, column 72: an integer of 5000 digits; expected"
        )

    def test_in_the_options_file_of_a_plugin(self, short_dir):
        options = short_dir / "options.yaml"
        options.write_text(f"paths: [/dev/null]\ncount: {HUGE}\n")
        result = plugvisor(
            "plugin", "generic", "--kubelet-dir", str(short_dir / "dp"), "--options-file", str(options)
        )
        expected = f"{options}: count: line 2, column 8: an integer of 5000"
        assert_usage_error(result, "--options-file", expected)

    def test_in_the_options_json_of_a_plugin(self, short_dir):
        options = f'{{"count": {HUGE}}}'
        dp = str(short_dir / "dp")
        result = plugvisor("plugin", "generic", "--kubelet-dir", dp, "--options-json", options)
        assert_usage_error(result, "--options-json", "count: an integer of 5000 digits")

    def test_in_a_lab_profile(self, short_dir):
        profile = short_dir / "profile.yaml"
        profile.write_text(f"gpus: {{count: {HUGE}}}\n")
        result = plugvisor("lab", "create", str(short_dir / "lab"), "--profile", str(profile))
        assert_usage_error(result, f"{profile}: gpus.count: line 1, column 15: an integer of 5000 digits")


class TestHostAndKubeletDirectories:
    def test_a_host_root_that_does_not_exist(self, short_dir):
        result = plugvisor(
            "plugin", "gpu", "--host-root", str(short_dir / "typo"), "--kubelet-dir", str(short_dir / "dp")
        )
        assert_usage_error(result, f"--host-root: {short_dir / 'typo'}: does not exist")

    def test_an_uncreatable_kubelet_dir_for_a_plugin(self, files):
        result = plugvisor("plugin", "generic", "--path", "/dev/null", "--kubelet-dir", f"{files['file']}/dp")
        assert_usage_error(result, f"--kubelet-dir: {files['file']}/dp: cannot create it: Not a directory")

    @pytest.mark.skipif(os.geteuid() != 0, reason="as another user the check refuses it before start")
    def test_a_kubelet_dir_the_kernel_refuses_to_create(self):
        """As root /proc looks writable, so the check passes; the watch's mkdir failed with a traceback."""
        result = plugvisor("plugin", "generic", "--path", "/dev/null", "--kubelet-dir", "/proc/no-such-dir")
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr, result.stderr
        assert "/proc/no-such-dir: No such file or directory" in result.stderr, result.stderr

    def test_a_kubelet_dir_that_is_a_dangling_link(self, short_dir):
        """It passed the check (nothing was created any more) and the watch's mkdir died on it."""
        (short_dir / "dp").symlink_to(short_dir / "nowhere")
        config = short_dir / "node.yaml"
        config.write_text(
            f"kubeletDir: {short_dir}/dp\nsupervisor: {{runtimeDir: {short_dir}/run}}\n"
            "resources: [{name: example.com/null, kind: generic, paths: [/dev/null]}]\n"
        )
        expected = f"{short_dir}/dp: a symbolic link to {short_dir}/nowhere, which does not exist"
        assert_usage_error(plugvisor("run", "--config", str(config)), f"kubeletDir: {expected}")
        result = plugvisor("plugin", "generic", "--path", "/dev/null", "--kubelet-dir", str(short_dir / "dp"))
        assert_usage_error(result, f"--kubelet-dir: {expected}")

    def test_an_uncreatable_kubelet_dir_for_the_agent(self, files, short_dir):
        config = short_dir / "node.yaml"
        config.write_text(
            f"kubeletDir: {files['file']}/dp\nsupervisor: {{runtimeDir: {short_dir}/run}}\n"
            "resources: [{name: example.com/null, kind: generic, paths: [/dev/null]}]\n"
        )
        result = plugvisor("run", "--config", str(config))
        assert_usage_error(result, f"{config}: kubeletDir: {files['file']}/dp: cannot create it")
        assert not (short_dir / "run").exists()

    @pytest.mark.skipif(os.geteuid() != 0, reason="mounting a read-only tmpfs needs root")
    def test_a_read_only_kubelet_dir(self, short_dir):
        read_only = short_dir / "ro"
        read_only.mkdir()
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(read_only)], check=False)
        if mounted.returncode != 0:
            pytest.skip("this environment cannot mount tmpfs")
        try:
            result = plugvisor("plugin", "generic", "--path", "/dev/null", "--kubelet-dir", str(read_only))
            assert_usage_error(result, f"--kubelet-dir: {read_only}: on a read-only filesystem")
        finally:
            subprocess.run(["umount", str(read_only)], check=True)


class TestStatus:
    @pytest.mark.parametrize(
        ("document", "expected"),
        [
            ([], "top level is list, expected an object"),
            ({"supervisor": {"pid": "1"}}, "supervisor.pid: expected an integer"),
            ({"supervisor": {"pid": 1}, "children": 5}, "children: expected a list"),
            ({"supervisor": {"pid": 1}, "children": [{"resource": "a"}]}, "children[0].state: missing"),
            (
                {
                    "supervisor": {"pid": 1},
                    "children": [{"resource": "a", "state": "RUNNING", "devices": {"total": "x"}}],
                },
                "children[0].devices: expected integer healthy and total",
            ),
        ],
    )
    def test_an_odd_state_file_is_named_not_a_traceback(self, short_dir, document, expected):
        (short_dir / "state.json").write_text(json.dumps(document))
        result = plugvisor("status", "--runtime-dir", str(short_dir))
        assert_usage_error(
            result, f"{short_dir / 'state.json'} is not a plugvisor agent state file: {expected}"
        )

    def test_a_state_file_that_is_a_fifo_does_not_block(self, short_dir):
        os.mkfifo(short_dir / "state.json")
        result = plugvisor("status", "--runtime-dir", str(short_dir), timeout=30)
        assert_usage_error(result, "is not a plugvisor agent state file: not a regular file")

    def test_a_state_file_that_is_not_utf8(self, short_dir):
        (short_dir / "state.json").write_bytes(b'{"supervisor": {"pid": 1}, "x": "\xff"}')
        assert_usage_error(
            plugvisor("status", "--runtime-dir", str(short_dir)), "is not a plugvisor agent state file"
        )


class TestBoundedEchoes:
    def test_a_huge_resource_name_gives_a_short_error(self, short_dir):
        result = plugvisor(
            "plugin",
            "generic",
            "--path",
            "/dev/null",
            "--kubelet-dir",
            str(short_dir / "dp"),
            "--resource",
            "x" * 100_000,
        )
        assert result.returncode == 2
        assert "(100000 characters)" in result.stderr and len(result.stderr) < 2000

    def test_a_huge_kind_name_gives_a_short_error(self, short_dir):
        result = plugvisor("plugin", "y" * 100_000, "--kubelet-dir", str(short_dir / "dp"))
        assert_usage_error(result, "unknown plugin kind", "(100000 characters)")
        assert len(result.stderr) < 2000


class TestAgentStart:
    def _config(self, short_dir, **extra) -> Path:
        config = short_dir / "node.yaml"
        document = {
            "kubeletDir": str(short_dir / "dp"),
            "supervisor": {"runtimeDir": str(short_dir / "run")},
            "resources": [{"name": "example.com/null", "kind": "generic", "paths": ["/dev/null"]}],
            **extra,
        }
        config.write_text(json.dumps(document))
        return config

    def test_an_uncreatable_runtime_dir(self, short_dir, files):
        config = self._config(short_dir, supervisor={"runtimeDir": f"{files['file']}/run"})
        result = plugvisor("run", "--config", str(config))
        assert_usage_error(result, f"{config}: supervisor.runtimeDir: {files['file']}/run: cannot create it")

    def test_a_metrics_port_in_use(self, short_dir):
        import socket

        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = busy.getsockname()[1]
            config = self._config(short_dir, metrics={"listen": f"127.0.0.1:{port}"})
            result = plugvisor("run", "--config", str(config))
        assert_usage_error(result, f"{config}: metrics.listen: cannot listen on 127.0.0.1:{port}: ")
        assert not (short_dir / "run" / "supervisor.pid").exists()

    def test_export_to_a_file_that_cannot_be_written(self, short_dir, files):
        result = plugvisor(
            "export", "supervisord", "--config", str(self._config(short_dir)), "-o", f"{files['file']}/x"
        )
        assert result.returncode == 1 and "Traceback" not in result.stderr
        assert f"--output: cannot write {files['file']}/x: Not a directory" in result.stderr

    def test_a_relative_spec_root(self, short_dir):
        result = plugvisor(
            "plugin",
            "generic",
            "--path",
            "/dev/null",
            "--kubelet-dir",
            str(short_dir / "dp"),
            "--spec-root",
            "rel",
        )
        assert_usage_error(result, "--spec-root", "rel must be an absolute path")

    @pytest.mark.parametrize("value", ["nan", "inf", "-1"])
    def test_a_rescan_interval_that_is_not_a_duration(self, short_dir, value):
        result = plugvisor(
            "plugin",
            "generic",
            "--path",
            "/dev/null",
            "--kubelet-dir",
            str(short_dir / "dp"),
            "--rescan-interval",
            value,
        )
        assert_usage_error(result, "--rescan-interval")


def test_a_path_with_a_line_break_cannot_inject_a_supervisord_program(short_dir):
    config = short_dir / "node.yaml"
    config.write_text(
        'kubeletDir: "/tmp/d\\n[program:evil]\\ncommand=/bin/touch /tmp/pwned"\n'
        "resources: [{name: example.com/null, kind: generic, paths: [/dev/null]}]\n"
    )
    result = plugvisor("export", "supervisord", "--config", str(config))
    assert_usage_error(result, "kubeletDir: '/tmp/d", "contains a control character")
    assert "[program:evil]" not in result.stdout
