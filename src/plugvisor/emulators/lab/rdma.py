"""What the kernel's RDMA stack shows for an RDMA-capable NIC function (ConnectX-like, RoCE).

A function bound to ``mlx5_core`` (PF, or VF bound to the netdev driver) registers an
IB device ``mlx5_N`` and a verbs char device ``uverbsN``; that is what the SR-IOV
device plugin's ``isRdma`` selector and its RDMA info provider (through Mellanox's
``rdmamap``) look for, and what ``rdma-core`` opens:

* ``<fn>/infiniband/mlx5_N/``: ``node_type``, ``node_guid``, ``fw_ver``, ``hca_type``,
  ``ports/1/{state,phys_state,rate,link_layer,lid,...}``, ``ports/1/gids/<i>``
  (``%pI6``: eight groups of four hex digits), ``gid_attrs/{types,ndevs}/<i>``;
  ``sys/class/infiniband/mlx5_N`` links to it (readers list the class directory's
  links, and the PCI function's ``infiniband/`` directories).
* ``<fn>/infiniband_verbs/uverbsN/``: ``ibdev`` (the IB device's name), ``dev``
  (``231:192+N``), ``abi_version``; ``sys/class/infiniband_verbs/uverbsN`` links to
  it; ``/dev/infiniband/uverbsN`` is the node.
* ``/dev/infiniband/rdma_cm`` (misc), shared by every device, written by :func:`shared`.

Ports follow the Ethernet link as RoCE ports do (a ``link-down`` takes them ``DOWN``),
and the ``rdma-port-down`` fault takes one port down on its own.
"""

from __future__ import annotations

from plugvisor.emulators.lab import majors
from plugvisor.emulators.lab.catalog import RdmaModel
from plugvisor.emulators.lab.spec import Dir, Spec, add_link, add_node, text, virtual_device
from plugvisor.emulators.lab.state import DeviceState

PORT_DOWN = "rdma-port-down"
GID_TABLE = 8
"""GID entries written per port: the two populated RoCE v1/v2 entries and zeroed ones after them.

A ConnectX port's table has 255 entries, all but the populated ones zero; eight keep the
shape (readers iterate the directory and skip zero GIDs) without 255 files per function.
"""
_ZERO_GID = ":".join(["0000"] * 8)


def name(model: RdmaModel, dev: DeviceState) -> str:
    """The IB device name of a function with RDMA (``mlx5_3``)."""
    assert dev.rdma_index is not None
    return f"{model.prefix}{dev.rdma_index}"


def _mac(dev: DeviceState) -> bytes:
    return bytes(int(x, 16) for x in (dev.mac or "00:00:00:00:00:00").split(":"))


def gid(dev: DeviceState) -> str:
    """The link-local RoCE GID of the function's netdev: ``fe80::`` plus its MAC as a modified EUI-64."""
    m = _mac(dev)
    eui = bytes([m[0] ^ 0x02, m[1], m[2], 0xFF, 0xFE, m[3], m[4], m[5]])
    words = [0xFE80, 0, 0, 0] + [int.from_bytes(eui[i : i + 2], "big") for i in range(0, 8, 2)]
    return ":".join(f"{w:04x}" for w in words)


def node_guid(dev: DeviceState) -> str:
    """``node_guid`` as the kernel prints it (``%04x:%04x:%04x:%04x``), derived from the MAC like mlx5's."""
    m = _mac(dev)
    raw = bytes([m[0], m[1], m[2], 0x03, 0x00, m[3], m[4], m[5]])
    return ":".join(f"{int.from_bytes(raw[i : i + 2], 'big'):04x}" for i in range(0, 8, 2))


