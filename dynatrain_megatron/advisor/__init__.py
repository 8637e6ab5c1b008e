"""The layout advisor: which layout of N devices trains a model fastest within memory.

Pure: uses `vps` (layouts, the one validator, the analytic layout) and `routing` (the
switch cost), never torch.distributed or megatron, so it runs anywhere at any scale.
  enumerate.py    every layout of N devices the validator accepts
  memory.py       exact state bytes per rank + the activation model
  step_time.py    the step-time model
  calibration.py  the models' constants, the workload, measured step times
  suggest.py      the ranking, the switch cost from the current layout
"""
from .calibration import Calibration, Measurement, Workload, load_calibration
from .enumerate import SearchSpace, enumerate_layouts
from .errors import AdvisorError, NoLayoutFits
from .suggest import SuggestedLayout, Suggestion, suggest

__all__ = ["Calibration", "Measurement", "Workload", "load_calibration", "SearchSpace",
           "enumerate_layouts", "AdvisorError", "NoLayoutFits", "SuggestedLayout",
           "Suggestion", "suggest"]
