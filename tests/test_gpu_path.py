"""The GPU path checked on the CPU: Transformer Engine names, the optimizer step of fused
Adams, the preparation thread's device and stream, NCCL-safe transport (first batch,
polled deadlines), the memory check of A and B together, and `scripts/gpu_check.py`."""
from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from dynatrain_megatron.adapters.live import (LiveState, ensure_optimizer_state,
                                              read_optimizer_step, write_optimizer_step)
from dynatrain_megatron.vps.analytic import analytic_layout
from dynatrain_megatron.vps.layout import Layout
from dynatrain_megatron.vps.model_spec import ModelSpec
from dynatrain_megatron.vps.naming import (TE_FUSED_NORMS, analytic_param_name,
                                           chunk_param_specs)

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY_GPT = ModelSpec.from_yaml(ROOT / "configs/models/tiny-gpt.yaml")
TINY_MOE = ModelSpec.from_yaml(ROOT / "configs/models/tiny-moe.yaml")


# ----------------------------------------------------------------- Transformer Engine names
def _te_fused_modules_from_megatron() -> dict[str, str]:
    """From megatron-core's own source (TE cannot be imported here): which submodule of a
    dense layer of `get_gpt_layer_with_transformer_engine_spec` is TE's fused
    LayerNormLinear, and which separate norm is then an IdentityOp."""
    import megatron.core.models.gpt.gpt_layer_specs as m

    tree = ast.parse(pathlib.Path(m.__file__).read_text())
    funcs = {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}

    def calls(fn, callee):
        return [c for c in ast.walk(fn) if isinstance(c, ast.Call)
                and getattr(c.func, "id", getattr(c.func, "attr", None)) == callee]

    fused = "column_parallel_layer_norm_linear"
    layer = funcs["get_gpt_layer_with_transformer_engine_spec"]
    # the non-MLA layer: SelfAttentionSubmodules(linear_qkv=backend.<fused>(), ...)
    attn = calls(layer, "SelfAttentionSubmodules")
    assert len(attn) == 1
    qkv = {k.arg: k.value for k in attn[0].keywords}["linear_qkv"]
    assert qkv.func.attr == fused
    subs = [c for c in calls(layer, "TransformerLayerSubmodules")
            if any(k.arg == "self_attention" and "SelfAttention" in ast.dump(k.value)
                   and "MLASelfAttention" not in ast.dump(k.value) for k in c.keywords)]
    assert len(subs) == 1
    kw = {k.arg: k.value for k in subs[0].keywords}
    out = {}
    if "input_layernorm" not in kw:  # TransformerLayerSubmodules' default: IdentityOp
        out["input_layernorm"] = "self_attention.linear_qkv"
    pre = kw["pre_mlp_layernorm"]  # `backend.layer_norm() if num_experts else IdentityOp`
    assert isinstance(pre, ast.IfExp) and getattr(pre.orelse, "id", None) == "IdentityOp"
    mlp = funcs["get_mlp_module_spec_for_backend"]
    fc1 = [a for a in ast.walk(mlp) if isinstance(a, ast.Assign)
           and getattr(a.targets[0], "id", None) == "linear_fc1"
           and isinstance(a.value, ast.Call) and getattr(a.value.func, "attr", None) == fused]
    if fc1:
        out["pre_mlp_layernorm"] = "mlp.linear_fc1"
    return out


def test_te_fused_norm_map_matches_megatron_te_spec():
    assert TE_FUSED_NORMS == _te_fused_modules_from_megatron()


@pytest.mark.parametrize("spec", [TINY_GPT, TINY_GPT.replace(normalization="LayerNorm"), TINY_MOE],
                         ids=["gpt-rms", "gpt-layernorm", "moe"])
