"""The nic kind's options and naming rules."""

import pydantic
import pytest

from plugvisor.common.validation import describe
from plugvisor.plugins.nic import NicOptions, env_name


def test_env_name_follows_the_sriov_plugin():
    assert env_name("intel.com/intel_sriov_netdevice") == "PCIDEVICE_INTEL_COM_INTEL_SRIOV_NETDEVICE"
    assert env_name("example.com/nic-a") == "PCIDEVICE_EXAMPLE_COM_NIC_A"


def test_pf_names_with_vf_ranges():
    match = NicOptions.model_validate({"match": {"pfNames": ["ens1f0#0-2,7", "ens1f1"]}}).match
    assert match.pf_ranges() == {"ens1f0": frozenset({0, 1, 2, 7}), "ens1f1": None}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"match": {"pfNames": ["ens1f0#3-1"]}},
            "match.pfNames[0]: Value error, 'ens1f0#3-1': VF range 3-1 runs backwards",
        ),
        ({"match": {"rootDevices": ["zz"]}}, "match.rootDevices[0]: Value error, 'zz' is not a PCI address"),
        ({"match": {"linkTypes": ["ether"]}}, "match.linkTypes: unknown key"),
    ],
)
def test_bad_options_name_the_field(options, message):
    with pytest.raises(pydantic.ValidationError) as info:
        NicOptions.model_validate(options)
    assert message in describe(info.value, source="node.yaml")
