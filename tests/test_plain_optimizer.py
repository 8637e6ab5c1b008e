"""Jobs without the distributed optimizer (plain DDP, `ModelSpec.distributed_optimizer`
False): the planning layout gives every data-parallel replica the whole optimizer state of
its TP/PP/EP shard, and plans move it like the weights (pure, small worlds)."""
import numpy as np
import pytest

from dynatrain_megatron.advisor.memory import (state_bytes_by_stage, state_bytes_per_rank,
                                              state_lower_bound)
from dynatrain_megatron.routing import build_plan, validate_plan
from dynatrain_megatron.transition.vocab_padding import padding_holdings, padding_plan
from dynatrain_megatron.vps import (KINDS, OPT_KINDS, LayoutError, Placement, analytic_layout,
                                   logical_tensor_map)
from dynatrain_megatron.vps.fragment import coverage_errors
from dynatrain_megatron.vps.naming import DTYPE_BYTES
from dynatrain_megatron.vps.validate import layout_errors

from routing_cases import brute_lower_bound, lay, spec


def plain(name: str):
    return spec(name).replace(distributed_optimizer=False)


LAYOUTS = [("tiny-gpt", "tp2pp2", 8), ("tiny-gpt+tied", "tp2pp2", 8),
           ("tiny-gpt+ln+bf16", "tp1pp2vpp2", 8), ("tiny-gpt", "tp2cp2", 8),
           ("tiny-moe", "tp2pp2ep2etp1", 8), ("tiny-moe", "tp2pp1ep1etp1", 4),
           ("tiny-moe+shared", "tp1pp2ep4", 8), ("tiny-moe+gmm+bf16", "tp2pp1ep2etp2", 4)]


@pytest.mark.parametrize("model,text,world", LAYOUTS)
def test_each_replica_holds_the_whole_optimizer_state_of_its_weights(model, text, world):
    """Optimizer fragments are the weight's fragments, replica numbers included, so the
    replica-0 fragments still cover every tensor once per kind."""
    s, L = plain(model), lay(text, world)
    al = analytic_layout(s, L, 4000)  # DDP's buckets do not cut plain optimizer state
    tensors = logical_tensor_map(s)
    every = []
    for r in range(L.world_size):
        frags = al.fragments(r)
        every += frags
        weights = {(f.key, f.box, f.replica, f.chunk, f.local_name, f.local_offsets)
                   for f in frags if f.kind == "param"}
        for kind in OPT_KINDS:
            got = {(f.key, f.box, f.replica, f.chunk, f.local_name, f.local_offsets)
                   for f in frags if f.kind == kind}
            assert got == weights, (r, kind)
    assert coverage_errors(every, tensors) == []
    # replicas 0..DP-1 (times the TP copies) of each box: one per data-parallel rank
    reps = {}
    for f in every:
        if f.kind == "exp_avg":
            reps.setdefault((f.key, f.box), set()).add(f.replica)
    assert all(min(v) == 0 and len(v) >= 1 for v in reps.values())
    if L.dp > 1:
        assert max(len(v) for v in reps.values()) >= L.dp


@pytest.mark.parametrize("model,text,world", LAYOUTS[:5])
def test_bytes_per_rank_count_the_whole_state_on_every_replica(model, text, world):
    s, L = plain(model), lay(text, world)
    al = analytic_layout(s, L)
    b = al.bytes_per_rank()
    pb = DTYPE_BYTES[s.params_dtype]
    for r in range(L.world_size):
        held = sum(f.numel for f in al.fragments(r, ("param",)))
        assert b["param"][r] == held * pb
        for kind in OPT_KINDS:
            assert b[kind][r] == held * 4
        sm = al.summary(r)
        assert sm.owned_tensors == sm.tensors and sm.main_param_bytes == held * 4
    # the distributed optimizer's per-rank state is the plain one's divided over DP x CP
    dist = analytic_layout(spec(model), L).bytes_per_rank()["exp_avg"]
    assert dist.sum() * L.dp_cp == b["exp_avg"].sum()


PAIRS = [
    ("tiny-gpt", "tp2pp1", 4, "tp1pp2", 4),          # TP and PP, DP stays 2
    ("tiny-gpt", "tp2pp2", 4, "tp1pp1", 4),          # TP, PP and DP 1 -> 4
    ("tiny-gpt+tied", "tp1pp1", 4, "tp2pp2", 4),     # DP 4 -> 1, tied copies
    ("tiny-gpt+ln+bf16", "tp1pp2", 8, "tp2pp1", 4),  # scale in
    ("tiny-gpt", "tp2pp1", 4, "tp1pp2vpp2", 8),      # scale out, VPP
    ("tiny-moe", "tp1pp2ep2etp1", 4, "tp1pp1ep4etp1", 4),
    ("tiny-moe+shared", "tp2pp1ep1etp1", 4, "tp2pp2ep2etp2", 8),
    ("tiny-moe+gmm+bf16", "tp2pp1ep2etp2", 4, "tp1pp2ep4etp1", 8),  # grouped experts
]


