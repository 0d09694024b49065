"""The lab's public face: create a lab, list its devices, break and mend them.

Every mutation follows one path: take the lab's lock, load the state, render the
affected devices, change the state, render them again, let the tree write the
difference atomically, save the state. So a CLI call, a test and the
``sriov_numvfs`` watcher can act on the same root without stepping on each
other, and the tree on disk is always what the state says.
"""

# Paths here are root-relative POSIX strings shared with the tree writer (see tree.py).
# ruff: noqa: PTH103, PTH104, PTH105

from __future__ import annotations

import contextlib
import os
import posixpath
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from plugvisor.emulators.lab import errors, faults, kinds, layout, nvml, profiles, render, state
from plugvisor.emulators.lab.faults import FaultKind
from plugvisor.emulators.lab.profiles import Profile
from plugvisor.emulators.lab.spec import Node
from plugvisor.emulators.lab.state import DeviceKind, DeviceState, LabState
from plugvisor.emulators.lab.tree import TOP_LEVEL, FakeTree, check_dir, ensure_dir

PCI_IDS = "usr/share/hwdata/pci.ids"


@dataclass(frozen=True, slots=True)
class DeviceNode:
    """A device node of a lab device, with the numbers ``sys/dev/char`` agrees on."""

    path: str
    major: int
    minor: int


@dataclass(frozen=True, slots=True)
class DeviceRecord:
    """What the lab says about one device, as a value (equality is a diff)."""

    name: str
    kind: DeviceKind | str
    """A :class:`DeviceKind`, or the name of a lab kind from another package (``acme-npu``)."""
    model: str
    bdf: str
    functions: tuple[str, ...]
    vendor: str
    device: str
    driver: str | None
    numa_node: int
    pcie_switch: str | None
    sysfs_path: str
    device_nodes: tuple[DeviceNode, ...]
    faults: tuple[FaultKind | str, ...]
    """:class:`FaultKind` members, and an outside kind's own faults by name."""
    state: Literal["present", "unplugged"]
    parent: str | None = None
    vfs: tuple[str, ...] = ()
    num_vfs: int | None = None
    total_vfs: int | None = None
    netdev: str | None = None
    uuid: str | None = None
    attributes: tuple[tuple[str, str | int], ...] = ()
    """What an outside kind decided for the device at creation (``lab show`` prints it as a mapping)."""


def _record(st: LabState, dev: DeviceState) -> DeviceRecord:
    ident = kinds.get(dev.kind).identity(dev)
    nodes = tuple(
        DeviceNode("/" + path, entry.major, entry.minor)
        for path, entry in sorted(render.device(st, dev).items())
        if isinstance(entry, Node)
    )
    present = dev.present and (dev.parent is None or st.devices[dev.parent].present)
    return DeviceRecord(
        name=dev.name,
        kind=dev.kind,
        model=dev.model,
        bdf=dev.primary.bdf,
        functions=tuple(fn.bdf for fn in dev.functions),
        vendor=f"0x{ident.vendor:04x}",
        device=f"0x{ident.device:04x}",
        driver=dev.primary.driver if faults.FaultKind.FALLEN_OFF_BUS.value not in dev.faults else None,
        numa_node=dev.numa_node,
        pcie_switch=dev.switch,
        sysfs_path=dev.primary.path,
        device_nodes=nodes,
        faults=tuple(faults.fault_kind(f) for f in dev.faults),
        state="present" if present else "unplugged",
        parent=dev.parent,
        vfs=tuple(vf.name for vf in st.vfs_of(dev.name)) if dev.kind is DeviceKind.NIC_PF else (),
        num_vfs=dev.num_vfs,
        total_vfs=dev.total_vfs,
        netdev=dev.netdev,
        uuid=dev.uuid,
        attributes=tuple(sorted(dev.attributes.items())),
    )


