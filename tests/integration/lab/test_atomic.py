"""Readers never see half-written attributes while faults come and go."""

from __future__ import annotations

import threading

from plugvisor.emulators.lab import Lab


def test_concurrent_reader_sees_whole_values(root: str) -> None:
    """A reader polling operstate and aer_dev_fatal during 30 fault/heal cycles only reads whole values."""
    lab = Lab.create(root, "small")
    pf = lab.device("nic0")
    operstate = f"{root}/sys/class/net/{pf.netdev}/operstate"
    aer = f"{root}/sys/bus/pci/devices/{pf.bdf}/aer_dev_fatal"
    seen: set[str] = set()
    bad: list[str] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            with open(operstate) as handle:
                seen.add(handle.read())
            with open(aer) as handle:
                text = handle.read()
            if not text.splitlines()[-1].startswith("TOTAL_ERR_FATAL "):
                bad.append(text)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for _ in range(30):
            lab.fault("nic0", "link-down")
            lab.fault("nic0", "aer-fatal")
            lab.heal("nic0")
    finally:
        stop.set()
        thread.join()
    assert seen <= {"up\n", "down\n"}
    assert bad == []
