"""The planner: exact coverage, local copies, lower bound, determinism (pure, small worlds)."""
import os
import subprocess
import sys

import numpy as np
import pytest

from dynatrain_megatron.routing import (Piece, RoutingError, build_plan, clear_caches,
                                        validate_plan)
from dynatrain_megatron.vps import (KINDS, OPT_KINDS, Layout, LayoutError, Placement,
                                   analytic_layout)
from dynatrain_megatron.vps.box import Box

from routing_cases import brute_lower_bound, lay, spec

# (model, A, world A, B, world B): TP / PP / VPP / CP / EP / ETP / DP and world changes
PAIRS = [
    ("tiny-gpt", "tp2pp2", 8, "tp1pp4", 8),
    ("tiny-gpt", "tp2pp2", 4, "tp4pp1", 4),        # TP 2 -> 4
    ("tiny-gpt", "tp4pp1", 8, "tp1pp2", 8),        # TP 4 -> 1
    ("tiny-gpt", "tp1pp4", 4, "tp1pp1", 4),        # PP 4 -> 1, DP 1 -> 4
    ("tiny-gpt", "tp1pp2vpp2", 4, "tp2pp2", 4),    # VPP off
    ("tiny-gpt", "tp2pp1", 4, "tp1pp2vpp2", 8),    # VPP on, world 4 -> 8
    ("tiny-gpt", "tp2cp2", 8, "tp2pp2", 8),        # CP 2 -> 1
    ("tiny-gpt", "tp2pp2", 8, "tp2pp2", 4),        # scale in
    ("tiny-gpt+tied", "tp2pp2", 8, "tp1pp4", 8),   # tied embeddings, both sides copies
    ("tiny-gpt+tied", "tp2pp1", 4, "tp2pp2", 8),
    ("tiny-gpt+ln+bf16", "tp2pp2", 8, "tp4pp2", 8),
    ("tiny-moe", "tp1pp2ep4", 8, "tp2pp2ep2etp1", 8),
    ("tiny-moe", "tp2pp2ep2etp1", 8, "tp2pp2ep4etp1", 8),  # EP 2 -> 4
    ("tiny-moe", "tp2pp2ep2etp1", 8, "tp2pp2ep2etp2", 8),  # ETP 1 -> 2
    ("tiny-moe", "tp2pp1ep1etp1", 4, "tp2pp2ep2etp2", 8),  # EP1 (dense buffer) -> EP2
    ("tiny-moe+ln", "tp2pp2ep2etp1", 8, "tp1pp4ep2", 8),
    ("tiny-moe+shared", "tp2pp1ep4", 8, "tp1pp2ep2", 4),
    ("tiny-gpt", "tp1pp2dp4", 8, "tp1pp2doi2dp4", 8),     # partial distributed optimizer on
    ("tiny-gpt+tied", "tp2pp1doi2", 8, "tp1pp2", 4),       # ... off, and scale in
    ("tiny-moe", "tp1pp2ep2etp1doi2", 8, "tp2pp1ep4etp1", 8),
    # grouped experts: one tensor per layer, row blocks by EP, column blocks by expert-TP
    ("tiny-moe+gmm+shared", "tp2pp1ep2etp2", 4, "tp1pp2ep4etp1", 8),  # EP, ETP, PP
    ("tiny-moe+gmm", "tp2pp1ep1etp1", 4, "tp2pp2ep2etp2", 8),  # EP1 (dense buffer) -> EP2
]


def _plan(model, a, wa, b, wb, **kw):
    s = spec(model)
    return s, lay(a, wa), lay(b, wb), build_plan(s, lay(a, wa), lay(b, wb), **kw)


@pytest.mark.parametrize("case", PAIRS, ids=lambda c: f"{c[0]}:{c[1]}x{c[2]}-{c[3]}x{c[4]}")
def test_pieces_tile_every_destination_fragment_and_move_the_lower_bound(case):
    s, A, B, plan = _plan(*case)
    assert validate_plan(plan) == []
    st = plan.stats
    want = brute_lower_bound(s, A, range(A.world_size), B, range(B.world_size), KINDS)
    assert st.moved_bytes == st.lower_bound_bytes == want
    pieces = plan.pieces()
    net = [p for p in pieces if not p.is_local]
    assert sum(p.nbytes for p in net) == st.moved_bytes
    assert sum(p.nbytes for p in pieces if p.is_local) == st.local_bytes
    assert (len(net), len(pieces) - len(net)) == (st.num_pieces, st.num_local_pieces)
    assert st.moved == {k: sum(p.nbytes for p in net if p.kind == k) for k in KINDS}
    # per-device views agree with the whole
    for d in plan.devices:
        mine = plan.pieces_for(d)
        assert mine == sorted(mine, key=lambda p: p.sort_key(plan.geometry.kidx.ids[p.key]))
        assert set(mine) == {p for p in pieces if d in (p.src_device, p.dst_device)}
        assert int(plan.traffic.send[d]) == sum(p.nbytes for p in net if p.src_device == d)
        assert int(plan.traffic.recv[d]) == sum(p.nbytes for p in net if p.dst_device == d)
    assert st.max_send_bytes == int(plan.traffic.send.max())
    assert st.intra_node_bytes + st.inter_node_bytes == st.moved_bytes


