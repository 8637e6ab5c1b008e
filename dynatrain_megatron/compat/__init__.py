"""Version and device differences of megatron-core, isolated here."""
from . import cpu, megatron_fixes


def prepare_runtime() -> bool:
    """Apply what this machine needs before building megatron models. Returns is_cpu."""
    is_cpu = cpu.apply_if_needed()
    megatron_fixes.apply()
    return is_cpu
