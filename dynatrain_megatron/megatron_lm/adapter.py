"""Glue between Megatron-LM's own training loop and the dynatrain step hook.

`patches/` adds three calls to Megatron-LM (`megatron/training/training.py`,
`pretrain_gpt.py`): `arguments.chain_extra_args_providers` registers our `--dynatrain*` flags,
`register_dataset_provider` remembers how `pretrain()` built its data, and `dynatrain_step`
runs after every optimizer step, next to `checkpoint_and_decide_exit`, and hands back the
objects `train()` must continue with. `finish_training` gives `pretrain()` the objects the
loop ended with (its own references point at a layout that was released).

What this can do, and what it cannot (the honest part):

* The switch engine works on our `TrainingObjects`. At the first step we *wrap* Megatron-LM's
  live model chunks, optimizer, scheduler and process groups into one, after checking that
  Megatron-LM's groups are the ones our `Layout` computes and that the live state agrees,
  fragment for fragment, with the analytic layout (the same check the switch does). A job
  whose state we would misread is refused at that point, before anything moves.
* The *new* layout's objects are built by Megatron-LM itself (`builder.MegatronLMBuilder`):
  the script's model provider through `get_model`, its optimizer and scheduler set-up, on a
  copy of the job's args set to B, in the background thread's own view of megatron-core's
  `parallel_state`; so every option of the job carries over as a restart at B would carry
  it. What the switch cannot carry is refused when the command line is parsed
  (`support.unsupported_args`, each with its reason). `--tp-comm-overlap` is off after a
  switch, with a warning.
* After a switch, Megatron-LM's `args` are updated to the new layout, the micro-batch
  calculator is reconfigured, and the data iterators are rebuilt with Megatron-LM's own
  `build_train_valid_test_data_iterators` at `args.consumed_train_samples`, so the sample
  stream continues exactly where it was, at any data-parallel size.
* Scale-in/out: a rank that a switch leaves out waits on standby inside `dynatrain_step`
  (the hook's `standby()`: the controller's broadcasts, B's groups) and comes back into
  `train()` with the new objects and the current iteration, or leaves the loop when the job
  ends. Meanwhile Megatron-LM's own code on the layout's ranks is given the layout as its
  world (`compat/stand_in_world.py`: their thread's default group is the layout's ranks,
  which are the job's first ranks), so everything it does over "the world" runs on them
  alone, as in a job launched on those ranks: timers, the rerun state machine, the data
  rebuild, evaluation, `--save` (megatron-core's `dist_checkpointing` included) and the
  exit checks of `checkpoint_and_decide_exit`. `dynatrain_step` gives our own collectives
  the real world back while it runs.
* A job that ends with ranks on standby: the layout's ranks hold all the training state;
  they run `pretrain()`'s final save (a checkpoint at their layout, loadable at any
  layout), validation and test among themselves. The standby ranks hold nothing: told by
  the layout's last step (`--train-iters`) or by its exit (`--exit-interval`,
  `--exit-duration-in-mins`, `--exit-signal-handler`, which `checkpoint_and_decide_exit`
  decides on the layout's ranks and `dynatrain_step` hears as `ending`), they leave
  `train()`, and `pretrain()` returns for them before its final save (`left_out()`).
  A switch still being prepared in the background when the job ends is cancelled on every
  rank (the standby ranks hear it through the preparation's vote) and its request filed as
  not applied; no switch starts at the last step.
* A rank that dies (under `dynatrain launch`, with `--dynatrain-rendezvous-dir`): the
  patched loop hands the failed collective to `rank_death`, which re-forms the world and
  comes back through `MegatronLMSession.rebind_loop` like a switch: from the survivors'
  memory with several distributed-optimizer instances, else (the dead rank's optimizer
  shards are lost) from Megatron-LM's last `--save`.
* Megatron-LM's first process groups (and their gloo twins) belong to the first layout:
  the switch that releases it destroys them on every rank, in one order, once megatron's
  globals point at the new layout's groups (`megatron_first_groups`); TE's tp-comm-overlap
  user buffers (`--tp-comm-overlap`, off after a switch) go with it (`session.release`).

Importing this module needs megatron-core and this package only; Megatron-LM
(`megatron.training`) is imported inside the functions that run within its loop.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from ..vps.errors import DynatrainError
from ..vps.layout import GROUP_AXES, Layout
from .arguments import (arg_value, args_for_layout, params_dtype_of, performance_differences,
                        rank_order_of, unsupported_args)
from .description import check_live_state, describe_job
from .data_ahead import DataAhead, build_now, retire_in_background
from .step_guard import StepGuard
from .support import plans_from_metadata, unlike_analytic
from .transformer_config import JobIntents, settings_at
from ..compat import stand_in_world
from ..compat.megatron_lm import set_last_rank

log = logging.getLogger("dynatrain")

# Megatron-LM's sample counters only a layout's ranks advance: agreed by B's at the switch
_AGREED_COUNTERS = ("consumed_valid_samples", "skipped_train_samples")

# ---------------------------------------------------------------------------- live state
@dataclass
class LoopObjects:
    """What Megatron-LM's `train()` holds and must rebind after a switch."""

    model: list
    optimizer: Any
    opt_param_scheduler: Any
    train_data_iterator: Any
    valid_data_iterator: Any
    config: Any
    test_data_iterator: Any = None
    changed: bool = False
    iteration: int = 0  # where the loop goes on (a rank back from standby catches up)
    stop: bool = False  # this rank was on standby when the job ended: leave the loop
    flops: Optional[float] = None  # floating-point operations so far, when a recovery reset them


