"""The emulated kubelet registers DRA drivers' kubelet plugins by the kubelet's rules and error texts.

Stub registrars (plain plugin-watcher sockets) say what a driver could say;
the kubelet of v1.37 answers as ``pkg/kubelet/cm/dra/plugin`` does.
"""

import asyncio
import os

import pytest

from plugvisor.emulators.kubelet import EmulatedKubelet, StubDevicePlugin

from .conftest import make_kubelet

DRIVER = "gpu.example.com"


async def statuses(stub: StubDevicePlugin, count: int) -> list[tuple[bool, str]]:
    async with asyncio.timeout(20):
        while len(stub.registration_statuses) < count:
            stub.status_changed.clear()
            await stub.status_changed.wait()
    return stub.registration_statuses


def registrar(kubelet: EmulatedKubelet, name: str, versions, *, endpoint: str, driver: str = DRIVER):
    assert kubelet.plugins_registry is not None
    stub = StubDevicePlugin(kubelet.plugins_registry / name, driver)
    stub.info_type, stub.info_name, stub.info_versions, stub.info_endpoint = (
        "DRAPlugin",
        driver,
        versions,
        endpoint,
    )
    return stub


class TestAccepted:
    async def test_the_first_service_the_plugin_lists_that_the_kubelet_speaks_is_used(self, kubelet, base):
        versions = ("v9.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAPlugin", "v1alpha1.DRAResourceHealth")
        async with registrar(kubelet, "a-reg.sock", versions, endpoint=str(base / "dra.sock")) as stub:
            assert await statuses(stub, 1) == [(True, "")]
            (plugin,) = kubelet.dra.plugins[DRIVER]
            assert (plugin.endpoint, plugin.service, plugin.health_service) == (
                str(base / "dra.sock"),
                "v1beta1.DRAPlugin",
                "v1alpha1.DRAResourceHealth",
            )

    async def test_the_newest_health_service_both_speak_is_chosen(self, kubelet, base):
        versions = ("v1.DRAPlugin", "v1alpha1.DRAResourceHealth", "v1.DRAResourceHealth")
        async with registrar(kubelet, "a-reg.sock", versions, endpoint=str(base / "dra.sock")) as stub:
            await statuses(stub, 1)
            assert kubelet.dra.plugins[DRIVER][0].health_service == "v1.DRAResourceHealth"

    async def test_two_plugins_of_one_driver_are_both_registered_and_the_newest_is_called(
        self, kubelet, base
    ):
        first = registrar(kubelet, "a-reg.sock", ("v1.DRAPlugin",), endpoint=str(base / "a.sock"))
        second = registrar(kubelet, "b-reg.sock", ("v1.DRAPlugin",), endpoint=str(base / "b.sock"))
        async with first:
            await statuses(first, 1)
            async with second:
                assert await statuses(second, 1) == [(True, "")]
                assert [p.endpoint for p in kubelet.dra.plugins[DRIVER]] == [
                    str(base / "a.sock"),
                    str(base / "b.sock"),
                ]
                assert kubelet.dra.plugin(DRIVER).endpoint == str(base / "b.sock")
            await kubelet.wait_for(lambda k: len(k.dra.plugins[DRIVER]) == 1, what="b deregistered")
            assert kubelet.dra.plugin(DRIVER).endpoint == str(base / "a.sock")
        await kubelet.wait_for(lambda k: DRIVER not in k.dra.plugins, what="a deregistered")

    async def test_a_newer_plugin_nobody_serves_does_not_take_the_calls_of_a_connected_one(
        self, kubelet, base
    ):
        """Upstream's GetPlugin prefers connected plugins: a rolling update's new instance whose endpoint
        never came up does not take the driver's claims (e2e/test_dra.py shows the real kubelet do it)."""
        assert kubelet.plugins_registry is not None
        served = kubelet.plugins_registry / "a-reg.sock"  # the stub serves gRPC on its own socket
        first = registrar(kubelet, "a-reg.sock", ("v1.DRAPlugin",), endpoint=str(served))
        second = registrar(kubelet, "b-reg.sock", ("v1.DRAPlugin",), endpoint=str(base / "nobody.sock"))
        async with first:
            await statuses(first, 1)
            async with second:
                assert await statuses(second, 1) == [(True, "")]
                await kubelet.wait_for(
                    lambda k: k.dra.plugin(DRIVER).endpoint == str(served), what="the connected plugin chosen"
                )
                assert len(kubelet.dra.plugins[DRIVER]) == 2


