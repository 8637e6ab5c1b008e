"""Box geometry and the flat-range decomposition of distributed-optimizer shards."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynatrain_megatron.vps.box import Box, BoxError
from dynatrain_megatron.vps.errors import DynatrainError


def test_str_and_properties():
    b = Box((0, 4), (4, 4))
    assert str(b) == "[0:4, 4:8]"
    assert b.numel == 16 and b.ndim == 2 and b.stops == (4, 8)
    assert str(Box((), ())) == "[]" and Box((), ()).numel == 1
    assert "offsets=(0, 4)" in repr(b)


@pytest.mark.parametrize("off,shape", [((0,), (0,)), ((-1,), (2,)), ((0, 0), (1,)),
                                       ((0.5,), (1,)), ((True,), (1,)), (None, (1,))])
def test_validation_names_the_box(off, shape):
    with pytest.raises(BoxError) as e:
        Box(off, shape)
    assert isinstance(e.value, DynatrainError) and "box" in str(e.value).lower()


def test_numpy_ints_become_plain_ints():
    b = Box(np.array([1, 2]), [np.int64(3), 4])
    assert b.offsets == (1, 2) and type(b.offsets[0]) is int and b == Box((1, 2), (3, 4))
    assert hash(b) == hash(Box((1, 2), (3, 4)))


def test_intersect_contains_translate():
    a, b = Box((0, 0), (4, 6)), Box((2, 3), (4, 4))
    assert a.intersect(b) == Box((2, 3), (2, 3))
    assert a.intersect(Box((4, 0), (1, 1))) is None  # touching is not overlapping
    assert a.contains(Box((1, 1), (3, 5))) and not a.contains(b)
    assert a.within((4, 6)) and not b.within((4, 6))
    assert b.translate((2, 3), (10, 0)) == Box((10, 0), (4, 4))
    with pytest.raises(BoxError):
        a.intersect(Box((0,), (1,)))


def test_ordering_and_hashing():
    boxes = {Box((1,), (2,)), Box((0,), (3,)), Box((1,), (2,))}
    assert sorted(boxes) == [Box((0,), (3,)), Box((1,), (2,))]


def test_from_flat_range_example():
    got = Box.from_flat_range((4, 6), 3, 20)
    assert [str(b) for b in got] == ["[0:1, 3:6]", "[1:3, 0:6]", "[3:4, 0:2]"]
    assert Box.from_flat_range((4, 6), 6, 18) == [Box((1, 0), (2, 6))]
    assert Box.from_flat_range((4, 6), 7, 9) == [Box((1, 1), (1, 2))]
    assert Box.from_flat_range((4, 6), 5, 5) == []
    assert Box.from_flat_range((), 0, 1) == [Box((), ())]
    with pytest.raises(BoxError):
        Box.from_flat_range((4, 6), 3, 25)


def test_flat_range_inverse_and_non_contiguous():
    assert Box((1, 2), (1, 3)).flat_range((4, 6)) == (8, 11)
    with pytest.raises(BoxError):
        Box((0, 0), (2, 3)).flat_range((4, 6))


@st.composite
def shape_and_range(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)))
    n = math.prod(shape)
    a = draw(st.integers(0, n))
    b = draw(st.integers(a, n))
    return shape, a, b


@settings(max_examples=300, deadline=None)
@given(shape_and_range())
def test_from_flat_range_property(case):
    """Boxes are contiguous, in flat order, disjoint, at most 2*ndim-1, union = range."""
    shape, a, b = case
    boxes = Box.from_flat_range(shape, a, b)
    assert len(boxes) <= 2 * len(shape) - 1
    mark = np.zeros(shape, dtype=np.int64)
    pos = a
    for box in boxes:
        assert box.within(shape)
        s, e = box.flat_range(shape)  # raises unless contiguous
        assert s == pos
        pos = e
        mark[box.slices()] += 1
    assert pos == b
    flat = mark.reshape(-1)
    assert (flat[a:b] == 1).all() and flat[:a].sum() == 0 and flat[b:].sum() == 0
    # a 1-D shard segment views as the box: copy the data through the boxes
    src = np.arange(math.prod(shape)).reshape(shape)
    seg = src.reshape(-1)[a:b]
    off = 0
    for box in boxes:
        assert (seg[off:off + box.numel].reshape(box.shape) == src[box.slices()]).all()
        off += box.numel
