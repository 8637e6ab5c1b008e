"""Imported first by the test ranks' fork server (`multiproc.PRELOAD`): what must hold
before megatron-core is imported there (`compat.cpu.defer_torch_compile`)."""
from ..compat.cpu import defer_torch_compile

defer_torch_compile()
