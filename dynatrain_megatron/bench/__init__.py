"""`dynatrain bench-switch`: our switch against the checkpoint path and megatron's refit."""
