"""CPU runtime for megatron-core 0.16.1 on a CPU-only torch with gloo.

megatron-core assumes CUDA everywhere. On a machine without a CUDA device we apply the
smallest set of patches that lets its GPT/MoE models, DDP and DistributedOptimizer run:

1. `_CudaToCpuMode`, a TorchFunctionMode that rewrites device="cuda"/int devices to CPU and
   makes `Tensor.cuda()` a no-op (megatron has ~140 such call sites; patching each is not
   maintainable). `Tensor.type()` reports `torch.cuda.*` names because the optimizer and
   grad-clipping code dispatch on the strings 'torch.cuda.FloatTensor' etc.
2. No-op `torch.cuda` streams, events, synchronize, nvtx, memory counters.
3. The CUDA RNG tracker seeds and forks CPU generator states instead (the tracker's
   per-TP/EP seeds keep their meaning: different across TP ranks, equal across DP).
4. MoE without Transformer Engine (its undefined `te_general_gemm` is fixed on every device
   in `megatron_fixes`): the all-to-all dispatcher expects numpy split sizes from
   `maybe_move_tensor_to_cpu(as_numpy=True)` but gets a tensor on CPU.
5. gloo has no uneven all-gather / reduce-scatter, which megatron's token dispatcher uses
   with expert-TP > 1 (`output_split_sizes`): we pad to the largest split and trim, and
   reduce-scatter unevenly as an all-reduce followed by taking our own slice.
6. MoE with TP>1 requires sequence parallelism, and megatron's torch norm refuses it; we build
   the norm without it and tag its parameters `sequence_parallel=True`, so their gradients are
   all-reduced over TP by `finalize_model_grads` (same math as the TE/apex norms).
7. An isend in flight keeps the memory it sends from (`_patch_overlapped_p2p_sends`): the
   interleaved schedule with overlapped P2P (Megatron-LM's default with VPP) pseudo-frees a
   sent activation (`out.data = torch.empty(1)`) before waiting on its isend.
8. `torch.compile` of a function defers to its first call (`defer_torch_compile`): megatron's
   import-time fusion decorators no longer import TorchInductor.
9. Grouped GEMM (`--moe-grouped-gemm`, megatron-core 0.16's `GroupedMLP`): its kernel package
   `grouped_gemm` is CUDA only; `grouped_gemm.ops.gmm` is stood in by a batch of plain torch
   matmuls, one per expert (`gmm`), and `torch.cuda.get_device_capability()` answers (8, 0),
   the least Megatron-LM's argument validation asks of a device for grouped GEMM.
   GroupedMLP decorates two closures (its GLU and the probability scaling) with
   `jit_fuser` (torch.compile) in each instance's `__init__`: every layer's would be
   compiled anew with TorchInductor (minutes on 2 cores) until torch's recompile limit,
   after which later instances (a switch's layout B) would run eagerly, with other
   rounding than the compiled ones of a restart. They run eagerly everywhere instead.

`apply_if_needed()` applies all of it only when `torch.cuda.is_available()` is False and is
idempotent; on a GPU it does nothing, so behaviour there is megatron's own.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger("dynatrain")

_CPU = torch.device("cpu")
_state = {"applied": False, "mode": None, "thread": None}


def _to_cpu_device(d: Any) -> Any:
    if isinstance(d, int) and not isinstance(d, bool):
        return _CPU
    if isinstance(d, str) and d.startswith("cuda"):
        return _CPU
    if isinstance(d, torch.device) and d.type == "cuda":
        return _CPU
    return d


class _CudaToCpuMode(TorchFunctionMode):
    """Redirects every CUDA device argument to the CPU (see module docstring, item 1)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs = dict(kwargs)
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (str, int, torch.device)):
            args = (args[0], _to_cpu_device(args[1])) + tuple(args[2:])
        return func(*args, **kwargs)


class _NullStream:
    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def wait_stream(self, *a: Any, **k: Any) -> None:
        pass

    def wait_event(self, *a: Any, **k: Any) -> None:
        pass

    def record_event(self, *a: Any, **k: Any) -> "_NullEvent":
        return _NullEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> "_NullStream":
        return self

    def __exit__(self, *a: Any) -> bool:
        return False


