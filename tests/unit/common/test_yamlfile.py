"""Operator-written YAML: bounded, strict, and every failure names the file (and the line and key)."""

import os

import pytest

from plugvisor.common.yamlfile import MAX_FILE_BYTES, YamlFileError, parse_yaml, read_yaml


def error_of(path) -> str:
    with pytest.raises(YamlFileError) as caught:
        read_yaml(path)
    return str(caught.value)


class TestReadYaml:
    def test_a_good_file_parses(self, tmp_path):
        (tmp_path / "f.yaml").write_text("a: 1\nb: [x, y]\n")
        assert read_yaml(tmp_path / "f.yaml") == {"a": 1, "b": ["x", "y"]}

    @pytest.mark.parametrize("name", ["no\nde.yaml", "\x1b[2Jnode.yaml", "node\u202e.yaml"])
    def test_a_path_is_echoed_with_what_a_terminal_would_act_on_escaped(self, tmp_path, name):
        """`--config` is input too: a newline or an escape sequence in it must not reach the terminal."""
        said = error_of(tmp_path / name)
        assert said.isprintable(), said
        assert said.endswith(": cannot read: No such file or directory"), said

    def test_a_byte_that_is_not_utf8_is_named_with_its_line_and_column(self, tmp_path):
        (tmp_path / "f.yaml").write_bytes(b"a: 1\nname: ab\xffc\n")
        assert error_of(tmp_path / "f.yaml") == (
            f"{tmp_path / 'f.yaml'}: line 2, column 9: byte 0xff is not UTF-8; expected UTF-8 YAML text"
        )

    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            (
                "count: 1\ncount: 5\n",
                "line 2, column 1: not valid YAML: duplicate key 'count' (first at line 1)",
            ),
            ("{count: 1, count: 5}\n", "duplicate key 'count' (first at line 1)"),
            ("r:\n  - {name: a, x: 1}\n  - {name: b, x: 2, x: 3}\n", "line 3, column 21"),
        ],
    )
    def test_a_repeated_key_is_an_error_naming_the_key_and_line(self, tmp_path, text, expected):
        (tmp_path / "f.yaml").write_text(text)
        assert expected in error_of(tmp_path / "f.yaml")

    def test_merge_keys_may_be_overridden_by_the_mapping_own_keys(self):
        assert parse_yaml("d: &d {a: 1, b: 2}\ne: {<<: *d, b: 3}\n", source="s")["e"] == {"a": 1, "b": 3}

    def test_a_directory_a_fifo_and_a_missing_file_are_named_not_read(self, tmp_path):
        os.mkfifo(tmp_path / "fifo")
        assert "not a regular file" in error_of(tmp_path / "fifo")  # and did not block
        assert "a directory" in error_of(tmp_path)
        assert "No such file or directory" in error_of(tmp_path / "missing.yaml")

    def test_a_huge_file_is_refused_without_reading_it_whole(self, tmp_path):
        with (tmp_path / "f.yaml").open("wb") as big:
            big.truncate(2 << 30)
        assert f"larger than {MAX_FILE_BYTES // 1024} KiB" in error_of(tmp_path / "f.yaml")

    def test_an_integer_too_long_to_convert_is_named_by_field_and_line(self):
        """Python refuses int() of more than 4300 digits with a bare ValueError; here the field is named."""
        text = f"r:\n  - {{name: a, count: {'9' * 5000}}}\n"
        with pytest.raises(YamlFileError) as caught:
            parse_yaml(text, source="f.yaml")
        assert str(caught.value) == (
            "f.yaml: r[0].count: line 2, column 22: an integer of 5000 digits; expected a number of at most "
            "4300 digits"
        )

    def test_long_integers_within_the_limit_and_in_other_bases_still_parse(self):
        data = parse_yaml(f"a: {'9' * 4300}\nb: 0x{'f' * 5000}\n", source="f.yaml")
        assert data["a"] == int("9" * 4300)
        assert data["b"] == 16**5000 - 1

    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            ("a: 2024-13-01\n", "line 1, column 4: not valid YAML: '2024-13-01' is not a valid timestamp"),
            ("a: !!int abc\n", "line 1, column 4: not valid YAML: 'abc' is not a valid int"),
            ("a: !!bool maybe\n", "line 1, column 4: not valid YAML: 'maybe' is not a valid bool"),
            ("a: !!timestamp x\n", "line 1, column 4: not valid YAML: 'x' is not a valid timestamp"),
        ],
    )
    def test_a_value_pyyaml_cannot_build_is_an_error_at_its_line(self, text, expected):
        """PyYAML's constructors raise ValueError, KeyError or AttributeError, with no position."""
        with pytest.raises(YamlFileError, match=None) as caught:
            parse_yaml(text, source="f.yaml")
        assert str(caught.value).startswith(f"f.yaml: {expected}")

    def test_an_alias_bomb_is_refused(self):
        lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
        lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
        with pytest.raises(YamlFileError, match="more than 100000 values"):
            parse_yaml("\n".join(lines), source="bomb.yaml")

    @pytest.mark.parametrize("opening", ["[", "{a: ", "- "])
    def test_deep_nesting_is_an_error_naming_the_file_not_a_recursion_error(self, tmp_path, opening):
        # 2 KB of brackets used to end in a RecursionError: a traceback, and an agent killed by SIGHUP.
        depth = 5000
        closing = {"[": "]", "{a: ": "}", "- ": ""}[opening]
        text = opening * depth + "x" + closing * depth + "\n"  # "- - x" is a list in a list, block style
        (tmp_path / "f.yaml").write_text(text)
        message = error_of(tmp_path / "f.yaml")
        assert message.startswith(f"{tmp_path / 'f.yaml'}: line ")
        assert "nested more than 100 levels deep" in message

    def test_nesting_a_configuration_uses_is_fine(self):
        assert parse_yaml("a: " + "[" * 50 + "1" + "]" * 50 + "\n", source="s")["a"] is not None
