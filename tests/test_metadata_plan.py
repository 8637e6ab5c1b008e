"""Plans made from live metadata (pure): fed every rank's fragments of two layouts, the
metadata planner fills every fragment of B exactly once with A's values, moves the analytic
planner's lower bound, plans the same pieces whatever order the records arrive in, and
names what cannot be planned (state held by no rank of A, a shape that differs)."""
import random

import numpy as np
import pytest

from dynatrain_megatron.routing import RoutingError, build_plan
from dynatrain_megatron.routing.metadata_plan import StateRecord, metadata_plan
from dynatrain_megatron.routing.schedule import schedule
from dynatrain_megatron.vps import KINDS, Placement, analytic_layout
from dynatrain_megatron.vps.box import Box

from routing_cases import lay, spec

PAIRS = [
    ("tiny-gpt", "tp2pp2", 8, "tp1pp4", 8),
    ("tiny-gpt+tied", "tp2pp1", 4, "tp2pp2", 8),       # tied copies, world 4 -> 8
    ("tiny-moe", "tp2pp2ep2etp1", 8, "tp2pp2ep4etp1", 8),
    ("tiny-gpt", "tp2pp2", 8, "tp2pp2", 4),            # scale in
]


def _records(al, kinds=KINDS, devices=None):
    out = []
    for v in range(al.layout.world_size):
        d = v if devices is None else devices[v]
        out += [StateRecord(f.key, f.kind, f.box, d, f.chunk, f.local_name, f.local_offsets)
                for f in al.fragments(v, kinds)]
    return out


def _shapes(al):
    return {t.key: tuple(t.shape) for t in al.logical_tensors}


def _mplan(s, A, B, src=None, dst=None, **kw):
    a, b = analytic_layout(s, A), analytic_layout(s, B)
    return metadata_plan(src if src is not None else _records(a),
                         dst if dst is not None else _records(b),
                         src_layout=A, dst_layout=B, src_devices=range(A.world_size),
                         dst_devices=range(B.world_size), kinds=KINDS,
                         itemsize={k: 4 for k in KINDS}, src_shapes=_shapes(a),
                         dst_shapes=_shapes(b), **kw)