class TestRefused:
    @pytest.mark.parametrize(
        ("versions", "problem"),
        [
            (
                ("v2.DRAPlugin", "v1.DRAResourceHealth"),
                'none of services supported by the plugin (["v2.DRAPlugin" "v1.DRAResourceHealth"]) are '
                'supported by the kubelet (["v1.DRAPlugin" "v1beta1.DRAPlugin"])',
            ),
            ((), "empty list of supported gRPC services (aka supported versions)"),
        ],
        ids=["unknown-services", "no-services"],
    )
    async def test_a_plugin_without_a_service_the_kubelet_speaks_is_told_why(
        self, kubelet, base, versions, problem
    ):
        endpoint = str(base / "dra.sock")
        async with registrar(kubelet, "a-reg.sock", versions, endpoint=endpoint) as stub:
            (status,) = (await statuses(stub, 1))[:1]
            told = (
                "RegisterPlugin error -- plugin validation failed with err: invalid supported gRPC versions "
                f"of DRA driver plugin {DRIVER} at endpoint {endpoint}: {problem}"
            )
            assert status == (False, told)
            assert DRIVER not in kubelet.dra.plugins
            # The kubelet logs the refusal it told as an error sending it (upstream's notifyPlugin).
            await kubelet.wait_for(
                lambda k: any(
                    e.message
                    == f"RegisterPlugin error -- failed to send error at socket {stub.socket_path}, "
                    f"err: {told}"
                    for e in k.events
                ),
                what="the refusal in the kubelet's events",
            )

    async def test_one_endpoint_cannot_be_registered_twice_for_a_driver(self, kubelet, base):
        endpoint = str(base / "dra.sock")
        first = registrar(kubelet, "a-reg.sock", ("v1.DRAPlugin",), endpoint=endpoint)
        second = registrar(kubelet, "b-reg.sock", ("v1.DRAPlugin",), endpoint=endpoint)
        async with first, second:
            await statuses(first, 1)
            outcomes = [*(await statuses(first, 1)), *(await statuses(second, 1))]
            refusal = f"endpoint {endpoint} already registered for DRA driver plugin {DRIVER}"
            assert sorted(outcomes) == [
                (False, f"RegisterPlugin error -- plugin registration failed with err: {refusal}"),
                (True, ""),
            ]
            assert len(kubelet.dra.plugins[DRIVER]) == 1

    async def test_the_driver_name_is_not_the_kubelets_to_check(self, kubelet, base):
        """The kubelet takes any name (the API server checks it in the slices); an empty one fails calls."""
        async with registrar(
            kubelet, "a-reg.sock", ("v1.DRAPlugin",), endpoint=str(base / "x"), driver="Not_DNS"
        ) as s:
            assert await statuses(s, 1) == [(True, "")]

    async def test_a_kubelet_before_dra_has_no_handler_for_it(self, base):
        kubelet = make_kubelet(base, kubelet_version="1.29")
        async with kubelet:
            assert kubelet.dra is None
            stub = registrar(kubelet, "a-reg.sock", ("v1.DRAPlugin",), endpoint=str(base / "dra.sock"))
            async with stub:
                assert await statuses(stub, 1) == [
                    (
                        False,
                        "RegisterPlugin error -- no handler registered for plugin type: DRAPlugin at socket "
                        f"{os.fspath(stub.socket_path)}",
                    )
                ]


class TestCalls:
    async def test_a_driver_that_is_not_registered_fails_the_prepare_with_the_kubelets_text(self, kubelet):
        from plugvisor.emulators.kubelet.dra import DraCallError, resource_claim

        claim = resource_claim("default", "c", "u1", [("r", DRIVER, "node-1", "gpu-0")])
        with pytest.raises(
            DraCallError, match=f"^prepare dynamic resources: DRA driver {DRIVER} is not registered$"
        ):
            await kubelet.dra.prepare(claim)
