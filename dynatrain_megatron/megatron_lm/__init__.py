"""Megatron-LM integration: `adapter` is what the patched `train()` / `pretrain_gpt.py`
call (the step hook inside Megatron-LM's own loop); `patch_tool` finds a checkout's
release and applies our patch (`dynatrain megatron-lm patch DIR`). The CPU runtime that
makes Megatron-LM's CUDA assumptions hold lives in `compat/megatron_lm.py`."""
