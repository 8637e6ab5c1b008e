"""Rank functions of test_hostile_live.py (imported by name in the spawned children)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist

from dynatrain_megatron.mcore.session import release, start_job

from rank_cases import spec_variant, switch_train_config

VALID = {"layout": "tp1pp2dp2", "world": 4}


def _hostile_writes(sig: Path, outside: Path) -> list:
    """One hostile object per poll (rank 0 writes it after the step, before the hook)."""
    victim = outside / "victim.json"

    def raw(data: bytes, mode: int = 0o600):
        def w():
            sig.write_bytes(data)
            os.chmod(sig, mode)
        return w

    state: dict = {}

    def partial():
        state["fd"] = os.open(sig, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(state["fd"], json.dumps(VALID).encode()[:12])

    return [
        lambda: os.symlink(victim, sig),
        lambda: os.mkfifo(sig, 0o600),
        lambda: os.mkdir(sig, 0o700),
        raw(json.dumps(VALID).encode(), 0o660),
        partial,
        raw(b'{"layout": "tp1\xff\xfepp2"}'),
        raw(b'{"layout": ' + b"[" * 30000 + b"]" * 30000 + b"}"),
        raw(b'{"layout": "tp1pp2", "world": ' + b"9" * 5000 + b"}"),
        raw(json.dumps({"layout": "tp1pp4dp1", "world": True}).encode()),
        raw(json.dumps({"layout": "tp2cp2pp1", "world": 4}).encode()),
        raw(json.dumps({"layout": "tp1pp3ppf2ppl2", "world": 3}).encode()),
        raw(json.dumps({"layout": "tp1etp2pp2", "world": 4}).encode()),
        raw(b'{"layout": "tp1pp2", "layout": "tp4pp1"}'),
        raw(b"x" * (100 * 1024)),
    ], state


def hostile_live_case(root: str) -> dict:
    """A 4-rank tiny job: (1) the same steps with no request, (2) with one hostile signal
    file per poll, (3) a schedule whose second entry falls while the first switch is
    pending, (4) megatron-core builds of a sample of layouts (test_validate.py's oracle)."""
    from dynatrain_megatron.elastic.controller import Controller
    from dynatrain_megatron.mcore.builders import validator_options
    from dynatrain_megatron.loop.hook import DynatrainHook

    s = spec_variant("tiny-gpt")
    train = switch_train_config()
    rank = dist.get_rank()
    root_p = Path(root)
    sig_dir, outside = root_p / "sig", root_p / "outside"
    out: dict = {}
    writes, state = _hostile_writes(sig_dir / "switch.json", outside)
    steps = len(writes) + 1

    tr = start_job(s, "tp2pp2dp1", train)
    out["plain_losses"] = [tr.step().loss for _ in range(steps)]
    release(tr.objs)

    tr = start_job(s, "tp2pp2dp1", train)
    ctl = Controller(s, str(sig_dir / "switch.json"),
                     check_options=lambda lay: validator_options(train, lay))
    hook = DynatrainHook(s, train, ctl, ranks_per_node=4)
    losses = []
    for i in range(steps):
        losses.append(tr.step().loss)
        if rank == 0 and i < len(writes):
            writes[i]()
        tr = hook.after_step(tr)
        if rank == 0 and "fd" in state:  # the partial writer finishes after the poll
            os.write(state["fd"], json.dumps(VALID).encode()[12:])
            os.close(state.pop("fd"))
    out["hostile"] = dict(losses=losses, layout=str(tr.objs.layout), rejected=hook.rejected,
                          history=len(hook.history))
    release(tr.objs)

    tr = start_job(s, "tp2pp2dp1", train)
    ctl = Controller(s, None, schedule=[(2, "tp1pp2dp2"), (3, "tp2pp1dp2")],
                     check_options=lambda lay: validator_options(train, lay))
    hook = DynatrainHook(s, train, ctl, ranks_per_node=4)
    hook.start(tr, tr.objs.layout, tr.objs.groups.placement)
    for _ in range(8):
        tr.step()
        tr = hook.after_step(tr)
    out["schedule"] = dict(layout=str(tr.objs.layout),
                           switches=[(h.iteration, h.src, h.dst) for h in hook.history])
    release(tr.objs)
    return out


def build_probe(cases: list[tuple[str, str, int]]) -> list[dict]:
    """For each (model, layout, world): does megatron-core build it (groups, model, DDP,
    optimizer, one training step) and do the live fragments equal the analytic layout's?
    Built past this package's validator, on the first `world` ranks (the rest standby)."""
    from dynatrain_megatron.adapters.live import LiveState
    from dynatrain_megatron.elastic.groups import build_groups
    from dynatrain_megatron.mcore import builders
    from dynatrain_megatron.mcore.builders import MegatronBuilder, bucket_size_of
    from dynatrain_megatron.mcore.training import Trainer
    from dynatrain_megatron.vps import analytic_layout
    from dynatrain_megatron.vps.layout import Layout
    from dynatrain_megatron.vps.placement import Placement

    import torch
    from rank_cases import ids

    builders.validate_layout = lambda *a, **k: None  # megatron-core itself is the judge
    train = switch_train_config()
    out = []
    for model, text, world in cases:
        s = spec_variant(model)
        lay = Layout.parse(text, world)
        groups = build_groups(lay, Placement(tuple(range(world))))
        ok, why, objs = 1, "", None
        if groups.virtual_rank is not None:
            try:
                objs = MegatronBuilder(s, train).build(lay, groups)
            except Exception as e:  # noqa: BLE001 - the verdict
                ok, why = 0, f"{type(e).__name__}: {e}"[:300]
        flag = torch.tensor([ok])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item() and objs is not None:
            try:
                Trainer(s, train, objs).step()
                live = LiveState(objs.model, objs.optimizer, groups.virtual_rank, s.vocab_size)
                an = analytic_layout(s, lay, bucket_size_of(train, lay))
                if ids(live.fragments()) != ids(an.fragments(groups.virtual_rank)):
                    ok, why = 0, "live fragments differ from the analytic layout"
            except Exception as e:  # noqa: BLE001
                ok, why = 0, f"{type(e).__name__}: {e}"[:300]
        flag = torch.tensor([ok if flag.item() else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        out.append(dict(model=model, layout=text, world=world, built=bool(flag.item()),
                        why=why))
        if objs is not None:
            release(objs)
        else:
            groups.destroy()
    return out


def live_and_probe(root: str, cases: list[tuple[str, str, int]]) -> dict:
    """One spawned group for both (spawning costs seconds on 2 cores)."""
    res = hostile_live_case(root)
    res["probe"] = build_probe(cases)
    return res
