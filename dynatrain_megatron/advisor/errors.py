"""Errors of the layout advisor."""
from ..vps.errors import DynatrainError


class AdvisorError(DynatrainError, ValueError):
    """Bad input to the advisor (workload, calibration) or no layout fits."""


class NoLayoutFits(AdvisorError):
    """No layout of the world fits the device memory (the message says what the best needs)."""
