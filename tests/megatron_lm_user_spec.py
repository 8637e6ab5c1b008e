"""A user's layer-spec module, as `--spec tests.megatron_lm_user_spec NAME` names it:
Megatron-LM imports the object NAME and builds every decoder layer from it. Each is
megatron-core's local layer with the normalization its job asks for (what the job gets
without `--spec`), so that the switch and Megatron-LM's restart build the same model
through a user's module, and the switch is planned from the live metadata."""
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

llama_layer = get_gpt_layer_local_spec(normalization="RMSNorm")  # the llama recipe's
gpt_layer = get_gpt_layer_local_spec(normalization="LayerNorm")  # TINY_GPT's
