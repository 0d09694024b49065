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
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 60)
    writer.close()
    return answer


async def test_an_over_long_request_line_or_header_is_a_431_not_a_traceback(node, kubelet, agents):
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
        for raw in (long_target, long_header):
            answer = await request(port, raw)
            assert answer.startswith(b"HTTP/1.0 431 "), answer[:200]
        assert (await request(port, b"GET /healthz HTTP/1.0\r\n\r\n")).endswith(b"\r\n\r\nok\n")
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