@pytest.mark.parametrize("model,text,world", [("tiny-gpt", "tp2pp2", 8),
                                              ("tiny-moe", "tp2pp2ep2etp1", 8),
                                              ("tiny-gpt+tied", "tp1pp2vpp2", 4)])
def test_same_layout_moves_nothing(model, text, world):
    s, A, B, plan = _plan(model, text, world, text, world)
    assert plan.stats.moved_bytes == 0 and plan.stats.num_pieces == 0
    assert all(p.is_local and p.src_local_offsets == p.dst_local_offsets
               for p in plan.pieces())
    assert plan.stats.local_bytes == sum(plan.stats.state.values()) or world > 1


def test_local_pieces_never_cross_devices_and_carry_both_local_places():
    s, A, B, plan = _plan("tiny-gpt", "tp2pp2", 8, "tp1pp4", 8)
    loc = plan.pieces()
    assert any(p.is_local for p in loc) and any(not p.is_local for p in loc)
    for p in loc:
        assert (p.src_device == p.dst_device) == p.is_local
        assert p.src_local_name and p.dst_local_name
    # TP 2 -> 1 on the same device: column blocks land at different local offsets
    proj = [p for p in loc if p.is_local and "linear_proj" in p.key and p.kind == "param"]
    assert any(p.src_local_offsets != p.dst_local_offsets for p in proj)


def test_determinism_two_calls_identical_plans():
    a = _plan("tiny-moe", "tp1pp2ep4", 8, "tp2pp2ep2etp1", 8)[3]
    clear_caches()
    b = _plan("tiny-moe", "tp1pp2ep4", 8, "tp2pp2ep2etp1", 8)[3]
    assert a is not b
    assert a.pieces() == b.pieces() and a.stats == b.stats


_DIGEST = """
import hashlib, sys
sys.path.insert(0, {tests!r})
from routing_cases import spec, lay
from dynatrain_megatron.routing import build_plan, build_schedule
p = build_plan(spec('tiny-moe'), lay('tp2pp2ep2etp1', 8), lay('tp1pp4ep2', 8))
h = hashlib.sha256()
for r in build_schedule(p, 20000).rounds:
    for d in p.devices:
        h.update(repr(r.sends(d)).encode())
print(h.hexdigest())
"""


def test_determinism_across_processes_and_hash_seeds():
    code = _DIGEST.format(tests=os.path.dirname(__file__))
    outs = set()
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                capture_output=True, text=True).stdout.strip())
    assert len(outs) == 1


@pytest.mark.parametrize("kinds", [OPT_KINDS, ("param",), ("exp_avg",)])
def test_only_requested_kinds(kinds):
    s, A, B, plan = _plan("tiny-gpt", "tp2pp2", 8, "tp1pp4", 8, kinds=kinds)
    assert {p.kind for p in plan.pieces()} == set(kinds)
    assert validate_plan(plan) == []
    assert plan.stats.moved_bytes == brute_lower_bound(s, A, range(8), B, range(8), kinds)


def test_disjoint_device_sets_everything_moves_and_old_devices_only_send():
    s = spec("tiny-gpt")
    A, B = lay("tp2pp2", 4), lay("tp2pp1", 4)
    src, dst = (A, Placement((0, 1, 2, 3))), (B, Placement((4, 5, 6, 7)))
    plan = build_plan(s, src, dst)
    assert validate_plan(plan) == []
    ps = plan.pieces()
    assert ps and not any(p.is_local for p in ps)
    assert {p.src_device for p in ps} <= {0, 1, 2, 3} and {p.dst_device for p in ps} == {4, 5, 6, 7}
    assert plan.stats.local_bytes == 0
    need = brute_lower_bound(s, A, range(4), B, range(4, 8), KINDS)
    assert plan.stats.moved_bytes == need


def test_placements_permute_devices_consistently():
    s = spec("tiny-gpt")
    A, B = lay("tp1pp2", 4), lay("tp1pp4", 4)
    pa, pb = Placement((3, 1, 0, 2)), Placement((2, 0, 3, 1))
    plan = build_plan(s, (A, pa), (B, pb))
    assert validate_plan(plan) == []
    assert plan.stats.moved_bytes == brute_lower_bound(s, A, pa.devices, B, pb.devices, KINDS)


