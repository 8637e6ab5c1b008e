"""Recovery analysis (issue: Transactional switching, rank failures): exactly which state
only the dead devices hold."""
import pytest

from dynatrain_megatron.routing.lost_state import lost_state, subtract
from dynatrain_megatron.vps import Layout, analytic_layout
from dynatrain_megatron.vps.box import Box
from dynatrain_megatron.vps.fragment import OPT_KINDS
from dynatrain_megatron.vps.model_spec import ModelSpec
from pathlib import Path

SPEC = ModelSpec.from_yaml(Path(__file__).parent.parent / "configs/models/tiny-gpt.yaml")


def test_subtract_partitions_the_difference():
    a, b = Box((0, 0), (4, 6)), Box((1, 2), (2, 2))
    parts = subtract(a, b)
    assert sum(p.numel for p in parts) == a.numel - b.numel
    for i, p in enumerate(parts):
        assert p.intersect(b) is None
        assert all(p.intersect(q) is None for q in parts[i + 1:])


def test_dead_rank_with_dp_replica_loses_only_its_optimizer_shards():
    lay = Layout.parse("tp2pp2dp2", 8)
    rep = lost_state(SPEC, lay, [3])
    assert rep.weights_recoverable and not rep.recoverable
    assert rep.lost_elements["param"] == 0
    assert rep.lost_elements == _oracle(lay, [3])
    # all of it is rank 3's, and most of rank 3's optimizer shards (all but the shards of
    # TP-replicated tensors such as norms, which its TP twin also holds)
    mine = analytic_layout(SPEC, lay).fragments(3, OPT_KINDS)
    assert all(any(f.key == b.key and f.kind == b.kind and f.box.contains(b.box) for f in mine)
               for b in rep.lost)
    assert 0.9 * sum(f.box.numel for f in mine) < sum(rep.lost_elements.values())
    assert "the only copy of" in rep.describe()


def _oracle(lay, dead):
    """Element by element: covered by a dead device and by no surviving one."""
    import numpy as np

    an = analytic_layout(SPEC, lay)
    shapes = {t.key: t.shape for t in an.logical_tensors}
    live, gone = {}, {}
    for r in range(lay.world_size):
        for f in an.fragments(r):
            m = (gone if r in dead else live).setdefault((f.kind, f.key),
                                                         np.zeros(shapes[f.key], bool))
            m[f.box.slices()] = True
    out = {}
    for (kind, key), m in gone.items():
        other = live.get((kind, key), np.zeros_like(m))
        out[kind] = out.get(kind, 0) + int((m & ~other).sum())
    return out


def test_partial_distributed_optimizer_keeps_every_shard_of_a_dead_rank():
    """With two optimizer instances every shard has a replica in the other instance: one
    dead rank loses nothing, the oracle agrees; two dead replicas of a shard lose it."""
    lay = Layout.parse("tp1pp2doi2dp2", 4)
    rep = lost_state(SPEC, lay, [3])
    assert rep.recoverable and _oracle(lay, [3]) == {k: 0 for k in rep.lost_elements}
    assert "no state that is not replicated" in rep.describe()
    both = lost_state(SPEC, lay, [2, 3])  # dp 0 and dp 1 of the second stage (tp-dp-pp)
    assert not both.recoverable and both.lost_elements == _oracle(lay, [2, 3])
    assert both.lost_elements["param"] > 0


def test_both_dp_replicas_dead_loses_weights_too():
    lay = Layout.parse("tp2pp2dp2", 8)
    # dp replicas of the same (tp, pp) coordinates: rank 1 and rank 1 + tp (megatron order tp-dp-pp)
    c1 = lay.coords(1)
    twin = next(r for r in range(8) if r != 1 and (lay.coords(r).tp, lay.coords(r).pp) == (c1.tp, c1.pp))
    rep = lost_state(SPEC, lay, [1, twin])
    assert not rep.weights_recoverable
    assert rep.lost_elements["param"] > 0
    assert rep.lost_elements == _oracle(lay, [1, twin])


def test_unknown_device_is_refused():
    with pytest.raises(ValueError, match="not part of"):
        lost_state(SPEC, Layout.parse("tp2pp2dp1", 4), [7])


def test_cli_names_lost_tensors_and_refuses_unknown_devices(capsys):
    from dynatrain_megatron.cli import main

    model = str(Path(__file__).parent.parent / "configs/models/tiny-gpt.yaml")
    assert main(["lost", "--model", model, "--layout", "tp2pp2dp2", "--world", "8",
                 "--dead", "3"]) == 0
    out = capsys.readouterr().out
    assert "the only copy of exp_avg" in out and "optimizer state lost" in out
    assert main(["lost", "--model", model, "--layout", "tp2pp2dp1", "--world", "4",
                 "--dead", "9"]) == 2
    assert "outside the world of 4 ranks" in capsys.readouterr().err


