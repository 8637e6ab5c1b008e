"""Property: for random models and layouts, the replica-0 fragments of every state kind
cover each logical tensor exactly once, and every fragment lies inside its local tensor
(optimizer kinds: inside the rank's owned flat range, contiguous)."""
from collections import defaultdict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynatrain_megatron.vps.analytic import AnalyticLayout
from dynatrain_megatron.vps.fragment import KINDS, coverage_errors
from dynatrain_megatron.vps.layout import Layout
from dynatrain_megatron.vps.model_spec import ModelSpec
from dynatrain_megatron.vps.naming import logical_tensors


@st.composite
def model_and_layout(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 2, 3]))
    vpp = draw(st.sampled_from([1, 2])) if pp > 1 else 1
    cp = draw(st.sampled_from([1, 2]))
    dp = draw(st.sampled_from([1, 2, 3]))
    world = tp * pp * cp * dp
    moe = draw(st.booleans())
    ep, etp = 1, tp
    if moe:
        # expert grid: etp * ep * pp must divide the world; with ep1, etp | tp (megatron 0.16.1)
        choices = [(e, t) for e in (1, 2, 4) for t in sorted({1, tp, 2})
                   if (world // pp) % (e * t) == 0 and (e > 1 or tp % t == 0)]
        ep, etp = draw(st.sampled_from(choices))
    groups = tp * draw(st.sampled_from([1, 2]))
    heads = groups * draw(st.sampled_from([1, 2]))
    kv = draw(st.sampled_from([4, 8]))
    bias = draw(st.booleans()) and (not moe or etp == 1)  # megatron: MoE bias needs ETP==1
    shared = tp * draw(st.integers(1, 2)) if moe and not bias and draw(st.booleans()) else None
    spec = ModelSpec(
        name="prop",
        num_layers=pp * vpp * draw(st.integers(1, 2)),
        hidden_size=draw(st.sampled_from([8, 16, 24])),
        num_attention_heads=heads, num_query_groups=groups, kv_channels=kv,
        ffn_hidden_size=tp * draw(st.integers(1, 6)),
        vocab_size=draw(st.integers(1, 700)),
        make_vocab_size_divisible_by=draw(st.sampled_from([8, 128])),
        seq_length=8 * cp * tp,
        swiglu=draw(st.booleans()),
        position_embedding_type=draw(st.sampled_from(["rope", "learned_absolute"])),
        untie_embeddings_and_output_weights=draw(st.booleans()),
        normalization=draw(st.sampled_from(["RMSNorm", "LayerNorm"])),
        add_bias_linear=bias,
        qk_layernorm=draw(st.booleans()),
        num_moe_experts=ep * draw(st.integers(1, 2)) if moe else None,
        moe_ffn_hidden_size=etp * draw(st.integers(1, 3)) if moe else None,
        moe_router_topk=1,
        moe_shared_expert_intermediate_size=shared,  # megatron: no bias with shared experts
        params_dtype=draw(st.sampled_from(["fp32", "bf16"])),
    )
    layout = Layout(tp=tp, pp=pp, vpp=vpp, cp=cp, dp=dp, ep=ep, etp=etp)
    bucket = draw(st.one_of(st.none(), st.integers(1, 3000)))
    return spec, layout, bucket


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_and_layout())
def test_replica0_fragments_cover_each_tensor_once(case):
    spec, layout, bucket = case
    al = AnalyticLayout(spec, layout, bucket)
    frags = []
    for r in range(layout.world_size):
        lts = {(t.chunk, t.local_name): t for t in al.local_tensors(r)}
        owned = al.owned_ranges(r)
        fr = al.fragments(r)
        pieces = defaultdict(list)
        for f in fr:
            t = lts[(f.chunk, f.local_name)]
            assert f.rank == r and f.key == t.key
            assert f.local_box.within(t.local_shape), f
            if f.kind != "param":
                s, e = owned[(f.chunk, f.local_name)]
                fs, fe = f.local_box.flat_range(t.local_shape)  # contiguous in the shard
                assert s <= fs < fe <= e, f
                pieces[f.kind].append((f.chunk, f.local_name, f.local_offsets, f.box, f.replica))
        # the three optimizer kinds share the same ranges
        assert pieces["main_param"] == pieces["exp_avg"] == pieces["exp_avg_sq"]
        frags.extend(fr)
    assert coverage_errors(frags, logical_tensors(spec), KINDS) == []
    # every logical tensor is held by someone; byte totals agree with the fragments
    per = al.bytes_per_rank()
    assert int(per["exp_avg"].sum()) == 4 * sum(f.numel for f in frags if f.kind == "exp_avg")
