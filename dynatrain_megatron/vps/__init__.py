"""Virtual Parameter Space: layout-independent coordinates of all training state.

Pure Python/numpy. Never imports torch.distributed or megatron, so planning runs anywhere.
"""
from .errors import DynatrainError, FragmentMismatchError, LayoutError, ModelSpecError
from .layout import Layout, RankCoords
from .model_spec import ModelSpec

__all__ = ["DynatrainError", "FragmentMismatchError", "LayoutError", "ModelSpecError",
           "Layout", "RankCoords", "ModelSpec"]