def test_lost_state_follows_the_virtual_rank_of_a_permuted_placement():
    """After a switch onto a non-rank-ordered placement, a dead device loses what its
    *virtual* rank held: the same as the default order with that virtual rank dead."""
    from dynatrain_megatron.vps import Placement

    lay = Layout.parse("tp4pp2dp1", 8)
    pl = Placement((4, 5, 6, 7, 0, 1, 2, 3))  # the best placement of tp4pp1dp2 -> tp4pp2dp1
    for dead_device in (0, 5):
        vr = pl.virtual_rank(dead_device)
        rep, ref = lost_state(SPEC, lay, [dead_device], pl), lost_state(SPEC, lay, [vr])
        assert vr != dead_device
        # the same tensors and boxes (the element counts alone match any rank's here)
        assert sorted(map(str, rep.lost)) == sorted(map(str, ref.lost)) != []
        assert rep.lost_elements == _oracle(lay, [vr])
        other = lost_state(SPEC, lay, [dead_device])  # read as a virtual rank: other layers
        assert sorted(map(str, other.lost)) != sorted(map(str, rep.lost))


def test_survivors_at_two_iterations_recover_the_newest_whole_one_never_a_mix():
    """Rank 3 of tp1pp2doi2dp2 (stages {0, 1} and {2, 3}) dies inside a step: a survivor
    whose update needed no collective with it finished iteration 5, one that failed before
    its update holds 4, one inside its update holds neither. The recovery takes the newest
    iteration every piece of state has a holder at, with every other survivor's state out
    of it, or none."""
    from dynatrain_megatron.loop.death_recovery import newest_whole_state

    lay = Layout.parse("tp1pp2doi2dp2", 4)

    def whole(positions):
        return newest_whole_state(
            positions, lambda out: lost_state(SPEC, lay, out, kinds=OPT_KINDS).recoverable,
            range(4))

    # both stages at 5 (ranks 0 and 2): rank 1's older state is no source
    assert whole({0: 5, 1: 4, 2: 5}) == (5, (1, 3))
    # stage 1 only at 4 (rank 2), stage 0 at 5 and 4: iteration 4, from ranks 1 and 2
    assert whole({0: 5, 1: 4, 2: 4}) == (4, (0, 3))
    # rank 1 inside its update (left out), stage 0 at 5 only, stage 1 at 4 only: none
    assert whole({0: 5, 2: 4}) is None
    # all at one iteration: every survivor a source
    assert whole({0: 4, 1: 4, 2: 4}) == (4, (3,))
    assert whole({}) is None


@pytest.mark.parametrize("model,old,survivors,want", [
    ("tiny-gpt", "tp1pp2doi2dp4", 7, "tp1pp2doi2dp2"),   # the replicas kept where they fit
    ("tiny-gpt", "tp1pp2doi2dp2", 3, "tp1pp2dp1"),       # ... dropped where not
    ("tiny-gpt", "tp1pp2vpp2dp2", 3, "tp1pp2vpp2dp1"),   # the virtual stages at the same PP
    ("tiny-gpt", "tp2pp2ppf1dp2", 7, "tp2pp2ppf1dp1"),   # the recipe's uneven stages
    ("tiny-gpt", "tp2pp2dp2", 3, "tp2pp1dp1"),           # a smaller PP: an even split
    ("tiny-moe", "tp1pp1ep4etp1dp4", 3, "tp1pp1ep2etp1dp2"),  # the largest EP that fits
    ("tiny-moe", "tp2pp1ep2etp1dp2", 3, "tp2pp1ep2etp1dp1"),  # its own expert TP
])
def test_survivors_keep_what_of_the_old_layout_fits(model, old, survivors, want):
    """Without auto-layout, the survivors' layout is the old one's TP/PP with the largest
    DP that fits, and keeps the rest of the old layout where it fits (the recipe's stages,
    its expert parallelism, the optimizer replicas the next death needs)."""
    from dynatrain_megatron.configs import load_model
    from dynatrain_megatron.loop.death_recovery import fit_layout
    from dynatrain_megatron.mcore.train_config import TrainConfig

    train = TrainConfig(micro_batch_size=1, global_batch_size=16)
    assert str(fit_layout(load_model(model), train, Layout.parse(old), survivors)) == want