def test_same_node_replica_preferred_and_sends_balanced():
    """Weights replicated over DP: a destination takes them from its own node when a
    holder is there, and the senders share the rest."""
    s = spec("tiny-gpt")
    A, B = lay("tp1pp4", 8), lay("tp1pp1", 8)  # every device needs all 4 stages
    plan = build_plan(s, A, B, kinds=("param",), ranks_per_node=4)
    for p in plan.pieces(include_local=False):
        holders = [d for d in range(8) if A.coords(d).pp == A.coords(p.src_device).pp]
        if any(h // 4 == p.dst_device // 4 for h in holders):
            assert p.src_device // 4 == p.dst_device // 4, str(p)
    send = plan.traffic.send[:8]
    assert send.max() <= 1.1 * plan.stats.balance_bound_bytes
    assert plan.stats.max_traffic_bytes == plan.stats.balance_bound_bytes  # optimal here


def test_piece_sub_boxes_are_flat_contiguous_and_shift_local_offsets():
    p = Piece(0, 1, "k", "exp_avg", Box((2, 4), (3, 5)), 0, "a", (0, 1), 1, "b", (5, 0), 4)
    subs = p.sub(3, 12)
    assert [str(x.box) for x in subs] == ["[2:3, 7:9]", "[3:4, 4:9]", "[4:5, 4:6]"]
    assert subs[0].src_local_offsets == (0, 4) and subs[0].dst_local_offsets == (5, 3)
    assert sum(x.numel for x in subs) == 9 and all(x.itemsize == 4 for x in subs)


def test_bad_inputs_refused():
    s = spec("tiny-gpt")
    with pytest.raises(RoutingError, match="placement has 3 devices"):
        build_plan(s, (lay("tp2pp2", 4), Placement((0, 1, 2))), lay("tp1", 4))
    with pytest.raises(RoutingError, match="kinds"):
        build_plan(s, lay("tp2", 2), lay("tp1", 2), kinds=("grad",))
    with pytest.raises(LayoutError, match="num_attention_heads"):
        build_plan(s, lay("tp2", 2), Layout(tp=3))
    with pytest.raises(RoutingError, match="ranks_per_node"):
        build_plan(s, lay("tp2", 2), lay("tp1", 2), ranks_per_node=0)


def test_large_world_plans_lazily_and_fast():
    """Llama-3-70B on 128 ranks: stats for everyone, pieces of one device on demand."""
    import time
    s = spec("llama3-70b")
    t = time.perf_counter()
    plan = build_plan(s, lay("tp8pp4", 128), lay("tp4pp4", 128))
    assert time.perf_counter() - t < 10  # generous: ~0.1 s on one core
    assert plan.stats.moved_bytes == plan.stats.lower_bound_bytes > 0
    mine = plan.pieces_for(77)
    assert mine and all(77 in (p.src_device, p.dst_device) for p in mine)
    recv = sum(p.nbytes for p in mine if p.dst_device == 77 and not p.is_local)
    assert recv == int(plan.traffic.recv[77])
    assert np.isclose(plan.stats.moved_fraction(OPT_KINDS), 0.87, atol=0.05)


def test_source_choice_at_4096_ranks_near_the_node_cut_bound():
    """Qwen3-235B ep32 -> ep64 on 4096 GPUs (the bench's planning-speed scenario): in
    every node, two devices are the only on-node holders of the expert weights their
    node-mates need (64 replicas, the others on other nodes), and the node-mates' NICs
    are half full with what no node-mate holds. The per-device bounds miss that; the
    node cuts (`cost.node_cut_bound`) raise the bound ~12%, and the source choice must
    come within 6% of it (a one-move-per-device search stopped at 7.6%, 1.21x the
    per-device bound). Bytes moved stay at their lower bound."""
    from dynatrain_megatron.routing import (LinkModel, bandwidth_lower_bound,
                                            placement_choice)
    from dynatrain_megatron.routing.cost import node_cut_bound
    from dynatrain_megatron.routing.links import GB
    s = spec("qwen3-235b-a22b")
    A, B = lay("tp4pp2ep32etp1", 4096), lay("tp4pp2ep64etp1", 4096)
    plan = placement_choice(s, A, None, B, range(4096), 8, None, KINDS).chosen_plan
    st, t = plan.stats, plan.traffic
    assert st.moved_bytes == st.lower_bound_bytes
    lm = LinkModel()
    bi, be = lm.intra_node_gbps * GB, lm.inter_node_gbps * GB
    lb = bandwidth_lower_bound(plan, lm)
    assert node_cut_bound(plan, bi, be) == lb > 1.1 * max(
        float((t.recv_inter_min / be).max()), float((t.recv / (bi + be)).max()))
    rounds = lm.device_seconds(t.send_intra, t.send_inter, t.recv_intra, t.recv_inter)
    assert lb <= rounds.max() <= 1.06 * lb


def test_bucketed_buffers_and_per_side_bucket_sizes():
    """DDP buckets change the distributed-optimizer ownership; a (src, dst) pair of bucket
    sizes plans a switch between two bucket settings."""
    s = spec("tiny-gpt")
    A, B = lay("tp1pp1", 4), lay("tp2pp1", 4)
    plan = build_plan(s, A, B, bucket_size=(20_000, 5_000))
    assert validate_plan(plan) == []
    want = brute_lower_bound(s, A, range(4), B, range(4), KINDS, bucket=(20_000, 5_000))
    assert plan.stats.moved_bytes == want
    assert want != brute_lower_bound(s, A, range(4), B, range(4), KINDS)


def _layouts(model, world):
    s = spec(model)
    out = []
    for tp in (1, 2, 4):
        for pp in (1, 2, 4):
            for vpp in (1, 2):
                for cp in (1, 2):
                    for ep in ((1, 2, 4) if s.is_moe else (1,)):
                        for etp in ({1, tp} if s.is_moe else {tp}):
                            if world % (tp * pp * cp):
                                continue
                            try:
                                L = Layout(tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp,
                                           dp=world // (tp * pp * cp))
                                analytic_layout(s, L)
                            except (LayoutError, ValueError):
                                continue
                            out.append(L)
    return out


def _sweep():
    import random
    rnd = random.Random(1234)
    cases = []
    for model in ("tiny-gpt", "tiny-moe"):
        for wa, wb in ((8, 8), (4, 8), (8, 4)):
            la, lb = _layouts(model, wa), _layouts(model, wb)
            for _ in range(5):
                cases.append((model, rnd.choice(la), rnd.choice(lb)))
    return cases


@pytest.mark.parametrize("case", _sweep(), ids=lambda c: f"{c[0]}:{c[1]}-{c[2]}")
def test_sweep_of_random_layout_pairs(case):
    model, A, B = case
    s = spec(model)
    plan = build_plan(s, A, B, ranks_per_node=4)
    assert validate_plan(plan) == []
    assert plan.stats.moved_bytes == plan.stats.lower_bound_bytes == brute_lower_bound(
        s, A, range(A.world_size), B, range(B.world_size), KINDS)
    # the (subset-closed) group bounds hold for the plan the planner found
    st = plan.stats
    assert st.max_send_bytes >= st.group_send_bound_bytes
    assert st.max_send_inter_bytes >= st.group_send_inter_bound_bytes


@pytest.mark.parametrize("model,a,b,b_devices", [
    ("tiny-gpt", "tp1pp2doi2dp2", "tp1pp2dp1", (0, 1)),       # stage 2 from its replica
    ("tiny-gpt+tied", "tp2pp1doi2dp2", "tp1pp2dp1", (0, 2)),  # TP-split shards too
    ("tiny-moe", "tp1pp1ep2etp1doi2dp4", "tp1pp1ep2etp1dp2", (0, 1)),  # expert shards
])
def test_dead_sources_are_never_used_and_the_rest_still_tiles_b(model, a, b, b_devices):
    """Recovery after a death: the plan takes every piece from a surviving replica."""
    s, A = spec(model), lay(a, 4)
    B = Layout.parse(b)
    plan = build_plan(s, A, (B, Placement(b_devices)), unavailable=(3,))
    assert validate_plan(plan) == []
    pieces = plan.pieces()
    assert pieces and all(p.src_device != 3 for p in pieces)
    full = build_plan(s, A, (B, Placement(b_devices)))
    # the same destination boxes, only the sources differ
    assert sorted((p.dst_device, p.key, p.kind, p.box) for p in pieces) == \
        sorted((p.dst_device, p.key, p.kind, p.box) for p in full.pieces())


def test_state_held_only_by_dead_devices_is_refused():
    s = spec("tiny-gpt")
    with pytest.raises(RoutingError, match="held only by the unavailable devices \\[3\\]"):
        build_plan(s, lay("tp1pp2dp2", 4), (Layout.parse("tp1pp2dp1"), Placement((0, 2))),
                   unavailable=(3,))  # without optimizer instances rank 3's shards die
    with pytest.raises(RoutingError, match="not devices of layout A"):
        build_plan(s, lay("tp1pp2dp2", 4), lay("tp1pp2dp2", 4), unavailable=(7,))