class _NullEvent:
    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def record(self, *a: Any, **k: Any) -> None:
        pass

    def wait(self, *a: Any, **k: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def _patch_torch_cuda() -> None:
    c = torch.cuda

    # a fresh function object per attribute: torch._dynamo's trace rules refuse one object
    # registered under two torch.cuda names
    def noop():
        return lambda *a, **k: None

    def zero():
        return lambda *a, **k: 0

    c.current_device = lambda: "cpu"
    c.device_count = lambda: 0
    c.set_device = noop()
    c.synchronize = noop()
    c.empty_cache = noop()
    c.Stream = _NullStream
    c.Event = _NullEvent
    c.current_stream = lambda *a, **k: _NullStream()
    c.default_stream = lambda *a, **k: _NullStream()
    c.stream = lambda *a, **k: contextlib.nullcontext()
    c.set_stream = noop()
    c.memory_allocated = zero()
    c.memory_reserved = zero()
    c.max_memory_allocated = zero()
    c.reset_peak_memory_stats = noop()
    c.nvtx.range_push = noop()
    c.nvtx.range_pop = noop()
    c.manual_seed = noop()  # the RNG tracker owns the model-parallel seeds (item 3)
    c.manual_seed_all = noop()
    c.get_rng_state = lambda *a, **k: torch.get_rng_state()
    c.set_rng_state = lambda s, *a, **k: torch.set_rng_state(s)
    c.get_device_capability = lambda *a, **k: GMM_DEVICE_CAPABILITY  # item 9


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda s, *a, **k: torch.set_rng_state(s)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.default_generator.manual_seed(seed)  # no lazy seeding of other devices
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    mrandom.CudaRNGStatesTracker.add = add


def _patch_moe() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor):
            return tensor.detach().cpu().numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


# what `torch.cuda.get_device_capability()` answers on the CPU (item 9): Megatron-LM's
# `validate_args` asserts a major version >= 8 for `--moe-grouped-gemm`; other readers ask
# for >= 10 (Blackwell-only paths), which this answer keeps off
GMM_DEVICE_CAPABILITY = (8, 0)


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: Any, trans_b: bool = False) -> torch.Tensor:
    """`grouped_gemm.ops.gmm` in plain torch (item 9): rows `a[s_i : s_i + n_i]` times
    expert `i`'s matrix `b[i]` (`b[i].T` with `trans_b`), where `n = batch_sizes` are the
    consecutive row counts of the experts. `a`: [sum(n), k]; `b`: [E, k, m] ([E, m, k] with
    `trans_b`); result [sum(n), m]. Autograd differentiates it as the matmuls it is."""
    sizes = [int(n) for n in torch.as_tensor(batch_sizes).reshape(-1).tolist()]
    if len(sizes) != b.shape[0] or sum(sizes) != a.shape[0]:
        raise ValueError(f"gmm: {len(sizes)} batch sizes summing to {sum(sizes)} for "
                         f"{b.shape[0]} experts and {a.shape[0]} rows")
    outs = [x @ (w.t() if trans_b else w) for x, w in zip(torch.split(a, sizes), b.unbind(0))]
    return torch.cat(outs) if outs else a.new_empty((0, b.shape[1 if trans_b else 2]))


def _patch_grouped_gemm() -> None:
    """Item 9: megatron-core's `grouped_gemm_util` found no `grouped_gemm` package (CUDA
    only): it gets a stand-in whose `ops.gmm` is `gmm`. Left alone where one is installed."""
    import types

    try:
        from megatron.core.transformer.moe import grouped_gemm_util as gg
    except ImportError:  # a release without the legacy grouped GEMM path
        return
    if gg.grouped_gemm is not None:
        return
    from megatron.core.transformer.moe import experts

    experts.jit_fuser = lambda fn: fn  # the name GroupedMLP's __init__ decorates with
    mod = types.ModuleType("grouped_gemm")
    mod.__doc__ = "dynatrain's CPU stand-in for grouped_gemm: per-expert torch matmuls"
    mod.ops = types.SimpleNamespace(gmm=gmm)
    gg.grouped_gemm, gg.ops = mod, mod.ops


def _patch_torch_norm_sequence_parallel() -> None:
    from megatron.core.transformer import torch_norm

    cls = torch_norm.WrappedTorchNorm
    original_new = cls.__new__

    def __new__(klass, config, hidden_size, eps=1e-5, **kw):
        sp = config.sequence_parallel
        config.sequence_parallel = False
        try:
            module = original_new(klass, config, hidden_size, eps, **kw)
        finally:
            config.sequence_parallel = sp
        for p in module.parameters():
            p.sequence_parallel = sp
        return module

    cls.__new__ = staticmethod(__new__)


