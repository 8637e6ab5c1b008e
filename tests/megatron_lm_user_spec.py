"""A user's layer-spec module, as `--spec tests.megatron_lm_user_spec NAME` names it:
Megatron-LM imports the object NAME and builds every decoder layer from it. Each is
megatron-core's local layer with the normalization its job asks for (what the job gets
without `--spec`), so that the switch and Megatron-LM's restart build the same model
through a user's module, and the switch is planned from the live metadata.

`llama_layer_counting` is the llama recipe's layer whose norms keep an extra state, as
Transformer Engine's FP8 layers keep their scaling state and amax history: a module state
that is no tensor of the model, changes at every step and differs between the ranks holding
the layer (their data differ). megatron-core's `sharded_state_dict()` describes it as a
`ShardedObject` (`_extra_state`), which dist_checkpointing saves from its main replica and
loads into every rank holding the layer at B: the input norm's one object per layer, the
pre-MLP norm's one per layer and data-parallel replica (`PerReplicaCountingRMSNorm`)."""
import dataclasses
from typing import Any

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec


class CountingRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm (what the local spec builds for `--normalization RMSNorm`) that
    counts its forward calls and keeps the running max of its input's magnitude, like an
    amax history. Its extra state is both; setting it (a load) restores them."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        self.calls = 0
        self.amax = torch.zeros((), dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.calls += 1
            self.amax = torch.maximum(self.amax, x.detach().abs().max().float())
        return super().forward(x)

    def get_extra_state(self) -> dict:
        return {"calls": self.calls, "amax": self.amax.clone()}

    def set_extra_state(self, state: Any) -> None:
        if state is None:  # a load without this state (another spec's checkpoint)
            return
        self.calls = int(state["calls"])
        self.amax = state["amax"].detach().clone().float()


class PerReplicaCountingRMSNorm(CountingRMSNorm):
    """A `CountingRMSNorm` whose extra state is saved per data-parallel replica: its
    `sharded_state_dict` shards the object over the data-parallel ranks as well as the
    layers (each replica's own running max; its main replica the tensor-parallel rank 0).
    dist_checkpointing loads it only at a layout with the same data-parallel size: at
    another, the object is sharded differently and the load fails (so must a switch)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Any = None) -> dict:
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.mapping import ShardedObject
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        dp = (metadata or {}).get("dp_cp_group") or parallel_state.get_data_parallel_group(
            with_context_parallel=True)
        tp = parallel_state.get_tensor_model_parallel_group()
        sd = make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True),
                                                 prefix, {}, sharded_offsets, tp_group=tp,
                                                 dp_cp_group=dp)
        obj = sd[f"{prefix}_extra_state"]
        sd[f"{prefix}_extra_state"] = ShardedObject(
            obj.key, obj.data, tuple(obj.global_shape) + (dp.size(),),
            tuple(obj.global_offset) + (dp.rank(),), (0, tp.rank(), 0))
        return sd


llama_layer = get_gpt_layer_local_spec(normalization="RMSNorm")  # the llama recipe's
gpt_layer = get_gpt_layer_local_spec(normalization="LayerNorm")  # TINY_GPT's
llama_layer_counting = dataclasses.replace(
    llama_layer, submodules=dataclasses.replace(llama_layer.submodules,
                                                input_layernorm=CountingRMSNorm,
                                                pre_mlp_layernorm=PerReplicaCountingRMSNorm))
