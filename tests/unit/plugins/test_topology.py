"""Topology-aware preferred allocation: PCI-tree distance, and the best set of a requested size."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from plugvisor.plugins import topology as t


def dgx(replicas: int = 1):
    """8 GPUs, 2 per switch, 4 per NUMA node (the lab's dgx-like)."""
    placements = {}
    for g in range(8):
        numa, sw = g // 4, g // 2
        chain = (f"pci0000:{numa}0", f"rp{sw}", f"up{sw}", f"dn{g}", f"gpu{g}")
        for r in range(replicas):
            device_id = f"g{g}" if replicas == 1 else f"g{g}::{r}"
            placements[device_id] = t.Placement(numa, chain, f"gpu{g}")
    return placements


def pick(placements, available, must, size, policy=t.Policy.PACK):
    return t.preferred(available, must, size, t.TopologyIndex(placements), policy=policy)


class TestDistance:
    def test_levels_follow_the_pci_tree(self):
        p = dgx()
        assert t.distance(p["g0"], p["g1"]) == t.Distance.SAME_SWITCH
        assert t.distance(p["g0"], p["g2"]) == t.Distance.SAME_HOST_BRIDGE
        assert t.distance(p["g0"], p["g4"]) == t.Distance.CROSS_NUMA
        r = dgx(2)
        assert t.distance(r["g0::0"], r["g0::1"]) == t.Distance.SAME_DEVICE


class TestPreferred:
    def test_pairs_are_switch_local_and_quads_numa_local(self):
        p = dgx()
        assert sorted(pick(p, list(p), [], 2)) == ["g0", "g1"]
        quad = pick(p, list(p), [], 4)
        assert len({p[i].numa for i in quad}) == 1

    def test_must_include_is_honoured_and_its_switch_partner_chosen(self):
        p = dgx()
        assert sorted(pick(p, list(p), ["g5"], 2)) == ["g4", "g5"]

    def test_a_pair_stays_under_one_pcie_root_where_a_numa_node_has_several(self):
        """Two root complexes on one NUMA node (as on EPYC servers), no switch with two GPUs free: the pair
        comes from one host bridge (DRA's pcieRoot), not merely one NUMA node."""
        p = {
            f"g{g}": t.Placement(
                0, (f"pci0000:{g // 2}0", f"rp{g}", f"up{g}", f"dn{g}", f"gpu{g}"), f"gpu{g}"
            )
            for g in range(4)
        }
        for available in (["g0", "g2", "g3"], ["g1", "g2", "g3"], ["g0", "g1", "g3"]):
            chosen = pick(p, available, [], 2)
            assert len({p[i].chain[0] for i in chosen}) == 1, (available, chosen)

    def test_best_fit_keeps_whole_switches_free(self):
        p = dgx()
        # g0's partner is taken: a single GPU should come from that broken switch.
        assert pick(p, ["g0", "g2", "g3", "g4", "g5", "g6", "g7"], [], 1) == ["g0"]

    def test_spread_takes_distinct_gpus_pack_takes_one(self):
        r = dgx(4)
        spread = pick(r, list(r), [], 3, t.Policy.SPREAD)
        assert len({r[i].physical for i in spread}) == 3
        assert len({r[i].numa for i in spread}) == 1
        packed = pick(r, list(r), [], 3, t.Policy.PACK)
        assert len({r[i].physical for i in packed}) == 1

    def test_spread_goes_round_robin_when_asked_for_more_than_there_are_gpus(self):
        r = dgx(2)
        chosen = pick(r, list(r), [], 12, t.Policy.SPREAD)
        counts = sorted(sum(1 for i in chosen if r[i].physical == f"gpu{g}") for g in range(8))
        assert counts == [1, 1, 1, 1, 2, 2, 2, 2]

    @settings(max_examples=150, deadline=None)
    @given(st.data())
    def test_answers_are_valid_and_optimal_on_dgx_like(self, data):
        p = dgx()
        available = data.draw(st.lists(st.sampled_from(sorted(p)), min_size=1, unique=True))
        size = data.draw(st.integers(1, len(available)))
        must = data.draw(st.lists(st.sampled_from(available), max_size=size, unique=True))
        chosen = pick(p, available, must, size)
        assert len(chosen) == len(set(chosen)) == size
        assert set(must) <= set(chosen) <= set(available)
        assert t.score(chosen, p) == t.optimal_score(available, must, size, p)

    def test_works_on_devices_without_numa_or_tree_position(self):
        p = {f"d{i}": t.Placement(None, (), f"d{i}") for i in range(5)}
        assert len(pick(p, list(p), ["d3"], 3)) == 3

    def test_large_trees(self):
        rng = random.Random(7)
        p = {
            f"d{i}": t.Placement(
                i // 5000, (f"hb{i // 1000}", f"rp{i // 16}", f"up{i // 4}", f"dn{i}"), f"d{i}"
            )
            for i in range(10_000)
        }
        index = t.TopologyIndex(p)
        available = rng.sample(sorted(p), 6000)
        chosen = t.preferred(available, [], 4, index)
        assert len(set(chosen)) == 4 and set(chosen) <= set(available)
