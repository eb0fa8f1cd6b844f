import itertools

import pytest

import fastpar
from fastpar import Coords

ORDERS = ["-".join(p) for p in itertools.permutations(["tp", "dp", "pp"])]
SIZES = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 3), (4, 2, 2),
         (3, 5, 2), (8, 1, 4), (2, 4, 8)]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("tp,pp,dp", SIZES)
def test_groups_partition_ranks_and_match_coords(tp, pp, dp, order):
    world = tp * pp * dp
    lay = fastpar.layout(world, tp=tp, pp=pp, dp=dp, order=order)
    for dim, groups, size in (("tp", lay.tp_groups, tp), ("pp", lay.pp_groups, pp),
                              ("dp", lay.dp_groups, dp)):
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(world)), f"{dim}: every rank in exactly one group"
        assert len(groups) == world // size and all(len(g) == size for g in groups)
        for g in groups:
            coords = [lay.coords(r) for r in g]
            # Members differ only in `dim`, and cover each of its values once.
            others = {tuple(v for k, v in c._asdict().items() if k != dim) for c in coords}
            assert len(others) == 1
            assert sorted(getattr(c, dim) for c in coords) == list(range(size))
            for r in g:
                assert lay.group_of(dim, r) == sorted(g, key=lambda x: getattr(lay.coords(x), dim))
    for r in range(world):
        assert lay.rank(**lay.coords(r)._asdict()) == r


@pytest.mark.parametrize("order", ORDERS)
def test_innermost_dimension_is_consecutive(order):
    lay = fastpar.layout(24, tp=2, pp=3, dp=4, order=order)
    inner = order.split("-")[0]
    size = lay.size(inner)
    assert lay.groups(inner)[0] == list(range(size))


def test_32_gpu_example_textbook_order():
    lay = fastpar.layout(32, tp=4, pp=2, dp=4, order="tp-pp-dp")
    assert lay.coords(13) == Coords(dp=1, pp=1, tp=1)
    assert lay.group_of("tp", 13) == [12, 13, 14, 15]
    assert lay.group_of("pp", 13) == [9, 13]
    assert lay.group_of("dp", 13) == [5, 13, 21, 29]
    assert [12, 13, 14, 15] in lay.tp_groups and [9, 13] in lay.pp_groups
    assert [5, 13, 21, 29] in lay.dp_groups


def test_default_order_is_megatron_tp_dp_pp():
    lay = fastpar.layout(16, tp=2, pp=2)
    assert lay.dp == 4 and lay.order == "tp-cp-dp-pp"
    assert lay.tp_groups[0] == [0, 1]
    assert lay.dp_groups[0] == [0, 2, 4, 6]      # dp is the middle dimension
    assert lay.pp_groups[0] == [0, 8]            # pp is the outermost
    assert lay.coords(11) == Coords(dp=1, pp=1, tp=1)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(world_size=8, tp=3), "world_size=8 is not divisible by tp*pp = 3*1 = 3"),
    (dict(world_size=8, tp=2, pp=2, dp=3), "tp*pp*dp = 2*2*3 = 12 != world_size=8"),
    (dict(world_size=8, tp=0), "tp=0"),
    (dict(world_size=8, pp=-2), "pp=-2"),
    (dict(world_size=8, tp=2, dp=0), "dp=0"),
    (dict(world_size=0), "world_size=0"),
    (dict(world_size=4, tp=2.0), "tp=2.0"),
    (dict(world_size=4, order="tp-pp"), "order='tp-pp'"),
    (dict(world_size=4, order="tp-dp-dp"), "order='tp-dp-dp'"),
    (dict(world_size=4, order="tp-dp-ep"), "order='tp-dp-ep'"),
])
def test_bad_input_names_the_numbers(kwargs, needle):
    with pytest.raises(ValueError) as err:
        fastpar.layout(**kwargs)
    assert needle in str(err.value)


def test_rank_and_coords_out_of_range():
    lay = fastpar.layout(4, tp=2)
    with pytest.raises(ValueError, match="rank=4"):
        lay.coords(4)
    with pytest.raises(ValueError, match="tp=2"):
        lay.rank(tp=2)


def test_context_parallel_is_the_fourth_dimension():
    lay = fastpar.layout(16, tp=2, cp=2, pp=2)
    assert (lay.dp, lay.cp) == (2, 2)
    assert lay.tp_groups[0] == [0, 1] and lay.cp_groups[0] == [0, 2]   # cp right after tp
    assert lay.dp_groups[0] == [0, 4] and lay.pp_groups[0] == [0, 8]
    assert lay.coords(7) == Coords(dp=1, pp=0, tp=1, cp=1)
    # The gradient reduction spans dp x cp: the ranks that share tp and pp coordinates.
    assert lay.groups("dp-cp")[0] == [0, 2, 4, 6] and lay.group_of("dp-cp", 3) == [1, 3, 5, 7]
    assert fastpar.layout(16, tp=2, cp=2, pp=2, order="tp-dp-pp").cp_groups == lay.cp_groups
    outer = fastpar.layout(16, tp=2, cp=2, pp=2, order="tp-dp-pp-cp")
    assert outer.cp_groups[0] == [0, 8]
    for r in range(16):
        assert lay.rank(**lay.coords(r)._asdict()) == r
    with pytest.raises(ValueError, match=r"tp\*cp\*pp = 2\*3\*1 = 6"):
        fastpar.layout(16, tp=2, cp=3)
    with pytest.raises(ValueError, match="cp=0 must be >= 1"):
        fastpar.layout(4, cp=0)


