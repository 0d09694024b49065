"""The agent's HTTP endpoint against bad and greedy clients, as a real process on a real socket."""

import asyncio
import json
import sys

from .conftest import RUN, Agent, running_registered


class JsonLoggingAgent(Agent):
    async def start(self) -> Agent:
        with self.log_path.open("wb") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, *RUN, "--config", str(self.node.config_path), "--log-format", "json",
                env=self.env, stderr=log,
            )  # fmt: skip
        return self


def port_of(agent: Agent) -> int:
    for line in agent.log().splitlines():
        record = json.loads(line)
        if record["event"] == "metrics_listening":
            return int(record["url"].rsplit(":", 1)[1].split("/")[0])
    raise AssertionError(agent.log())


async def request(port: int, raw: bytes) -> bytes:
    """The whole answer to ``raw``; empty when the server closed the connection without one."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 60)
    except ConnectionResetError:
        return b""
    finally:
        writer.close()


async def test_an_over_long_request_line_is_a_414_a_header_a_431_not_a_traceback(node, kubelet, agents):
    """Over 64 KiB it was 'Unhandled exception in client_connected_cb' and 22 plain-text lines per request,
    even with --log-format json."""
    node.write_config(metrics={"listen": "127.0.0.1:0"})
    agent = JsonLoggingAgent(node)
    await agent.start()
    try:
        await agent.wait_state(running_registered, timeout=30)
        port = port_of(agent)
        long_target = b"GET /" + b"a" * 100_000 + b" HTTP/1.0\r\n\r\n"
        long_header = b"GET /metrics HTTP/1.0\r\nX-Pad: " + b"b" * 100_000 + b"\r\n\r\n"
        for raw, status in ((long_target, b"414"), (long_header, b"431")):
            answer = await request(port, raw)
            assert answer.startswith(b"HTTP/1.0 " + status + b" "), answer[:200]
        assert (await request(port, b"GET /healthz HTTP/1.0\r\n\r\n")).endswith(b"\r\n\r\nok\n")
        # The absolute form (RFC 9112, 3.2.2), which a server must accept: served by its path.
        absolute = await request(port, b"GET http://node:9400/healthz HTTP/1.1\r\nHost: node\r\n\r\n")
        assert absolute.endswith(b"\r\n\r\nok\n"), absolute[:200]
        assert await agent.stop() == 0
    finally:
        if agent.proc.returncode is None:
            agent.proc.kill()
            await agent.proc.wait()
    log = agent.log()
    assert "Traceback" not in log
    for line in log.splitlines():
        json.loads(line)  # every line is a JSON record


async def test_scrapes_that_never_read_do_not_hold_health_or_other_scrapes(node, kubelet, agents):
    node.write_config(metrics={"listen": "127.0.0.1:0"})
    agent = await agents()
    await agent.wait_state(running_registered, timeout=30)
    port = int(agent.log().split("url='http://127.0.0.1:")[1].split("/")[0])
    stalled = []
    for _ in range(10):  # they ask and never read
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.0\r\n\r\n")
        stalled.append(writer)
    answers = await asyncio.gather(*(request(port, b"GET /metrics HTTP/1.0\r\n\r\n") for _ in range(20)))
    assert all(answer.startswith(b"HTTP/1.0 200 OK") for answer in answers)
    assert (await request(port, b"GET /healthz HTTP/1.0\r\n\r\n")).endswith(b"ok\n")
    for writer in stalled:
        writer.close()
    assert await agent.stop() == 0


async def test_beyond_the_cap_the_longest_silent_connection_gives_way_to_a_new_one(monkeypatch):
    """Held connections are bounded (each is a descriptor the agent needs to restart children), and those
    that never send a request cannot keep the kubelet's liveness probe out: the oldest silent one goes."""
    from plugvisor.supervisor import metrics as metrics_

    monkeypatch.setattr(metrics_, "MAX_CONNECTIONS", 5)
    monkeypatch.setattr(metrics_, "REQUEST_DEADLINE", 120.0)  # silent ones are not closed for being slow
    metrics = metrics_.Metrics(lambda: {"supervisor": {}, "children": []}, multiproc_dir=None)
    server = metrics_.HttpServer(metrics, lambda: (True, "ready"), host="127.0.0.1", port=0)
    await server.start()
    try:
        _, port = server.address
        idle = []
        for _ in range(5):
            idle.append(await asyncio.open_connection("127.0.0.1", port))
            await asyncio.sleep(0.05)  # taken by the server in this order (they say nothing)
        assert (await request(port, b"GET /healthz HTTP/1.0\r\n\r\n")).endswith(b"ok\n")
        assert await asyncio.wait_for(idle[0][0].read(), 60) == b""  # the oldest gave way
        for reader, writer in idle[1:]:  # the others are still served
            writer.write(b"GET /healthz HTTP/1.0\r\n\r\n")
            assert (await asyncio.wait_for(reader.read(), 60)).endswith(b"ok\n")
        for _, writer in idle:
            writer.close()
    finally:
        await server.close()


class BigBody:
    """A metrics source whose body is far larger than any socket buffer (a node with very many series)."""

    def __init__(self, size: int) -> None:
        from plugvisor.supervisor.metrics import ScrapeGate

        self.data = b"x" * size
        self.gate = ScrapeGate()

    async def acquire(self):
        return self

    def release(self, body) -> None:
        pass


async def test_scrapes_that_stall_mid_body_give_way_to_a_scrape_that_reads(monkeypatch):
    """Every send slot taken by clients that asked and then take nothing: a real scrape still gets
    its whole answer (a stalled one gives way), long before the send deadline would free a slot."""
    import socket

    from plugvisor.supervisor import metrics as metrics_

    monkeypatch.setattr(metrics_, "MAX_SCRAPES", 4)
    monkeypatch.setattr(metrics_, "SEND_DEADLINE", 3600.0)  # a stalled slot is never freed by the deadline
    source = BigBody(64 << 20)
    server = metrics_.HttpServer(source, lambda: (True, "ready"), host="127.0.0.1", port=0)
    await server.start()
    stalled = []
    try:
        _, port = server.address
        for _ in range(4):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            stalled.append(sock)  # never read
        answer = await asyncio.wait_for(request(port, b"GET /metrics HTTP/1.0\r\n\r\n"), 120)
        assert answer.startswith(b"HTTP/1.0 200 OK") and answer.endswith(source.data[-100:])
        assert len(answer) > len(source.data)
    finally:
        for sock in stalled:
            sock.close()
        await server.close()
