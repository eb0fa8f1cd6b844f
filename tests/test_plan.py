"""The cost model's formulas on hand-checked cases, the planner's rules, bad input."""
import json

import pytest

from fastpar.models import GPTConfig, get_config
from fastpar.plan import (BUILTIN, Cluster, Hardware, ParallelConfig, Workload, evaluate,
                          get_hardware, load_hardware, save_hardware, search)
from fastpar.plan import cost
from fastpar.plan.cost import Shape

# A GPT-3-style layer: a d = h, f = 4h, GELU.
GPT = GPTConfig(vocab_size=51200, n_layers=8, d_model=1024, n_heads=16, max_seq_len=2048,
                norm="layernorm", activation="gelu", rotary=False)
# Round numbers so times can be checked by hand: 100 TFLOP/s, 1000 GB/s, no overheads.
ROUND = Hardware("round", peak_tflops=100.0, matmul_efficiency=0.5, hbm_gb=80.0, hbm_gbps=1000.0,
                 intra_node_gbps=100.0, inter_node_gbps=10.0, collective_latency_us=0.0,
                 kernel_overhead_us=0.0)


def test_layer_flops_match_megatron_count():
    T, s, h = 2 * 2048, 2048, 1024
    fl = cost.layer_forward_flops(GPT, s, T)
    assert fl["qkvo"] == 8 * T * h * h
    assert fl["mlp"] == 16 * T * h * h
    assert sum(fl.values()) == 24 * T * h * h + 4 * T * s * h
    model = cost.model_flops_per_step(GPT, s, 2)
    assert model == 3 * (8 * sum(fl.values()) + 2 * T * h * GPT.padded_vocab)
    # Megatron's 96 B s l h^2 (1 + s/6h + V/16lh) counts full recompute.
    mega = 96 * 2 * s * 8 * h * h * (1 + s / (6 * h) + GPT.padded_vocab / (16 * 8 * h))
    assert cost.hardware_flops_per_step(GPT, s, 2, "full") == pytest.approx(mega)


def test_gemm_roofline():
    # 1024^3: 2.1 GFLOP at 50 TFLOP/s = 42.9 us; 6 MB at 1000 GB/s = 6.3 us -> compute-bound.
    assert ROUND.gemm_time(1024, 1024, 1024) == pytest.approx(2 * 1024 ** 3 / 50e12)
    # (1024, 8) @ (8, 1024): 16.8 MFLOP = 0.34 us; 2 (8k + 8k + 1M) bytes = 2.13 us -> memory.
    assert ROUND.gemm_time(1024, 1024, 8) == pytest.approx(2 * (8192 * 2 + 1024 ** 2) / 1e12)
    assert ROUND.gemm_efficiency(4096, 4096, 4096) == pytest.approx(0.5)
    slow = Hardware(**{**ROUND.to_dict(), "kernel_overhead_us": 10.0})
    assert slow.gemm_time(8, 8, 8, count=3) == pytest.approx(3 * (10e-6 + 2 * 192 / 1e12))


def test_ring_collectives():
    n = 1e9
    assert cost.ring_time("all_reduce", n, 4, 100.0, 0.0) == pytest.approx(2 * 3 / 4 * n / 1e11)
    assert cost.ring_time("all_gather", n, 4, 100.0, 0.0) == pytest.approx(3 / 4 * n / 1e11)
    assert cost.ring_time("all_reduce", n, 2, 100.0, 5.0) == pytest.approx(2 * 5e-6 + n / 1e11)
    assert cost.ring_time("all_reduce", n, 1, 100.0, 5.0) == 0.0
    assert cost.ring_time("send", n, 2, 10.0, 0.0) == pytest.approx(0.1)


def test_tp_collectives_and_overlap():
    shape = Shape(GPT, 2048, 1, tp=4)
    act = 2048 * 1024 * 2                                   # (s, b, h) bf16
    ar = 2 * 3 / 4 * act / 100e9
    f, b = cost.tp_collectives(shape, ROUND, 100.0)
    assert (f, b) == (pytest.approx(2 * ar), pytest.approx(2 * ar))
    f_sp, b_sp = cost.tp_collectives(Shape(GPT, 2048, 1, tp=4, sp=True), ROUND, 100.0)
    assert f_sp == pytest.approx(f) and b_sp == pytest.approx(1.5 * b)
    assert cost.tp_collectives(Shape(GPT, 2048, 1), ROUND, 100.0) == (0.0, 0.0)
    assert cost.exposed(1.0, 3.0, 4) == pytest.approx(0.25)   # hidden but one chunk
    assert cost.exposed(3.0, 1.0, 4) == pytest.approx(2.25)


def test_activation_memory_matches_korthikanti():
    from fastpar.plan.cost import Features
    s, b, h, a = 2048, 1, 1024, 16
    unfused = Features(flash_attention=False, dropout=True)
    sbh = s * b * h
    base = cost.activation_bytes(Shape(GPT, s, b), "none", unfused)
    assert base == pytest.approx(sbh * (34 + 5 * a * s / h))
    tp = cost.activation_bytes(Shape(GPT, s, b, tp=8), "none", unfused)
    assert tp == pytest.approx(sbh * (10 + 24 / 8 + 5 * a * s / (h * 8)))
    sp = cost.activation_bytes(Shape(GPT, s, b, tp=8, sp=True), "selective", unfused)
    assert sp == pytest.approx(sbh * 34 / 8)
    assert cost.activation_bytes(Shape(GPT, s, b, tp=8), "full", unfused) == 2 * sbh
    # fastpar: fused attention and no dropout store neither scores nor masks.
    assert cost.activation_bytes(Shape(GPT, s, b), "none") == pytest.approx(sbh * 32)


