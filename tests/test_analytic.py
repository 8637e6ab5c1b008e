"""Analytic layout vs known facts of megatron-core (ref doc §2-§5, checked on 0.16.1)."""
import math

import pytest

from dynatrain_megatron.vps.analytic import AnalyticLayout, analytic_layout
from dynatrain_megatron.vps.box import Box
from dynatrain_megatron.vps.distopt import (build_buffer_layout, effective_bucket_size,
                                            resolve_bucket_size)
from dynatrain_megatron.vps.errors import LayoutError
from dynatrain_megatron.vps.fragment import KINDS, Fragment, FragmentError, coverage_errors
from dynatrain_megatron.vps.layout import Layout
from dynatrain_megatron.vps.model_spec import ModelSpec
from dynatrain_megatron.vps.naming import chunk_param_specs, logical_tensor_map, logical_tensors

# the model of the ref doc's runs: h64, a8, g2 (d8), F128 SwiGLU, no linear biases
DENSE = ModelSpec(name="ref-dense", num_layers=4, hidden_size=64, num_attention_heads=8,
                  num_query_groups=2, ffn_hidden_size=128, vocab_size=1024, seq_length=32)
MOE = DENSE.replace(name="ref-moe", num_moe_experts=4, moe_ffn_hidden_size=32)


def _lt(al, rank, name, chunk=0):
    return next(t for t in al.local_tensors(rank) if t.local_name == name and t.chunk == chunk)


def test_swiglu_fc1_tp2_rank1_gate_row64_up_row192():
    al = analytic_layout(DENSE, Layout.parse("tp2pp1", 2))
    t = _lt(al, 1, "decoder.layers.0.mlp.linear_fc1.weight")
    assert t.local_shape == (128, 64)
    assert [str(b) for b in t.blocks] == ["[0:64, 0:64]->[64:128, 0:64]",
                                          "[64:128, 0:64]->[192:256, 0:64]"]
    assert logical_tensor_map(DENSE)[t.key].shape == (256, 64)


def test_tp2pp2_rank3_matches_sharded_state_dict():
    """Ref §2.7: rank 3 (TP1, PP1): local layer 0 is global layer 2, qkv rows 48.., output
    layer rows 512.. of 1024."""
    al = analytic_layout(DENSE, Layout.parse("tp2pp2", 4))
    qkv = _lt(al, 3, "decoder.layers.0.self_attention.linear_qkv.weight")
    assert qkv.key == "decoder.layers.2.self_attention.linear_qkv.weight"
    assert qkv.blocks[0].logical == Box((48, 0), (48, 64))
    proj = _lt(al, 3, "decoder.layers.0.self_attention.linear_proj.weight")
    assert proj.blocks[0].logical == Box((0, 32), (64, 32))
    out = _lt(al, 3, "output_layer.weight")
    assert out.blocks[0].logical == Box((512, 0), (512, 64))
    # TP-replicated norm: main replica on tp0, replica on tp1
    frs = {f.local_name: f for f in al.fragments(1, ["param"])}
    assert frs["decoder.layers.0.input_layernorm.weight"].replica == 1
    assert frs["decoder.layers.0.self_attention.linear_qkv.weight"].replica == 0


@pytest.mark.parametrize("num_layers,text,table", [
    (8, "tp1pp4", {0: [[0, 1]], 1: [[2, 3]], 2: [[4, 5]], 3: [[6, 7]]}),
    (8, "tp1pp2vpp2", {0: [[0, 1], [4, 5]], 1: [[2, 3], [6, 7]]}),
])
def test_pipeline_layer_assignment(num_layers, text, table):
    spec = DENSE.replace(num_layers=num_layers)
    lay = Layout.parse(text, 4 if "pp4" in text else 2)
    for pp, chunks in table.items():
        for v, layers in enumerate(chunks):
            ps = chunk_param_specs(spec, lay, pp, v)
            keys = {p.key.split(".")[2] for p in ps if p.key.startswith("decoder.layers.")}
            names = {p.local_name.split(".")[2] for p in ps if p.local_name.startswith("decoder.layers.")}
            assert sorted(map(int, keys)) == layers
            assert sorted(map(int, names)) == list(range(len(layers)))
            assert any(p.local_name.startswith("embedding.") for p in ps) == (pp == 0 and v == 0)
            last = pp == lay.pp - 1 and v == lay.vpp - 1
            assert any(p.local_name == "output_layer.weight" for p in ps) == last