def _patch_uneven_collectives() -> None:
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    original_gather = mappings._gather_along_first_dim
    original_reduce_scatter = mappings._reduce_scatter_along_first_dim

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original_gather(input_, group, output_split_sizes, use_global_buffer)
        longest = max(output_split_sizes)
        padded = input_.new_zeros((longest,) + tuple(input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in output_split_sizes]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p[:n] for p, n in zip(parts, output_split_sizes)], dim=0)

    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original_reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        r = group.rank()
        start = sum(input_split_sizes[:r])
        return total[start:start + input_split_sizes[r]].contiguous()

    mappings._gather_along_first_dim = gather
    mappings._reduce_scatter_along_first_dim = reduce_scatter


def _patch_overlapped_p2p_sends() -> None:
    """Item 7. gloo's isend remembers the tensor's data pointer and sends from it later, in
    its own thread; its work object holds the tensor, not the memory the tensor had. With
    `overlap_p2p_comm`, megatron's interleaved schedule calls `deallocate_output_tensor` on an
    activation whose isend it waits for only at the next send, and that replaces the
    tensor's storage: on a GPU the caching allocator keeps the old block until the NCCL
    stream has passed the send, on the CPU it is freed at once and the next stage receives
    whatever is written there next (NaN in bf16, wrong numbers in fp32). Each send of
    `_p2p_ops` (the unbatched path, the only one that returns before its sends complete)
    gets an alias instead: a tensor of its own on the same storage, which the deallocation
    does not touch and which keeps the storage alive until the send's work is released.
    No copy, so what is sent is bit-for-bit the same."""
    from megatron.core.pipeline_parallel import p2p_communication

    original = p2p_communication._p2p_ops
    if getattr(original, "_dynatrain_send_alias", False):
        return

    def alias(t: Any) -> Any:
        return None if t is None else t.detach()

    def _p2p_ops(*, tensor_send_prev, tensor_send_next, **kw: Any) -> Any:
        return original(tensor_send_prev=alias(tensor_send_prev),
                        tensor_send_next=alias(tensor_send_next), **kw)

    _p2p_ops._dynatrain_send_alias = True  # type: ignore[attr-defined]
    _p2p_ops.__wrapped__ = original  # type: ignore[attr-defined]
    p2p_communication._p2p_ops = _p2p_ops


@contextlib.contextmanager
def in_this_thread():
    """The CPU runtime for the current thread. Torch-function modes are thread-local: a
    thread started after `apply_if_needed` (a switch prepared in the background) would
    otherwise build megatron modules on "cuda" devices. A no-op on a GPU machine and in
    the thread that applied the runtime."""
    if not _state["applied"] or threading.get_ident() == _state["thread"]:
        yield
        return
    with _CudaToCpuMode():
        yield


def defer_torch_compile() -> bool:
    """Without a CUDA device, `torch.compile(fn)` of a plain function defers everything to
    the function's first call. megatron-core decorates a few dozen fusion functions with
    `torch.compile` as its modules are imported (`megatron.core.jit.jit_fuser`); each
    decoration looks up the compiler backend, which imports TorchInductor: about 60% of
    `import megatron.core`, in every process, for functions the CPU launch (`--no-*-fusion`)
    never calls. A function that is called is compiled then, with the same arguments, as
    `torch.compile` would at its first call anyway. Modules and other objects go to
    `torch.compile` unchanged. Call before megatron is imported; idempotent. True when
    deferred (no CUDA device)."""
    if torch.cuda.is_available():
        return False
    real = torch.compile
    if getattr(real, "_dynatrain_deferred", False):
        return True

    def compile_at_first_call(model: Any = None, **options: Any) -> Any:
        if model is None:  # used as @torch.compile(...)
            return lambda fn: compile_at_first_call(fn, **options)
        if not inspect.isfunction(model):
            return real(model, **options)
        compiled: list = []

        @functools.wraps(model)
        def run(*a: Any, **k: Any) -> Any:
            if not compiled:
                compiled.append(real(model, **options))
            return compiled[0](*a, **k)

        return run

    compile_at_first_call._dynatrain_deferred = True  # type: ignore[attr-defined]
    torch.compile = compile_at_first_call
    return True


