"""The training objects in the arguments of one of Megatron-LM's calls (its save, its
evaluation, its exit checks), swapped for the survivors' after a recovery: the call is made
again at the survivors' layout (`post_step.py`, `after_train.py`).

The arguments are Megatron-LM's own names, the same in every supported release: `model`,
`optimizer`, `opt_param_scheduler`, `train_data_iterator`, `config`, and an evaluation's
`data_iterator` (the validation set's, or the test set's when its `prefix` says so).
"""
from __future__ import annotations

import inspect
from typing import Any

_OBJECTS = ("model", "optimizer", "opt_param_scheduler", "train_data_iterator", "config",
            "data_iterator")


def drop_objects(bound: inspect.BoundArguments) -> None:
    """The broken layout's objects out of a call's arguments (kept for a later call, they
    must not keep that layout's communicators alive: `rank_death._let_go`)."""
    for name in _OBJECTS:
        if name in bound.arguments:
            bound.arguments[name] = None


def substitute(bound: inspect.BoundArguments, objs: Any) -> None:
    """The survivors' objects (`LoopObjects`) in a call's arguments."""
    a = bound.arguments
    for name, value in (("model", objs.model), ("optimizer", objs.optimizer),
                        ("opt_param_scheduler", objs.opt_param_scheduler),
                        ("train_data_iterator", objs.train_data_iterator),
                        ("config", objs.config)):
        if name in a:
            a[name] = value
    if "data_iterator" in a:  # an evaluation: of the validation or the test set
        test = "test set" in str(a.get("prefix", ""))
        a["data_iterator"] = objs.test_data_iterator if test else objs.valid_data_iterator


__all__ = ("drop_objects", "substitute")
