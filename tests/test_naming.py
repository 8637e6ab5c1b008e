"""Canonical names: the logical tensors of a model, and how the local parameters of every
rank of a layout map onto them (pure)."""
import pytest

from dynatrain_megatron.vps.box import overlapping_pairs
from dynatrain_megatron.vps.layout import Layout
from dynatrain_megatron.vps.naming import (chunk_param_specs, local_tensors, logical_tensor_map,
                                           logical_tensors, param_numel)

from routing_cases import spec


def test_logical_tensors_of_tiny_gpt():
    s = spec("tiny-gpt")  # h 64, 8 heads of 8 (4 query groups), F 128 SwiGLU, V 1000, 4 layers
    m = logical_tensor_map(s)
    assert m["embedding.word_embeddings.weight"].shape == (1000, 64)  # unpadded vocab
    assert m["decoder.layers.3.self_attention.linear_qkv.weight"].shape == ((8 + 2 * 4) * 8, 64)
    assert m["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 128, 64)  # [gate; up]
    assert m["decoder.layers.0.mlp.linear_fc2.weight"].shape == (64, 128)
    assert m["output_layer.weight"].shape == (1000, 64)  # untied
    assert len({t.key for t in logical_tensors(s)}) == len(logical_tensors(s))
    assert param_numel(s) == sum(t.numel for t in m.values())
    assert not any(".layers.4." in k for k in m)


def test_moe_experts_are_keyed_by_global_index():
    s = spec("tiny-moe")
    lay = Layout.parse("tp1pp1ep2", 2)
    keys = [{lt.key for lt in local_tensors(s, lay, lay.coords(r))} for r in range(2)]
    experts = [{k.split(".experts.")[1].split(".")[0] for k in ks if ".experts." in k}
               for ks in keys]
    assert experts[0].isdisjoint(experts[1])
    assert experts[0] | experts[1] == {str(e) for e in range(s.num_moe_experts)}


@pytest.mark.parametrize("model,layout,world", [
    ("tiny-gpt", "tp4pp2", 8),       # rows, cols, glu, vocab (with padding rows), rep
    ("tiny-gpt", "tp2pp2vpp2", 4),   # chunks: local layer indices restart per chunk
    ("tiny-moe", "tp2pp1ep2etp2", 4),
    ("tiny-moe+gmm", "tp2pp1ep2etp2", 4),  # grouped experts: EP row and ETP column blocks
    ("tiny-moe+gmm+shared", "tp1pp2ep4", 8),
])
def test_every_logical_tensor_is_tiled_by_the_replica_0_ranks(model, layout, world):
    """The blocks of every rank's local tensors, over one replica (dp = 0, and edp = 0
    for experts), tile each logical tensor exactly; each block fits its local tensor."""
    s = spec(model)
    lay = Layout.parse(layout, world)
    boxes: dict[str, list] = {k: [] for k in logical_tensor_map(s)}
    for r in range(lay.world_size):
        c = lay.coords(r)
        for lt in local_tensors(s, lay, c):
            for b in lt.blocks:
                assert b.local.within(lt.local_shape), (lt, b)
            first_replica = c.edp == 0 if lt.spec.is_expert else c.dp == 0 and c.cp == 0
            # replicated (rep) tensors: one TP rank stands for its copies
            axis_index = c.etp if lt.spec.axis == "etp" else c.tp
            if first_replica and (lt.spec.rule != "rep" or axis_index == 0) \
                    and not lt.spec.tied_copy:
                boxes[lt.key] += [b.logical for b in lt.blocks]
    m = logical_tensor_map(s)
    for k, bs in boxes.items():
        assert overlapping_pairs(bs, 1) == [], k
        assert sum(b.numel for b in bs) == m[k].numel, k


def test_chunks_number_layers_locally():
    s = spec("tiny-gpt")
    lay = Layout.parse("tp1pp2vpp2", 2)
    names = [p.local_name for p in chunk_param_specs(s, lay, 1, 1)]
    keys = {p.key for p in chunk_param_specs(s, lay, 1, 1)}
    assert any(n.startswith("decoder.layers.0.") for n in names)
    assert not any(n.startswith("decoder.layers.1.") for n in names)  # one layer per chunk
    assert "decoder.layers.3.mlp.linear_fc2.weight" in keys  # the last layer, globally


def test_grouped_experts_are_one_box_per_rank_in_memory_order():
    """GroupedMLP's weight1/weight2 (`+gmm`): one logical tensor per layer and weight, each
    rank one box of it (its EP rank's rows, its expert-TP rank's columns); the box holds
    what GroupedMLP's forward reads there: `weight1.view(E_l, h, X)[e]` is expert e's
    `[gate_r | up_r]` columns of fc1 transposed, `weight2.view(E_l, Y, h)[e]` its fc2 rows."""
    import torch

    s = spec("tiny-moe+gmm")  # E 8, h 64, F 64, SwiGLU
    E, h, F = s.num_moe_experts, s.hidden_size, s.moe_ffn_hidden_size
    m = logical_tensor_map(s)
    assert m["decoder.layers.1.mlp.experts.weight1"].shape == (E * h * 2, F)
    assert m["decoder.layers.1.mlp.experts.weight2"].shape == (E, F * h)
    assert not any(".experts.0." in k for k in m)
    gen = torch.Generator().manual_seed(0)
    fc1 = torch.randn(E, 2 * F, h, generator=gen)  # expert e's fc1 [gate; up]
    fc2 = torch.randn(E, h, F, generator=gen)
    # the logical tensors as the module doc of vps.naming defines them
    w1 = fc1.view(E, 2, F, h).permute(0, 3, 1, 2).reshape(E * h * 2, F)
    w2 = fc2.permute(0, 2, 1).reshape(E, F * h)
    lay = Layout.parse("tp2pp1ep2etp2", 4)
    for r in range(lay.world_size):
        c = lay.coords(r)
        El, X, Y = E // lay.ep, 2 * F // lay.etp, F // lay.etp
        e0, f0 = c.ep * El, c.etp * Y
        lts = {lt.local_name: lt for lt in local_tensors(s, lay, c)}
        for name, logical in (("weight1", w1), ("weight2", w2)):
            lt = lts[f"decoder.layers.1.mlp.experts.{name}"]
            (b,) = lt.blocks
            assert b.local.shape == lt.local_shape and lt.spec.is_expert
            local = logical[b.logical.slices()].contiguous()  # what the rank stores
            if name == "weight1":
                held = local.view(El, h, X)  # GroupedMLP's w1
                want = torch.cat([fc1[e0:e0 + El, f0:f0 + Y], fc1[e0:e0 + El, F + f0:F + f0 + Y]],
                                 dim=1).transpose(1, 2)
            else:
                held = local.view(El, Y, h)  # GroupedMLP's w2
                want = fc2[e0:e0 + El, :, f0:f0 + Y].transpose(1, 2)
            assert torch.equal(held, want), (r, name)
