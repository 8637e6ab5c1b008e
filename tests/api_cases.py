"""The public API inside spawned gloo ranks (imported by name in the children): one group
checks every call (tests/test_api.py asserts on what it returns)."""
from __future__ import annotations

import torch.distributed as dist

from rank_cases import gather_layout_state, spec_variant, switch_train_config
from rank_checks import all_ranks, layout_bytes, rng_states, same_rng

A, G, G2, B, C = "tp2pp2dp1", "tp4pp1dp1", "tp2pp1dp2", "tp1pp4dp1", "tp2pp1dp2"
F = "tp1pp1dp4"  # a switch to F fails on rank 1 before its commit (FAULTS)
FAULTS = '{"fail_rank": 1, "fail_phase": "commit", "dst_layout": "%s"}' % F
PROMPTS, NUM_TOKENS = ("The quick brown fox", "Hello"), 4


def _scalars(objs) -> tuple:
    from dynatrain_megatron.adapters.live import read_optimizer_step

    return read_optimizer_step(objs.optimizer), objs.scheduler.state_dict()








def _at_weights(s, gen, full_before) -> dict:
    """The weights at the generation layout against the training state's weights: every
    replica bit for bit, and nothing else held there."""
    from dynatrain_megatron.adapters.live import LiveState
    from dynatrain_megatron.testing import gather as G_
    from dynatrain_megatron.vps import Layout

    layout = Layout.parse(gen.layout, dist.get_world_size())
    vr = gen.placement.index(dist.get_rank())
    live = LiveState(gen.model, None, vr, s.vocab_size)
    full = G_.broadcast_full_state(full_before)
    params = {k: v for k, v in full.items() if k[0] == "param"}
    bad = G_.mismatches_against(live, params, ("param",))
    # bare model chunks: no DDP wrapper, no gradient buffer, no optimizer
    wrapped = any(hasattr(m, "ddp_config") or hasattr(m, "buffers_") for m in gen.model)
    return dict(layout=str(layout), mismatches=all_ranks(not bad), wrapped=wrapped,
                bytes_moved=gen.bytes_moved, parked=gen.parked_bytes)