def render(spec: Spec, fn_path: str, model: RdmaModel, dev: DeviceState, *, link_up: bool) -> None:
    """Add the IB device and its verbs node for one function."""
    assert dev.rdma_index is not None
    ib = name(model, dev)
    d = f"{fn_path}/infiniband/{ib}"
    spec[d] = Dir()
    spec[f"{d}/node_type"] = text("1: CA")
    spec[f"{d}/node_guid"] = text(node_guid(dev))
    spec[f"{d}/sys_image_guid"] = text(node_guid(dev))
    spec[f"{d}/fw_ver"] = text(model.fw_ver)
    spec[f"{d}/hca_type"] = text(model.hca_type)
    spec[f"{d}/board_id"] = text(model.board_id)
    spec[f"{d}/hw_rev"] = text("0x0")
    spec[f"{d}/node_desc"] = text(f"plugvisor-lab {ib}")
    spec[f"{d}/uevent"] = text(f"NAME={ib}")
    add_link(spec, f"{d}/device", fn_path)
    add_link(spec, f"{d}/subsystem", "sys/class/infiniband")
    add_link(spec, f"sys/class/infiniband/{ib}", d)

    active = link_up and PORT_DOWN not in dev.faults
    port = f"{d}/ports/1"
    spec[port] = Dir()
    spec[f"{port}/state"] = text("4: ACTIVE" if active else "1: DOWN")
    spec[f"{port}/phys_state"] = text("5: LinkUp" if active else "3: Disabled")
    spec[f"{port}/rate"] = text(model.rate)
    spec[f"{port}/link_layer"] = text("Ethernet")
    spec[f"{port}/lid"] = text("0x0")
    spec[f"{port}/sm_lid"] = text("0x0")
    spec[f"{port}/lid_mask_count"] = text(0)
    spec[f"{port}/sm_sl"] = text(0)
    spec[f"{port}/cap_mask"] = text("0x04010000")
    spec[f"{port}/pkeys/0"] = text("0xffff")
    for i in range(GID_TABLE):
        populated = i < 2 and dev.netdev is not None
        spec[f"{port}/gids/{i}"] = text(gid(dev) if populated else _ZERO_GID)
        if populated:
            spec[f"{port}/gid_attrs/types/{i}"] = text("IB/RoCE v1" if i == 0 else "RoCE v2")
            spec[f"{port}/gid_attrs/ndevs/{i}"] = text(dev.netdev or "")

    minor = majors.UVERBS_BASE_MINOR + dev.rdma_index
    verbs = f"{fn_path}/infiniband_verbs/uverbs{dev.rdma_index}"
    spec[verbs] = Dir()
    spec[f"{verbs}/ibdev"] = text(ib)
    spec[f"{verbs}/abi_version"] = text(1)
    spec[f"{verbs}/dev"] = text(f"{majors.UVERBS}:{minor}")
    spec[f"{verbs}/uevent"] = text(
        f"MAJOR={majors.UVERBS}\nMINOR={minor}\nDEVNAME=infiniband/uverbs{dev.rdma_index}"
    )
    add_link(spec, f"{verbs}/device", fn_path)
    add_link(spec, f"{verbs}/subsystem", "sys/class/infiniband_verbs")
    add_link(spec, f"sys/class/infiniband_verbs/uverbs{dev.rdma_index}", verbs)
    add_node(
        spec,
        at=f"dev/infiniband/uverbs{dev.rdma_index}",
        major=majors.UVERBS,
        minor=minor,
        sys_target=verbs,
    )


def shared(spec: Spec) -> set[int]:
    """Node-wide RDMA entries: the class directories, ``abi_version``, ``/dev/infiniband/rdma_cm``."""
    spec["sys/class/infiniband"] = Dir()
    spec["sys/class/infiniband_verbs"] = Dir()
    spec["sys/class/infiniband_verbs/abi_version"] = text(6)
    virtual_device(
        spec, "sys/devices/virtual/misc/rdma_cm", majors.MISC, majors.RDMA_CM_MINOR, "dev/infiniband/rdma_cm"
    )
    return {majors.MISC, majors.UVERBS}
