"""Fixes for bugs of megatron-core 0.16.1's DistributedOptimizer with torch Adam.

Without TE/apex, the distributed optimizer falls back to `torch.optim.Adam`, and loading a
`fully_reshardable` checkpoint into a fresh optimizer has three bugs (found by probing,
see shared/ref/megatron-core-on-cpu.md). They are not CPU-specific (they bite any install
without TE/apex), and the checkpoint-based reference path we compare against must be
correct, so these are applied on every device:

1. `sharded_state_dict(is_loading=True)` on a fresh optimizer asserts on the empty Adam
   state: we initialise the states first (megatron's own dummy-step helper).
2. `_set_main_param_and_optimizer_states` copies every Adam state key, including `step`,
   which the reshardable loader never provides -> KeyError: we copy the keys provided.
3. `load_state_dict` gives every parameter ONE shared `step` tensor; torch Adam then
   increments it once per parameter per step and bias correction goes wrong: we un-share it.

And one of MoE without Transformer Engine (on a GPU as much as on the CPU): the router's
`moe_utils` references `te_general_gemm`, which is only imported when TE is installed, so
the router's forward raises NameError; defined as None it takes its torch path.
"""
from __future__ import annotations

import torch

_state = {"applied": False}


def _define_te_general_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def apply() -> None:
    if _state["applied"]:
        return
    _define_te_general_gemm()
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

    DO.sharded_state_dict = sharded_state_dict
    DO._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    DO.load_state_dict = load_state_dict
    _state["applied"] = True
