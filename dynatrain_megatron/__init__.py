"""dynatrain_megatron: online, in-memory switching of Megatron parallel layouts.

The public Python API (`dynatrain_megatron.api`, docs/api.md) is importable from here:
`from dynatrain_megatron import ElasticJob`. It is loaded on first use, so importing the
package (or its pure planning modules) does not import torch or megatron-core.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_API = {
    "ElasticJob": "api", "Preparation": "api",
    "ApiError": "api_types", "LayoutInfo": "api_types", "SwitchAborted": "api_types",
    "SwitchPlan": "api_types", "Switched": "api_types", "WeightsSwitched": "api_types",
    "GreedyGeneration": "generation", "generate_greedy": "generation",
}


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'dynatrain_megatron' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_API))


__all__ = ["__version__", *_API]
