"""A plugin's reports reach a busy agent: none is lost to a full socket queue.

A unix datagram socket queues only net.unix.max_dgram_qlen datagrams (10 by
default) for its reader; 256 plugins starting at once, or an agent busy for a
moment, fill it, and a non-blocking send then fails. A report that says a plugin
registered, lost that way, was never sent again: the agent restarted the plugin
as "unregistered" after its registration timeout.
"""

import asyncio
import socket

from plugvisor.common import notify


async def test_reports_sent_while_the_queue_is_full_arrive_later_in_order(short_dir):
    path = short_dir / "status.sock"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(path))
    receiver.setblocking(False)
    reporter = notify.StatusReporter(str(path))
    try:
        for number in range(1, 41):  # nobody reads yet: the queue fills after a few
            reporter.send(REGISTERED=number)
        received: list[int] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while len(received) < 40 and loop.time() < deadline:
            try:
                received.append(int(notify.decode(receiver.recv(4096))["REGISTERED"]))
            except BlockingIOError:
                await asyncio.sleep(0.01)
        assert received == list(range(1, 41))
    finally:
        reporter.close()
        receiver.close()
