import os
import sys

# spawned ranks import test modules by name: make tests/ importable for them
sys.path.insert(0, os.path.dirname(__file__))

# before any test module imports megatron-core: its fusion decorators need not import
# TorchInductor on a CPU machine (compat.cpu.defer_torch_compile)
from dynatrain_megatron.compat.cpu import defer_torch_compile  # noqa: E402

defer_torch_compile()