def apply_if_needed() -> bool:
    """Apply the CPU runtime when no CUDA device is present. Returns True if active."""
    if _state["applied"]:
        return True
    if torch.cuda.is_available():
        return False
    defer_torch_compile()
    _patch_torch_cuda()
    _patch_rng_tracker()
    _patch_moe()
    _patch_grouped_gemm()
    _patch_torch_norm_sequence_parallel()
    _patch_uneven_collectives()
    _patch_overlapped_p2p_sends()
    mode = _CudaToCpuMode()
    mode.__enter__()
    _state.update(applied=True, mode=mode, thread=threading.get_ident())
    log.info("megatron-core CPU runtime applied (no CUDA device)")
    return True


# ---------------------------------------------------------------- before megatron imports
# Modules of megatron-core that import triton at their top level, unguarded, while being
# imported on every path (0.16.1: Megatron-LM's initialize imports the first; 0.18+: `import
# megatron.core` reaches the second through the pipeline schedules).
TRITON_MODULES = (
    "megatron.core.transformer.custom_layers.batch_invariant_kernels",
    "megatron.core.transformer.moe.ops.paged_stash",
)


def typing_override() -> bool:
    """`typing.override` (Python 3.12) on an older Python, where megatron-core 0.17+ imports
    it (`megatron/training/models/`): the decorator of PEP 698, which only marks the
    function. Returns True when it was added."""
    import typing

    if hasattr(typing, "override"):
        return False

    def override(fn: Any) -> Any:
        try:
            fn.__override__ = True
        except (AttributeError, TypeError):
            pass
        return fn

    typing.override = override  # type: ignore[attr-defined]
    return True


def megatron_core_dir() -> Any:
    """The directory `import megatron.core` will load from (the first `megatron` portion on
    the path holding `core/__init__.py`), found without importing it; None if none."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("megatron")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        if (Path(loc) / "core" / "__init__.py").is_file():
            return Path(loc) / "core"
    return None


def _unguarded_triton_import(source: str) -> bool:
    import ast

    for node in ast.parse(source).body:  # top level only: a try/except import is guarded
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "triton"
                                                for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "triton":
            return True
    return False


def _stand_in_module(name: str, source: str) -> Any:
    """A module in place of `name` (whose `source` imports triton): its top-level constants
    (literals) as they are, each top-level function and class a callable that refuses with
    a clear error, so that importing names from it works and using them does not."""
    import ast
    import types

    from ..vps.errors import DynatrainError

    mod = types.ModuleType(name)
    mod.__doc__ = f"dynatrain's stand-in for {name}: triton is not installed on this machine"

    def refusing(attr: str) -> Any:
        def refuse(*a: Any, **k: Any) -> Any:
            raise DynatrainError(f"{name}.{attr} needs triton, which is not installed here "
                                 f"(dynatrain's stand-in keeps its import from failing)")
        refuse.__name__ = attr
        return refuse

    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            setattr(mod, node.name, refusing(node.name))
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            try:
                setattr(mod, node.targets[0].id, ast.literal_eval(node.value))
            except ValueError:
                pass

    def missing(attr: str) -> Any:
        raise AttributeError(f"{name}.{attr}: triton is not installed, so this module is "
                             f"dynatrain's stand-in")

    mod.__getattr__ = missing  # type: ignore[attr-defined]
    return mod


def triton_stand_ins(dry_run: bool = False) -> list[str]:
    """Without triton: each module of `TRITON_MODULES` that the megatron-core about to be
    imported has, and that imports triton unguarded, is replaced by a stand-in
    (`_stand_in_module`). Keyed by what the source does, not by a version: a module that
    guards its import, or that a release lacks, is left alone. triton itself is not faked,
    so nothing else believes it is present. Returns the modules replaced (`dry_run`: that
    would be replaced, installing nothing)."""
    import importlib.util
    import sys

    if importlib.util.find_spec("triton") is not None:
        return []
    core = megatron_core_dir()
    if core is None:
        return []
    out = []
    for name in TRITON_MODULES:
        if name in sys.modules:
            continue
        path = core.joinpath(*name.split(".")[2:]).with_suffix(".py")
        if not path.is_file():
            continue
        source = path.read_text()
        if _unguarded_triton_import(source):
            if not dry_run:
                sys.modules[name] = _stand_in_module(name, source)
            out.append(name)
    return out