class Lab:
    """An emulated hardware tree under a root directory.

    Use :meth:`create` or :meth:`open`; every method re-reads the state from the
    root, so several ``Lab`` objects (or processes) on one root agree.
    """

    def __init__(self, tree: FakeTree, notes: tuple[str, ...] = ()) -> None:
        self._tree = tree
        self.root = Path(tree.root)
        self.notes = notes
        """What creating the lab left out and the user should hear (no C compiler: no NVML)."""

    # -- construction ------------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        root: str | os.PathLike[str],
        profile: Profile | str = "small",
        *,
        mknod: bool = False,
        replace: bool = False,
    ) -> Lab:
        """Write a new lab under ``root`` from a profile (a :class:`Profile`, a built-in name or a file).

        The profile is validated and laid out before anything is written, and
        the tree is built in a staging directory and moved into place, so an
        invalid profile, a refused root or a missing CAP_MKNOD leaves ``root``
        as it was.
        """
        if isinstance(profile, str):
            profile = profiles.resolve(profile)
        st = layout.build(profile, mknod=mknod)
        tree = FakeTree(root, mknod=mknod)
        real = tree.root
        if state.exists(real) and not replace:
            raise errors.LabExistsError(
                f"{real!r} already holds a lab; pass replace=True (--force) to recreate it"
            )
        check_dir(real, posixpath.dirname(PCI_IDS))
        if not state.exists(real):
            for top in (*TOP_LEVEL, PCI_IDS):
                if os.path.lexists(posixpath.join(real, top)):
                    raise errors.LabExistsError(
                        f"{posixpath.join(real, top)!r} exists and is not a lab's; refusing to overwrite it"
                    )
        os.makedirs(real, exist_ok=True)
        with state.locked(real):
            if mknod:
                tree.check_mknod()
            staged = tree.stage(render.whole(st))
            try:
                if replace and state.exists(real):
                    with contextlib.suppress(errors.LabError):  # a damaged lab is replaced all the same
                        nvml.uninstall(tree, state.load(real))
                if replace:
                    for top in TOP_LEVEL:
                        tree.remove_dir(top)
                    tree.remove(PCI_IDS)
                for top in TOP_LEVEL:
                    os.rename(posixpath.join(staged, top), posixpath.join(real, top))
                ensure_dir(real, posixpath.dirname(PCI_IDS))
                os.replace(posixpath.join(staged, PCI_IDS), posixpath.join(real, PCI_IDS))
            finally:
                tree.discard(staged)
            nvml.start(st)
            state.save(tree, st)
            notes = nvml.install(tree, st)
        return cls(tree, tuple(notes))

    @classmethod
    def open(cls, root: str | os.PathLike[str]) -> Lab:
        """Open an existing lab (the guard runs again: a root can change under us)."""
        tree = FakeTree(root)
        st = state.load(tree.root)
        tree.mknod = st.mknod
        return cls(tree)

    # -- reading --------------------------------------------------------------------------------------

    def state(self) -> LabState:
        """Return a fresh copy of the lab's state (for renderers, tests and tools)."""
        return state.load(self._tree.root)

    def devices(self, *, kind: DeviceKind | str | None = None) -> tuple[DeviceRecord, ...]:
        """Return every device (VFs included), PFs before their VFs, in name order; or those of one kind."""
        st = self.state()
        ordered = sorted(
            st.devices.values(), key=lambda d: (*layout.name_key(d.parent or d.name), d.vf_index or -1)
        )
        return tuple(_record(st, d) for d in ordered if kind is None or d.kind == kind)

    def device(self, name: str) -> DeviceRecord:
        """Return one device."""
        st = self.state()
        return _record(st, st.device(name))

    def show(self) -> dict[str, Any]:
        """Return the lab as JSON-ready data: devices, identities, topology, faults."""
        st = self.state()
        records = self.devices()
        on_switch: dict[str, list[str]] = {}
        for r in records:
            if r.pcie_switch and r.kind is not DeviceKind.NIC_VF:
                on_switch.setdefault(r.pcie_switch, []).append(r.name)
        return {
            "root": str(self.root),
            "profile": st.profile.name,
            "mknod": st.mknod,
            "numa_nodes": [n.model_dump() for n in st.numa_nodes],
            "host_bridges": st.host_bridges,
            "switches": [s.model_dump() | {"devices": on_switch.get(s.name, [])} for s in st.switches],
            "devices": [asdict(r) | {"attributes": dict(r.attributes)} for r in records],
        }

    def check(self) -> list[str]:
        """Every way the tree would mislead a real reader (``lab check``): the lab's checks, its kinds'."""
        from plugvisor.emulators.lab import fidelity  # noqa: PLC0415 - only checking walks the tree

        found = fidelity.problems(self.root)
        present = dict.fromkeys(kinds.get(d.kind) for d in self.state().devices.values())
        for kind in present:
            found += kinds.check(kind, str(self._tree.root))
        return found

    # -- changing ---------------------------------------------------------------------------------------

    def _change(self, name: str, mutate: Callable[[LabState, DeviceState], None]) -> DeviceRecord:
        with state.locked(self._tree.root):
            st = self.state()
            dev = st.device(name)
            before = render.family(st, name)
            old = render.devices(st, before)
            was = {n: st.devices[n].model_copy(deep=True) for n in before}
            mutate(st, dev)
            after = render.family(st, name)
            touched = list(dict.fromkeys([*before, *after]))
            for n in touched:
                if n in was and n in st.devices:
                    nvml.account(was[n], st.devices[n])
            new = render.devices(st, touched)
            self._tree.apply(old, new)
            state.save(self._tree, st)
            nvml.write_state(self._tree, st, touched)
            return _record(st, st.devices[name])

    def fault(self, device: str, kind: FaultKind | str) -> DeviceRecord:
        """Inject a fault (see :class:`FaultKind` and :func:`.faults.applicable`)."""

        def mutate(st: LabState, dev: DeviceState) -> None:
            faults.inject(st, dev, faults.parse(kind, dev))

        return self._change(device, mutate)

    def heal(self, device: str, kind: FaultKind | str | None = None) -> DeviceRecord:
        """Undo one fault of a device, or all of them."""

        def mutate(st: LabState, dev: DeviceState) -> None:
            faults.heal(st, dev, None if kind is None else faults.parse(kind, dev))

        return self._change(device, mutate)

    def unplug(self, device: str) -> DeviceRecord:
        """Hot-unplug a device: its whole subtree (VFs of a PF too), links and nodes go."""

        def mutate(st: LabState, dev: DeviceState) -> None:
            if not dev.present:
                raise errors.UsageError(f"{dev.name} is already unplugged")
            dev.present = False

        return self._change(device, mutate)

    def plug(self, device: str) -> DeviceRecord:
        """Re-plug a device: it comes back as freshly enumerated (no faults, zero AER counts).

        A PF comes back with the VFs it had, as a node whose operator re-applies
        its VF configuration would show it.
        """

        def mutate(st: LabState, dev: DeviceState) -> None:
            if dev.present:
                raise errors.UsageError(f"{dev.name} is already plugged in")
            if dev.parent and not st.devices[dev.parent].present:
                raise errors.UsageError(
                    f"{dev.name} is a VF of {dev.parent}, which is unplugged; plug the PF"
                )
            for d in [dev, *st.vfs_of(dev.name)]:
                d.present = True
                d.faults = [f for f in d.faults if f == FaultKind.VFS_RESET.value]
                d.aer = (0, 0, 0)

        return self._change(device, mutate)

    def set_num_vfs(self, pf: str, count: int) -> DeviceRecord:
        """Write ``sriov_numvfs`` the kernel's way: 0 removes all VFs; N needs 0 VFs first (else EBUSY)."""

        def mutate(st: LabState, dev: DeviceState) -> None:
            if dev.kind is not DeviceKind.NIC_PF:
                raise errors.UsageError(f"{dev.name} is a {dev.kind}, not an SR-IOV PF (nic-pf)")
            if not dev.present:
                raise errors.UsageError(f"{dev.name} is unplugged; plug it back first")
            total = dev.total_vfs or 0
            if not 0 <= count <= total:
                raise errors.UsageError(
                    f"{dev.name}: sriov_numvfs {count} is out of range; expected 0..{total}"
                )
            current = dev.num_vfs or 0
            if count == current:
                return
            if current and count:
                raise errors.DeviceBusyError(
                    f"{dev.name}: sriov_numvfs is {current}; write 0 first, then {count} "
                    "(the kernel answers EBUSY otherwise)"
                )
            if FaultKind.VFS_RESET.value in dev.faults:
                dev.faults.remove(FaultKind.VFS_RESET.value)
                dev.saved_num_vfs = None
            from plugvisor.emulators.lab import nic  # noqa: PLC0415 - keeps nic out of the public import path

            nic.set_vf_states(st, dev, count)

        return self._change(pf, mutate)