@pytest.mark.parametrize("case", PAIRS, ids=lambda c: f"{c[0]}:{c[1]}x{c[2]}-{c[3]}x{c[4]}")
def test_every_fragment_of_b_gets_a_values_and_the_bytes_are_the_lower_bound(case):
    model, a, wa, b, wb = case
    s, A, B = spec(model), lay(a, wa), lay(b, wb)
    plan = _mplan(s, A, B)
    # every logical element's value: its global flat index
    tensors = {t.key: np.arange(int(np.prod(t.shape))).reshape(t.shape)
               for t in analytic_layout(s, A).logical_tensors}
    held = {}
    for v in range(A.world_size):
        for f in analytic_layout(s, A).fragments(v):
            held.setdefault((v, f.kind, f.key), []).append(f)
    dst = {v: analytic_layout(s, B).fragments(v) for v in range(B.world_size)}
    vals, count = {}, {}
    for v, frags in dst.items():  # B's local storage, as far as its fragments reach
        for f in frags:
            k = (v, f.kind, f.chunk, f.local_name)
            ext = tuple(o + n for o, n in zip(f.local_offsets, f.box.shape))
            old = vals.get(k, np.zeros((0,) * len(ext))).shape
            shape = tuple(max(a, b) for a, b in zip(old, ext)) if old else ext
            vals[k] = np.full(shape, -1)
            count[k] = np.zeros(shape, np.int64)
    for p in plan.pieces():
        # the source really holds the piece's box at the place the piece names
        assert any(f.box.contains(p.box) and f.chunk == p.src_chunk
                   and f.local_name == p.src_local_name
                   and tuple(o - fo + lo for o, fo, lo in zip(p.box.offsets, f.box.offsets,
                                                              f.local_offsets))
                   == p.src_local_offsets
                   for f in held[(p.src_device, p.kind, p.key)]), p
        k = (p.dst_device, p.kind, p.dst_chunk, p.dst_local_name)
        vals[k][p.dst_local_box.slices()] = tensors[p.key][p.box.slices()]
        count[k][p.dst_local_box.slices()] += 1
    n = 0
    for v, frags in dst.items():
        for f in frags:
            k = (v, f.kind, f.chunk, f.local_name)
            assert (vals[k][f.local_box.slices()] == tensors[f.key][f.box.slices()]).all(), f
            assert (count[k][f.local_box.slices()] == 1).all(), f
            n += f.box.numel
    assert n == sum(int(c.sum()) for c in count.values())  # nothing else written
    analytic = build_plan(s, A, B, bucket_size=None)
    assert plan.stats.moved_bytes == analytic.stats.lower_bound_bytes
    budget = max(1 << 14, plan.stats.moved_bytes // 8)  # the scheduler takes it: rounds
    rounds = schedule(plan, budget, align=16)
    assert len(rounds) > 1 or plan.stats.moved_bytes == 0
    assert sum(p.nbytes for r in rounds for d in plan.devices for p in r.sends(d)) \
        == plan.stats.moved_bytes


def test_the_plan_does_not_depend_on_the_order_records_arrive_in():
    s, A, B = spec("tiny-moe"), lay("tp2pp2ep2etp1", 8), lay("tp1pp2ep4etp1", 8)
    src, dst = _records(analytic_layout(s, A)), _records(analytic_layout(s, B))
    one = _mplan(s, A, B, src, dst)
    random.Random(3).shuffle(src)
    random.Random(4).shuffle(dst)
    two = _mplan(s, A, B, src, dst)
    assert [one.pieces_for(d) for d in range(8)] == [two.pieces_for(d) for d in range(8)]


def test_state_no_device_of_a_holds_is_refused_with_its_name():
    s, A, B = spec("tiny-gpt"), lay("tp2pp2", 8), lay("tp1pp4", 8)
    a = analytic_layout(s, A)
    # the devices of A's first pipeline stage are dead: the first layers have no holder
    dead = [v for v in range(8) if A.coords(v).pp == 0]
    with pytest.raises(RoutingError, match=r"held by no available device of A"):
        _mplan(s, A, B, unavailable=dead)
    # a tensor A does not have at all, and one whose shape differs
    extra = StateRecord("mtp.layers.0.eh_proj.weight", "param", Box((0, 0), (4, 4)), 0, 0,
                        "mtp.layers.0.eh_proj.weight", (0, 0))
    shapes = dict(_shapes(a), **{"mtp.layers.0.eh_proj.weight": (4, 4)})
    with pytest.raises(RoutingError, match=r"mtp.layers.0.eh_proj.weight: held at B, by no "
                                           r"rank of A"):
        metadata_plan(_records(a), _records(analytic_layout(s, B)) + [extra], src_layout=A,
                      dst_layout=B, src_devices=range(8), dst_devices=range(8), kinds=KINDS,
                      itemsize={k: 4 for k in KINDS}, src_shapes=_shapes(a), dst_shapes=shapes)
    bad = {k: (v[0] + 1,) + v[1:] if k == "decoder.final_layernorm.weight" else v
           for k, v in _shapes(a).items()}
    with pytest.raises(RoutingError, match=r"final_layernorm.weight: global shape"):
        metadata_plan(_records(a), _records(analytic_layout(s, B)), src_layout=A,
                      dst_layout=B, src_devices=range(8), dst_devices=range(8), kinds=KINDS,
                      itemsize={k: 4 for k in KINDS}, src_shapes=_shapes(a), dst_shapes=bad)


def test_records_travel_as_tuples():
    r = StateRecord("k", "exp_avg", Box((1, 2), (3, 4)), 5, 1, "w", (0, 2), 4)
    assert StateRecord.from_tuple(r.as_tuple()) == r
    with pytest.raises(RoutingError):
        StateRecord("k", "grad", Box((0,), (1,)), 0, 0, "w", (0,))


@pytest.mark.multirank
def test_a_rank_that_failed_before_the_gather_joins_it_and_every_rank_raises():
    from dynatrain_megatron.testing.multiproc import run_on_ranks

    import rank_cases

    got = run_on_ranks(rank_cases.metadata_gather_with_a_failed_rank, 2, timeout=120)
    assert got == ["gathering the live metadata failed: rank 1: prepare: boom"] * 2, got


def test_live_weights_are_checked_where_the_analytic_layout_describes_them_too():
    from dynatrain_megatron.adapters.live import LiveFragment
    from dynatrain_megatron.adapters.verify import check_live_matches_analytic_where_both
    from dynatrain_megatron.vps.errors import FragmentMismatchError

    s, A = spec("tiny-gpt"), lay("tp2pp2", 8)
    al = analytic_layout(s, A)
    rank = 7  # the last stage: the output layer
    expected = al.fragments(rank, ("param",))
    live = [LiveFragment(f.key, f.kind, f.box, f.rank, f.chunk, f.local_name, f.local_offsets,
                         f.replica == 0) for f in expected]
    # what the analytic layout does not describe (an MTP layer) is left out of the check
    mtp = LiveFragment("mtp.layers.0.eh_proj.weight", "param", Box((0, 0), (8, 16)), rank, 0,
                       "mtp.layers.0.eh_proj.weight", (0, 0), True)
    assert check_live_matches_analytic_where_both(live + [mtp], expected, rank) == len(
        {f.key for f in expected})
    # a tensor both describe, at another place: refused, named
    f = live[0]
    moved = LiveFragment(f.key, f.kind, f.box, f.rank, f.chunk, f.local_name,
                         tuple(o + 1 for o in f.local_offsets), f.main)
    with pytest.raises(FragmentMismatchError, match=f.key.replace(".", r"\.")):
        check_live_matches_analytic_where_both([moved] + live[1:], expected, rank)


def test_layers_a_heterogeneous_model_shapes_otherwise_are_left_out_of_the_check():
    """`--heterogeneous-layers-config-path`: each layer its own MLP size (the analytic layout
    repeats one layer). The builder names the layers' prefix (`unlike_analytic`), which
    only a plan from the live metadata allows; the other tensors are still checked."""
    from dynatrain_megatron.adapters.live import LiveFragment
    from dynatrain_megatron.adapters.verify import check_live_matches_analytic_where_both
    from dynatrain_megatron.mcore.builders import MegatronBuilder
    from dynatrain_megatron.mcore.train_config import TrainConfig
    from dynatrain_megatron.transition.metadata_exchange import unlike_analytic
    from dynatrain_megatron.vps.errors import FragmentMismatchError

    s, A = spec("tiny-gpt"), lay("tp2pp2", 8)
    rank = 7
    expected = analytic_layout(s, A).fragments(rank, ("param",))
    live = []
    for f in expected:  # layer 3's fc1 with an MLP of its own size: half the rows
        box = f.box
        if f.key == "decoder.layers.3.mlp.linear_fc1.weight":
            box = Box(box.offsets, (box.shape[0] // 2,) + box.shape[1:])
        live.append(LiveFragment(f.key, f.kind, box, f.rank, f.chunk, f.local_name,
                                 f.local_offsets, f.replica == 0))
    with pytest.raises(FragmentMismatchError, match=r"decoder\.layers\.3\.mlp\.linear_fc1"):
        check_live_matches_analytic_where_both(live, expected, rank)
    # the embedding's, norm's and output layer's fragments still compared
    assert check_live_matches_analytic_where_both(live, expected, rank,
                                                  ("decoder.layers.",)) == 2
    moved = [LiveFragment(f.key, f.kind, f.box, f.rank, f.chunk, f.local_name,
                          tuple(o + 1 for o in f.local_offsets), f.main)
             if f.key == "output_layer.weight" else f for f in live]
    with pytest.raises(FragmentMismatchError, match=r"output_layer\.weight"):
        check_live_matches_analytic_where_both(moved, expected, rank, ("decoder.layers.",))
    train = TrainConfig()
    builder = MegatronBuilder(s, train, plan_from="metadata",
                              unlike_analytic=("decoder.layers.",))
    assert unlike_analytic(builder) == ("decoder.layers.",)
    with pytest.raises(ValueError, match="needs plans from the live metadata"):
        MegatronBuilder(s, train, unlike_analytic=("decoder.layers.",))
