"""``plugvisor plugin KIND --mode dra`` as a process: registration, claims, restarts, kills, exit codes."""

import asyncio
import json
import os
import signal
import socket
import struct
import sys

import pytest

from plugvisor.common import notify
from plugvisor.common.hostpaths import HostPaths
from plugvisor.emulators.kubelet.dra import DraCallError, resource_claim
from plugvisor.plugins.gpu.nvml import LIBRARY, library_candidates

from .conftest import NODE, Driver, driver_args, eventually, registered, slice_devices

DRIVER = "gpu.plugvisor.io"


def spec_of(lab_root, claim_uid):
    return lab_root / "cdi" / f"k8s.{DRIVER}-claim_{claim_uid}.json"


def checkpointed(base):
    path = base / "plugins" / DRIVER / "prepared-claims.json"
    return [] if not path.exists() else [c["uid"] for c in json.loads(path.read_text())["claims"]]


def claim(devices, uid="uid-1", name="gpus"):
    return resource_claim("default", name, uid, [("gpus", DRIVER, NODE, device) for device in devices])


class TestProcess:
    async def test_a_driver_registers_prepares_and_reports_to_its_agent(
        self, kubelet, base, lab_root, start_driver
    ):
        status_path = base / "status.sock"
        receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        receiver.bind(str(status_path))
        receiver.setblocking(False)
        try:
            await start_driver(env={notify.STATUS_SOCKET_ENV: str(status_path)})
            await kubelet.wait_for(registered(), what="the driver registered", timeout=60)
            await eventually(lambda: len(slice_devices(base)) == 8, what="the slice")
            view = await kubelet.dra.prepare(claim(slice_devices(base)[:2]))
            assert view.cdi_devices() == [f"k8s.{DRIVER}/claim=uid-1-gpus"]
            assert spec_of(lab_root, "uid-1").exists() and checkpointed(base) == ["uid-1"]
            await kubelet.dra.unprepare("default", "gpus")
            assert not spec_of(lab_root, "uid-1").exists() and checkpointed(base) == []
            fields: dict[str, str] = {}
            await eventually(
                lambda: _drain(receiver, fields) and {"REGISTERED", "SLICES"} <= fields.keys(),
                what="REGISTERED= and SLICES=",
            )
        finally:
            receiver.close()
        assert fields["REGISTERED"] == "1"
        assert fields["DEVICES"] == "8/8"
        assert fields["ENDPOINT"] == f"{DRIVER}-reg.sock"
        assert fields["SLICES"] == "synced"

    async def test_a_killed_driver_restarted_unprepares_what_it_prepared(
        self, kubelet, base, lab_root, start_driver
    ):
        first = await start_driver()
        await kubelet.wait_for(registered(), what="the driver registered", timeout=60)
        await eventually(lambda: len(slice_devices(base)) == 8, what="the slice")
        await kubelet.dra.prepare(claim(slice_devices(base)[:1]))
        first.kill()
        assert await first.stop() == -9
        await start_driver()
        await kubelet.wait_for(registered(times=2), what="registered again", timeout=60)
        await kubelet.dra.unprepare("default", "gpus")
        assert not spec_of(lab_root, "uid-1").exists() and checkpointed(base) == []

    async def test_a_kill_between_writing_the_spec_and_the_checkpoint_loses_nothing(
        self, kubelet, base, lab_root, start_driver
    ):
        """SIGKILL in the very instant after the claim's CDI spec is written, before the checkpoint is."""
        killer = (
            "import os, signal, sys\n"
            "from plugvisor.dra.checkpoint import Checkpoint\n"
            "save = Checkpoint.save\n"
            "def dying(self, claims):\n"
            "    claims = list(claims)\n"
            "    if claims: os.kill(os.getpid(), signal.SIGKILL)\n"
            "    save(self, claims)\n"
            "Checkpoint.save = dying\n"
            "from plugvisor.cli import main\n"
            "main(sys.argv[1:], prog_name='plugvisor')\n"
        )
        args = driver_args(base, lab_root)
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", killer, *args[3:])
        await kubelet.wait_for(registered(), what="the driver registered", timeout=60)
        await eventually(lambda: len(slice_devices(base)) == 8, what="the slice")
        devices = slice_devices(base)[:2]
        with pytest.raises(DraCallError, match="prepare dynamic resources: NodePrepareResources: rpc error"):
            await kubelet.dra.prepare(claim(devices))
        assert await proc.wait() == -9
        assert spec_of(lab_root, "uid-1").exists() and checkpointed(base) == []
        await start_driver()
        await kubelet.wait_for(registered(times=2), what="registered again", timeout=60)
        # The pod went away meanwhile: the kubelet unprepares a claim the driver never recorded.
        await kubelet.dra.plugin(DRIVER).call(
            "NodeUnprepareResources",
            _unprepare_request("uid-1"),
            _unprepare_response(),
            timeout=30,
        )
        assert not spec_of(lab_root, "uid-1").exists()
        # And a retried prepare succeeds as if nothing had happened.
        view = await kubelet.dra.prepare(claim(devices))
        assert view.cdi_devices() and checkpointed(base) == ["uid-1"]

    @pytest.mark.parametrize(
        ("stop", "withdrawn"),
        [
            (((), signal.SIGTERM), False),
            ((("--withdraw-on-stop",), signal.SIGTERM), True),
            (((), notify.STOP_FOR_GOOD_SIGNAL), True),
        ],
        ids=["restarting", "withdraw-on-stop", "the-agents-stop-for-good"],
    )
    async def test_a_clean_stop_leaves_the_slice_unless_the_driver_goes_for_good(
        self, kubelet, base, start_driver, stop, withdrawn
    ):
        flags, stop_signal = stop
        driver = await start_driver(*flags)
        await kubelet.wait_for(registered(), what="the driver registered", timeout=60)
        await eventually(lambda: len(slice_devices(base)) == 8, what="the slice")
        driver.proc.send_signal(stop_signal)
        assert await driver.stop() == 0
        assert len(slice_devices(base)) == (0 if withdrawn else 8)
        assert not (base / "plugins_registry" / f"{DRIVER}-reg.sock").exists()

    async def test_every_line_that_names_a_resource_names_the_driver_nvmls_too(self, kubelet, base, lab_root):
        """The operator knows the process by the driver's name (the agent's ``resource=``), not the kind's
        ``<driver>/gpu``, which names only its CDI kind."""
        if not any(p.exists() for p in library_candidates(HostPaths(root=lab_root), "/")):
            pytest.skip(f"the lab wrote no {LIBRARY} (it needs a C compiler, cc, to build its NVML stand-in)")
        log_path = base / "driver.log"
        with log_path.open("wb") as log:
            proc = await asyncio.create_subprocess_exec(
                *driver_args(base, lab_root), stdout=asyncio.subprocess.DEVNULL, stderr=log
            )
        driver = Driver(proc)
        try:
            await kubelet.wait_for(registered(), what="the driver registered", timeout=60)
            await eventually(lambda: len(slice_devices(base)) == 8, what="the slice")
        finally:
            assert await driver.stop() == 0
        lines = log_path.read_text().splitlines()
        named = {line.split("resource=")[1].split()[0] for line in lines if " resource=" in line}
        assert named == {f"'{DRIVER}'"}, lines
        assert any("event='nvml_opened'" in line for line in lines), lines

    async def test_a_second_driver_of_the_same_name_exits_2_naming_the_socket(self, kubelet, start_driver):
        await start_driver()
        await kubelet.wait_for(registered(), what="the driver registered", timeout=60)
        second = await start_driver()
        assert await asyncio.wait_for(second.proc.wait(), 60) == 2

    async def test_a_driver_name_of_63_characters_serves_where_its_sockets_just_fit(
        self, kubelet, base, start_driver
    ):
        driver = ".".join(("a" * 20, "b" * 20, "c" * 21))
        assert len(str(base / "plugins_registry" / f"{driver}-reg.sock")) == 107  # the unix socket limit
        process = await start_driver("--driver", driver)
        await kubelet.wait_for(registered(driver), what="the driver registered", timeout=60)
        assert process.proc.returncode is None

    async def test_a_driver_taken_over_stands_by_and_serves_again_when_the_other_stops(
        self, kubelet, base, lab_root, start_driver
    ):
        """A second driver with --replace (the agent's child, a new pod) is left the sockets, not fought."""
        registration = base / "plugins_registry" / f"{DRIVER}-reg.sock"
        status_path = base / "status.sock"
        receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        receiver.bind(str(status_path))
        receiver.setblocking(False)
        fields: dict[str, str] = {}
        try:
            first = await start_driver(env={notify.STATUS_SOCKET_ENV: str(status_path)})
            await kubelet.wait_for(registered(), what="the first driver registered", timeout=60)
            await eventually(lambda: len(slice_devices(base)) == 8, what="the slice")
            second = await start_driver("--replace")
            await eventually(
                lambda: _drain(receiver, fields) and "TAKEN_OVER" in fields, what="the first says TAKEN_OVER="
            )
            assert _server_pid(registration) == second.proc.pid
            assert _server_pid(base / "plugins" / DRIVER / "dra.sock") == second.proc.pid
            await kubelet.wait_for(registered(times=2), what="the second driver registered", timeout=60)
            await kubelet.dra.prepare(claim(slice_devices(base)[:1]))
            assert checkpointed(base) == ["uid-1"]
            assert await second.stop() == 0
            await eventually(
                lambda: _server_pid(registration) == first.proc.pid, what="the first serving again"
            )
            await kubelet.wait_for(registered(times=3), what="the first registered again", timeout=60)
            await kubelet.dra.unprepare("default", "gpus")
            assert not spec_of(lab_root, "uid-1").exists() and checkpointed(base) == []
        finally:
            receiver.close()


