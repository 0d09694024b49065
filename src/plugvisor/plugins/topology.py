"""Topology-aware preferred allocation: distance in the PCI tree, and the best set of a given size.

Pure functions over plain values, shared by the kinds (no I/O: the kinds read
sysfs and hand in a :class:`Placement` per device), so the search can be unit
tested, fuzzed and benchmarked on 10,000 devices without a tree on disk.

**Distance** between two devices follows the tree the kernel shows in
``/sys/devices/pci...`` (NVIDIA's ``nvidia-smi topo`` levels, computed from sysfs
instead of NVML): replicas of one physical device (0) < same PCIe switch (1) <
same root port (2) < same host bridge (3) < same NUMA node (4) < across NUMA
nodes or unknown (5). A set's **score** is the sum of its pairwise distances (as
ROCm's best-effort policy scores subsets), lower is better.

**Search** never enumerates subsets. The devices form a tree (machine -> NUMA
node -> host bridge -> root port -> switch ports -> device -> replicas) in which
the distance of two devices is a property of their lowest common ancestor, so the
best set lives in the smallest subtree that has enough free devices; inside it,
the request is split over child subtrees as unevenly as their free counts allow
(fewest pairs across children). Ties go to the subtree whose ancestors have the
fewest free devices (best fit), which keeps whole switches and NUMA nodes free for
later large requests. Must-include devices fix the subtree to their common
ancestor (or above, when it is too small).

With replicas (time-slicing), ``pack`` treats replicas of one device as closest
(NVIDIA's ``packed``), ``spread`` first picks distinct physical devices, least
loaded first and topology-close, then adds replicas round-robin (NVIDIA's
``distributed``).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Final


class Distance(IntEnum):
    """How far apart two devices are, by their lowest common point in the PCI tree."""

    SAME_DEVICE = 0
    SAME_SWITCH = 1
    SAME_ROOT_PORT = 2
    SAME_HOST_BRIDGE = 3
    SAME_NUMA = 4
    CROSS_NUMA = 5


class Policy(StrEnum):
    """How replicas of one physical device are handed out."""

    SPREAD = "spread"
    PACK = "pack"


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one allocatable device sits.

    ``chain`` runs from the host bridge to the device's PCI function
    (``("pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:00.0", "0000:03:00.0")``);
    ``physical`` names the physical device, shared by its replicas. ``numa`` is
    ``None`` when unknown.
    """

    numa: int | None
    chain: tuple[str, ...]
    physical: str
    path: tuple[tuple[str, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        steps: list[tuple[str, int]] = [
            ("numa:?", Distance.CROSS_NUMA)
            if self.numa is None
            else (f"numa:{self.numa}", Distance.SAME_NUMA)
        ]
        last = len(self.chain) - 1
        for index, element in enumerate(self.chain):
            steps.append((f"pci:{element}", _chain_cost(index, last)))
        steps.append((f"dev:{self.physical}", Distance.SAME_DEVICE))
        object.__setattr__(self, "path", tuple(steps))


def _chain_cost(index: int, last: int) -> int:
    if index == last:
        return Distance.SAME_SWITCH if index >= 2 else (Distance.SAME_ROOT_PORT if index == 1 else 3)
    if index == 0:
        return Distance.SAME_HOST_BRIDGE
    if index == 1:
        return Distance.SAME_ROOT_PORT
    return Distance.SAME_SWITCH


_ROOT_COST: Final = int(Distance.CROSS_NUMA)


def distance(a: Placement, b: Placement) -> int:
    """The distance of two devices: the cost of their lowest common ancestor in the tree."""
    if a.physical == b.physical and a.path == b.path:
        return Distance.SAME_DEVICE
    cost = _ROOT_COST
    for (key_a, cost_a), (key_b, _) in zip(a.path, b.path, strict=False):
        if key_a != key_b:
            break
        cost = cost_a
    return cost


def score(ids: Sequence[str], placements: Mapping[str, Placement]) -> int:
    """Sum of pairwise distances of a set (lower is better)."""
    return sum(distance(placements[a], placements[b]) for a, b in itertools.combinations(ids, 2))


def optimal_score(
    available: Sequence[str], must_include: Sequence[str], size: int, placements: Mapping[str, Placement]
) -> int:
    """The best score any valid set reaches, by enumeration (an oracle for tests and benchmarks)."""
    must = list(must_include)
    rest = [i for i in available if i not in set(must)]
    return min(score([*must, *combo], placements) for combo in itertools.combinations(rest, size - len(must)))


class TopologyIndex:
    """The device tree of one device snapshot, built once and reused by every request.

    Internal nodes with a single child are dropped (they are never the common
    ancestor of two devices, so distances do not change), which keeps the tree
    shallow. A request then only counts free devices per node, with integer
    arrays, which is what keeps a request on 10,000 devices within milliseconds.
    """

    def __init__(self, placements: Mapping[str, Placement]) -> None:
        self.placements: Mapping[str, Placement] = placements
        keys: dict[tuple[str, ...], int] = {}
        cost: list[int] = [_ROOT_COST]
        parent: list[int] = [-1]
        children: list[list[int]] = [[]]
        leaf: list[str | None] = [None]
        leaf_index: dict[str, int] = {}
        for device_id, placement in placements.items():
            node = 0
            prefix: tuple[str, ...] = ()
            for key, step_cost in placement.path:
                prefix = (*prefix, key)
                child = keys.get(prefix)
                if child is None:
                    child = keys[prefix] = len(cost)
                    cost.append(step_cost)
                    parent.append(node)
                    children.append([])
                    leaf.append(None)
                    children[node].append(child)
                node = child
            index = len(cost)
            cost.append(Distance.SAME_DEVICE)
            parent.append(node)
            children.append([])
            leaf.append(device_id)
            children[node].append(index)
            leaf_index[device_id] = index
        # Splice out single-child internal nodes (never anybody's lowest common ancestor).
        for node in range(1, len(cost)):
            if leaf[node] is None and len(children[node]) == 1:
                (only,) = children[node]
                up = parent[node]
                children[up][children[up].index(node)] = only
                parent[only] = up
                children[node] = []
        ancestors: dict[str, tuple[int, ...]] = {}
        for device_id, index in leaf_index.items():
            chain = [index]
            node = parent[index]
            while node != -1:
                chain.append(node)
                node = parent[node]
            ancestors[device_id] = tuple(chain)
        self._cost = cost
        self._parent = parent
        self._children = children
        self._leaf = leaf
        self._ancestors = ancestors
        self._physical: TopologyIndex | None = None

    def physical(self) -> TopologyIndex:
        """The index of the physical devices (one entry per device shared by replicas)."""
        if self._physical is None:
            seen: dict[str, Placement] = {}
            for placement in self.placements.values():
                seen.setdefault(placement.physical, placement)
            self._physical = TopologyIndex(seen)
        return self._physical

    def pick(
        self,
        ids: Sequence[str],
        must_include: Sequence[str],
        size: int,
        rank: Mapping[str, int] | None = None,
    ) -> list[str]:
        """The best ``size`` of ``ids`` (all of ``must_include`` among them), closest first."""
        request = _Request(self, ids, must_include)
        return request.pick(size, rank)


class _Request:
    """Free and must-include counts per tree node, for one request."""

    def __init__(self, index: TopologyIndex, ids: Sequence[str], must_include: Sequence[str]) -> None:
        self.index = index
        n = len(index._cost)
        cap = [0] * n
        must = [0] * n
        ancestors = index._ancestors
        for device_id in ids:
            for node in ancestors[device_id]:
                cap[node] += 1
        for device_id in must_include:
            for node in ancestors[device_id]:
                must[node] += 1
        self.cap = cap
        self.must = must
        self.must_include = must_include

    def pick(self, size: int, rank: Mapping[str, int] | None) -> list[str]:
        index = self.index
        cap = self.cap
        if self.must_include:
            wanted = len(self.must_include)
            node = index._ancestors[self.must_include[0]][0]
            while self.must[node] < wanted or cap[node] < size:
                node = index._parent[node]
            out: list[str] = []
            self.fill(node, size, out)
            return out
        placements = index.placements
        best: tuple[tuple[int, int, int], list[str]] | None = None
        for order, node in enumerate(self.candidates(size, _CANDIDATE_LIMIT)):
            chosen: list[str] = []
            self.fill(node, size, chosen)
            key = (score(chosen, placements), sum(rank[i] for i in chosen) if rank else 0, order)
            if best is None or key < best[0]:
                best = (key, chosen)
        assert best is not None
        return best[1]

    def fill(self, node: int, k: int, out: list[str]) -> None:
        """Take ``k`` free leaves under ``node`` (its must-include leaves among them), concentrated."""
        index = self.index
        leaf = index._leaf[node]
        if leaf is not None:
            out.append(leaf)
            return
        cap = self.cap
        must = self.must
        children = [c for c in index._children[node] if cap[c]]
        if k == cap[node]:
            for child in children:
                self.fill(child, cap[child], out)
            return
        take = self.distribute(node, children, [must[c] for c in children], k)
        for child, count in zip(children, take, strict=True):
            if count:
                self.fill(child, count, out)

    def distribute(self, node: int, children: list[int], take: list[int], k: int) -> list[int]:
        """How many devices each child gives, its must-include ones at least, ``k`` in all.

        Filling one child as far as it goes and then the next gives the fewest
        pairs across children (at most one child ends up partly used); which child
        goes first is decided by the resulting score when there are few children,
        and by "largest reachable count, then fullest" otherwise.
        """
        cap = self.cap
        rest = k - sum(take)
        order = sorted(
            range(len(children)),
            key=lambda i: (-min(cap[children[i]], take[i] + rest), -take[i], cap[children[i]], i),
        )

        def fill_from(first: int) -> list[int]:
            counts = list(take)
            left = rest
            for i in (first, *(j for j in order if j != first)):
                extra = min(cap[children[i]] - counts[i], left)
                counts[i] += extra
                left -= extra
            return counts

        room = [i for i in order if cap[children[i]] > take[i]]
        if rest <= 0 or len(room) == 1 or len(children) > _EXACT_FANOUT:
            return fill_from(room[0]) if rest > 0 else take
        cross = self.index._cost[node]
        best: tuple[tuple[int, int], list[int]] | None = None
        for rank, first in enumerate(room):
            counts = fill_from(first)
            total = sum(self.inner_score(c, n) for c, n in zip(children, counts, strict=True) if n > 1)
            total += cross * (k * k - sum(n * n for n in counts)) // 2
            if best is None or (total, rank) < best[0]:
                best = ((total, rank), counts)
        assert best is not None
        return best[1]

    def inner_score(self, node: int, k: int) -> int:
        """The score of the ``k`` devices :meth:`fill` would take under ``node``."""
        chosen: list[str] = []
        self.fill(node, k, chosen)
        return score(chosen, self.index.placements)

    def candidates(self, k: int, limit: int) -> list[int]:
        """Up to ``limit`` smallest subtrees with ``k`` free devices and the lowest cost, best fit first.

        Children are visited in increasing number of free devices, so the first
        candidates found are those whose ancestors are the fullest (best fit),
        which keeps large groups free for later requests.
        """
        index = self.index
        cap = self.cap
        kids = index._children
        if k == 1:
            best: dict[int, int] = {}
            target = int(Distance.SAME_DEVICE)
        else:
            best = self._best_costs(k)
            target = best[0]
        found: list[int] = []
        stack = [0]
        while stack and len(found) < limit:
            node = stack.pop()
            big = [c for c in kids[node] if cap[c] >= k and best.get(c, Distance.SAME_DEVICE) == target]
            if big:
                big.sort(key=cap.__getitem__)
                stack.extend(reversed(big))
            else:
                found.append(node)
        return found

    def _best_costs(self, k: int) -> dict[int, int]:
        """For every subtree with ``k`` free devices: the lowest candidate cost inside it."""
        kids = self.index._children
        cost = self.index._cost
        cap = self.cap
        best: dict[int, int] = {}
        stack: list[tuple[int, bool]] = [(0, False)]
        while stack:
            node, done = stack.pop()
            big = [c for c in kids[node] if cap[c] >= k]
            if not done and big:
                stack.append((node, True))
                stack.extend((c, False) for c in big)
                continue
            best[node] = min((best[c] for c in big), default=cost[node])
        return best


_EXACT_FANOUT: Final = 8
"""Up to this many children, which child to fill first is decided by the resulting score."""

_CANDIDATE_LIMIT: Final = 32
"""How many equally good subtrees are scored exactly before the best-fit order decides."""


def preferred(
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    index: TopologyIndex,
    *,
    policy: Policy = Policy.PACK,
) -> list[str]:
    """Choose ``size`` IDs from ``available`` (all of ``must_include`` among them), closest first.

    Expects what the framework guarantees: IDs known to ``index``, distinct,
    ``must_include`` within ``available`` and
    ``len(must_include) <= size <= len(available)``.
    """
    if size == len(available):
        return list(available)
    if policy is Policy.PACK:
        return index.pick(available, must_include, size)
    return _spread(available, must_include, size, index)


def _spread(
    available: Sequence[str], must_include: Sequence[str], size: int, index: TopologyIndex
) -> list[str]:
    placements = index.placements
    free: dict[str, list[str]] = {}
    for device_id in available:
        free.setdefault(placements[device_id].physical, []).append(device_id)
    chosen = list(must_include)
    taken = set(chosen)
    used = Counter(placements[i].physical for i in chosen)
    for physical in used:
        free[physical] = [i for i in free[physical] if i not in taken]
    need = size - len(chosen)
    fresh = [p for p in free if p not in used and free[p]]
    count = min(need, len(fresh))
    if count:
        anchors = list(used)
        rank = {p: -len(free[p]) for p in fresh}
        picked = index.physical().pick([*anchors, *fresh], anchors, count + len(anchors), rank)
        for physical in picked:
            if physical in used:
                continue
            chosen.append(free[physical].pop(0))
            used[physical] += 1
        need -= count
    order = {p: n for n, p in enumerate(free)}
    while need > 0:
        physical = min((p for p in free if free[p]), key=lambda p: (used[p], -len(free[p]), order[p]))
        chosen.append(free[physical].pop(0))
        used[physical] += 1
        need -= 1
    return chosen