_DATASET_PROVIDER: Optional[Callable] = None
_MODEL_PROVIDER: Optional[Callable] = None
_SESSION: Optional["MegatronLMSession"] = None


def register_dataset_provider(provider: Callable, args: Any = None,
                              model_provider: Optional[Callable] = None) -> None:
    """Called by the patched `pretrain()` before `train()`: the provider rebuilds the data
    iterators when a switch changes the data-parallel size or the pipeline stages that read
    data. It is also where a job we could not switch is refused: at start-up, before its
    first step, naming every flag (`args`: Megatron-LM's global args when not given).
    `model_provider`: what `pretrain()` was given (default: the script's own
    `model_provider` bound to its `gpt_builder`, `builder.script_model_provider`)."""
    global _DATASET_PROVIDER, _MODEL_PROVIDER
    if args is None:
        from megatron.training import get_args

        args = get_args()
    check_switchable(args)
    _DATASET_PROVIDER = provider
    _MODEL_PROVIDER = model_provider


def _model_provider() -> Callable:
    """The model provider B is built with (`register_dataset_provider`)."""
    from .builder import script_model_provider

    provider = _MODEL_PROVIDER or script_model_provider()
    if provider is None:
        raise DynatrainError("cannot find the script's model provider: pass model_provider= "
                             "to register_dataset_provider, or run pretrain_gpt.py")
    return provider


def check_switchable(args: Any) -> None:
    """Raise naming every Megatron-LM flag a switch cannot carry (`unsupported_args`; the
    patched script's parser refuses them already, `arguments.refuse_when_parsed`)."""
    problems = unsupported_args(args)
    if problems:
        raise DynatrainError("--dynatrain cannot switch this Megatron-LM job: "
                             + "; ".join(problems))


