"""Process groups of a layout, built in one process over a fake torch.distributed: the
same creation order on every rank (gloo creates groups eagerly: another order
deadlocks), each rank in the group of its coordinates, each group created once."""
import pytest

from dynatrain_megatron.elastic import groups as G
from dynatrain_megatron.vps.layout import GROUP_AXES, Layout
from dynatrain_megatron.vps.placement import Placement


class _FakeGroup:
    def __init__(self, ranks):
        self.ranks = tuple(ranks)


def _build(monkeypatch, layout, placement, rank, world):
    calls = []

    def new_group(ranks, device_id=None, sort_ranks=True):
        # torch numbers members by sorted global rank unless sort_ranks=False
        calls.append((tuple(ranks), sort_ranks))
        return _FakeGroup(sorted(ranks) if sort_ranks else ranks)

    monkeypatch.setattr(G.dist, "new_group", new_group)
    monkeypatch.setattr(G.dist, "get_rank", lambda: rank)
    monkeypatch.setattr(G.dist, "get_world_size", lambda: world)
    monkeypatch.setattr(G.dist, "get_backend", lambda *a, **k: "gloo")
    return G.build_groups(layout, placement), calls


@pytest.mark.parametrize("text,world,devices", [
    ("tp2pp2dp2", 10, tuple(range(2, 10))),  # B on devices 2..9 of a world of 10
    ("tp1pp2ep2dp2", 4, None),
    ("tp1pp2doi2dp4", 8, None),              # two distributed-optimizer instances
])
def test_groups_of_a_layout(monkeypatch, text, world, devices):
    lay = Layout.parse(text, len(devices) if devices else world)
    pl = Placement(devices) if devices else Placement.default(lay.world_size)
    dev = pl.devices
    built = {r: _build(monkeypatch, lay, pl, r, world) for r in range(world)}
    order = built[0][1]
    assert all(calls == order for _, calls in built.values())  # collective order
    assert order[-1][0] == tuple(range(world))  # the transfer group spans the world
    for r, (groups, calls) in built.items():
        assert len(groups.created) == len(set(calls[:-1])) + 1  # each group made once
        assert groups.transfer.ranks == tuple(range(world))
        if r not in dev:
            assert groups.virtual_rank is None and groups.group_ranks == {}
            assert groups.layout_group is None
            continue
        v = dev.index(r)
        assert groups.virtual_rank == v and groups.layout_group.ranks == dev
        c = lay.coords(v)
        for name, axes in GROUP_AXES.items():
            # the members: every virtual rank whose coordinates differ from r's on `axes`
            # only (dense and expert grids), as devices, in virtual order
            want = next([dev[u] for u in g] for g in lay.groups(axes) if v in g)
            assert groups.group_ranks[name] == want, name
            assert getattr(groups.pg_collection, name).ranks == tuple(want)
            assert r in want
        pp = [dev[u] for u in next(g for g in lay.groups(("pp",)) if v in g)]
        if c.pp in (0, lay.pp - 1):
            assert groups.group_ranks["embd"] == [pp[0], pp[-1]]
        else:
            assert groups.pg_collection.embd is None
        if lay.doi > 1:
            assert len(groups.group_ranks["intra_dp_cp"]) == lay.dense_shards
            inst = groups.group_ranks["intra_dist_opt"]
            assert len(inst) == lay.world_size // lay.doi and r in inst
        else:
            assert groups.group_ranks["intra_dp_cp"] == groups.group_ranks["dp_cp"]


def test_a_placement_that_is_not_rank_ordered_numbers_members_by_virtual_rank(monkeypatch):
    """Devices (1, 0, 2, 3): virtual rank 0 sits on device 1, so its TP group is [1, 0]
    in that order (group rank = virtual TP rank), asked of torch with sort_ranks=False;
    ascending member lists keep torch's default call."""
    lay = Layout.parse("tp2pp1dp2", 4)
    pl = Placement((1, 0, 2, 3))
    groups, calls = _build(monkeypatch, lay, pl, 1, 4)
    assert groups.virtual_rank == 0
    assert groups.pg_collection.tp.ranks == (1, 0)
    assert groups.group_ranks["tp"] == [1, 0]
    for ranks, sort_ranks in calls:
        assert sort_ranks == (list(ranks) == sorted(ranks))
    assert ((1, 0), False) in calls
