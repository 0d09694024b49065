"""The kubelet's extended-resource-name rule and Go's %q quoting, reproduced exactly."""

import pytest

from plugvisor.common.names import extended_resource_name_problem, go_quote, is_extended_resource_name


class TestExtendedResourceName:
    @pytest.mark.parametrize(
        "name",
        ["example.com/resource", "test.device/x", "nvidia.com/gpu", "plugvisor.io/gpu", "a.b/C_d.e-f", "x/y"],
    )
    def test_accepts_names_the_kubelet_accepts(self, name):
        assert is_extended_resource_name(name)
        assert extended_resource_name_problem(name) is None

    @pytest.mark.parametrize(
        "name",
        [
            "gpu",
            "kubernetes.io/gpu",
            "foo.kubernetes.io/x",
            "Example.com/gpu",
            "example.com/-x",
            "a/b/c",
            "requests.example.com/x",
            "example.com/",
            "/gpu",
            "example.com/" + "x" * 64,
            "a" * 245 + ".com/x",
            "exa mple.com/gpu",
            "example.com/gpu\n",
            "example.com\n/gpu",
        ],
    )
    def test_rejects_names_the_kubelet_rejects(self, name):
        assert not is_extended_resource_name(name)
        problem = extended_resource_name_problem(name)
        assert problem is not None and repr(name) in problem

    def test_name_part_may_be_exactly_63_characters(self):
        assert is_extended_resource_name("example.com/" + "x" * 63)


class TestGoQuote:
    @pytest.mark.parametrize(
        ("value", "quoted"),
        [
            ("v1", '"v1"'),
            ('a"b', '"a\\"b"'),
            ("a\\b", '"a\\\\b"'),
            ("line\nbreak\t", '"line\\nbreak\\t"'),
            ("\x01", '"\\x01"'),
            ("é", '"é"'),
            ("\u200b", '"\\u200b"'),
            ("", '""'),
        ],
    )
    def test_quotes_like_strconv_quote(self, value, quoted):
        assert go_quote(value) == quoted
