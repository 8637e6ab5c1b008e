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
