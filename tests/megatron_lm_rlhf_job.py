"""A Megatron-LM job for tests/test_megatron_lm_rlhf.py (run by torchrun's ranks with
Megatron-LM's flags, like pretrain_gpt.py): the RLHF example's loop
(examples/rlhf_megatron_lm.py) on Megatron-LM's own training objects, beside a twin built
from the same seeds that never leaves layout A, with the checks the test asserts on. Rank 0
writes them to `$RLHF_RESULT` (JSON); `$RLHF_WORK` holds the weights' checkpoint.

One job checks: the twins start equal; at G every replica of every weight is A's, the
chunks are bare (no DDP, no optimizer) and the optimizer state is parked, not copied (its
device storages are empty, the parked bytes are all it held); after the last weights-only
round trip the full state is what it was; G's chunks are reused by the next round; after train -> generate -> train the full state,
the optimizer step, the scheduler and the RNGs equal the twin's, and so do the losses;
round 0's tokens equal megatron-core's generation at G from a `dist_checkpointing`
checkpoint of the same weights, loaded into chunks built at G.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from rank_checks import all_ranks, rng_states, same_rng  # noqa: E402 (tests/, this script's)







def _unwrap(chunk):
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


class _Recording:
    """A training whose steps' losses are kept."""

    def __init__(self, training) -> None:
        self.training = training
        self.losses: list[float] = []

    def step(self):
        s = self.training.step()
        self.losses.append(s.loss)
        return s


def main() -> int:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.training import get_args

    import rlhf_megatron_lm as ex
    from dynatrain_megatron.adapters.live import LiveState, read_optimizer_step
    from dynatrain_megatron.adapters.offload import optimizer_storages
    from dynatrain_megatron.elastic.groups import build_groups
    from dynatrain_megatron.generation import byte_tokenizer, generate_greedy
    from dynatrain_megatron.loop.switching import RngSnapshot
    from dynatrain_megatron.mcore.session import release
    from dynatrain_megatron.testing import gather as G_
    from dynatrain_megatron.vps.layout import Layout

    t_start = time.perf_counter()
    gpt = ex.start_megatron_lm()
    args = get_args()
    gen_layout, rounds, steps = args.rlhf_generate, args.rlhf_rounds, args.rlhf_train_steps
    num_tokens = args.rlhf_num_tokens
    work = Path(os.environ["RLHF_WORK"])
    rank = dist.get_rank()
    out: dict = {}

    # twins: Megatron-LM's objects built twice from the same RNG states
    rng0 = RngSnapshot.take()
    ref = ex.MegatronLMTraining(gpt)
    rng0.restore()
    tr = ex.MegatronLMTraining(gpt)
    job = ex.elastic_job_of(tr)
    spec = job.builder.spec
    vr = job.current().virtual_rank

    def state(t):
        return G_.gather_full_state(LiveState(t.model, t.optimizer, vr, spec.vocab_size), spec,
                                    dst=0)

    def diff(a, b):
        return None if a is None else G_.states_equal(a, b)

    out["twins_equal"] = diff(state(ref), state(tr))

    # the job that never leaves A
    start = RngSnapshot.take()
    ref_losses = [ref.step().loss for _ in range(rounds * steps + 2)]
    ref_state, ref_rng = state(ref), rng_states()
    ref_scalars = (read_optimizer_step(ref.optimizer), ref.scheduler.state_dict())
    start.restore()

    # the example's loop, checked at A before each round and at G
    before: dict = {}
    at_g: list = []
    storages = optimizer_storages(tr.optimizer, tr.model)
    held = sum(s.nbytes() for s in storages)

    def before_generation(r: int) -> None:
        if r == 0:  # the weights round 0 generates from, as a checkpoint
            if rank == 0:
                (work / "weights").mkdir()
            dist.barrier()
            dist_checkpointing.save(_unwrap(tr.model[0]).sharded_state_dict(),
                                    str(work / "weights"))
        before[r] = (state(tr), rng_states(), read_optimizer_step(tr.optimizer),
                     tr.scheduler.state_dict())

    def at_generation(gen) -> None:
        full = G_.broadcast_full_state(before[len(at_g)][0])
        live = LiveState(gen.model, None, gen.placement.index(rank), spec.vocab_size)
        bad = G_.mismatches_against(live, {k: v for k, v in full.items() if k[0] == "param"},
                                    ("param",))
        at_g.append(dict(
            layout=gen.layout, weights_equal=all_ranks(not bad),
            bare=all_ranks(not any(hasattr(m, "ddp_config") for m in gen.model)),
            emptied=all_ranks(held > 0 and all(s.nbytes() == 0 for s in storages)),
            parked_all=all_ranks(gen.parked_bytes == held), bytes_moved=gen.bytes_moved,
            pause_s=gen.pause_seconds, chunk=id(gen.model[0])))

    def after_round(r: int) -> dict:
        st, rng, step, sched = before[r]
        return dict(state=diff(st, state(tr)), rng=all_ranks(same_rng(rng, rng_states())),
                    scalars=all_ranks(read_optimizer_step(tr.optimizer) == step
                                 and tr.scheduler.state_dict() == sched))

    rec = _Recording(tr)
    t0 = time.perf_counter()
    # G's chunks are built in round 0 and kept for the next rounds (weights_back(keep=True))
    gens = ex.run_rounds(rec, job, args, at_generation=at_generation,
                         before_generation=before_generation)
    after = after_round(rounds - 1)  # the last round trip, before training on
    loop_s = time.perf_counter() - t0
    rec.step()
    rec.step()
    out.update(
        at_g=at_g, after_last_round=after, losses=rec.losses, ref_losses=ref_losses,
        vs_never_left=diff(ref_state, state(tr)),
        rng_vs_never_left=all_ranks(same_rng(ref_rng, rng_states())),
        scalars_vs_never_left=all_ranks((read_optimizer_step(tr.optimizer),
                                    tr.scheduler.state_dict()) == ref_scalars),
        tokens=[list(map(list, g.tokens)) for g in gens], loop_s=loop_s)

    # megatron-core's generation at G from the checkpoint of round 0's weights, in chunks
    # built at G (Megatron-LM's model provider) and loaded by dist_checkpointing
    layout = Layout.parse(gen_layout, dist.get_world_size())
    groups = build_groups(layout)
    objs = job.builder.build_weights_detached(layout, groups)
    job.builder.activate(objs)
    chunk = _unwrap(objs.model[0])
    loaded = dist_checkpointing.load(chunk.sharded_state_dict(), str(work / "weights"))
    result = chunk.load_state_dict(loaded, strict=False)
    out["ckpt_missing"] = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    out["ckpt_tokens"] = list(map(list, generate_greedy(
        objs.model, groups.pg_collection, byte_tokenizer(), ex.PROMPTS, num_tokens).tokens))
    release(objs)
    out["job_s"] = time.perf_counter() - t_start
    if rank == 0:
        Path(os.environ["RLHF_RESULT"]).write_text(json.dumps(out, default=str))
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