def test_layer_cost_recompute_adds_forward():
    shape = Shape(GPT, 2048, 1, tp=2)
    none = cost.layer_cost(shape, ROUND, "none", 100.0)
    full = cost.layer_cost(shape, ROUND, "full", 100.0)
    sel = cost.layer_cost(shape, ROUND, "selective", 100.0)
    assert full.b == pytest.approx(none.b + none.f)
    assert full.tp_comm_b == pytest.approx(none.tp_comm_b + none.tp_comm_f)
    assert none.b < sel.b < full.b and none.w == full.w == none.gemm_f


def _work(batch=64):
    return Workload(GPT, 2048, batch)


def test_more_gpus_never_less_total_throughput():
    hw = get_hardware("a100-80gb")
    last = 0.0
    for nodes in (1, 2, 4, 8, 16, 32):
        dp = nodes * 8 // 8
        cfg = ParallelConfig(tp=4, pp=2, dp=dp, micro_batch_size=2, schedule="1f1b")
        est = evaluate(_work(8 * dp), Cluster(nodes * 8, 8, hw), cfg)
        assert est.fits
        assert est.tokens_per_s >= last
        last = est.tokens_per_s


def test_memory_rejection_names_the_reason():
    big = get_config("70b")
    est = evaluate(Workload(big, 4096, 8), Cluster(8, 8, get_hardware("a100-40gb")),
                   ParallelConfig(tp=8, pp=1, dp=1, micro_batch_size=1))
    assert not est.fits
    assert "more than the 40 GB of a100-40gb" in est.reason and "optimizer" in est.reason
    assert est.memory_gb_per_gpu > 40
    assert est.to_dict()["fits"] is False


def test_evaluate_output_and_search_order():
    work, cluster = _work(32), Cluster(16, 8, BUILTIN["h100-80gb"])
    est = evaluate(work, cluster, ParallelConfig(tp=2, pp=2, dp=4, micro_batch_size=2,
                                                 schedule="interleaved", virtual_stages=2,
                                                 recompute="selective"))
    d = est.to_dict()
    for key in ("tp", "pp", "dp", "virtual_stages", "micro_batch_size", "schedule",
                "recompute", "step_time_s", "tflops_per_gpu", "mfu", "memory_gb_per_gpu"):
        assert key in d
    assert 0 < d["mfu"] < BUILTIN["h100-80gb"].matmul_efficiency
    assert d["tflops_per_gpu"] == pytest.approx(d["mfu"] * 989.0, rel=1e-3)
    assert 0 < est.bubble_fraction < 0.5
    best, rejected = search(work, cluster, top=4)
    assert len(best) == 4 and all(e.fits for e in best)
    times = [e.step_time_s for e in best]
    assert times == sorted(times)
    # The bound-and-prune search finds what evaluating every candidate finds.
    assert best[0].step_time_s <= est.step_time_s


@pytest.mark.parametrize("make, words", [
    (lambda: ParallelConfig(tp=3, pp=1, dp=1).check(_work(), Cluster(3, 3, ROUND)),
     ["n_heads=16", "tp=3"]),
    (lambda: Cluster(12, 8, ROUND), ["gpus=12", "gpus_per_node=8"]),
    (lambda: get_hardware("a200"), ["'a200'", "a100-80gb"]),
    (lambda: ParallelConfig(tp=1, pp=1, dp=8, micro_batch_size=3).check(_work(), Cluster(8, 8, ROUND)),
     ["global batch 64", "3 x 8"]),
    (lambda: ParallelConfig(tp=2, pp=1, dp=2).check(_work(), Cluster(8, 8, ROUND)),
     ["2*1*2", "gpus=8"]),
    (lambda: ParallelConfig(tp=1, pp=2, dp=1, schedule="interleaved", virtual_stages=2)
     .check(_work(3), Cluster(2, 2, ROUND)), ["num_microbatches=3", "pp_size=2"]),
    (lambda: Hardware("x", peak_tflops=-1, matmul_efficiency=0.5, hbm_gb=1, hbm_gbps=1,
                      intra_node_gbps=1, inter_node_gbps=1), ["peak_tflops=-1"]),
])
def test_bad_input_raises_one_clear_error(make, words):
    with pytest.raises(ValueError) as info:
        make()
    for w in words:
        assert w in str(info.value)


def test_hardware_json_round_trip(tmp_path):
    path = save_hardware(ROUND, tmp_path / "round.json")
    assert load_hardware(path) == ROUND
    (tmp_path / "bad.json").write_text(json.dumps({**ROUND.to_dict(), "flops": 1}))
    with pytest.raises(ValueError, match="unknown field"):
        load_hardware(tmp_path / "bad.json")
    (tmp_path / "short.json").write_text(json.dumps({"peak_tflops": 1}))
    with pytest.raises(ValueError, match="short.json"):
        load_hardware(tmp_path / "short.json")
