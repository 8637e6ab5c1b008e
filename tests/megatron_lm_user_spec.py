"""A user's layer-spec module, as `--spec tests.megatron_lm_user_spec NAME` names it:
Megatron-LM imports the object NAME and builds every decoder layer from it. Each is
megatron-core's local layer with the normalization its job asks for (what the job gets
without `--spec`), so that the switch and Megatron-LM's restart build the same model
through a user's module, and the switch is planned from the live metadata.

`llama_layer_counting` is the llama recipe's layer whose input norm keeps an extra state, as
Transformer Engine's FP8 layers keep their scaling state and amax history: a module state
that is no tensor of the model, changes at every step and differs between the ranks holding
the layer (their data differ). megatron-core's `sharded_state_dict()` describes it as a
`ShardedObject` (`_extra_state`), which dist_checkpointing saves from its main replica and
loads into every rank holding the layer at B."""
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


llama_layer = get_gpt_layer_local_spec(normalization="RMSNorm")  # the llama recipe's
gpt_layer = get_gpt_layer_local_spec(normalization="LayerNorm")  # TINY_GPT's
llama_layer_counting = dataclasses.replace(
    llama_layer, submodules=dataclasses.replace(llama_layer.submodules,
                                                input_layernorm=CountingRMSNorm))
