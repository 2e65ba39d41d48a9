"""The training-state machine's table of legal transitions (``core/state.py``):
every legal move is taken, every other raises one error naming the unit, the
rank and both states."""
from __future__ import annotations

import itertools
import types

import pytest

from fullshard.core import state
from fullshard.core.state import TrainingState

LEGAL = {
    ("IDLE", "FORWARD"), ("IDLE", "PRE_BACKWARD"), ("IDLE", "POST_BACKWARD"),
    ("FORWARD", "IDLE"),
    ("PRE_BACKWARD", "POST_BACKWARD"), ("PRE_BACKWARD", "IDLE"),
    ("POST_BACKWARD", "PRE_BACKWARD"), ("POST_BACKWARD", "POST_BACKWARD"), ("POST_BACKWARD", "IDLE"),
}


@pytest.mark.parametrize("old,new", list(itertools.product(TrainingState, TrainingState)))
def test_transition_table(old, new):
    rt = types.SimpleNamespace(state=old, unit=types.SimpleNamespace(name="layers.3"))
    if (old.value, new.value) in LEGAL:
        state.UnitRuntime.transition(rt, new)
        assert rt.state is new
    else:
        with pytest.raises(state.TrainingStateError,
                           match=rf"\[rank 0\] unit 'layers.3': illegal training-state transition "
                                 rf"{old.value} -> {new.value}"):
            state.UnitRuntime.transition(rt, new)
        assert rt.state is old