def test_layout_is_sized_and_checked_in_one_place():
    """Layout itself sizes dp and checks the sizes: the function, ParallelConfig.check and the
    trainer's config all return the object it makes."""
    from fastpar.mesh import Layout
    from fastpar.models import get_config
    from fastpar.models.parallel_config import ParallelConfig
    from fastpar.train import TrainConfig

    assert Layout(8, tp=2, pp=2).dp == 2 and Layout(8, tp=2, cp=2).dp == 2
    assert Layout(8, tp=2, pp=2) == fastpar.layout(8, tp=2, pp=2) == Layout(8, 2, 2, 2)
    for kwargs, message in ((dict(tp=3), "world_size=8 is not divisible by tp*pp = 3*1 = 3"),
                            (dict(tp=2, dp=2), "tp*pp*dp = 2*1*2 = 4 != world_size=8"),
                            (dict(tp=0), "tp=0 must be >= 1"),
                            (dict(dp=0), "dp=0 must be >= 1"),
                            (dict(order="tp-dp"), "order='tp-dp' must be")):
        with pytest.raises(ValueError, match=message.replace("*", r"\*")):
            Layout(8, **kwargs)
    lay = ParallelConfig(tp=2).check(get_config("tiny"), 4, 8, 64)
    assert isinstance(lay, Layout) and (lay.world_size, lay.tp, lay.dp) == (4, 2, 2)
    with pytest.raises(ValueError, match="gpus=6"):
        ParallelConfig(tp=4).check(get_config("tiny"), 6, 8, 64, world_name="gpus=")
    cfg = TrainConfig(tp=2, cp=2, seq_len=64)
    assert cfg.check_layout(8) == Layout(8, tp=2, cp=2)
    assert cfg.check_layout(8).sizes() == {"tp": 2, "pp": 1, "dp": 2, "cp": 2}


@pytest.mark.parametrize("kwargs", [dict(tp=2, dp=2, cp=2), dict(tp=2, pp=2, dp=2),
                                    dict(cp=4, dp=2), dict(dp=2, cp=2, tp=2, order="dp-tp-pp")])
def test_one_replica_of_each_shard_is_copy_zero(kwargs):
    """The ranks that hold the same (tp, pp) shard of the weights (the dp x cp group) number
    their copies 0..dp*cp-1 in that group's order; exactly one, copy 0, saves the shard."""
    from fastpar.mesh import Layout, Mesh

    lay = Layout(8, **kwargs)
    meshes = [Mesh(lay, r, None, None, None, None) for r in range(8)]
    for m in meshes:
        assert m.group_ranks("dp-cp").index(m.rank) == m.replica_rank
    writers = [(m.tp_rank, m.pp_rank) for m in meshes if m.replica_rank == 0]
    assert sorted(writers) == sorted({(m.tp_rank, m.pp_rank) for m in meshes})


@pytest.mark.parametrize("world, tp, pp, cp, ep", [(16, 2, 2, 1, 4), (16, 2, 1, 2, 8),
                                                   (32, 4, 2, 1, 8), (8, 2, 1, 1, 2)])
def test_folded_ep_groups_are_whole_tp_groups(world, tp, pp, cp, ep):
    """TP folded into ep: every ep group is whole TP groups of ep / tp dp x cp ranks of one
    stage, every rank in one; the ranks holding the same experts are those the unfolded
    ep / tp would pair (the same TP rank: the replicas' ZeRO shards stay inside dp x cp)."""
    from fastpar.mesh import ep_ranks
    lay = fastpar.layout(world, tp=tp, pp=pp, cp=cp)
    blocks, across = ep_ranks(lay, ep, fold_tp=True)
    assert sorted(r for b in blocks for r in b) == list(range(world))
    for b in blocks:
        assert len(b) == ep and len({lay.coords(r).pp for r in b}) == 1
        for r in b:
            assert set(lay.group_of("tp", r)) <= set(b)
    assert across == ep_ranks(lay, ep // tp)[1]
    for a in across:
        assert len({lay.coords(r).tp for r in a}) == 1
        assert all(len(set(a) & set(b)) == 1 for b in blocks if lay.coords(b[0]).pp ==
                   lay.coords(a[0]).pp)
