"""A user's layer-spec module, as `--spec tests.megatron_lm_user_spec llama_layer` names it:
Megatron-LM imports the object and builds every decoder layer from it. Here it is
megatron-core's local layer with RMSNorm (what the Llama recipe gets without `--spec`), so
that the switch and Megatron-LM's restart build the same model by a user's module."""
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

llama_layer = get_gpt_layer_local_spec(normalization="RMSNorm")