def wrap_megatron_groups(layout: Layout, order: Optional[str] = None):
    """Megatron-LM's `parallel_state` groups as our `ParallelGroups`, after checking that
    every group has the ranks `layout` gives it on its rank `order`'s placement (so the
    planner's idea of who holds what is Megatron-LM's). Creates no group.

    With several distributed-optimizer instances (`layout.doi` > 1) that includes the
    instance groups the optimizer shards and reduces over (`intra_dp_cp`, `intra_expt_dp`,
    `inter_dist_opt`, `intra_dist_opt`: `elastic.groups.optimizer_instance_groups`).
    The layout's own group (loss averaging, state gathers) is the default group: Megatron-LM
    starts on every process, and an instance (`intra_dist_opt`) spans only 1/doi of them."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    from ..elastic.groups import ParallelGroups, optimizer_instance_groups
    from ..vps.placement import DEFAULT_ORDER, megatron_rank_order

    pgc = ProcessGroupCollection.use_mpu_process_groups()
    rank = dist.get_rank()
    if layout.world_size != dist.get_world_size():
        raise DynatrainError(f"layout {layout} has {layout.world_size} ranks, but Megatron-LM "
                             f"runs on {dist.get_world_size()}")
    expected_groups = {name: layout.groups(axes) for name, axes in GROUP_AXES.items()}
    expected_groups.update(optimizer_instance_groups(layout))
    if layout.doi == 1:  # one instance: megatron-core shards over the whole DP groups
        expected_groups["intra_dp_cp"] = expected_groups["dp_cp"]
        expected_groups["intra_expt_dp"] = expected_groups["expt_dp"]
    mine: dict[str, list[int]] = {}
    wrong = []
    me = (placement := megatron_rank_order(layout, order or DEFAULT_ORDER)).virtual_rank(rank)
    for name, groups in expected_groups.items():
        group = getattr(pgc, name, None)
        expected = sorted(placement.devices[v] for v in next(g for g in groups if me in g))
        if group is None:
            if len(expected) > 1:
                wrong.append(f"{name}: Megatron-LM has none, {layout} needs {expected}")
            continue
        actual = sorted(dist.get_process_group_ranks(group))
        if actual != expected:
            wrong.append(f"{name}: Megatron-LM {actual}, {layout} {expected}")
        mine[name] = expected
    if wrong:
        raise DynatrainError(f"rank {rank}: Megatron-LM's process groups are not those of "
                             f"{layout} in rank order {order or DEFAULT_ORDER}: "
                             + "; ".join(wrong[:4]))
    for name in ("embd", "pos_embd"):
        g = getattr(pgc, name, None)
        if g is not None:
            mine[name] = sorted(dist.get_process_group_ranks(g))
    return ParallelGroups(layout=layout, placement=placement,
                          rank=rank, pg_collection=pgc, group_ranks=mine,
                          created=megatron_first_groups(), layout_group=dist.group.WORLD)


def megatron_first_groups() -> list:
    """Every process group Megatron-LM's `initialize_model_parallel` left in megatron-core's
    `parallel_state` globals (gloo twins included, the default group excluded), once
    each, in the order of the globals' names: the same order on every rank. They are
    handed to the first layout's `ParallelGroups` as its own, so a switch that releases
    that layout destroys them (every rank, together, after `install` pointed every
    global at B's groups); until then nothing changes. Without this they stayed in
    torch's group registry for the whole job."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    out, seen = [], set()
    for name, value in sorted(vars(ps).items()):
        if (name.startswith("_") and isinstance(value, dist.ProcessGroup)
                and value is not dist.group.WORLD and id(value) not in seen):
            seen.add(id(value))
            out.append(value)
    return out


def _prepare_config(args: Any, model: list, optimizer: Any, config: Any, old_config: Any) -> None:
    """Set the callbacks on the new model's config as Megatron-LM's `train()` does at its
    start (grad scaling, timers, no-sync / grad-sync / param-sync, grad finalisation)."""
    from megatron.core.distributed import finalize_model_grads

    def per_chunk(attr: str):
        fns = [getattr(m, attr) for m in model]
        return fns[0] if len(fns) == 1 else fns

    config.grad_scale_func = optimizer.scale_loss
    config.timers = getattr(old_config, "timers", None)
    config.no_sync_func = None
    config.grad_sync_func = None
    config.param_sync_func = None
    if arg_value(args, "overlap_grad_reduce", False):
        config.no_sync_func = per_chunk("no_sync")
        if arg_value(args, "align_grad_reduce", True):
            config.grad_sync_func = per_chunk("start_grad_sync")
    if arg_value(args, "overlap_param_gather", False) and arg_value(args, "align_param_gather", True):
        config.param_sync_func = per_chunk("start_param_sync")
    config.finalize_model_grads_func = finalize_model_grads


def _rebuild_data_iterators(args: Any, num_chunks: int) -> tuple[Any, Any, Any]:
    """Train/valid/test iterators for the current layout, as `pretrain()` builds them (one
    per virtual stage with VPP), positioned at `args.consumed_train_samples`."""
    if _DATASET_PROVIDER is None:
        raise DynatrainError("no dataset provider registered: the patched pretrain() calls "
                             "register_dataset_provider(); is the training.py patch applied?")
    from megatron.training.training import build_train_valid_test_data_iterators

    if arg_value(args, "virtual_pipeline_model_parallel_size") is None:
        return build_train_valid_test_data_iterators(_DATASET_PROVIDER)
    out: tuple[list, list, list] = ([], [], [])
    for vp_stage in range(num_chunks):
        provider = functools.partial(_DATASET_PROVIDER, vp_stage=vp_stage)
        if getattr(_DATASET_PROVIDER, "is_distributed", False):
            provider.is_distributed = True  # type: ignore[attr-defined]
        for lst, it in zip(out, build_train_valid_test_data_iterators(provider)):
            lst.append(it)
    return out


class MegatronLMSession:
    """The hook and our view of Megatron-LM's live objects, for one training run."""

    def __init__(self, args: Any, model: list, optimizer: Any, opt_param_scheduler: Any,
                 config: Any) -> None:
        import torch.distributed as dist

        from ..mcore.builders import TrainingObjects
        from .builder import MegatronLMBuilder
        from ..loop.hook import DynatrainHook
        from ..mcore.training import Trainer

        from ..elastic.communicators import ensure_control_group
        from ..elastic.groups import GroupOptions, set_group_options
        from ..loop.logs import configure

        configure(dist.get_rank(), arg_value(args, "dynatrain_log_all_ranks", False))
        check_switchable(args)
        ensure_control_group()  # the votes' CPU group (every rank starts its session here)
        # B's groups with the job's per-group NCCL options (elastic.groups.GroupOptions)
        set_group_options(GroupOptions.from_megatron_args(args))
        for note in performance_differences(args):
            log.warning("dynatrain: %s", note)
        self.args = args
        self.spec, self.train, layout = describe_job(args, dist.get_world_size())
        groups = wrap_megatron_groups(layout, rank_order_of(args))  # A's, in its rank order
        objs = TrainingObjects(layout=layout, groups=groups, config=config,
                               model=model, optimizer=optimizer, scheduler=opt_param_scheduler)
        metadata = plans_from_metadata(args)  # what the analytic layout does not describe
        if metadata:
            log.info("dynatrain: %s: switches are planned from every rank's live sharded "
                     "metadata", ", ".join(metadata))
        check_live_state(self.spec, self.train, objs, bool(metadata), unlike_analytic(args))
        self.trainer = Trainer(self.spec, self.train, objs,
                               consumed_samples=arg_value(args, "consumed_train_samples", 0))
        # B is built by Megatron-LM itself, from a copy of these args set to B (builder.py)
        self.intents = JobIntents.from_args(args)
        # B's data iterators, built in the background with B (data_ahead.py)
        self.data_ahead = DataAhead(args, self.spec, self.intents.sequence_parallel,
                                    lambda: self.hook.decision, _rebuild_data_iterators)
        self.hook = DynatrainHook.from_args(
            args, self.spec, self.train,
            builder=MegatronLMBuilder(self.spec, self.train, args=copy.copy(args),
                                      intents=self.intents, model_provider=_model_provider(),
                                      data_ahead=self.data_ahead,
                                      plan_from="metadata" if metadata else "analytic",
                                      unlike_analytic=unlike_analytic(args)))
        self.hook.controller.complete = self.hook.builder.complete_layout  # its split
        from .metrics import attach

        attach(self.hook)  # its TensorBoard/W&B writers and iteration timer (metrics.py)
        self.test_data_iterator: Any = None
        self.latest: Optional[LoopObjects] = None
        self.launch_layout = layout  # Megatron-LM's log line does not show a later one
        # the final iteration, once a peer died after train() (rank_death.recover_after_train)
        self.after_train: Optional[int] = None
        # what a rank death inside a train_step leaves behind, and its fault points
        self.guard = StepGuard(self.hook.fault_plans, vote=self.hook.rendezvous_dir is not None,
                               generation=lambda: self.hook.generation)
        log.info("dynatrain: wrapping Megatron-LM's %s job (%s); switches are polled every %d "
                 "iteration(s)", layout, self.spec.name, args.dynatrain_poll_interval)

    def begin(self, iteration: int) -> None:
        """Before the loop's first `train_step`, on every rank: the state Megatron-LM
        starts the loop with (iteration `iteration`: 0, or the loaded checkpoint's) is the
        first step boundary, so a peer that dies in the first step is recovered from it as
        from any later boundary (`begin_session`)."""
        t = self.trainer
        t.iteration = iteration
        t.consumed_samples = arg_value(self.args, "consumed_train_samples", t.consumed_samples)
        self.hook.start(t, t.objs.layout, t.objs.groups.placement)  # collective
        self.guard.at_boundary(iteration, t.objs)

    def step(self, iteration: int, loop: LoopObjects, ending: bool = False) -> LoopObjects:
        import torch.distributed as dist

        stand_in_world.use(None)  # the controller's and the switch's collectives: the world
        t = self.trainer
        if loop.model is not t.objs.model:
            raise DynatrainError("train() holds other objects than the last switch returned; "
                                 "is every rebinding of the training.py patch applied?")
        t.iteration = iteration
        t.consumed_samples = arg_value(self.args, "consumed_train_samples", t.consumed_samples)
        self.guard.at_boundary(iteration, t.objs)  # this rank's step completed
        self.data_ahead.note_step(iteration)
        old_config = t.objs.config
        before = t.objs
        if not ending:  # an exit decided by Megatron-LM: no new switch at the last step
            t = self.hook.after_step(t)
        if t is None:  # a scale-in left this rank out: on standby until one brings it back
            log.info("dynatrain: iteration %d: this rank is on standby", iteration)
            t = self.hook.standby()
            if t is None:  # the job ended while this rank was out
                self.trainer = None
                log.info("dynatrain: the job ended while this rank was on standby: it leaves "
                         "train() holding no training state")
                return dataclasses.replace(loop, iteration=arg_value(self.args, "train_iters",
                                                                iteration), stop=True)
            log.info("dynatrain: back from standby at iteration %d", t.iteration)
        self.trainer = t
        world = dist.get_world_size()
        out = self.hook.layout.world_size < world  # some processes are on standby
        if ending or t.iteration >= arg_value(self.args, "train_iters", t.iteration):
            # the last step: a switch still being prepared is cancelled, the ranks on
            # standby leave train()
            self.hook.end_job(t)
        self._log_layout(t.iteration, out, world)
        o = t.objs
        if o is not before:
            # A's iterators: their workers stop in a thread once B's first steps are
            # measured: processes exiting beside the switch's last agreement and B's first
            # step slowed both (docs/bench/stall.md)
            its = (loop.train_data_iterator, loop.valid_data_iterator, self.test_data_iterator)
            self.hook.stall.defer(lambda: retire_in_background(*its))
            self.rebind_loop(t, old_config)
            self.guard.at_boundary(t.iteration, o)
        if ending:  # train() exits with Megatron-LM's iterators: they go with its frames
            self.forget_iterators()
        # until the next call, Megatron-LM's code on this rank sees the layout as its world
        self.enter_layout_world()
        meter = self.hook.stall.switch_meter
        if meter is not None:  # B's first step starts now: the end of the stall's window
            meter.resume()
        return loop if o is before else self.latest

    def _log_layout(self, iteration: int, out: bool, world: int) -> None:
        """Beside Megatron-LM's iteration line (every `--log-interval`), which names no
        layout, rank 0 logs the one the job runs at once it is not the launch layout (and
        how many ranks are on standby): the log says at which layout each step ran."""
        import torch.distributed as dist

        lay = self.hook.layout
        if dist.get_rank() != 0 or not (out or lay != self.launch_layout):
            return
        if iteration % (arg_value(self.args, "log_interval", 1) or 1):
            return
        if out:
            log.info("dynatrain: iteration %d done at %s on %d of %d ranks (the others on "
                     "standby)", iteration, lay, lay.world_size, world)
        else:
            log.info("dynatrain: iteration %d done at %s", iteration, lay)

    def rebind_loop(self, t: Any, old_config: Any, flops: Optional[float] = None) -> LoopObjects:
        """After `t` got new objects (a switch, a recovery): Megatron-LM's `args`, the model
        config's callbacks and the data iterators follow them; returns what `train()`
        continues with (`old_config`: the model config `train()` had, for its timers;
        `flops`: the floating-point operations so far, when a checkpoint set them back)."""
        import torch.distributed as dist

        t0 = time.perf_counter()
        self.trainer = t
        o = t.objs
        self.args.consumed_train_samples = t.consumed_samples
        self.set_args_for(o.layout)
        set_last_rank(o.groups.placement.devices[-1])  # the last stage prints the loss
        _prepare_config(self.args, o.model, o.optimizer, o.config, old_config)
        t1 = time.perf_counter()
        # Megatron-LM's sample counters that only the layout's ranks advance (validation,
        # skipped train samples): a rank back from standby holds its last step's, so B's
        # ranks take the job's (the largest); its validation loader then starts where the
        # other stages' do. Agreed with the iterators built ahead, in one collective
        counters = {n: int(arg_value(self.args, n, 0) or 0) for n in _AGREED_COUNTERS}
        ahead, agreed = self.data_ahead.take(o.groups, t.consumed_samples, counters)
        for n, v in agreed.items():
            if hasattr(self.args, n):
                setattr(self.args, n, v)
        if ahead is not None:  # built in the background for exactly this switch
            train_it, valid_it, test_it = ahead
            self._note_prepared("data_iterators", self.data_ahead.last_seconds)
        else:  # every rank of B, its DataLoader workers all started (worker_start)
            def build() -> tuple:
                with stand_in_world.stand_in(_stand_in_world(o, dist.get_world_size())):
                    return tuple(_rebuild_data_iterators(self.args, len(o.model)))
            train_it, valid_it, test_it = build_now(o.groups, build)
        # the last iterators are dropped here: their worker processes end
        self.test_data_iterator = test_it
        self.latest = LoopObjects(o.model, o.optimizer, o.scheduler, train_it, valid_it,
                                  o.config, test_it, changed=True, iteration=t.iteration,
                                  flops=flops)
        meter = self.hook.stall.switch_meter  # the stall's parts (loop/stall.py)
        if meter is not None:
            meter.add_all({"rebind": t1 - t0, "data_iterators": time.perf_counter() - t1})
        return self.latest

    def _note_prepared(self, what: str, seconds: Optional[float]) -> None:
        """Add to the last switch's record what else was prepared in the background."""
        if self.hook.history and seconds is not None:
            self.hook.history[-1].prepared[what] = round(seconds, 4)

    def set_args_for(self, layout: Layout) -> None:
        """Megatron-LM's `args` describe `layout` (its loop, logging, data loaders and
        checkpointing read them), with the job's intents where validation decides by layout."""
        for k, v in args_for_layout(layout, self.spec, like=self.args,
                                    sequence_parallel=self.intents.sequence_parallel).items():
            setattr(self.args, k, v)
        for k, v in settings_at(self.args, layout, self.intents).items():
            setattr(self.args, k, v)

    def enter_layout_world(self) -> None:
        """Give Megatron-LM's code on this rank the current layout as its world (after a
        recovery, as `step` does after a switch)."""
        import torch.distributed as dist

        stand_in_world.use(_stand_in_world(self.trainer.objs, dist.get_world_size()))

    def forget_iterators(self) -> None:
        """Drop the session's references to the data iterators (Megatron-LM holds its own).
        A DataLoader's worker processes end when its last holder lets it go; one still held
        at interpreter exit is ended with SIGTERM, which the handler of
        `--exit-signal-handler`, inherited by the forked workers, swallows: exit hangs."""
        if self.latest is not None:
            self.latest = dataclasses.replace(self.latest, train_data_iterator=None,
                                              valid_data_iterator=None, test_data_iterator=None)
        self.test_data_iterator = None
        self.data_ahead.drop()


def _stand_in_world(objs: Any, world: int) -> Any:
    """The world Megatron-LM's code is given on a rank of `objs`'s layout: None (the real
    one) when the layout spans every process, else its ranks (`ParallelGroups`)."""
    if objs.layout.world_size == world:
        return None
    group = objs.groups.stand_in_world
    if group is None:
        raise DynatrainError(
            f"{objs.layout} runs on devices {list(objs.groups.placement.devices)} of {world} "
            f"processes: Megatron-LM's world collectives can be confined to a layout only on "
            f"the job's first ranks")
    return group


def dynatrain_step(args: Any, iteration: int, model: list, optimizer: Any,
                   opt_param_scheduler: Any, train_data_iterator: Any, valid_data_iterator: Any,
                   config: Any, ending: bool = False) -> LoopObjects:
    """The per-step call of the patched `train()`, on every rank, after the optimizer step,
    the iteration/consumed-samples accounting and `checkpoint_and_decide_exit`; `ending`:
    what that returned (Megatron-LM leaves the loop after this step: no switch starts, and
    ranks on standby are told the job is over).

    Returns the objects to continue with; `changed` is True after a switch, when the
    caller must also refresh `get_forward_backward_func()` and `get_num_microbatches()`;
    `stop` is True on a rank that was on standby when the job ended (leave the loop).
    """
    global _SESSION
    loop = LoopObjects(model, optimizer, opt_param_scheduler, train_data_iterator,
                       valid_data_iterator, config)
    if _SESSION is None:
        _SESSION = MegatronLMSession(args, model, optimizer, opt_param_scheduler, config)
    return _SESSION.step(iteration, loop, ending)


def begin_session(args: Any, iteration: int, model: list, optimizer: Any,
                  opt_param_scheduler: Any, config: Any) -> "MegatronLMSession":
    """The patched loop's first `train_step` call, on every rank, before the step runs:
    start the session on the objects Megatron-LM built (or loaded), at `iteration`, so
    that a death inside the first step (before any `dynatrain_step`) is recovered like
    one in a later step (`MegatronLMSession.begin`). Later calls return the session."""
    global _SESSION
    if _SESSION is None:
        session = MegatronLMSession(args, model, optimizer, opt_param_scheduler, config)
        _SESSION = session
        session.begin(iteration)
    return _SESSION


def finish_training(model: list, optimizer: Any, opt_param_scheduler: Any,
                    train_data_iterator: Any, valid_data_iterator: Any,
                    test_data_iterator: Any, config: Any) -> tuple:
    """Called by the patched `pretrain()` after `train()` returns: the objects the loop
    ended with (the caller's are released if a switch happened) and the switch summary."""
    import torch.distributed as dist

    s = _SESSION
    if s is None or s.trainer is None:  # no session, or on standby at the end (left_out)
        return (model, optimizer, opt_param_scheduler, train_data_iterator,
                valid_data_iterator, test_data_iterator, config)
    s.hook.finish(s.trainer)
    o = s.trainer.objs
    with stand_in_world.real_world():
        world = dist.get_world_size()
    if o.layout.world_size < world:
        log.info("dynatrain: the job ends at %s on ranks 0..%d; the other %d are on standby "
                 "and leave: Megatron-LM's final save, validation and test run on the "
                 "layout's ranks as its world", o.layout, o.layout.world_size - 1,
                 world - o.layout.world_size)
    if s.latest is None:
        return (model, optimizer, opt_param_scheduler, train_data_iterator,
                valid_data_iterator, test_data_iterator, config)
    last = s.latest
    out = (o.model, o.optimizer, o.scheduler, last.train_data_iterator,
           last.valid_data_iterator, s.test_data_iterator, o.config)
    s.forget_iterators()
    return out


def left_out() -> bool:
    """True on a process that was on standby when the job ended: it holds no training
    state, so the patched `pretrain()` returns before its final save, validation and test
    (the layout's ranks run them among themselves)."""
    return _SESSION is not None and _SESSION.trainer is None


def current_session() -> Optional["MegatronLMSession"]:
    """The session of this process (None before the first `dynatrain_step`)."""
    return _SESSION


def reset_session() -> None:
    """Forget the session and the dataset provider (tests, in-process restarts)."""
    global _SESSION, _DATASET_PROVIDER, _MODEL_PROVIDER
    stand_in_world.use(None)
    _SESSION = None
    _DATASET_PROVIDER = None
    _MODEL_PROVIDER = None


__all__: Iterable[str] = (
    "LoopObjects", "MegatronLMSession", "begin_session", "check_switchable", "current_session",
    "dynatrain_step", "finish_training", "left_out", "register_dataset_provider", "reset_session",
    "wrap_megatron_groups",
)
