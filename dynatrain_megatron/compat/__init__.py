"""Version and device differences of megatron-core, isolated here."""
from . import cpu, megatron_fixes


def prepare_runtime() -> bool:
    """Apply what this machine needs before building megatron models. Returns is_cpu."""
    is_cpu = cpu.apply_if_needed()
    megatron_fixes.apply()
    return is_cpu


def runtime_in_this_thread():
    """Context manager: what `prepare_runtime` set up, for a thread started after it."""
    return cpu.in_this_thread()
