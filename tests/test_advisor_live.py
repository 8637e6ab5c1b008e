"""The advisor against live megatron-core jobs (issue 18): for tiny-gpt and tiny-moe on 4
and 8 gloo ranks, every suggested layout builds and trains one step, and the advisor's
exact state bytes equal the live per-rank storages byte for byte (one spawned group per
world size for all its layouts)."""
import pytest

from dynatrain_megatron.advisor import SearchSpace, Workload, suggest
from dynatrain_megatron.testing.multiproc import run_on_ranks
from dynatrain_megatron.configs import load_model as resolve_model
from advisor_cases import train_and_measure

pytestmark = pytest.mark.multirank

TOP = 3
# CPU: megatron-core's local attention has no context parallelism (needs Transformer Engine)
CPU = SearchSpace(context_parallel=False)
WORK = Workload(micro_batch_size=2, global_batch_size=8, seq_length=32)
# state checks beyond the suggestions: bf16 weights (separate fp32 main params),
# several DDP buckets (bucket padding), expert parallelism
EXTRA = {4: [("tiny-gpt+bf16", "tp2pp1dp2", {"ddp_bucket_size": 3000,
                                             "overlap_grad_reduce": True}),
             ("tiny-moe", "tp2pp1ep2etp1dp2", {})],
         8: [("tiny-moe", "tp1pp2ep4etp1dp4", {"ddp_bucket_size": 3000,
                                                "overlap_grad_reduce": True})]}


def suggested(world: int) -> list[tuple[str, str, dict]]:
    cases = []
    for model in ("tiny-gpt", "tiny-moe"):
        s = suggest(resolve_model(model), world, WORK, space=CPU, top=TOP)
        cases += [(model, str(r.layout), {}) for r in s.rows]
    return cases


@pytest.fixture(scope="module", params=[4, 8], ids=lambda w: f"{w}ranks")
def live(request):
    world = request.param
    cases = suggested(world) + EXTRA[world]
    return world, cases, run_on_ranks(train_and_measure, world, cases)


def test_suggested_layouts_train_and_state_bytes_are_exact(live):
    world, cases, per_rank = live
    assert len(cases) == 2 * TOP + len(EXTRA[world])
    for i, (model, layout, _) in enumerate(cases):
        rows = [r[i] for r in per_rank]
        for r, row in enumerate(rows):
            assert row["layout"] == layout and row["model"] == model
            assert row["finite"] and row["stepped"], row
            assert row["live"] == row["predicted"], (model, layout, r, row)
        # every rank of a layout reports the same loss (one global loss per step)
        assert len({row["loss"] for row in rows}) == 1, rows
