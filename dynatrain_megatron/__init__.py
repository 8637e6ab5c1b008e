"""dynatrain_megatron: online, in-memory switching of Megatron parallel layouts."""
__version__ = "0.1.0"
