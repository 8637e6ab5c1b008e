"""Region tables (the planner's geometry) vs the analytic layout, fragment by fragment."""
import numpy as np
import pytest

from dynatrain_megatron.routing.regions import (HolderSets, RoutingError, join_boxes,
                                                key_index, region_table)
from dynatrain_megatron.vps import KINDS, analytic_layout, logical_tensors

from routing_cases import lay, spec

CASES = [
    ("tiny-gpt", "tp2pp2", 8), ("tiny-gpt", "tp1pp4", 8), ("tiny-gpt", "tp4pp1", 8),
    ("tiny-gpt", "tp2pp2vpp2", 8), ("tiny-gpt", "tp2cp2", 8), ("tiny-gpt+tied", "tp2pp2", 8),
    ("tiny-gpt+tied", "tp2pp1", 4), ("tiny-gpt+ln", "tp2pp2", 8),
    ("tiny-moe", "tp1pp2ep4", 8), ("tiny-moe", "tp2pp2ep2etp1", 8),
    ("tiny-moe", "tp2pp1ep2etp2", 8), ("tiny-moe", "tp2pp1ep1etp1", 4),
    ("tiny-moe+ln", "tp2pp2ep2etp1", 8), ("tiny-moe", "tp4pp1ep8etp1", 8),
    ("tiny-moe", "tp2pp2ep1etp2", 8), ("tiny-moe+shared", "tp2pp2ep2", 8),
    # partial distributed optimizer: the optimizer state replicated over instances
    ("tiny-gpt", "tp1pp2doi2", 8), ("tiny-gpt", "tp2pp1doi4", 8), ("tiny-gpt+tied", "tp1pp2doi2", 8),
    ("tiny-moe", "tp1pp2ep2etp1doi2", 8), ("tiny-moe", "tp2pp1ep1etp1doi2", 8),
]


def _expand(t, kidx):
    out = set()
    for i in range(len(t)):
        box = kidx.box(int(t.key[i]), int(t.r0[i]), int(t.r1[i]), int(t.c0[i]), int(t.c1[i]))
        for v in t.holders.members(int(t.hset[i])):
            out.add((kidx.keys[t.key[i]], box, int(v)))
    return out


@pytest.mark.parametrize("model,text,world", CASES)
@pytest.mark.parametrize("bucket", [None, 1000])
def test_destination_regions_are_the_analytic_fragments(model, text, world, bucket):
    s, L = spec(model), lay(text, world)
    al, kidx = analytic_layout(s, L, bucket), key_index(s)
    for cls, kind in (("param", "param"), ("opt", "main_param")):
        got = _expand(region_table(s, L, bucket, cls, False), kidx)
        want = {(f.key, f.box, f.rank) for r in range(world) for f in al.fragments(r, [kind])}
        assert got == want, (cls, sorted(got ^ want)[:3])


@pytest.mark.parametrize("model,text,world", [("tiny-gpt+tied", "tp2pp2", 8),
                                              ("tiny-gpt+tied", "tp1pp4", 4),
                                              ("tiny-gpt+tied", "tp1pp2doi2", 8),
                                              ("tiny-gpt", "tp2pp2", 8)])
def test_source_regions_partition_each_tensor_with_all_holders(model, text, world):
    """Refined source regions: disjoint, cover every tensor, and an element's holders are
    exactly the ranks holding it (tied copies merged into atoms)."""
    s, L = spec(model), lay(text, world)
    al, kidx = analytic_layout(s, L), key_index(s)
    shapes = {t.key: t.shape for t in logical_tensors(s)}
    for cls, kind in (("param", "param"), ("opt", "exp_avg")):
        t = region_table(s, L, None, cls, True)
        held = {k: [set() for _ in range(int(np.prod(shp)))] for k, shp in shapes.items()}
        for r in range(world):
            for f in al.fragments(r, [kind]):
                idx = np.arange(int(np.prod(shapes[f.key]))).reshape(shapes[f.key])
                for e in idx[f.box.slices()].ravel():
                    held[f.key][e].add(r)
        seen = {k: np.zeros(int(np.prod(shp)), int) for k, shp in shapes.items()}
        for i in range(len(t)):
            key = kidx.keys[t.key[i]]
            box = kidx.box(int(t.key[i]), int(t.r0[i]), int(t.r1[i]), int(t.c0[i]),
                           int(t.c1[i]))
            mem = set(map(int, t.holders.members(int(t.hset[i]))))
            idx = np.arange(seen[key].size).reshape(shapes[key])[box.slices()].ravel()
            seen[key][idx] += 1
            assert all(held[key][e] == mem for e in idx), (cls, key, str(box))
        assert all((v == 1).all() for v in seen.values()), cls


@pytest.mark.parametrize("model", ["tiny-gpt", "tiny-moe", "tiny-moe+ln", "tiny-moe+shared",
                                   "llama3-70b", "gpt-50m"])
def test_key_index_is_model_order(model):
    s = spec(model)
    k = key_index(s)
    ts = logical_tensors(s)
    assert k.keys == tuple(t.key for t in ts)
    assert [tuple(int(x) for x in ((k.nrows[i], k.ncols[i]) if k.ndim[i] == 2
                                   else (k.nrows[i],))) for i in range(len(ts))] \
        == [t.shape for t in ts]


def test_join_finds_every_overlap_once():
    # a: a 2-band partition of a [6, 4] tensor (bands of 2 columns), flat-contiguous boxes
    w = np.array([2])
    a = np.array([[0, 0, 3, 0, 2], [0, 3, 6, 0, 2], [0, 0, 1, 2, 4], [0, 1, 2, 2, 4],
                  [0, 2, 6, 2, 4]])
    b = np.array([[0, 2, 5, 1, 3], [0, 0, 6, 0, 4]])
    ia, ib, r0, r1, c0, c1 = join_boxes(*a.T, w, *b.T)
    vol = np.bincount(ib, weights=(r1 - r0) * (c1 - c0))
    assert list(vol) == [6, 24]
    assert len(set(zip(ia.tolist(), ib.tolist()))) == len(ia)


def test_holder_sets_progressions_and_unions():
    hs = HolderSets()
    p1, p2 = hs.pattern(4, 3), hs.pattern(1, 2, 8, 2)
    ids = hs.intern(np.array([p1, p2, p1]), np.array([1, 0, 1]))
    assert ids[0] == ids[2] and ids[0] != ids[1]
    assert hs.members(int(ids[0])).tolist() == [1, 5, 9]
    assert hs.members(int(ids[1])).tolist() == [0, 1, 8, 9]
    u = hs.union(int(ids[0]), int(ids[1]))
    assert hs.members(u).tolist() == [0, 1, 5, 8, 9]
    off, mem = hs.csr(np.array([ids[1], u, ids[0]]))
    assert off.tolist() == [0, 4, 9, 12] and mem.tolist() == [0, 1, 8, 9, 0, 1, 5, 8, 9, 1, 5, 9]
    with pytest.raises(RoutingError):
        hs.intern(np.array([p1]), np.array([2]))


def test_unknown_class_refused():
    with pytest.raises(RoutingError, match="kind class"):
        region_table(spec("tiny-gpt"), lay("tp1", 1), None, "grads", False)
    assert KINDS[0] == "param"
