"""The switch's options and prepared state: bad options refused with every reason, a
prepared switch refused for another switch (pure: no process group)."""
import pytest

from dynatrain_megatron.transition.switch_types import Prepared, SwitchError, SwitchOptions
from dynatrain_megatron.vps import KINDS, OPT_KINDS, Layout, Placement
from dynatrain_megatron.vps.errors import DynatrainError


def test_options_kinds_and_defaults():
    assert SwitchOptions().kinds == OPT_KINDS
    assert SwitchOptions(move_weights=True).kinds == KINDS
    # fp32 masters that are views of the weights travel with them, once
    assert SwitchOptions(move_weights=True, masters_are_weights=True).kinds == (
        "param", "exp_avg", "exp_avg_sq")
    assert SwitchOptions(masters_are_weights=True).kinds == OPT_KINDS
    with pytest.raises(AttributeError):
        SwitchOptions().timeout = 3.0  # frozen


def test_bad_options_list_every_reason():
    with pytest.raises(SwitchError) as e:
        SwitchOptions(placement="fastest", ranks_per_node=0, memory_budget=0, timeout=-1.0)
    msg = str(e.value)
    for why in ("placement must be one of ('best', 'default'), got 'fastest'",
                "ranks_per_node must be a positive int, got 0",
                "memory_budget must be positive or None, got 0",
                "timeout must be positive or None, got -1.0"):
        assert why in msg
    assert isinstance(e.value, DynatrainError)  # the CLI reports it as one line


def test_prepared_refuses_another_switch():
    a, b = Layout.parse("tp2pp1", 2), Layout.parse("tp1pp2", 2)
    pl = Placement.default(2)
    prep = Prepared(a, pl, b, pl, groups=None, kinds=OPT_KINDS)
    prep.check_for(a, pl, b, OPT_KINDS, ())
    with pytest.raises(SwitchError, match="does not match the requested"):
        prep.check_for(a, pl, b, KINDS, ())
    with pytest.raises(SwitchError):
        prep.check_for(b, pl, a, OPT_KINDS, ())