def api_cases(root: str) -> dict:
    from dynatrain_megatron import ElasticJob, SwitchAborted  # the package's lazy exports
    from dynatrain_megatron.adapters.offload import optimizer_storages
    from dynatrain_megatron.api_types import ApiError
    from dynatrain_megatron.adapters.live import storage_fingerprint
    from dynatrain_megatron.mcore.builders import MegatronBuilder
    from dynatrain_megatron.mcore.session import release, start_job
    from dynatrain_megatron.testing import gather as G_
    from dynatrain_megatron.generation import byte_tokenizer, generate_greedy
    from dynatrain_megatron.mcore import dist_ckpt
    from dynatrain_megatron.vps.errors import LayoutError
    import os

    ckpt = os.path.join(root, "weights-at-a")

    s = spec_variant("tiny-gpt")
    train = switch_train_config()
    out: dict = {}
    # the reference: a job that never leaves A
    ref = start_job(s, A, train)
    out["ref_losses"] = [ref.step().loss for _ in range(5)]
    ref_state = gather_layout_state(s, ref)
    release(ref.objs)

    tr = start_job(s, A, train)
    losses = [tr.step().loss for _ in range(3)]
    job = ElasticJob.from_objects(tr.objs, MegatronBuilder(s, train))
    info = job.current()
    out["current"] = (info.layout, info.placement, info.virtual_rank == dist.get_rank(),
                      info.weights_at)
    # bad requests: one-line errors, nothing touched
    fp = storage_fingerprint(tr.objs.model, tr.objs.optimizer)
    errors = {}
    for name, call in (("layers", lambda: job.plan("tp1pp4vpp2dp1")),
                       ("world", lambda: job.switch("tp8pp1dp1")),
                       ("place", lambda: job.weights_to(G, optimizer="disk")),
                       ("back", lambda: job.weights_back())):
        try:
            call()
            errors[name] = None
        except (ApiError, LayoutError) as e:
            errors[name] = (type(e).__name__, str(e))
    out["errors"] = errors
    out["untouched_by_errors"] = storage_fingerprint(tr.objs.model, tr.objs.optimizer) == fp

    # -- weights only, optimizer kept on the devices; the weights saved for the reference
    dist_ckpt.save(tr.objs, tr.iteration, tr.consumed_samples, ckpt)
    before = gather_layout_state(s, tr)
    scalars, rng = _scalars(tr.objs), rng_states()
    plan_w = job.plan(G, weights_only=True)
    gen = job.weights_to(G, optimizer="keep")
    rng_at_g = rng_states()
    out["gen_keep"] = generate_greedy(gen.model, gen.pg_collection, byte_tokenizer(), PROMPTS,
                                      NUM_TOKENS).tokens
    out["gen_rng_kept"] = same_rng(rng_at_g, rng_states())
    out["plan_w"] = (plan_w.kinds, plan_w.bytes_moved, plan_w.lower_bound_bytes,
                     plan_w.estimated_seconds > 0)
    out["keep"] = _at_weights(s, gen, before)
    out["keep"]["current"] = job.current().weights_at
    try:
        job.switch(B)
        out["keep"]["switch_refused"] = None
    except ApiError as e:
        out["keep"]["switch_refused"] = str(e)
    out["keep"]["optimizer_untouched"] = storage_fingerprint(tr.objs.model,
                                                             tr.objs.optimizer) == fp
    gen_bytes = layout_bytes(gen.model, None)
    job.weights_back()
    # G's chunks are freed in place though `gen` still holds them
    out["keep"]["gen_freed"] = all_ranks(gen_bytes > 0 and layout_bytes(gen.model, None) == 0)
    after = gather_layout_state(s, tr)
    out["keep"]["state_diff"] = None if before is None else G_.states_equal(before, after)
    out["keep"]["scalars"] = _scalars(tr.objs) == scalars
    out["keep"]["rng"] = same_rng(rng, rng_states())

    # -- weights only, optimizer parked in host memory: the example's loop, one round
    storages = optimizer_storages(tr.objs.optimizer, tr.objs.model)
    held = sum(st.nbytes() for st in storages)

    rounds: list[dict] = []

    def at_generation(gen):
        r = _at_weights(s, gen, before)
        r["emptied"] = all_ranks(all(st.nbytes() == 0 for st in storages) and held > 0)
        r["parked_all"] = all_ranks(gen.parked_bytes == held)
        r["chunk"] = id(gen.model[0])
        r["build_s"] = dict(gen.phases).get("build")
        rounds.append(r)

    # two rounds (no training between): the second reuses the first's chunks at G2
    gens = _example().rlhf_loop(tr, job, rounds=2, train_steps=0, gen_layout=G2,
                                prompts=PROMPTS, num_tokens=NUM_TOKENS, optimizer="host",
                                at_generation=at_generation)
    out["host"] = rounds[0]
    out["host_reused"] = dict(same_chunks=rounds[1]["chunk"] == rounds[0]["chunk"],
                              mismatches=rounds[1]["mismatches"],
                              emptied=rounds[1]["emptied"], build_s=rounds[1]["build_s"],
                              bytes_moved=(rounds[0]["bytes_moved"], rounds[1]["bytes_moved"]))
    out["gen_host"] = [g.tokens for g in gens]
    after = gather_layout_state(s, tr)
    out["host"]["state_diff"] = None if before is None else G_.states_equal(before, after)
    out["host"]["scalars"] = _scalars(tr.objs) == scalars
    out["host"]["rng"] = same_rng(rng, rng_states())

    # -- a switch that fails on one rank (FAULTS): every rank rolls back, state untouched
    aborted = {}
    for name, call in (("switch", lambda: job.switch(F, iteration=3, consumed_samples=24)),
                       ("weights", lambda: job.weights_to(F, optimizer="host"))):
        try:
            call()
            aborted[name] = None
        except SwitchAborted as e:
            aborted[name] = str(e)
    state = gather_layout_state(s, tr)
    out["aborted"] = dict(reasons=aborted, at=(job.current().layout, job.current().weights_at),
                          diff=None if before is None else G_.states_equal(before, state),
                          scalars=_scalars(tr.objs) == scalars, rng=same_rng(rng, rng_states()))

    # training goes on as if the job had never left A
    losses += [tr.step().loss for _ in range(2)]
    out["losses"] = losses
    state = gather_layout_state(s, tr)
    out["vs_never_left"] = None if state is None else G_.states_equal(ref_state, state)

    # -- a whole-state switch, planned first
    plan = job.plan(B)
    before, scalars = gather_layout_state(s, tr), _scalars(tr.objs)
    old = (list(tr.objs.model), tr.objs.optimizer)  # held across the switch, as a loop would
    old_bytes = layout_bytes(*old)
    sw = job.switch(B, iteration=tr.iteration, consumed_samples=tr.consumed_samples)
    old_freed = all_ranks(old_bytes > 0 and layout_bytes(*old) == 0)
    del old
    tr.rebind(job.objects)
    after = gather_layout_state(s, tr)
    out["switch"] = dict(layout=sw.layout, plan=(plan.bytes_moved, plan.lower_bound_bytes,
                                                 plan.placement, plan.rounds),
                         done=(sw.bytes_moved, sw.lower_bound_bytes, sw.placement),
                         iteration=(sw.iteration, sw.consumed_samples),
                         objects=sw.model is tr.objs.model and sw.optimizer is tr.objs.optimizer,
                         diff=None if before is None else G_.states_equal(before, after),
                         scalars=_scalars(tr.objs) == scalars,
                         current=job.current().layout, background=sw.prepared_in_background,
                         old_freed=old_freed)
    tr.step()

    # -- prepared in the background while training, then switched
    p = job.prepare(C)
    steps = 0
    while True:
        tr.step()
        steps += 1
        if p.ready():
            break
    before, scalars = gather_layout_state(s, tr), _scalars(tr.objs)
    sw = job.switch(C, iteration=tr.iteration, consumed_samples=tr.consumed_samples,
                    preparation=p)
    tr.rebind(job.objects)
    after = gather_layout_state(s, tr)
    out["prepared"] = dict(layout=sw.layout, steps=steps, background=sw.prepared_in_background,
                           diff=None if before is None else G_.states_equal(before, after),
                           scalars=_scalars(tr.objs) == scalars)
    # a preparation cancelled: nothing changes
    p = job.prepare(A)
    fp = storage_fingerprint(tr.objs.model, tr.objs.optimizer)
    p.cancel()
    out["cancelled"] = (job.current().layout,
                        storage_fingerprint(tr.objs.model, tr.objs.optimizer) == fp)
    tr.step()
    release(tr.objs)

    # the reference generation: megatron-core's engine on a job restarted at G from the
    # checkpoint of the weights generated from
    ref = start_job(s, G, train)
    dist_ckpt.load(ref.objs, ckpt)
    out["gen_ckpt"] = generate_greedy(ref.objs.model, ref.objs.groups.pg_collection,
                                      byte_tokenizer(), PROMPTS, NUM_TOKENS).tokens
    release(ref.objs)
    return out


def _example():
    """examples/rlhf_loop.py, as the example's users run it."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "rlhf_loop.py"
    spec = importlib.util.spec_from_file_location("rlhf_loop_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
