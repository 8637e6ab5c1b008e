"""Fixes for bugs of megatron-core 0.16.1's DistributedOptimizer with torch Adam.

Without TE/apex, the distributed optimizer falls back to `torch.optim.Adam`, and loading a
`fully_reshardable` checkpoint into a fresh optimizer has three bugs (found by probing,
see shared/ref/megatron-core-on-cpu.md), and saving one has a fourth (any install; see
shared/ref/megatron-state-layout.md). They are not CPU-specific (they bite any install
without TE/apex), and the checkpoint-based reference path we compare against must be
correct, so these are applied on every device:

1. `sharded_state_dict(is_loading=True)` on a fresh optimizer asserts on the empty Adam
   state: we initialise the states first (megatron's own dummy-step helper).
2. `_set_main_param_and_optimizer_states` copies every Adam state key, including `step`,
   which the reshardable loader never provides -> KeyError: we copy the keys provided.
3. `load_state_dict` gives every parameter ONE shared `step` tensor; torch Adam then
   increments it once per parameter per step and bias correction goes wrong: we un-share it.
4. Saving `fully_reshardable` misplaces the optimizer state of every parameter after a
   padded bucket end: `get_parameter_state_dp_zero` packs each buffer's buckets back to
   back with their end padding stripped, but `sharded_param_state_fully_reshardable` slices
   that packing at `param_index_map` offsets, which count the padding. The parameter's
   param / exp_avg / exp_avg_sq are then saved shifted by the padding, with zeros at the
   end (megatron warns "param range exceeds unpadded buffer ... data corruption"); loading
   takes them as they are. A buffer has more than one bucket with the DDP bucket size, and
   with tied embeddings and PP > 1 (the first stage's word embedding gets a bucket of its
   own): e.g. Megatron-LM's tiny GPT with `--decoder-first-pipeline-num-layers 1` restarts
   with its embedding shifted by a row. We hand that function the packing laid out at the
   buckets' buffer offsets, so the offsets it uses are right (fixed upstream after 0.16.1,
   NVIDIA/Megatron-LM PR #5077, the other way round).

And one of MoE without Transformer Engine (on a GPU as much as on the CPU): the router's
`moe_utils` references `te_general_gemm`, which is only imported when TE is installed, so
the router's forward raises NameError; defined as None it takes its torch path.

And one of multi-latent attention without Transformer Engine: MLA builds its core
attention with `k_channels` / `v_channels` (query-key and value head sizes differ), which
TE's attention takes and megatron's own `DotProductAttention` does not (TypeError). Its
only use of a head size besides the softmax scale (which MLA passes) is the shape of its
output, `heads * v_channels` per partition: we take the two keywords and set that. MLA's
module also believes TE is there when its extension module imports without TE (its
`TELinear` is then no class, and `isinstance` raises): it is told the truth.
"""
from __future__ import annotations

import torch

_state = {"applied": False}


def _define_te_general_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _dot_product_attention_head_sizes() -> None:
    import inspect

    from megatron.core.transformer.dot_product_attention import DotProductAttention as DPA

    original = DPA.__init__
    if "v_channels" in inspect.signature(original).parameters or getattr(
            original, "_dynatrain_head_sizes", False):
        return  # a release whose attention takes them

    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        original(self, *args, **kwargs)
        if v_channels is not None:
            heads = self.hidden_size_per_partition // self.hidden_size_per_attention_head
            self.hidden_size_per_attention_head = v_channels
            self.hidden_size_per_partition = heads * v_channels

    __init__._dynatrain_head_sizes = True  # type: ignore[attr-defined]
    DPA.__init__ = __init__
    try:
        from megatron.core.transformer import multi_latent_attention as mla
    except ImportError:
        return
    if getattr(mla, "HAVE_TE", False) and not isinstance(getattr(mla, "TELinear", None), type):
        mla.HAVE_TE = False


def _at_bucket_offsets(buffers, state):
    """Fix 4: `get_parameter_state_dp_zero`'s world tensors (buckets packed without their
    end padding) laid out as the buffer is, each bucket at its offset, padding zero."""
    if state is None:  # memory-efficient gather: DP ranks other than 0 get nothing
        return None
    for gbuf_idx, buffer in enumerate(buffers):
        for world in state[gbuf_idx].values():
            for key in ("param", "exp_avg", "exp_avg_sq"):
                packed = world[key]
                laid_out = packed.new_zeros(buffer.numel)
                start = 0
                for bucket in buffer.buckets:
                    n = bucket.numel_unpadded
                    laid_out[bucket.offset:bucket.offset + n] = packed[start:start + n]
                    start += n
                world[key] = laid_out
    return state


def apply() -> None:
    if _state["applied"]:
        return
    _define_te_general_gemm()
    _dot_product_attention_head_sizes()
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as DO

    original_ssd = DO.sharded_state_dict

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, *a, **k):
        if is_loading and len(self.optimizer.state) == 0:
            self._init_optimizer_states_with_dummy_values()
        return original_ssd(self, model_sharded_state_dict or {}, is_loading, *a, **k)

    original_set = DO._set_main_param_and_optimizer_states

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original_set(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        targets = {"param": main_param, **self.optimizer.state[main_param]}
        for k, v in targets.items():
            if k in tensors:
                v.copy_(tensors[k])

    original_load = DO.load_state_dict

    def load_state_dict(self, state_dict):
        out = original_load(self, state_dict)
        for st in self.optimizer.state.values():
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].clone()
        return out

    original_fully_reshardable = DO.sharded_param_state_fully_reshardable

    def sharded_param_state_fully_reshardable(self, *a, **k):
        # only this call sees the laid-out tensors; `save_parameter_state` and the DP-zero
        # load keep megatron's packed format
        self.get_parameter_state_dp_zero = lambda *ga, **gk: _at_bucket_offsets(
            self.buffers, DO.get_parameter_state_dp_zero(self, *ga, **gk))
        try:
            return original_fully_reshardable(self, *a, **k)
        finally:
            del self.get_parameter_state_dp_zero

    DO.sharded_state_dict = sharded_state_dict
    DO.sharded_param_state_fully_reshardable = sharded_param_state_fully_reshardable
    DO._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    DO.load_state_dict = load_state_dict
    _state["applied"] = True