def test_named_parameters_order_local_spec():
    """Order and names as megatron-core 0.16.1 yields them (linear_proj before linear_qkv)."""
    spec = DENSE.replace(num_layers=1, normalization="LayerNorm", add_bias_linear=True,
                         qk_layernorm=True, position_embedding_type="learned_absolute")
    names = [p.local_name for p in chunk_param_specs(spec, Layout(), 0, 0)]
    layer = [n[len("decoder.layers.0."):] for n in names if n.startswith("decoder.layers.0.")]
    assert names[:2] == ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight"]
    assert layer == [
        "input_layernorm.weight", "input_layernorm.bias",
        "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
        "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
        "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
        "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias",
        "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
        "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight",
        "mlp.linear_fc2.bias"]
    assert names[-3:] == ["decoder.final_layernorm.weight", "decoder.final_layernorm.bias",
                          "output_layer.weight"]
    moe = [p.local_name for p in chunk_param_specs(MOE.replace(num_layers=1), Layout(), 0, 0)]
    assert moe[5:9] == ["decoder.layers.0.mlp.router.weight",
                        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight",
                        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight",
                        "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]


def test_distopt_bucket_example_of_ref_doc():
    """Ref §5.2: DP=4, bucket_size 40000, 2-layer GPT h64, vocab 1000 (unpadded), LayerNorm."""
    spec = DENSE.replace(num_layers=2, vocab_size=1000, make_vocab_size_divisible_by=8,
                         normalization="LayerNorm", params_dtype="bf16")
    al = AnalyticLayout(spec, Layout.parse("tp1pp1", 4), bucket_size=40000)
    (buf,) = al.buffers(0, 0)
    assert [(b.offset, b.offset + b.numel) for b in buf.buckets] == [
        (0, 64000), (64000, 107392), (107392, 198272)]
    in_b1 = {n for n, *_ in buf.owned_param_ranges(0)}  # sanity: rank 0 owns something
    assert in_b1
    b1 = {p.local_name for p in buf.params if p.bucket == 1}

    def owned(r):
        return {n: (s, e) for n, s, e in buf.owned_param_ranges(r) if n in b1}
    assert owned(1) == {"decoder.layers.1.mlp.linear_fc1.weight": (2528, 13376)}
    o2 = owned(2)
    assert o2["decoder.layers.1.mlp.linear_fc1.weight"] == (13376, 16384)
    assert o2["decoder.layers.1.self_attention.linear_qkv.weight"] == (0, 96 * 64)
    assert o2["decoder.layers.1.self_attention.linear_proj.weight"] == (0, 1568)
    assert {"decoder.layers.1.pre_mlp_layernorm.weight",
            "decoder.layers.1.pre_mlp_layernorm.bias"} <= set(o2)
    # buffer order is reversed named_parameters(): output layer first, embedding last
    assert buf.params[0].local_name == "output_layer.weight" and buf.params[0].start == 0
    assert buf.params[-1].local_name == "embedding.word_embeddings.weight"
    assert all(p.start % 64 == 0 for p in buf.params)


def test_bucket_size_applies_to_first_chunk_of_first_stage_only():
    assert resolve_bucket_size(None, False, 8) is None
    assert resolve_bucket_size(None, True, 64) == 64_000_000
    assert resolve_bucket_size(123, True, 64) == 123
    assert effective_bucket_size(100, 0, 0) == 100
    assert effective_bucket_size(100, 1, 0) is None
    assert effective_bucket_size(100, 0, 1) is None
    assert effective_bucket_size(100, 0, 1, bucket_chunks_after_first=True) == 100
    al = AnalyticLayout(DENSE.replace(num_layers=8), Layout.parse("tp1pp2vpp2", 4), 1000)
    assert len(al.buffers(0, 0)[0].buckets) > 1
    assert all(len(al.buffers(pp, v)[0].buckets) == 1 for pp, v in [(0, 1), (1, 0), (1, 1)])


def test_shared_embedding_gets_own_bucket_and_same_ranges_on_both_stages():
    spec = DENSE.replace(untie_embeddings_and_output_weights=False)
    al = AnalyticLayout(spec, Layout.parse("tp2pp2", 8), bucket_size=None)
    (b0,), (b1,) = al.buffers(0, 0), al.buffers(1, 0)
    emb = b0.params[-1]
    out = b1.params[0]
    assert emb.local_name == "embedding.word_embeddings.weight" and out.local_name == "output_layer.weight"
    assert b0.buckets[emb.bucket].numel == b1.buckets[out.bucket].numel
    assert len(b0.buckets) == 2 and len(b1.buckets) == 2
    # tied copy: same key, replica != 0 for every kind
    for r in (4, 5, 6, 7):  # the last stage
        for f in al.fragments(r):
            if f.local_name == "output_layer.weight":
                assert f.key == "embedding.word_embeddings.weight" and f.replica >= 1
    # PP = 1: no output layer parameter at all
    names = [p.local_name for p in chunk_param_specs(spec, Layout(), 0, 0)]
    assert "output_layer.weight" not in names


def test_vocab_padding_rows_are_not_in_the_vps():
    spec = DENSE.replace(vocab_size=200, num_query_groups=4)  # tp4: V' = 512, 128 rows each
    al = analytic_layout(spec, Layout.parse("tp4pp1", 4))
    rows = [sum(b.local.shape[0] for b in _lt(al, r, "embedding.word_embeddings.weight").blocks)
            for r in range(4)]
    assert rows == [128, 72, 0, 0]
    assert all(_lt(al, r, "output_layer.weight").local_shape == (128, 64) for r in range(4))
    frs = [f for r in range(4) for f in al.fragments(r)]
    assert coverage_errors(frs, logical_tensors(spec)) == []
    assert al.summary(2).param_bytes < al.summary(0).param_bytes


def test_expert_placement_tp2_ep2_etp1():
    """Ref §4.3: rank 0 holds experts 0,1 and rank 1 experts 2,3; ranks 2,3 repeat them."""
    al = analytic_layout(MOE, Layout.parse("tp2pp1ep2etp1", 4))
    for r, experts in [(0, [0, 1]), (1, [2, 3]), (2, [0, 1]), (3, [2, 3])]:
        got = sorted({int(t.key.split(".")[5]) for t in al.local_tensors(r)
                      if ".mlp.experts." in t.key})
        assert got == experts
        reps = {f.replica for f in al.fragments(r, ["param"]) if ".mlp.experts." in f.key}
        assert reps == {r // 2}  # expert-DP rank
    # EP > 1: experts have their own buffer over expert-DP; router stays dense
    bufs = al.buffers(0, 0)
    assert [(b.is_expert, b.shard_size) for b in bufs] == [(False, 2), (True, 2)]
    assert not any("router" in p.local_name for p in bufs[1].params)


def test_ep1_keeps_experts_in_the_dense_buffer():
    al = analytic_layout(MOE, Layout.parse("tp2pp1ep1etp1", 4))
    (buf,) = al.buffers(0, 0)
    assert any("local_experts" in p.local_name for p in buf.params)
    t = _lt(al, 1, "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight")
    assert t.local_shape == (64, 64) and t.key == "decoder.layers.0.mlp.experts.3.linear_fc1.weight"
    frs = [f for r in range(4) for f in al.fragments(r)]
    assert coverage_errors(frs, logical_tensors(MOE)) == []
    with pytest.raises(LayoutError, match="etp 4 must divide tp 2"):
        AnalyticLayout(MOE, Layout.parse("tp2pp1ep1etp4", 4))


def test_summary_matches_fragments_and_bytes_per_rank():
    for spec, text, w in [(MOE.replace(params_dtype="bf16"), "tp2pp2ep2etp1", 8),
                          (DENSE, "tp1pp2vpp2cp2", 8)]:
        al = AnalyticLayout(spec, Layout.parse(text, w), bucket_size=3000)
        per = al.bytes_per_rank()
        pb = 2 if spec.params_dtype == "bf16" else 4
        for r in range(w):
            frs = al.fragments(r)
            s = al.summary(r)
            assert s.param_bytes == pb * sum(f.numel for f in frs if f.kind == "param")
            for k in KINDS[1:]:
                assert s.bytes[k] == 4 * sum(f.numel for f in frs if f.kind == k) == per[k][r]
            assert s.owned_tensors == len({(f.chunk, f.local_name) for f in frs
                                           if f.kind == "exp_avg"})
            assert s.tensors == len({(f.chunk, f.local_name) for f in frs if f.kind == "param"})


def test_owned_ranges_and_fragments_are_comparable():
    al = analytic_layout(DENSE, Layout.parse("tp2pp1dp2", 4), 2000)
    assert al is analytic_layout(DENSE, Layout.parse("tp2pp1dp2", 4), 2000)  # memoised
    owned = al.owned_ranges(3)
    frs = al.fragments(3, ["exp_avg"])
    lts = {(t.chunk, t.local_name): t for t in al.local_tensors(3)}
    for f in frs:
        s, e = owned[(f.chunk, f.local_name)]
        fs, fe = f.local_box.flat_range(lts[(f.chunk, f.local_name)].local_shape)
        assert s <= fs < fe <= e
    assert len(set(frs)) == len(frs) and sorted(frs) == sorted(al.fragments(3, ["exp_avg"]))
    assert "exp_avg" in str(frs[0]) and "@r3" in str(frs[0])


def test_fragment_validation_and_coverage_errors_report_everything():
    with pytest.raises(FragmentError):
        Fragment("k", "grad", Box((0,), (1,)), 0, 0, 0, "n", (0,))
    with pytest.raises(FragmentError):
        Fragment("k", "param", Box((0,), (1,)), 0, 0, 0, "n", (0, 0))
    al = analytic_layout(DENSE, Layout.parse("tp2pp1", 2))
    frs = al.fragments(0) + al.fragments(1)
    bad = [f for f in frs if not (f.kind == "param" and "linear_qkv" in f.key)]
    bad.append(next(f for f in frs if f.kind == "exp_avg" and f.replica == 0))  # duplicate
    errs = coverage_errors(bad, logical_tensors(DENSE))
    assert sum("linear_qkv" in e and "cover 0" in e for e in errs) == DENSE.num_layers
    assert sum("overlap" in e for e in errs) == 1


def test_logical_tensors_total_is_the_parameter_count():
    spec = MOE.replace(num_layers=2, qk_layernorm=True)
    h, E, Fe, V = 64, 4, 32, 1024
    per_layer = (2 * h + h * 64 + 96 * h + 2 * 8 + E * h + E * (2 * Fe * h + h * Fe))
    assert sum(t.numel for t in logical_tensors(spec)) == 2 * per_layer + 2 * V * h + h
    assert len({t.key for t in logical_tensors(spec)}) == len(logical_tensors(spec))


def test_buffer_layout_validation():
    lay = build_buffer_layout([("a", 100, False), ("b", 10, True)], 4, None)
    assert [(b.offset, b.numel, b.numel_unpadded) for b in lay.buckets] == [(0, 128, 10),
                                                                            (128, 128, 100)]
    assert math.lcm(4, 128) == 128
    with pytest.raises(LayoutError):
        build_buffer_layout([("a", 1, False)], 0, None)
