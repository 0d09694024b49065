"""Owners of devices a DRA driver prepared come from PodResources' dynamic_resources, keyed by driver."""

from plugvisor.api.podresources.v1 import api_pb2
from plugvisor.common.monitoring import Holder
from plugvisor.deviceplugin.owners import holders_from


def test_devices_of_dra_claims_are_held_by_the_containers_that_use_the_claim():
    claimed = api_pb2.DynamicResource(
        claim_name="two-gpus",
        claim_namespace="team",
        claim_resources=[
            api_pb2.ClaimResource(driver_name="gpu.plugvisor.io", pool_name="node-a", device_name="gpu-1"),
            api_pb2.ClaimResource(driver_name="gpu.plugvisor.io", pool_name="node-a", device_name="gpu-3"),
        ],
    )
    plugin = api_pb2.ContainerDevices(resource_name="plugvisor.io/fuse", device_ids=["fuse-0"])
    response = api_pb2.ListPodResourcesResponse(
        pod_resources=[
            api_pb2.PodResources(
                name="trainer",
                namespace="team",
                containers=[
                    api_pb2.ContainerResources(name="main", devices=[plugin], dynamic_resources=[claimed]),
                    api_pb2.ContainerResources(name="sidecar", dynamic_resources=[claimed]),
                ],
            )
        ]
    )

    holders = holders_from(response)

    both = (Holder("team", "trainer", "main"), Holder("team", "trainer", "sidecar"))
    assert holders == {
        ("plugvisor.io/fuse", "fuse-0"): (Holder("team", "trainer", "main"),),
        ("gpu.plugvisor.io", "gpu-1"): both,
        ("gpu.plugvisor.io", "gpu-3"): both,
    }
