"""The framework and the emulated kubelet keep separate copies of the kubelet's name rules.

They are separate on purpose (a wrong framework rule must not be confirmed by the
emulator that tests it), so both are held here against the same vectors, taken from
upstream: ``pkg/apis/core/v1/helper/helpers_test.go`` (IsExtendedResourceName),
``apimachinery/pkg/util/validation/validation_test.go`` (qualified names) and Go's
``strconv`` quote tests.
"""

import pytest

from plugvisor.common import names as framework_names
from plugvisor.emulators.kubelet import names as kubelet_names

VALID = [
    "example.com/resource",
    "test.device/x",
    "nvidia.com/gpu",
    "plugvisor.io/gpu",
    "a.b/C_d.e-f",
    "x/y",
    "foo.bar/a",
    "example.com/" + "x" * 63,
    "a" * 244 + "/x",
]
INVALID = [
    "gpu",
    "",
    "cpu",
    "kubernetes.io/gpu",
    "foo.kubernetes.io/x",
    "kubernetes.io/",
    "Example.com/gpu",
    "example.com/-x",
    "example.com/x-",
    "a/b/c",
    "requests.example.com/x",
    "example.com/",
    "/gpu",
    "example.com/" + "x" * 64,
    "a" * 245 + "/x",
    "exa mple.com/gpu",
    "example.com/gpu\n",
    "example.com\n/gpu",
    "example..com/gpu",
    "example.com/g pu",
]
QUOTED = [
    ("v1", '"v1"'),
    ('a"b', '"a\\"b"'),
    ("a\\b", '"a\\\\b"'),
    ("line\nbreak\t", '"line\\nbreak\\t"'),
    ("\x01", '"\\x01"'),
    ("\x7f", '"\\x7f"'),
    ("é", '"é"'),
    ("\u200b", '"\\u200b"'),
    ("☺", '"☺"'),
    ("", '""'),
]
COPIES = [pytest.param(framework_names, id="framework"), pytest.param(kubelet_names, id="emulator")]


@pytest.mark.parametrize("rules", COPIES)
@pytest.mark.parametrize("name", VALID)
def test_both_copies_accept_what_the_kubelet_accepts(rules, name):
    assert rules.is_extended_resource_name(name)


@pytest.mark.parametrize("rules", COPIES)
@pytest.mark.parametrize("name", INVALID)
def test_both_copies_reject_what_the_kubelet_rejects(rules, name):
    assert not rules.is_extended_resource_name(name)


@pytest.mark.parametrize("rules", COPIES)
@pytest.mark.parametrize(("value", "quoted"), QUOTED)
def test_both_copies_quote_like_strconv_quote(rules, value, quoted):
    assert rules.go_quote(value) == quoted


def test_the_emulator_reports_qualified_name_errors_in_the_api_servers_words():
    assert kubelet_names.qualified_name_errors("example.com/") == [
        "name part must be non-empty",
        "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
        "alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
        "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')",
    ]
    assert kubelet_names.qualified_name_errors("Example.com/x")[0].startswith(
        "prefix part a lowercase RFC 1123 subdomain must consist of"
    )
