"""The one layout validator against megatron-core's own checks, for random layout strings
and world sizes on tiny-gpt and tiny-moe (pure: megatron-core's TransformerConfig and
rank-grid arithmetic, and our analytic layout; real builds on ranks are in
test_hostile_live.py)."""
from __future__ import annotations

import dataclasses
import random

import pytest

from dynatrain_megatron.mcore.builders import make_transformer_config
from dynatrain_megatron.vps.analytic import AnalyticLayout
from dynatrain_megatron.vps.errors import LayoutError
from dynatrain_megatron.vps.layout import Layout
from dynatrain_megatron.vps.validate import layout_errors, validate_layout

from rank_cases import spec

# reasons the validator gives where megatron-core's config would accept the layout: the
# runtime would refuse it later (CP without TE in the attention module), or the request
# would not do what it says (etp on a dense model is ignored)
LATER_OR_STRICTER = ("Transformer Engine", "needs an MoE model")


def _random_layouts(n: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        axes = rng.sample(["tp", "pp", "vpp", "cp", "ep", "etp", "ppf", "ppl", "dp"],
                          rng.randint(1, 5))
        text = "".join(f"{a}{rng.choice([1, 1, 2, 2, 3, 4, 8])}" for a in axes)
        out.append((text, rng.choice([1, 2, 3, 4, 6, 8, 16])))
    return out


def _megatron_accepts(s, lay: Layout) -> tuple[bool, str]:
    """megatron-core's config checks and its rank grids (initialize_model_parallel's
    divisibility), plus our analytic layout (what a switch plans with)."""
    w = lay.world_size
    if w % (lay.tp * lay.pp * lay.cp) or w % (lay.etp * lay.ep * lay.pp):
        return False, "grid"
    try:
        make_transformer_config(s, lay)
        AnalyticLayout(s, lay)
    except (ValueError, AssertionError, LayoutError) as e:
        return False, f"{type(e).__name__}: {e}"
    return True, ""


@pytest.mark.parametrize("model", ["tiny-gpt", "tiny-moe"])
def test_validator_agrees_with_megatron_core_on_random_layouts(model):
    s = spec(model)
    parsed = accepted = 0
    for text, world in _random_layouts(600, seed=len(model) + (model == "tiny-moe")):
        try:
            lay = Layout.parse(text, world)
        except LayoutError:
            continue
        parsed += 1
        errs = layout_errors(s, lay)
        ok, why = _megatron_accepts(s, lay)
        if not errs:
            accepted += 1
            assert ok, (text, world, why)
        elif ok:  # refused although megatron's config takes it: only the documented classes
            assert all(any(k in e for k in LATER_OR_STRICTER) for e in errs), (text, errs)
    assert parsed > 60 and accepted > 10, (parsed, accepted)


def test_classes_the_quick_check_missed():
    gpt, moe = spec("tiny-gpt"), spec("tiny-moe")
    cases = [(gpt, "tp1pp3ppf2ppl2", 3, "at least one layer"),
             (gpt, "tp1cp2", 2, "Transformer Engine"),
             (gpt, "tp2etp1", 2, "needs an MoE model"),
             (moe, "tp1etp2", 4, "etp 2 must divide tp 1")]
    for s, text, world, why in cases:
        with pytest.raises(LayoutError, match=why):
            validate_layout(s, Layout.parse(text, world))
    validate_layout(gpt, Layout.parse("tp1cp2", 2), transformer_engine=True)
    assert "groups of pp 2" in "".join(layout_errors(
        gpt, Layout.parse("tp1pp2vpp2", 4), global_batch_size=6, micro_batch_size=1))
    assert not layout_errors(gpt, Layout.parse("tp1pp2vpp2", 4), global_batch_size=8,
                             micro_batch_size=1)
    assert "not divisible by micro batch 2 * dp 4" in "".join(layout_errors(
        gpt, Layout.parse("tp1pp1", 4), global_batch_size=6, micro_batch_size=2))
    # megatron-core's MoE rules are refused when a layout is requested, not while B is
    # prepared: biases only at ETP 1, shared experts split over TP
    biased = dataclasses.replace(moe, add_bias_linear=True)
    with pytest.raises(LayoutError, match=r"add_bias_linear with MoE needs etp1, got etp2"):
        validate_layout(biased, Layout.parse("tp2pp1ep2etp2", 4))
    validate_layout(biased, Layout.parse("tp2pp1ep2etp1", 4))
    shared = dataclasses.replace(moe, moe_shared_expert_intermediate_size=50)
    assert "moe_shared_expert_intermediate_size 50 % tp 4 != 0" in "".join(
        layout_errors(shared, Layout.parse("tp4", 4)))
    assert "moe_shared_expert_intermediate_size" not in "".join(
        layout_errors(shared, Layout.parse("tp2", 4)))
    with pytest.raises(LayoutError, match="ASCII"):
        Layout.parse("tp２pp2", 4)
    with pytest.raises(LayoutError, match="at most 64"):
        Layout.parse("tp" + "1" * 5000)
