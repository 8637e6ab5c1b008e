"""Virtual Parameter Space: layout-independent coordinates of all training state.

Pure Python/numpy. Never imports torch.distributed or megatron, so planning runs anywhere.
"""
from .analytic import AnalyticLayout, RankSummary, analytic_layout
from .box import Box
from .errors import DynatrainError, FragmentMismatchError, LayoutError, ModelSpecError
from .fragment import KINDS, OPT_KINDS, Fragment, coverage_errors
from .layout import Layout, RankCoords
from .model_spec import ModelSpec
from .naming import LogicalTensor, logical_tensor_map, logical_tensors
from .placement import Placement

__all__ = ["AnalyticLayout", "RankSummary", "analytic_layout", "Box", "DynatrainError",
           "FragmentMismatchError", "LayoutError", "ModelSpecError", "KINDS", "OPT_KINDS",
           "Fragment", "coverage_errors", "Layout", "RankCoords", "ModelSpec", "LogicalTensor",
           "logical_tensor_map", "logical_tensors", "Placement"]