@pytest.mark.parametrize("case", PAIRS, ids=lambda c: f"{c[0]}:{c[1]}x{c[2]}-{c[3]}x{c[4]}")
def test_plans_tile_b_and_move_only_what_b_lacks(case):
    model, a, wa, b, wb = case
    s, A, B = plain(model), lay(a, wa), lay(b, wb)
    plan = build_plan(s, A, B)
    assert validate_plan(plan) == []
    want = brute_lower_bound(s, A, range(wa), B, range(wb), KINDS)
    assert plan.stats.moved_bytes == plan.stats.lower_bound_bytes == want
    # every destination device receives all the optimizer state of its weights
    for d in range(wb):
        for kind in OPT_KINDS:
            got = sum(p.numel for p in plan.pieces_for(d) if p.dst_device == d and p.kind == kind)
            need = sum(f.numel for f in analytic_layout(s, B).fragments(d, (kind,)))
            assert got == need, (d, kind)


def test_a_replica_on_the_destination_is_the_source_and_nothing_moves():
    """At DP 4 every device holds everything: B's state is all already where it goes."""
    s = plain("tiny-gpt")
    plan = build_plan(s, lay("tp1pp1", 4), lay("tp2pp2", 4))
    assert plan.stats.moved_bytes == 0 and plan.stats.local_bytes > 0
    assert all(p.is_local for p in plan.pieces())


def test_sources_are_same_node_replicas_and_the_choice_is_deterministic():
    s = plain("tiny-gpt")
    A, B = lay("tp1pp4dp2", 8), lay("tp1pp1", 8)  # every device needs all 4 stages
    plan = build_plan(s, A, B, kinds=OPT_KINDS, ranks_per_node=4)
    net = plan.pieces(include_local=False)
    assert net
    for p in net:  # a holder of the piece's stage on the destination's node serves it
        holders = [d for d in range(8) if A.coords(d).pp == A.coords(p.src_device).pp]
        if any(h // 4 == p.dst_device // 4 for h in holders):
            assert p.src_device // 4 == p.dst_device // 4, str(p)
    again = build_plan(s, (A, Placement.default(8)), (B, Placement.default(8)),
                       kinds=OPT_KINDS, ranks_per_node=4)
    assert again.pieces() == plan.pieces()
    # plain state costs DP times the distributed optimizer's to move here
    dist = build_plan(spec("tiny-gpt"), A, B, kinds=OPT_KINDS, ranks_per_node=4)
    assert plan.stats.moved_bytes > dist.stats.moved_bytes


def test_vocab_padding_of_the_optimizer_state_is_held_by_every_replica():
    s = plain("tiny-gpt").replace(vocab_size=1000, make_vocab_size_divisible_by=64)
    A, B = lay("tp2pp1", 4), lay("tp1pp2", 4)
    al = analytic_layout(s, A)
    held = padding_holdings(al, Placement.default(4))
    weights = sorted((h.key, h.device, h.replica, h.lo, h.hi) for h in held
                     if h.kind == "param")
    # rows 1000..1023 of the embedding and the output layer: the last TP rank of each DP
    # replica holds them, and their optimizer state with them
    assert sorted({(k, d) for k, d, *_ in weights}) == [
        (k, d) for k in ("embedding.word_embeddings.weight", "output_layer.weight")
        for d in (1, 3)]
    for kind in OPT_KINDS:
        assert sorted((h.key, h.device, h.replica, h.lo, h.hi) for h in held
                      if h.kind == kind) == weights
    pp = padding_plan((al, Placement.default(4)), (analytic_layout(s, B), Placement.default(4)))
    assert {p.kind for p in pp.pieces} >= set(OPT_KINDS)


def test_several_optimizer_instances_need_the_distributed_optimizer():
    s, L = plain("tiny-gpt"), lay("tp1pp2doi2dp4", 8)
    assert any("needs the distributed optimizer" in e for e in layout_errors(s, L))
    with pytest.raises(LayoutError, match="need the distributed optimizer"):
        analytic_layout(s, L)


@pytest.mark.parametrize("model,text,world", [LAYOUTS[0], LAYOUTS[2], LAYOUTS[4]])
def test_advisor_counts_the_whole_optimizer_state_on_every_replica(model, text, world):
    """The advisor's exact per-rank state: main params and moments of every local parameter
    (vocab padding included), and its cheap bound stays below it."""
    s, L = plain(model), lay(text, world)
    al = analytic_layout(s, L)
    per_rank = state_bytes_per_rank(s, L)
    nopt = 2 + (s.params_dtype != "fp32")
    for r, sb in enumerate(per_rank):
        c = L.coords(r)
        local = sum(p.numel for ch in range(L.vpp) for p in al.chunk_params(c.pp, ch))
        assert sb.main_param + sb.optimizer == local * 4 * nopt
    stages = state_bytes_by_stage(s, L)
    assert (state_lower_bound(s, L) <= stages).all()
    dist = state_bytes_by_stage(spec(model), L)
    assert (stages > dist).all() if L.dp_cp > 1 else (stages == dist).all()
