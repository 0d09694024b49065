"""The gpu kind's ``nvml:`` keys: NVIDIA's health-check switches, and what a hostile value gets."""

import pydantic
import pytest

from plugvisor.common.validation import describe
from plugvisor.plugins.gpu.options import DEFAULT_IGNORED_XIDS, GpuOptions


def nvml(**keys):
    return GpuOptions.model_validate({"nvml": keys}).nvml


class TestWhichXidsCount:
    def test_by_default_nvidias_ignored_xids_do_nothing_and_others_count(self):
        options = nvml()
        assert not any(options.xid_is_critical(x) for x in DEFAULT_IGNORED_XIDS)
        assert options.xid_is_critical(79)
        assert options.xid_is_critical(48)

    def test_a_list_adds_to_the_ignored_ones(self):
        options = nvml(disableHealthChecks=[79])
        assert not options.xid_is_critical(79)
        assert not options.xid_is_critical(13)
        assert options.xid_is_critical(48)

    def test_enable_takes_an_xid_back_from_the_default_ignore_list(self):
        options = nvml(enableHealthChecks=[13])
        assert options.xid_is_critical(13)
        assert not options.xid_is_critical(31)

    def test_enable_all_takes_every_xid_back(self):
        assert all(nvml(enableHealthChecks="all").xid_is_critical(x) for x in DEFAULT_IGNORED_XIDS)

    def test_xids_turns_the_xid_check_off_but_not_nvml_health(self):
        options = nvml(disableHealthChecks="xids")
        assert not options.xid_is_critical(79)
        assert options.health

    def test_all_turns_nvml_health_off(self):
        options = nvml(disableHealthChecks="all")
        assert not options.health
        assert not options.xid_is_critical(79)

    def test_nvml_is_used_where_it_loads_unless_turned_off(self):
        assert nvml().enabled == "auto"
        assert nvml(enabled=False).enabled is False

    def test_a_repeated_xid_is_one_entry(self):
        assert nvml(disableHealthChecks=[48, 48, 63]).disable_health_checks == (48, 63)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"disableHealthChecks": [-1]}, "nvml.disableHealthChecks: item 0: -1 is not an XID number"),
        ({"disableHealthChecks": [65536]}, "nvml.disableHealthChecks: item 0: 65536 is not an XID number"),
        ({"disableHealthChecks": ["79"]}, "nvml.disableHealthChecks: item 0: '79' is not an XID number"),
        ({"disableHealthChecks": [True]}, "nvml.disableHealthChecks: item 0: True is not an XID number"),
        ({"disableHealthChecks": [1.5]}, "nvml.disableHealthChecks: item 0: 1.5 is not an XID number"),
        (
            {"disableHealthChecks": list(range(1, 10**6))},
            "nvml.disableHealthChecks: 999999 XIDs; at most 1024",
        ),
        ({"disableHealthChecks": "some"}, "nvml.disableHealthChecks: expected 'all' or 'xids' or a list"),
        ({"disableHealthChecks": 79}, "nvml.disableHealthChecks: expected 'all' or 'xids' or a list"),
        ({"enableHealthChecks": "xids"}, "nvml.enableHealthChecks: expected 'all' or a list"),
        ({"enableHealthChecks": [0]}, "nvml.enableHealthChecks: item 0: 0 is not an XID number"),
        ({"enabled": True}, "nvml.enabled: expected 'auto' or false, got True"),
        ({"enabled": "yes"}, "nvml.enabled: expected 'auto' or false"),
        ({"recoverAfterSeconds": -1}, "nvml.recoverAfterSeconds: Input should be greater than or equal to 0"),
        ({"recoverAfterSeconds": "5"}, "nvml.recoverAfterSeconds: Input should be a valid integer"),
        ({"ignoredXids": [1]}, "nvml.ignoredXids: unknown key"),
    ],
)
def test_a_bad_value_is_one_error_naming_the_key(keys, message):
    with pytest.raises(pydantic.ValidationError) as info:
        GpuOptions.model_validate({"nvml": keys})
    assert message in describe(info.value, source="node.yaml")
