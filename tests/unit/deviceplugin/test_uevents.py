"""Kernel uevent datagrams: ACTION@DEVPATH then NUL-separated KEY=VALUE fields."""

from plugvisor.deviceplugin.uevents import parse


def test_a_kernel_pci_add_is_decoded():
    data = (
        b"add@/devices/pci0000:00/0000:00:01.0/0000:03:00.0\0"
        b"ACTION=add\0SUBSYSTEM=pci\0PCI_SLOT_NAME=0000:03:00.0\0"
    )
    event = parse(data)
    assert event is not None
    assert (event.action, event.subsystem) == ("add", "pci")
    assert event.devpath == "/devices/pci0000:00/0000:00:01.0/0000:03:00.0"
    assert event.fields["PCI_SLOT_NAME"] == "0000:03:00.0"


def test_udev_rebroadcasts_and_garbage_are_ignored():
    assert parse(b"libudev\0\xfe\xed\xca\xfe") is None
    assert parse(b"no header here") is None
    assert parse(b"") is None


def test_an_event_without_subsystem_has_none():
    event = parse(b"remove@/devices/virtual/x\0ACTION=remove\0")
    assert event is not None and event.subsystem is None