def _server_pid(path):
    """The process serving the unix socket at ``path`` (None when nobody does)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
        pid, _, _ = struct.unpack("3i", probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except OSError:
        return None
    finally:
        probe.close()
    return pid


def _drain(receiver, fields):
    while True:
        try:
            fields.update(notify.decode(receiver.recv(4096)))
        except BlockingIOError:
            return True


def _unprepare_request(uid):
    from plugvisor.api.dra.v1 import api_pb2

    return api_pb2.NodeUnprepareResourcesRequest(
        claims=[api_pb2.Claim(namespace="default", name="gpus", uid=uid)]
    )


def _unprepare_response():
    from plugvisor.api.dra.v1 import api_pb2

    return api_pb2.NodeUnprepareResourcesResponse


class TestBadInput:
    @pytest.mark.parametrize(
        ("extra", "message"),
        [
            (
                ("--driver", "Bad_Name"),
                "Invalid value for --driver: DRA driver name 'Bad_Name' is not a DNS subdomain",
            ),
            (("--cdi-dir", "relative"), "Invalid value for --cdi-dir: relative must be an absolute path"),
            (("--options-json", '{"replicas": 0}'), "replicas: Input should be greater than or equal to 1"),
            (
                ("--node-name", "x/../../escaped"),
                "node name 'x/../../escaped' is not a lowercase DNS-1123 subdomain",
            ),
        ],
        ids=["driver-name", "cdi-dir", "kind-options", "node-name"],
    )
    async def test_bad_options_exit_2_naming_the_option(self, base, lab_root, extra, message):
        proc = await asyncio.create_subprocess_exec(
            *driver_args(base, lab_root, "gpu", *extra), stderr=asyncio.subprocess.PIPE
        )
        try:
            _, stderr = await asyncio.wait_for(proc.communicate(), 60)
        finally:
            if proc.returncode is None:  # it took the bad input and runs: the test fails, leaving nothing
                proc.kill()
                await proc.wait()
        assert proc.returncode == 2
        assert message in stderr.decode()

    async def test_without_an_api_server_configured_the_driver_exits_2_saying_what_it_tried(
        self, base, lab_root, tmp_path
    ):
        args = [arg for arg in driver_args(base, lab_root) if arg not in ("--objects-dir", str(base / "api"))]
        env = {
            key: value
            for key, value in os.environ.items()
            if key not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")
        }
        proc = await asyncio.create_subprocess_exec(
            *args, stderr=asyncio.subprocess.PIPE, env={**env, "HOME": str(tmp_path)}
        )
        _, stderr = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 2
        assert "no API server configuration: KUBECONFIG is not set" in stderr.decode()
