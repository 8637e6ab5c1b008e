"""Layouts: parsing, printing, rank grids, and one clear error per impossible layout."""
import pytest

from dynatrain_megatron.adapters.verify import check_live_matches_analytic
from dynatrain_megatron.vps import Box, Fragment, FragmentMismatchError, Layout, LayoutError, ModelSpec

TINY = dict(name="t", num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=4,
            ffn_hidden_size=128, vocab_size=1000, seq_length=32)


def test_parse_and_print():
    assert str(Layout.parse("tp2pp2", 8)) == "tp2pp2dp2"
    assert str(Layout.parse("tp1pp2ep4etp1dp4")) == "tp1pp2ep4etp1dp4"
    assert Layout.parse("tp2pp2vpp2dp1").vpp == 2
    assert Layout.parse("tp4", 4).etp == 4  # megatron's default: etp = tp
    L = Layout.parse("tp1pp2doi2", 8)  # megatron's --num-distributed-optimizer-instances 2
    assert str(L) == "tp1pp2doi2dp4" and (L.doi, L.dense_shards, L.expert_shards) == (2, 2, 2)
    assert Layout.parse(str(L)) == L


def test_megatron_rank_grid():
    L = Layout.parse("tp2pp2", 16)  # the ref doc's verified example
    assert L.groups(["tp"])[:2] == [[0, 1], [2, 3]]
    assert L.groups(["dp"])[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert L.groups(["pp"])[:2] == [[0, 8], [1, 9]]
    E = Layout.parse("tp2pp2ep4etp1", 16)
    assert E.groups(["ep"])[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert E.groups(["edp"])[:2] == [[0, 4], [1, 5]]


@pytest.mark.parametrize("text,world,match", [
    ("tp2xx", 4, "malformed layout"),
    ("tp2tp2", 4, "axis tp given twice"),
    ("tp3", 4, "tp\\*pp\\*cp = 3 does not divide world size 4"),
    ("tp2dp4", 4, "dp4 but world size 4"),
    ("tp1pp1vpp2", 4, "vpp2 needs pp > 1"),
    ("tp2pp2ep2", 4, "expert grid etp\\*ep\\*pp = 2\\*2\\*2 = 8 does not divide world size 4"),
    ("tp1doi3", 4, "doi3 distributed-optimizer instances must divide .*dp\\*cp = 4"),
    ("tp1pp2split1-2-3", 4, "split \\(1, 2, 3\\) names 3 model chunks, pp2 vpp1 has 2"),
    ("tp1pp2ppf1split1-2", 4, "no ppf/ppl beside it"),
    ("tp1pp2split1-2split1-2", 4, "split given twice"),
    ("tp1pp2split1-" + "9" * 8, 4, "a split's layer count is too large"),
])
def test_malformed_or_impossible_layouts(text, world, match):
    with pytest.raises(LayoutError, match=match):
        Layout.parse(text, world)


@pytest.mark.parametrize("text,world,moe,match", [
    ("tp8", 8, False, "num_query_groups 4 % tp 8"),
    ("tp1pp3", 3, False, "num_layers 4 % \\(pp\\*vpp = 3\\*1\\)"),
    ("tp1pp1ep3etp1", 3, True, "num_moe_experts 8 % ep 3"),
    ("tp1ep2etp1", 2, False, "ep2 needs an MoE model"),
])
def test_layouts_the_model_cannot_take(text, world, moe, match):
    spec = ModelSpec(**TINY, **(dict(num_moe_experts=8) if moe else {}))
    with pytest.raises(LayoutError, match=match):
        Layout.parse(text, world).check_model(spec)


def test_live_mismatch_names_tensor_and_rank():
    box = Box((0, 0), (4, 4))
    good = Fragment("decoder.layers.0.mlp.linear_fc1.weight", "param", box, 3, 0, 0,
                    "decoder.layers.0.mlp.linear_fc1.weight", (0, 0))
    moved = Fragment("decoder.layers.0.mlp.linear_fc1.weight", "param", Box((4, 0), (4, 4)), 3,
                     0, 0, "decoder.layers.0.mlp.linear_fc1.weight", (0, 0))
    check_live_matches_analytic([good], [good], 3)
    with pytest.raises(FragmentMismatchError,
                       match="rank 3: .*decoder.layers.0.mlp.linear_fc1.weight/param"):
        check_live_matches_analytic([moved], [good], 3)


def test_memory_fit_refuses_a_layout_that_does_not_fit():
    from dynatrain_megatron.vps.memory import check_memory_fit, estimate_state_memory

    spec = ModelSpec.from_yaml("configs/models/llama3-70b.yaml")
    tp8pp4 = Layout.parse("tp8pp4", 128)
    est = estimate_state_memory(spec, tp8pp4)
    # 70.5B / 32 model-parallel ranks = 2.2B params each: bf16 weights + fp32 grads
    # (6 B/param) + fp32 master and Adam moments sharded over dp4 (12/4 B/param) ~ 19.8 GB
    assert 19e9 < est.max_bytes < 21e9
    check_memory_fit(spec, tp8pp4, 141 * 2**30)
    with pytest.raises(LayoutError, match="layout tp1pp1dp128 does not fit: rank 0 needs"):
        check_memory_fit(spec, Layout.parse("tp1pp1", 128), 141 * 2**30)


@pytest.mark.parametrize("text,layers,expect", [
    # megatron-core's layer assignment (ref doc, verified by running megatron)
    ("tp1pp4", 8, [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]),
    ("tp1pp2vpp2", 8, [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]),
    ("tp1pp4ppf1ppl3", 10, [[[0]], [[1, 2, 3]], [[4, 5, 6]], [[7, 8, 9]]]),
    # a split Megatron-LM's flags fix: chunks in vp-major order, empty ones included
    ("tp1pp2vpp2split1-2-2-1", 6, [[[0], [3, 4]], [[1, 2], [5]]]),
    ("tp1pp2vpp2split0-3-2-0", 5, [[[], [3, 4]], [[0, 1, 2], []]]),
    ("tp1pp3vpp2ppf2ppl2", 12, [[[0], [6]], [[1, 2, 3, 4], [7, 8, 9, 10]], [[5], [11]]]),
])
def test_pipeline_layer_assignment(text, layers, expect):
    L = Layout.parse(text)
    got = [[list(L.stage_layers(layers, p, v)) for v in range(L.vpp)] for p in range(L.pp)]
    assert got == expect


def test_a_split_prints_parses_and_must_hold_the_model():
    L = Layout.parse("tp2pp2vpp2split1-2-2-1", 8)
    assert str(L) == "tp2pp2vpp2split1-2-2-1dp2" and Layout.parse(str(L)) == L
    assert L.stage_num_layers(6) == [3, 3] and L != Layout.parse("tp2pp2vpp2", 8)
    # the split may exceed the 64 characters of the axes (one count per chunk)
    long = Layout.parse("tp1pp8vpp8split" + "-".join(["10"] * 64))
    assert long.stage_num_layers(640) == [80] * 8 and len(str(long)) > 64
    with pytest.raises(LayoutError, match="split 1-2-2-1 holds 6 layers, the model has 4"):
        L.check_model(ModelSpec(**TINY))


def test_uneven_pipeline_that_does_not_split():
    spec = ModelSpec(**{**TINY, "num_layers": 9})
    with pytest.raises(LayoutError, match="= 5 does not split evenly over the 2 middle stage"):
        Layout.parse("tp1pp4ppf1ppl3", 4).check_model(spec)
