"""pytest-benchmark: the cost of laying out a 4096-GPU job. The test command runs it as a test;
``pytest tests/test_bench_layout.py --benchmark-only`` times it."""
import fastpar


def _all_groups():
    lay = fastpar.layout(4096, tp=8, pp=16, order="tp-dp-pp")
    return len(lay.tp_groups) + len(lay.pp_groups) + len(lay.dp_groups)


def test_layout_4096_ranks(benchmark):
    assert benchmark(_all_groups) == 4096 // 8 + 4096 // 16 + 4096 // 32
