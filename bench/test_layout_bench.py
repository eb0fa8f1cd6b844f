"""pytest-benchmark: the cost of laying out a 4096-GPU job (run with --benchmark-only)."""
import fastpar


def _all_groups():
    lay = fastpar.layout(4096, tp=8, pp=16, order="tp-dp-pp")
    return len(lay.tp_groups) + len(lay.pp_groups) + len(lay.dp_groups)


def test_layout_4096_ranks(benchmark):
    assert benchmark(_all_groups) == 4096 // 8 + 4096 // 16 + 4096 // 32
