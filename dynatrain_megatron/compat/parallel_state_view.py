"""A thread's own view of megatron-core's `parallel_state` and of Megatron-LM's `args`.

A switch builds layout B with Megatron-LM's own model provider, `get_model`, optimizer and
scheduler set-up, in a background thread while layout A trains on the main thread. Those
builders read process-global state: megatron-core's `parallel_state` (the pipeline rank
chooses a stage's layer pattern and its multi-token-prediction layers, the data-parallel
rank numbers a tied weight's replica, DDP and the distributed optimizer take their groups
from it) and Megatron-LM's `get_args()`. Both are A's while B is built, and must stay A's
for the main thread. So both are made per thread:

* every function of `parallel_state` becomes a dispatcher: on a thread with a view
  (`in_view`) it runs a copy of the function whose globals are the view's own namespace,
  which the caller filled with B's groups; on every other thread it runs the original.
  The names other modules imported from `parallel_state` (`from ... import get_x`) are
  rebound to the dispatchers, so every reader sees the same thing.
* `megatron.training.global_vars.get_args` likewise answers a thread's own `args`
  (`thread_args`), where Megatron-LM is imported at all.

`register(module, view)` remembers which view a built model belongs to, so that code reading
its metadata later (its `sharded_state_dict()`, whose replica ids read the data-parallel
rank) can enter the same view (`view_of`). The first view installs the dispatchers for the
whole process (idempotent); a thread without a view pays one thread-local lookup per call.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import threading
import types
import weakref
from typing import Any, Callable, Iterator, Optional

_local = threading.local()  # .view: ParallelStateView; .args: Megatron-LM args
_lock = threading.Lock()
_originals: dict[str, Callable] = {}  # parallel_state function name -> the original
_installed = {"parallel_state": False, "args": None}
_views: "weakref.WeakKeyDictionary[Any, ParallelStateView]" = weakref.WeakKeyDictionary()


def rebind_everywhere(replacements: dict[int, Callable]) -> None:
    """Every module attribute that *is* one of the originals (by id) now names its
    replacement: the names `from parallel_state import get_x` bound elsewhere."""
    for mod in list(sys.modules.values()):
        d = getattr(mod, "__dict__", None)
        if not isinstance(d, dict):
            continue
        for k, v in list(d.items()):
            if callable(v) and id(v) in replacements and d.get(k) is v:
                d[k] = replacements[id(v)]


def _thread_dispatcher(name: str, original: Callable) -> Callable:
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        view = getattr(_local, "view", None)
        if view is None:
            return original(*args, **kwargs)
        return view.functions[name](*args, **kwargs)

    functools.update_wrapper(dispatch, original)
    dispatch._dynatrain_original = original  # type: ignore[attr-defined]
    return dispatch


def _install_parallel_state() -> None:
    from megatron.core import parallel_state as ps

    with _lock:
        if _installed["parallel_state"]:
            return
        replacements: dict[int, Callable] = {}
        for name, fn in list(vars(ps).items()):
            if isinstance(fn, types.FunctionType) and fn.__module__ == ps.__name__:
                _originals[name] = fn
                replacements[id(fn)] = _thread_dispatcher(name, fn)
        for name, fn in _originals.items():
            setattr(ps, name, replacements[id(fn)])
        rebind_everywhere(replacements)
        _installed["parallel_state"] = True


def _holds_groups(value: Any) -> bool:
    """A process group, or a container of them (a view must not keep another layout's
    communicators alive, nor hand them out)."""
    import torch.distributed as dist

    if isinstance(value, dist.ProcessGroup):
        return True
    if isinstance(value, (list, tuple)) and value:
        return any(isinstance(v, dist.ProcessGroup) for v in value)
    if isinstance(value, dict) and value:
        return any(isinstance(v, dist.ProcessGroup) for v in value.values())
    return False


class ParallelStateView:
    """`parallel_state`'s functions over a namespace of their own: a copy of the module's
    globals that `fill(namespace_module)` sets to a layout's groups (the same setter that
    points the real module at a layout, called on this namespace instead)."""

    def __init__(self, fill: Callable[[types.ModuleType], None]) -> None:
        from megatron.core import parallel_state as ps

        _install_parallel_state()
        module = types.ModuleType(ps.__name__, ps.__doc__)
        ns = module.__dict__
        ns.update(vars(ps))
        for name, value in list(ns.items()):  # the process's own groups stay out of it
            if _holds_groups(value):
                ns[name] = None
        self.functions: dict[str, Callable] = {}
        for name, orig in _originals.items():
            fn = types.FunctionType(orig.__code__, ns, orig.__name__, orig.__defaults__,
                                    orig.__closure__)
            fn.__kwdefaults__ = orig.__kwdefaults__
            fn.__qualname__ = orig.__qualname__
            ns[name] = fn
            self.functions[name] = fn
        self.module = module
        with in_view(self):  # a getter a setter calls must read this namespace too
            fill(module)

    def __repr__(self) -> str:
        f = self.functions
        try:
            return (f"ParallelStateView(tp={f['get_tensor_model_parallel_world_size']()}, "
                    f"pp={f['get_pipeline_model_parallel_world_size']()}, "
                    f"pp_rank={f['get_pipeline_model_parallel_rank']()})")
        except Exception:  # noqa: BLE001 - a view not filled yet
            return "ParallelStateView(<unset>)"


@contextlib.contextmanager
def thread_value(local: threading.local, name: str, value: Any) -> Iterator[None]:
    """Within the block, this thread's `local.<name>` is `value`; what it was (or None)
    again after, whatever the block raised."""
    previous = getattr(local, name, None)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, previous)


def in_view(view: Optional[ParallelStateView]) -> contextlib.AbstractContextManager:
    """Within the block, this thread's `parallel_state` calls read `view` (None: the
    process's own)."""
    return thread_value(_local, "view", view)


def register(module: Any, view: ParallelStateView) -> None:
    """Remember that `module` (a model chunk, wrapped or not) was built in `view`."""
    _views[module] = view


def view_of(module: Any) -> contextlib.AbstractContextManager:
    """The view `module` was built in, entered (a no-op for a module built with the
    process's own state)."""
    view = _views.get(module)
    return in_view(view) if view is not None else contextlib.nullcontext()


# ------------------------------------------------------------------ Megatron-LM's args
def _install_args() -> bool:
    """Make `megatron.training.global_vars.get_args` thread-aware. False where Megatron-LM
    (megatron.training) is not importable: then nothing reads its args."""
    try:
        from megatron.training import global_vars
    except ImportError:
        return False
    with _lock:
        if _installed["args"] is not None:
            return True
        original = global_vars.get_args

        def get_args(*a: Any, **k: Any) -> Any:
            mine = getattr(_local, "args", None)
            return mine if mine is not None else original(*a, **k)

        functools.update_wrapper(get_args, original)
        global_vars.get_args = get_args
        rebind_everywhere({id(original): get_args})
        _installed["args"] = get_args
    return True


@contextlib.contextmanager
def thread_args(args: Any) -> Iterator[None]:
    """Within the block, Megatron-LM's `get_args()` on this thread returns `args`."""
    _install_args()
    previous = getattr(_local, "args", None)
    _local.args = args
    try:
        yield
    finally:
        _local.args = previous


__all__ = ("ParallelStateView", "in_view", "register", "thread_args", "view_of")
