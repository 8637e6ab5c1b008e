"""Errors of the Virtual Parameter Space and of layouts.

One exception family so callers (controller, CLI) can refuse a request with the message
and keep training, instead of catching bare AssertionErrors from deep inside megatron.
"""


class DynatrainError(Exception):
    """Base class of every error this package raises on purpose."""


class LayoutError(DynatrainError, ValueError):
    """A layout string is malformed or the layout cannot hold the model / world."""


class ModelSpecError(DynatrainError, ValueError):
    """A model config is malformed or inconsistent."""


class FragmentMismatchError(DynatrainError):
    """Live fragments of a rank disagree with the analytic layout."""