def test_te_param_specs_name_te_params_with_analytic_keys(spec):
    lay = Layout.parse("tp2pp2", 4) if not spec.is_moe else Layout.parse("tp1pp2ep2", 4)
    te = spec.replace(transformer_engine=True)
    for pp in range(lay.pp):
        local = chunk_param_specs(spec, lay, pp, 0)
        fused = chunk_param_specs(te, lay, pp, 0)
        # the same tensors with the same keys and shapes, under TE's names
        assert sorted((p.key, p.local_shape) for p in local) == \
            sorted((p.key, p.local_shape) for p in fused)
        assert {analytic_param_name(p.local_name): p.key for p in fused} == \
            {p.local_name: p.key for p in local}
        names = [p.local_name for p in fused]
        assert not any(".input_layernorm." in n for n in names)
        assert any(n.endswith("self_attention.linear_qkv.layer_norm_weight") for n in names)
        assert any(n.endswith("pre_mlp_layernorm.weight") for n in names) == spec.is_moe
        assert any(n.endswith("layer_norm_bias") for n in names) == (spec.normalization == "LayerNorm")
        # TE registers the norm's parameters before the layer's weight (named_parameters order)
        for i, n in enumerate(names):
            if n.endswith("linear_qkv.layer_norm_weight") or n.endswith("linear_fc1.layer_norm_weight"):
                rest = names[i + 1:i + 3]
                host = n.rsplit(".", 1)[0]
                assert host + ".weight" in rest
    # the analytic layout holds the same bytes (the order changes only bucket boundaries)
    assert analytic_layout(te, lay).bytes_per_rank()["param"].sum() == \
        analytic_layout(spec, lay).bytes_per_rank()["param"].sum()


def test_live_key_of_te_fused_norm_is_the_analytic_key():
    key = LiveState._canonical_key
    assert key("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
               "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", (5,)) == \
        "decoder.layers.5.input_layernorm.weight"
    assert key("decoder.layers.1.mlp.linear_fc1.layer_norm_bias",
               "decoder.layers.1.mlp.linear_fc1.layer_norm_bias", (3,)) == \
        "decoder.layers.3.pre_mlp_layernorm.bias"
    assert analytic_param_name("decoder.layers.2.mlp.linear_fc1.weight") == \
        "decoder.layers.2.mlp.linear_fc1.weight"
    assert analytic_param_name("output_layer.layer_norm_weight") == "output_layer.layer_norm_weight"


# ----------------------------------------------------------------- optimizer step
class FusedAdam(torch.optim.Optimizer):
    """TE's / apex's FusedAdam as far as the step goes: `group['step']`, made at step 1."""

    def __init__(self, params):
        super().__init__(params, {})

    def step(self):
        for g in self.param_groups:
            g["step"] = g.get("step", 0) + 1
            for p in g["params"]:
                st = self.state[p]
                st.setdefault("exp_avg", torch.zeros_like(p))
                st.setdefault("exp_avg_sq", torch.zeros_like(p))


class _DistOpt:  # what optimizers_of unwraps: `.optimizer` is the torch optimizer
    def __init__(self, inner):
        self.optimizer = inner


def _chain(*inners):
    class Chained:
        chained_optimizers = [_DistOpt(i) for i in inners]
    return Chained()


@pytest.mark.parametrize("style", ["torch", "fused"])
def test_optimizer_step_read_and_written_where_the_optimizer_keeps_it(style):
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    if style == "torch":
        inner = torch.optim.Adam(params, lr=0.1)
        for p in params:
            p.grad = torch.ones_like(p)
    else:
        inner = FusedAdam(params)
    fresh_params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    fresh = torch.optim.Adam(fresh_params) if style == "torch" else FusedAdam(fresh_params)
    a, b = _chain(inner), _chain(fresh)
    assert read_optimizer_step(a) is None
    for _ in range(3):
        inner.step()
    assert read_optimizer_step(a) == 3.0
    ensure_optimizer_state(b)  # what binding B does before the transfer
    has_param_step = any("step" in st for st in fresh.state.values())
    assert has_param_step == (style == "torch")
    write_optimizer_step(b, 3.0)
    assert read_optimizer_step(b) == 3.0
    if style == "torch":
        steps = [fresh.state[p]["step"] for p in fresh_params]
        assert all(float(s) == 3.0 for s in steps)
        assert steps[0] is not steps[1]  # one tensor per parameter, never shared
    else:
        assert all(g["step"] == 3 for g in fresh.param_groups)
        fresh.step()
        assert read_optimizer_step(b) == 4.0  # bias correction continues, not from 1
