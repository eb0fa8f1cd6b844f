"""The cost model's formulas on hand-checked cases, the planner's rules, bad input."""
import dataclasses
import json

import time

import pytest

from fastpar.models import GPTConfig, get_config
from fastpar.plan import (BUILTIN, Cluster, Hardware, ParallelConfig, Workload, evaluate,
                          get_hardware, load_hardware, save_hardware, search)
from fastpar.plan import cost, planner
from fastpar.plan.cost import Features, Shape

# A GPT-3-style layer: a d = h, f = 4h, GELU.
GPT = GPTConfig(vocab_size=51200, n_layers=8, d_model=1024, n_heads=16, max_seq_len=2048,
                norm="layernorm", activation="gelu", rotary=False)
# Round numbers so times can be checked by hand: 100 TFLOP/s, 1000 GB/s, no overheads.
ROUND = Hardware("round", peak_tflops=100.0, matmul_efficiency=0.5, hbm_gb=80.0, hbm_gbps=1000.0,
                 intra_node_gbps=100.0, inter_node_gbps=10.0, collective_latency_us=0.0,
                 kernel_overhead_us=0.0)


def test_layer_flops_match_megatron_count():
    T, s, h = 2 * 2048, 2048, 1024
    fl = GPT.layer_flops(s, T)
    assert fl["qkvo"] == 8 * T * h * h
    assert fl["mlp"] == 16 * T * h * h
    assert sum(fl.values()) == 24 * T * h * h + 4 * T * s * h
    model = GPT.train_flops(s, 2 * s)
    assert model == 3 * (8 * sum(fl.values()) + 2 * T * h * GPT.padded_vocab)
    # Megatron's 96 B s l h^2 (1 + s/6h + V/16lh) counts full recompute.
    mega = 96 * 2 * s * 8 * h * h * (1 + s / (6 * h) + GPT.padded_vocab / (16 * 8 * h))
    assert GPT.train_flops(s, 2 * s, "full") == pytest.approx(mega)


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
    # fastpar, as Megatron: the fused QKV and fc1 all-reduce their input gradients, o and fc2
    # their outputs: two of each.
    assert cost.tp_collectives(shape, ROUND, 100.0) == (pytest.approx(2 * ar),
                                                       pytest.approx(2 * ar))
    f_sp, b_sp = cost.tp_collectives(Shape(GPT, 2048, 1, tp=4, sp=True), ROUND, 100.0)
    assert f_sp == pytest.approx(2 * ar) and b_sp == pytest.approx(2 * ar)   # AG = RS = ar / 2
    # Gathering the column inputs again in backward (Megatron's; fastpar's under selective
    # recompute) adds one all-gather per column linear.
    b_sp = cost.tp_collectives(Shape(GPT, 2048, 1, tp=4, sp=True), ROUND, 100.0,
                               regather=True)[1]
    assert b_sp == pytest.approx(3 * ar)
    # Separate q, k, v, gate and up linears (as fastpar had) reduce one input gradient each.
    unfused = Features(fused_qkv=False)
    f, b = cost.tp_collectives(shape, ROUND, 100.0, unfused)
    assert (f, b) == (pytest.approx(2 * ar), pytest.approx(4 * ar))
    f_sp, b_sp = cost.tp_collectives(Shape(GPT, 2048, 1, tp=4, sp=True), ROUND, 100.0, unfused,
                                     regather=True)
    assert f_sp == pytest.approx(3 * ar) and b_sp == pytest.approx(5 * ar)
    # Each overlapped all-reduce is tp_chunks calls, each paying the per-step latency.
    slow = Hardware(**{**ROUND.to_dict(), "collective_latency_us": 100.0})
    f_lat, b_lat = cost.tp_collectives(shape, slow, 100.0)
    steps = 2 * 3 * 4                                       # ring steps x chunks per all-reduce
    assert f_lat == pytest.approx(2 * ar + 2 * steps * 100e-6)
    assert b_lat == pytest.approx(2 * ar + 2 * steps * 100e-6)
    assert cost.tp_collectives(Shape(GPT, 2048, 1), ROUND, 100.0) == (0.0, 0.0)
    # gloo reduce-scatters through a whole all-reduce: the SP backward's column reduce-scatters
    # cost all-reduces on a CPU (the forward's are the row linears' own exchanges).
    cpu, sp = dataclasses.replace(ROUND, kind="cpu"), Shape(GPT, 2048, 1, tp=4, sp=True)
    n, col = 2048 * GPT.d_model * 2, cost.column_linears(GPT)

    def ring(kind, hw):
        return cost.collective_time(kind, n, 4, 100.0, hw)
    assert cost.tp_collectives(sp, cpu, 100.0)[0] == cost.tp_collectives(sp, ROUND, 100.0)[0]
    assert cost.tp_collectives(sp, cpu, 100.0)[1] - cost.tp_collectives(sp, ROUND, 100.0)[1] == \
        pytest.approx(col * (ring("all_reduce", cpu) - ring("reduce_scatter", ROUND)))
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
    # fastpar: fused attention and no dropout store neither scores nor masks, but the fused
    # core saves its output beside o's sequence-first copy of it (2 sbh more), unless
    # selective recompute redoes the core.
    assert cost.activation_bytes(Shape(GPT, s, b), "none") == pytest.approx(sbh * 34)
    assert cost.activation_bytes(Shape(GPT, s, b), "selective") == pytest.approx(sbh * 32)


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


# A CPU-like profile (reference ops, per-operator overhead, slow links) whose memory is set per case.
CPU_LIKE = Hardware("cpu-like", peak_tflops=0.05, matmul_efficiency=0.6, hbm_gb=1.0,
                    hbm_gbps=10.0, intra_node_gbps=0.5, inter_node_gbps=0.5,
                    collective_latency_us=500.0, kernel_overhead_us=20.0, sync_us=100.0,
                    memory_reserve_gb=0.0, kind="cpu", activation_gbps=2.0, bytes_per_element=4)
NO_OVERLAP = Features(tp_overlap=False, dp_overlap=False, flash_attention=False, dropout=True)
SEARCH_CASES = {   # (workload, cluster, features, some candidates rejected for memory)
    "tiny, 2 CPU ranks": (Workload(get_config("tiny"), 128, 16), Cluster(2, 2, CPU_LIKE),
                          cost.FASTPAR, False),
    "small, 4 CPU ranks, 0.1 GB": (Workload(get_config("small"), 256, 16),
                                   Cluster(4, 4, Hardware(**{**CPU_LIKE.to_dict(),
                                                             "hbm_gb": 0.1})),
                                   cost.FASTPAR, True),
    # No overlap and unfused attention: the bound the search used before exceeded the simulated
    # step of three ZB-H1 candidates here.
    "8 layers, 8 A100, no overlap": (Workload(GPT, 2048, 8), Cluster(8, 8, BUILTIN["a100-80gb"]),
                                     NO_OVERLAP, False),
    "8 layers, 2 nodes of 8 A100, 2.5 GB": (Workload(GPT, 2048, 16), Cluster(16, 8, Hardware(
        **{**BUILTIN["a100-80gb"].to_dict(), "hbm_gb": 2.5})), cost.FASTPAR, True),
}


@pytest.mark.parametrize("case", list(SEARCH_CASES))
def test_pruned_search_equals_exhaustive_evaluation(case):
    """The branch-and-bound search returns what evaluating every candidate returns, and its
    step bound is below every candidate's simulated step."""
    work, cluster, feat, tight = SEARCH_CASES[case]
    every, fits = [], []
    for cfg in planner.candidates(work, cluster):
        est = evaluate(work, cluster, cfg, feat)
        every.append(est)
        fits += [est] if est.fits else []
        split = cfg.schedule in planner.SPLIT_SCHEDULES
        fbw = planner._stage_costs(work, cluster, cfg, feat, split)[0]
        bound = planner._step_lower_bound(fbw, cfg.pp, cfg.num_microbatches(work.global_batch),
                                          split, [planner.stages_on(cfg, r)
                                                  for r in range(cfg.pp)])
        assert bound <= est.step_time_s, cfg
    assert (len(fits) < len(every)) == tight and fits
    fits.sort(key=lambda e: (e.step_time_s, e.memory_gb_per_gpu))
    best, rejected = search(work, cluster, feat, top=3)

    def key(e):
        return e.step_time_s, e.memory_gb_per_gpu
    assert [key(e) for e in best] == [key(e) for e in fits[:3]]
    assert best[0].config in [e.config for e in fits if key(e) == key(fits[0])]
    if tight:      # the fastest layout of all does not fit: memory decides
        assert min(every, key=key).config != best[0].config and rejected["memory"] > 0


@pytest.mark.parametrize("make, words", [
    (lambda: planner.check(ParallelConfig(tp=3, pp=1, dp=1), _work(), Cluster(3, 3, ROUND)),
     ["n_heads=16", "tp=3"]),
    (lambda: Cluster(12, 8, ROUND), ["gpus=12", "gpus_per_node=8"]),
    (lambda: get_hardware("a200"), ["'a200'", "a100-80gb"]),
    (lambda: planner.check(ParallelConfig(tp=1, pp=1, dp=8, micro_batch_size=3), _work(),
                           Cluster(8, 8, ROUND)),
     ["global batch 64", "3 x 8"]),
    (lambda: planner.check(ParallelConfig(tp=2, pp=1, dp=2), _work(), Cluster(8, 8, ROUND)),
     ["2*1*2", "gpus=8"]),
    (lambda: planner.check(ParallelConfig(tp=1, pp=2, dp=1, schedule="interleaved",
                                          virtual_stages=2), _work(3), Cluster(2, 2, ROUND)),
     ["num_microbatches=3", "pp_size=2"]),
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


def _count_layer_ops(model):
    """Operators one fastpar layer dispatches on the CPU, forward and backward (views excluded)."""
    import torch

    from fastpar.models.layers import ParallelTransformerLayer, rotary_tables
    from fastpar.plan.calibrate import count_ops

    layer = ParallelTransformerLayer(model)
    rope = rotary_tables(model) if model.rotary else None
    x = torch.randn(8, 2, model.d_model, requires_grad=True)
    out = {}
    fwd = count_ops(lambda: out.setdefault("y", layer(x, rope)))
    grad = torch.ones_like(out["y"])
    return fwd, count_ops(lambda: out["y"].backward(grad))


@pytest.mark.parametrize("model", [get_config("tiny"), GPTConfig(
    n_layers=1, d_model=64, n_heads=4, norm="layernorm", activation="gelu", rotary=False,
    bias=True)])
def test_reference_op_counts_match_the_layer(model):
    """The CPU path's operator counts come from the layer's structure; re-count them."""
    fwd, bwd = _count_layer_ops(model)
    linears = 4                                        # qkv, o, fc1 (up + gate), down
    f, b = cost.reference_ops(model)
    f, b = f + linears, b + 2 * linears                # plus the GEMMs (one, then two, each)
    assert abs(f - fwd) <= 0.15 * fwd and abs(b - bwd) <= 0.15 * bwd, (f, fwd, b, bwd)


def test_cpu_profile_counts_operators_and_serialises_tp():
    cpu = Hardware(**{**ROUND.to_dict(), "kind": "cpu", "kernel_overhead_us": 10.0})
    gpu = Hardware(**{**ROUND.to_dict(), "kernel_overhead_us": 10.0})
    tiny = get_config("tiny")
    shape = Shape(tiny, 128, 4)
    lc_cpu, lc_gpu = cost.layer_cost(shape, cpu), cost.layer_cost(shape, gpu)
    f_ops, b_ops = cost.reference_ops(tiny)
    # The reference path launches more operators than the fused one, each paying the overhead.
    assert lc_cpu.f - lc_gpu.f == pytest.approx((f_ops - 2 - 7 + 1 - 2) * 10e-6, rel=0.05)
    assert lc_cpu.b > lc_gpu.b
    work, cluster = Workload(tiny, 128, 16), Cluster(2, 2, cpu)
    est = evaluate(work, cluster, ParallelConfig(tp=2, pp=1, dp=1, micro_batch_size=4))
    # On a CPU nothing hides the TP collectives.
    assert est.tp_exposed_s > 0
    # On a GPU whose GEMMs outlast the collectives, the overlap (two row chunks at this size)
    # hides half of them; on a CPU none.
    slow_gpu = Hardware(**{**gpu.to_dict(), "peak_tflops": 0.01})
    slow_cpu = Hardware(**{**cpu.to_dict(), "peak_tflops": 0.01})
    work, cfg = Workload(tiny, 256, 32), ParallelConfig(tp=2, pp=1, dp=1, micro_batch_size=32)
    assert cost.tp_pieces(Shape(tiny, 256, 32, 2), slow_gpu) == 2
    est_gpu, est_cpu = (evaluate(work, Cluster(2, 2, hw), cfg) for hw in (slow_gpu, slow_cpu))
    assert est_gpu.tp_exposed_s == pytest.approx(0.5 * est_cpu.tp_exposed_s)


def test_curves_interpolate_and_round_trip(tmp_path):
    hw = Hardware(**{**ROUND.to_dict(), "matmul_curve": [[1e6, 0.2], [1e8, 0.6]],
                     "memory_curve": [(1e5, 2000.0), (1e7, 1000.0)],
                     "attention_curve": [(1e6, 0.3)]})
    assert hw.matmul_fraction(1e5) == 0.2 and hw.matmul_fraction(1e9) == 0.6
    assert hw.matmul_fraction(1e7) == pytest.approx(0.4)          # halfway in log size
    assert hw.bandwidth(1e6) == pytest.approx(1500e9)
    assert hw.attention_fraction(5e8) == 0.3
    assert ROUND.attention_fraction(1e6) == ROUND.matmul_efficiency
    # A GEMM's time follows the curve: a 1 MFLOP GEMM at 0.2 of 100 TFLOP/s.
    assert hw.gemm_time(50, 100, 100) == pytest.approx(1e6 / 20e12)
    path = save_hardware(hw, tmp_path / "curved.json")
    assert load_hardware(path) == hw
    with pytest.raises(ValueError, match="kind='tpu'"):
        Hardware(**{**ROUND.to_dict(), "kind": "tpu"})
    with pytest.raises(ValueError, match="matmul_curve"):
        Hardware(**{**ROUND.to_dict(), "matmul_curve": [(1e6, -1.0)]})


def _count_layer_bytes(model, seq=16, batch=2):
    """Bytes the CPU path's operators of one layer read and write, forward and backward, except
    its GEMMs and the attention kernel (views and metadata excluded)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from fastpar.models.layers import ParallelTransformerLayer, rotary_tables

    skip = {"mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_flash_attention_for_cpu_backward", "view", "_unsafe_view",
            "permute", "transpose", "t", "expand", "slice", "select", "as_strided", "unsqueeze",
            "squeeze", "reshape", "alias", "detach", "split", "chunk", "unbind", "narrow",
            "split_with_sizes", "promote_types"}

    class _Bytes(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func._overloadpacket.__name__ not in skip:
                _Bytes.n += sum(t.numel() * t.element_size() for t in
                                tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor))
            return out

    torch.manual_seed(0)
    layer = ParallelTransformerLayer(model)
    rope = rotary_tables(model) if model.rotary else None
    x = torch.randn(seq, batch, model.d_model, requires_grad=True)
    with _Bytes():
        y = layer(x, rope)
    fwd, _Bytes.n = _Bytes.n, 0
    grad = torch.ones_like(y)
    with _Bytes():
        y.backward(grad)
    return fwd, _Bytes.n


@pytest.mark.parametrize("model", [get_config("tiny"), GPTConfig(
    n_layers=1, d_model=64, n_heads=4, norm="layernorm", activation="gelu", rotary=False,
    bias=True)])
def test_reference_bytes_match_the_layer(model):
    """The CPU path's elementwise traffic comes from the layer's structure; re-count it."""
    seq, batch = 64, 2
    fwd, bwd = _count_layer_bytes(model, seq, batch)
    f, b, tr_f, tr_b = (4 * x for x in cost.reference_bytes(Shape(model, seq, batch)))
    assert abs(f - fwd) <= 0.15 * fwd and abs(b - bwd) <= 0.15 * bwd, (f, fwd, b, bwd)
    assert 0 < tr_f < f and 0 < tr_b < b
    # Twice the tokens, twice the bytes (the rotary and norm tables aside).
    assert cost.reference_bytes(Shape(model, seq, 2 * batch))[1] == pytest.approx(2 * b / 4)


def _moe_variants():
    base = get_config("tiny-moe")
    return [base, dataclasses.replace(base, n_experts=8), dataclasses.replace(base, moe_top_k=1),
            dataclasses.replace(base, moe_ffn=96, moe_aux_loss=0.0),
            dataclasses.replace(base, moe_shared_experts=1, moe_shared_gate=True)]


def _moe_mlp(model, tokens):
    import torch

    from fastpar.models.layers import ParallelTransformerLayer
    torch.manual_seed(0)
    mlp = ParallelTransformerLayer(model).mlp
    x = torch.randn(tokens, 1, model.d_model, requires_grad=True)
    return mlp, x


@pytest.mark.parametrize("model", _moe_variants(), ids=["e4k2", "e8", "k1", "ffn96-noaux",
                                                         "shared-gate"])
def test_moe_op_counts_match_the_layer(model):
    """The MoE MLP's operators outside its GEMMs (MOE_OPS), and its GEMMs (loop_linears: a
    loop over the experts off CUDA), re-counted on the module: exactly."""
    import torch

    from fastpar.plan.calibrate import count_ops
    mlp, x = _moe_mlp(model, 256)            # every expert gets rows
    out = {}
    fwd = count_ops(lambda: out.setdefault("y", mlp(x)[0]))
    grad = torch.ones_like(out["y"])
    bwd = count_ops(lambda: out["y"].backward(grad))
    shape = Shape(model, 256, 1)
    gemms = len(cost.loop_linears(shape)) - 4            # less q, k, v, o
    gemms -= 1 if model.moe_shared_experts else 0         # the shared gate-up is one GEMM
    f, b = cost.moe_ops(shape, cpu=True)
    # (top-1's renormalisation has one operator less in its backward)
    assert abs(f + gemms - fwd) + abs(b + 2 * gemms - bwd) <= 1, (f, gemms, fwd, b, bwd)
    # The experts' loop runs per local expert and per pass of a chunked dispatch.
    ep = Shape(model, 256, 1, ep=2, ep_chunks=2)
    assert ep.expert_passes == 4 and cost.moe_ops(ep, True)[0] - f == \
        (model.n_experts // 2 * 4 - model.n_experts) * cost.MOE_OPS["expert"][0]
    assert cost.moe_ops(Shape(get_config("tiny"), 256, 1), True) == (0, 0)


@pytest.mark.parametrize("tokens", [256, 512])
@pytest.mark.parametrize("model", _moe_variants(), ids=["e4k2", "e8", "k1", "ffn96-noaux",
                                                         "shared-gate"])
def test_moe_bytes_match_the_layer(model, tokens):
    """The MoE MLP's traffic outside its GEMMs (its SwiGLU on the rows, MOE_BYTES), re-counted
    on the module."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    # count_ops' free list (views and metadata), plus the GEMMs
    skip = {"mm", "view", "_unsafe_view", "permute", "transpose", "t", "expand", "slice",
            "select", "as_strided", "unsqueeze", "squeeze", "reshape", "alias", "detach",
            "split", "chunk", "unbind", "narrow", "split_with_sizes"}

    class _Bytes(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func._overloadpacket.__name__ not in skip:
                _Bytes.n += sum(t.numel() for t in tree_flatten((args, kwargs, out))[0]
                                if isinstance(t, torch.Tensor))
            return out

    mlp, x = _moe_mlp(model, tokens)
    with _Bytes():
        y = mlp(x)[0]
    fwd, _Bytes.n = _Bytes.n, 0
    grad = torch.ones_like(y)
    with _Bytes():
        y.backward(grad)
    bwd = _Bytes.n
    shape = Shape(model, tokens, 1)
    rows = tokens * model.expert_ffn * (model.moe_top_k + model.moe_shared_experts)
    sw = cost.REFERENCE_BYTES["swiglu"]
    f, b = cost.moe_bytes(shape, cpu=True)
    f, b = f + sw[0] * rows, b + (sw[1] + 4) * rows      # + the gate | up concatenation
    assert abs(f - fwd) <= 0.05 * fwd and abs(b - bwd) <= 0.05 * bwd, (f, fwd, b, bwd)
    # reference_bytes counts the SwiGLU on the rows, not on a dense MLP's width.
    assert cost.reference_bytes(shape)[2] == cost.REFERENCE_BYTES["transcendental"][0] * rows


def test_cpu_activations_run_at_their_own_rate():
    cpu = Hardware(**{**ROUND.to_dict(), "kind": "cpu"})
    assert cpu.activation_time(1e9) == pytest.approx(1e9 / cpu.bandwidth(1e9))
    slow = Hardware(**{**cpu.to_dict(), "activation_gbps": 2.0})
    assert slow.activation_time(1e9) == pytest.approx(0.5) and slow.activation_time(0) == 0.0
    shape = Shape(get_config("tiny"), 128, 4)
    tr_f, tr_b = cost.reference_bytes(shape)[2:]
    fast_f, fast_b = cost._elementwise(shape, cpu, cost.FASTPAR)
    slow_f, slow_b = cost._elementwise(shape, slow, cost.FASTPAR)
    E = cpu.bytes_per_element
    assert slow_f - fast_f == pytest.approx(E * tr_f * (1 / 2e9 - 1 / 1000e9))
    assert slow_b - fast_b == pytest.approx(E * tr_b * (1 / 2e9 - 1 / 1000e9))
    with pytest.raises(ValueError, match="activation_gbps=-1 must be >= 0"):
        Hardware(**{**ROUND.to_dict(), "activation_gbps": -1})
    with pytest.raises(ValueError, match="sync_us=-2 must be >= 0"):
        Hardware(**{**ROUND.to_dict(), "sync_us": -2})


def test_every_collective_call_site_pays_the_sync():
    synced = Hardware(**{**ROUND.to_dict(), "sync_us": 50.0})
    ring = cost.ring_time("all_reduce", 1e6 / 4, 4, 100.0, 0.0)
    assert cost.collective_time("all_reduce", 1e6, 4, 100.0, synced, pieces=4) == \
        pytest.approx(4 * ring + 50e-6)
    assert cost.collective_time("all_reduce", 1e6, 1, 100.0, synced) == 0.0
    shape = Shape(GPT, 2048, 1, tp=4)
    (f0, b0), (f1, b1) = (cost.tp_collectives(shape, hw, 100.0) for hw in (ROUND, synced))
    # Two row linears' outputs and two column linears' input gradients: one sync each.
    assert f1 - f0 == pytest.approx(2 * 50e-6) and b1 - b0 == pytest.approx(2 * 50e-6)
    work, cfg = _work(), ParallelConfig(tp=1, pp=1, dp=8, micro_batch_size=1)
    slow = evaluate(work, Cluster(8, 8, synced), cfg).dp_exposed_s
    assert slow > evaluate(work, Cluster(8, 8, ROUND), cfg).dp_exposed_s


def test_a_call_pays_the_sync_of_its_kind(tmp_path):
    from fastpar.plan.hardware import load_hardware, save_hardware
    kinds = Hardware(**{**ROUND.to_dict(), "sync_us": 50.0,
                        "sync_by_kind": [["all_to_all", 10.0], ["all_gather", 30.0]]})
    assert kinds.sync_by_kind == (("all_gather", 30.0), ("all_to_all", 10.0))
    assert load_hardware(save_hardware(kinds, tmp_path / "hw.json")) == kinds
    assert [kinds.call_sync(k) * 1e6 for k in ("all_reduce", "reduce_scatter", "all_gather",
                                               "all_to_all")] == pytest.approx([50, 50, 30, 10])
    plain = dataclasses.replace(kinds, sync_by_kind=())
    for kind, less in (("all_to_all", 40e-6), ("all_gather", 20e-6), ("all_reduce", 0.0)):
        assert cost.collective_time(kind, 1e6, 4, 100.0, plain) - \
            cost.collective_time(kind, 1e6, 4, 100.0, kinds) == pytest.approx(less)
    # ``sync_as``: the bytes of one kind, the sync of another
    assert cost.collective_time("all_gather", 1e6, 4, 100.0, kinds, sync_as="all_to_all") == \
        pytest.approx(cost.collective_time("all_gather", 1e6, 4, 100.0, plain) - 40e-6)
    # Under SP the overlapped path's column and row forwards and row backward are the C++
    # extension's rings of exchanges (the all-to-all's sync), the column backward's
    # reduce-scatter and its regather the backend's own (a GPU's profile: a CPU hides some of
    # each, test_a_cpu_hides_an_sp_call_s_sync_behind_its_gemm).
    shape = Shape(GPT, 2048, 1, tp=4, sp=True)
    row, col = cost.tp_call_sites(shape)
    (f0, b0), (f1, b1) = (cost.tp_collectives(shape, hw, 100.0, regather=True)
                          for hw in (plain, kinds))
    assert f0 - f1 == pytest.approx((row + col) * 40e-6)
    assert b0 - b1 == pytest.approx(row * 40e-6 + col * 20e-6)
    unfused = dataclasses.replace(cost.FASTPAR, tp_overlap=False)
    (f0, b0), (f1, b1) = (cost.tp_collectives(shape, hw, 100.0, unfused, regather=True)
                          for hw in (plain, kinds))
    assert f0 - f1 == pytest.approx(col * 20e-6)      # the reduce-scatters pay sync_us
    assert b0 - b1 == pytest.approx((row + col) * 20e-6)
    # An expert-parallel layer's all-to-alls (the counts', two of the rows' each way) too.
    moe = Shape(get_config("tiny-moe"), 512, 1)
    (ef0, eb0), (ef1, eb1) = (cost.ep_alltoall(moe, hw, 2, 1, 100.0) for hw in (plain, kinds))
    assert (ef0 - ef1, eb0 - eb1) == pytest.approx((3 * 40e-6, 2 * 40e-6))
    for bad, match in (([["all_reduce", 1.0]], "all_reduce"), ([["all_to_all", -1.0]], "-1.0"),
                       ([["all_gather", 1.0], ["all_gather", 2.0]], "twice"), (5, "pairs")):
        with pytest.raises(ValueError, match=match):
            Hardware(**{**ROUND.to_dict(), "sync_by_kind": bad})


def test_a_cpu_hides_an_sp_call_s_sync_behind_its_gemm():
    """On a CPU the overlapped path's SP calls are each issued before a GEMM and waited after
    it: of each call's sync, that GEMM's time is hidden (a block of the gathered rows in the
    rings, the weight gradient under the column backward's reduce-scatter, the input gradient
    under its regather); the bytes still show."""
    shape = Shape(get_config("tiny"), 240, 4, tp=2, sp=True)
    cols, rows = cost.tp_linears(shape)
    assert cols == [(960, 192, 128), (960, 384, 128)]             # fused QKV, fused gate-up
    assert rows == [(960, 128, 64), (960, 128, 192)]              # o, down
    assert (len(rows), len(cols)) == cost.tp_call_sites(shape)
    cpu = dataclasses.replace(ROUND, kind="cpu", sync_us=2000.0, peak_tflops=0.05,
                              sync_by_kind=(("all_gather", 1500.0), ("all_to_all", 1000.0)))
    bare = dataclasses.replace(cpu, sync_us=0.0, sync_by_kind=())
    f, ex = cpu.for_forward(), 1e-3
    hid_f = sum(min(ex, f.gemm_time(480, n, k)) for m, n, k in cols + rows)
    hid_b = sum(min(ex, cpu.gemm_time(480, k, n)) for m, n, k in rows) + \
        sum(min(2e-3, cpu.gemm_time(n, k, 960)) + min(1.5e-3, cpu.gemm_time(960, k, n))
            for m, n, k in cols)
    assert 0 < hid_f < 4 * ex and 0 < hid_b < 2 * ex + 2 * 3.5e-3     # partly hidden
    (f0, b0), (f1, b1) = (cost.tp_collectives(shape, hw, 1.0, regather=True)
                          for hw in (bare, cpu))
    assert f1 - f0 == pytest.approx(4 * ex - hid_f)
    assert b1 - b0 == pytest.approx(2 * ex + 2 * 3.5e-3 - hid_b)
    # GEMMs of seconds hide every sync; a GPU's (its overlap is the planner's) or the plain
    # path's (no GEMM between issue and wait) none
    slow = dataclasses.replace(cpu, peak_tflops=1e-9)
    assert cost.tp_collectives(shape, slow, 1.0, regather=True) == pytest.approx(
        cost.tp_collectives(shape, dataclasses.replace(slow, sync_us=0.0, sync_by_kind=()),
                            1.0, regather=True))
    gpu, gpu_bare = (dataclasses.replace(h, kind="gpu") for h in (cpu, bare))
    (g0, _), (g1, _) = (cost.tp_collectives(shape, h, 1.0) for h in (gpu_bare, gpu))
    assert g1 - g0 == pytest.approx(4 * ex)
    unfused = dataclasses.replace(cost.FASTPAR, tp_overlap=False)
    (u0, _), (u1, _) = (cost.tp_collectives(shape, h, 1.0, unfused) for h in (bare, cpu))
    assert u1 - u0 == pytest.approx(2 * 1.5e-3 + 2 * 2e-3)


def test_a_call_after_longer_computing_pays_more_sync():
    gappy = Hardware(**{**ROUND.to_dict(), "sync_us": 50.0, "sync_per_gap": 0.25,
                        "sync_gap_us": 1000.0})
    base = cost.collective_time("all_reduce", 1e6, 4, 100.0, gappy)
    # up to the compute the sync was measured after, nothing more; beyond it, a quarter of it
    assert cost.collective_time("all_reduce", 1e6, 4, 100.0, gappy, gap=0.5e-3) == base
    assert cost.collective_time("all_reduce", 1e6, 4, 100.0, gappy, gap=3e-3) == \
        pytest.approx(base + 0.25 * 2e-3)
    # A layer shares its compute between the gaps before its calls: a MoE layer's one forward
    # all-reduce comes after all of the forward, a dense one's two after half of it each.
    shape = Shape(GPT, 2048, 1, tp=4)
    flat = dataclasses.replace(gappy, sync_per_gap=0.0)
    (f0, b0), (f1, b1) = (cost.tp_collectives(shape, hw, 100.0, compute=(0.01, 0.02))
                          for hw in (flat, gappy))
    row, col = cost.tp_call_sites(shape)
    assert f1 - f0 == pytest.approx(row * 0.25 * (0.01 / row - 1e-3))
    assert b1 - b0 == pytest.approx(col * 0.25 * (0.02 / col - 1e-3))
    # layer_cost hands it the layer's own compute: the MoE's one forward call pays for it all
    # (this profile's layers compute for microseconds: measured after 1 us)
    short = dataclasses.replace(gappy, sync_gap_us=1.0)
    for name, calls in (("tiny-moe", 1), ("tiny", 2)):
        layer = Shape(get_config(name), 512, 1, tp=2)
        lc0, lc1 = (cost.layer_cost(layer, hw, tp_link_gbps=100.0)
                    for hw in (dataclasses.replace(short, sync_per_gap=0.0), short))
        assert lc0.f > 2e-6 * calls
        assert lc1.tp_comm_f - lc0.tp_comm_f == pytest.approx(
            calls * 0.25 * (lc0.f / calls - 1e-6))
    with pytest.raises(ValueError, match="sync_per_gap=-1 must be >= 0"):
        Hardware(**{**ROUND.to_dict(), "sync_per_gap": -1})


def test_gradient_accumulation_per_extra_micro_batch():
    work, cluster = _work(), Cluster(8, 8, ROUND)
    fp32 = cost.trainer_features("fp32")
    one = evaluate(work, cluster, ParallelConfig(tp=1, pp=1, dp=8, micro_batch_size=8), fp32)
    eight = evaluate(work, cluster, ParallelConfig(tp=1, pp=1, dp=8, micro_batch_size=1), fp32)
    params = eight.memory["gradients"] * 1e9 / cost.FASTPAR.grad_bytes
    # The first micro-batch's gradients are copied into the buckets (read, write); the seven
    # after it each read two gradients and write one (fp32).
    assert one.grad_accumulation_s == pytest.approx(2 * 4 * params / 1000e9)
    assert eight.grad_accumulation_s == pytest.approx((2 + 7 * 3) * 4 * params / 1000e9)
    # Under amp the weights are fp32 (and a bf16 copy): gradients are bucket views, as fp32.
    amp = evaluate(work, cluster, ParallelConfig(tp=1, pp=1, dp=8, micro_batch_size=1),
                   cost.trainer_features("amp"))
    assert amp.grad_accumulation_s == pytest.approx(eight.grad_accumulation_s)
    # With bf16 weights and fp32 main gradients: zeroed, then every micro-batch added.
    bf16 = cost.trainer_features("bf16")
    eight16 = evaluate(work, cluster, ParallelConfig(tp=1, pp=1, dp=8, micro_batch_size=1), bf16)
    assert eight16.grad_accumulation_s == pytest.approx((1 + 8 * 3) * 4 * params / 1000e9)


def _measure_link_rank(rank, world):
    import collections

    import torch.distributed as dist

    from fastpar.plan.calibrate import measure_link
    gather = "all_gather_single" if hasattr(dist, "all_gather_single") else \
        "all_gather_into_tensor"                                  # torch 2.13's name, or before
    calls, plain = collections.Counter(), {k: getattr(dist, k) for k in (
        "all_reduce", gather, "all_to_all_single")}

    def counted(name):
        def call(*args, **kwargs):
            t = args[0] if name == "all_reduce" else args[1]
            calls[name.replace(gather, "gather") if name != "all_reduce"
                  else t.numel() * t.element_size()] += 1
            return plain[name](*args, **kwargs)
        return call
    for name in plain:
        setattr(dist, name, counted(name))
    try:                                  # one round: what is measured, not how steady
        return measure_link(rounds=1, calls={2 ** 16: 7, 2 ** 24: 3}, gap_calls=5,
                            kind_calls=4), calls
    finally:
        for name, fn in plain.items():
            setattr(dist, name, fn)


def test_measure_link_under_gloo():
    from fastpar.plan.calibrate import LINK_CALLS
    from fastpar.testing import run_ranks
    for (bw, latency, sync, curve, post, per_gap, gap, kinds), calls in run_ranks(
            _measure_link_rank, 2, timeout=120):
        # Each call site size as many times as asked, the rest as LINK_CALLS has them (each
        # timed run after 2 untimed calls); 64 KB and 16 MB also back to back (100 and 4), and
        # 64 KB after the longer computing (5)
        assert calls[2 ** 16] == 102 + 9 + 7 and calls[2 ** 24] == 6 + 5
        assert {x: calls[x] - 2 for x in (2 ** 18, 2 ** 20, 2 ** 22)} == \
            {x: LINK_CALLS[x] for x in (2 ** 18, 2 ** 20, 2 ** 22)}
        assert bw > 1e6 and 0 <= latency < 0.1 and 0 <= sync < 0.1 and 0 < post < 0.1
        # the call sites' three GEMMs of 320 took their time; the growth per second of it is
        # a ratio of seconds, never negative
        assert 1e-5 < gap < 1.0 and 0 <= per_gap < 100
        # the all-gather's and the all-to-all's call sites, 4 calls after 2 untimed ones
        assert calls["gather"] == calls["all_to_all_single"] == 6
        assert sorted(kinds) == ["all_gather", "all_to_all"]
        assert all(0 <= v < 0.1 for v in kinds.values())
        # 64 KB to 16 MB, called after computing; the sync is what the 64 KB call costs beyond
        # the ring model, so the curve is 1 there (unless the call ran under it: no sync)
        assert [x for x, _ in curve] == [2 ** 16, 2 ** 18, 2 ** 20, 2 ** 22, 2 ** 24]
        assert curve[0][1] == pytest.approx(1.0) or sync == 0
        assert all(0 < y < 100 for _, y in curve)
        # a larger all-reduce is never modelled cheaper than a smaller one
        modelled = [sync + y * (2 * latency + x / bw) for x, y in curve]
        assert modelled == sorted(modelled)


def _slowed_link_rank(rank, world, name, extra, calls, kind_calls):
    """``measure_link`` with each call of ``torch.distributed.<name>`` busy ``extra(t)``
    seconds longer on both ranks (``t``: the call's first argument)."""
    import torch.distributed as dist

    from fastpar.plan.calibrate import measure_link
    plain = getattr(dist, name)

    def slowed(*args, **kwargs):
        out = plain(*args, **kwargs)
        end = time.perf_counter() + extra(args[0])
        while time.perf_counter() < end:
            pass
        return out
    setattr(dist, name, slowed)
    try:
        return measure_link(rounds=2, calls={x: calls for x in (2 ** 16, 2 ** 18, 2 ** 20,
                                                                2 ** 22)},
                            gap_calls=4, kind_calls=kind_calls)
    finally:
        setattr(dist, name, plain)


class _EveryEighth:
    """Every eighth 64 KB call 16 ms longer (a picklable ``extra`` for the ranks)."""

    def __init__(self):
        self.count = 0

    def __call__(self, t):
        if t.numel() * t.element_size() != 2 ** 16:
            return 0.0
        self.count += 1
        return 16e-3 if self.count % 8 == 0 else 0.0


def _five_ms(t):
    return 5e-3


def test_a_slow_tail_goes_into_the_sync_not_the_latency():
    """The latency is the back-to-back 64 KB all-reduce's median call: a tail of slow calls
    (one in eight 16 ms longer: at least 2 ms on every round's mean, so that a round's mean
    would put at least 1 ms a ring step into the latency) is the call sites' sync to carry."""
    from fastpar.testing import run_ranks
    for bw, latency, sync, *_ in run_ranks(_slowed_link_rank, 2, "all_reduce", _EveryEighth(),
                                           8, 4, timeout=120):
        assert latency < 0.9e-3
        assert sync > 1.5e-3 and sync > latency


def test_each_kind_of_call_site_has_its_own_sync():
    """The all-to-all's sync is its own call site's: 5 ms slower all-to-alls show in it, not in
    the all-reduce's or the all-gather's (which stay what the host gives them)."""
    from fastpar.testing import run_ranks
    for bw, latency, sync, *_, kinds in run_ranks(_slowed_link_rank, 2, "all_to_all_single",
                                                  _five_ms, 4, 6, timeout=120):
        assert kinds["all_to_all"] > 4.5e-3
        assert kinds["all_to_all"] > kinds["all_gather"] + 2e-3
        assert kinds["all_to_all"] > sync + 2e-3


def _interleaved_rank(rank, world, repeats=1):
    import functools

    from fastpar.plan import calibrate
    events, rounds = [], iter(range(100))
    link = calibrate.measure_link

    def compute(*args, **kwargs):      # round k: every rate (k+1) x, the overhead (k+1) us
        k = next(rounds)
        events.append(("compute", k))
        return ((k + 1) * 1e9, (k + 1) * 1e-6, [(1e6, (k + 1) * 5e8), (1e8, (k + 1) * 1e9)],
                [(2 ** 20, (k + 1) * 1e9), (2 ** 24, (k + 1) * 2e9)], [(1e6, (k + 1) * 3e8)],
                (k + 1) * 1e9)

    def measured_link(*args, between=None, **kwargs):
        def logged(i):
            events.append(("link", i))
            between(i)
        return link(*args, between=logged, calls={x: 3 for x in (2 ** 16, 2 ** 18, 2 ** 20,
                                                                  2 ** 22, 2 ** 24)},
                    gap_calls=3, kind_calls=3, **kwargs)
    calibrate._measure_compute = compute
    calibrate.measure_link = measured_link
    calibrate.measure_layer_overhead = lambda hw, d, **kw: (2e-5, 1e-5)
    calibrate.measure_split_overhead = lambda d, **kw: 1e-4
    calibrate.measure_saved_rate = functools.partial(lambda d, **kw: 1e10)
    hw = calibrate.measure("x", rounds=3, repeats=repeats)
    return events, hw


def test_compute_rounds_are_spread_among_the_link_rounds():
    """Under a process group the calibration's compute rounds run between the link's rounds
    (at rounds 1, 4 and 6 of 8), not three in a row; each figure is the median round's."""
    from fastpar.plan.calibrate import LINK_ROUNDS
    from fastpar.testing import run_ranks
    for events, hw in run_ranks(_interleaved_rank, 2, timeout=180):
        assert LINK_ROUNDS == 8
        assert events == [("link", 0), ("link", 1), ("compute", 0), ("link", 2), ("link", 3),
                          ("link", 4), ("compute", 1), ("link", 5), ("link", 6),
                          ("compute", 2), ("link", 7)]
        assert hw.peak_tflops == pytest.approx(2e-3)             # the middle round's 2e9 FLOP/s
        assert hw.matmul_curve == ((1e6, 0.5), (1e8, 1.0))
        assert hw.memory_curve == ((2 ** 20, 2.0), (2 ** 24, 4.0))
        assert (hw.forward_overhead_us, hw.kernel_overhead_us) == pytest.approx((20.0, 10.0))
        assert hw.intra_node_gbps > 0 and hw.sync_gap_us > 0     # the link was measured too


def test_repeats_run_every_round_that_many_times_spread_alike():
    """``repeats=2`` (``--calibrate-repeats 2``): 16 link rounds and 6 compute rounds, spread
    among them as the 3 among 8 are; each figure the median round's; 0 is refused before any
    measurement."""
    from fastpar.plan import calibrate
    from fastpar.testing import run_ranks
    for events, hw in run_ranks(_interleaved_rank, 2, 2, timeout=180):
        spots = [i for i, (kind, _) in enumerate(events) if kind == "compute"]
        links = [k for kind, k in events if kind == "link"]
        assert links == list(range(16))
        # compute round k runs before link round 1, 4, 6, 9, 12, 14 (after its "link" event)
        assert [spots[k] - k - 1 for k in range(6)] == [1, 4, 6, 9, 12, 14]
        assert hw.peak_tflops == pytest.approx(3.5e-3)   # the median of six rounds: 3.5e9
        assert hw.matmul_curve == ((1e6, 0.5), (1e8, 1.0))
    with pytest.raises(ValueError, match="repeats=0 must be >= 1"):
        calibrate.measure("x", repeats=0)


def test_calibration_takes_the_median_of_its_rounds():
    from fastpar.plan.calibrate import _median_rounds
    # _measure_compute's shape: (peak, overhead, [(flops, rate)], ...); one slow round of three
    # moves no figure, and a point keeps its size
    rounds = [(1.0, 5e-6, [(1e6, 2.0), (1e9, 8.0)], 16.0),
              (0.5, 9e-6, [(1e6, 1.0), (1e9, 3.0)], 4.0),
              (1.1, 6e-6, [(1e6, 2.2), (1e9, 7.0)], 15.0)]
    assert _median_rounds(rounds) == (1.0, 6e-6, [(1e6, 2.0), (1e9, 7.0)], 15.0)
    assert _median_rounds([(1.0, 2.0), (3.0, 1.0), (2.0, 9.0)]) == (2.0, 2.0)   # forward, backward


def _clocked_parts(monkeypatch, part_times):
    """``_timed_parts`` on a step whose n-th call's two parts take ``part_times(n)`` seconds of
    a fake clock (warm-up calls are n = -2, -1)."""
    import types

    from fastpar.plan import calibrate
    clock = [0.0]
    monkeypatch.setattr(calibrate, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    calls = iter(range(-2, 10 ** 6))

    def step(mark):
        first, second = part_times(next(calls))
        clock[0] += first
        mark()
        clock[0] += second
    return calibrate._timed_parts(step, calibrate.torch.device("cpu"), iters=40, windows=5)


def test_host_work_parts_leave_out_a_stall_and_share_a_slow_spell(monkeypatch):
    """The host-work figures (a backward less its forward, a split step less a plain one) time
    both parts in each call, and take the median of five windows' means: one call stalled by
    30 ms, or a slow spell over one window, moves neither part; a stall every few calls (a
    shared core's time slice) stays in every window and is paid."""
    f, b = 2e-3, 4e-3
    assert _clocked_parts(monkeypatch, lambda n: (f, b + 0.03 * (n == 13))) == \
        pytest.approx([f, b])
    spell = _clocked_parts(monkeypatch, lambda n: (f * (1 + (n < 8)), b * (1 + (n < 8))))
    assert spell == pytest.approx([f, b])                    # both parts, the same calls
    sliced = _clocked_parts(monkeypatch, lambda n: (f, b + 3e-3 * (n % 4 == 0)))
    assert sliced == pytest.approx([f, b + 3e-3 / 4])        # two in each window of eight


def test_dp_across_nodes_uses_every_nic_of_its_ranks():
    cluster = Cluster(32, 8, ROUND)                 # NVLink 100 GB/s, one 10 GB/s NIC per GPU
    assert cluster.link_gbps(8) == 100.0 and cluster.link_gbps(16) == 10.0
    assert cluster.link_gbps(16, per_node=4) == 40.0
    assert cluster.link_gbps(32, per_node=16) == 100.0      # NVLink bounds it
    grads = 1e9                                     # bytes of gradients per GPU
    for tp, per_node in ((1, 8), (2, 4), (8, 1)):
        dp = 32 // tp
        cfg = ParallelConfig(tp=tp, pp=1, dp=dp)
        t = planner._dp_time(cluster, cfg, Features(dp_overlap=False), grads / 4, 0.0)
        ring = 2 * (dp - 1) / dp * grads / (min(100.0, 10.0 * per_node) * 1e9)
        # plus the fp32 main gradients divided in place (bf16 weights); the copy into the
        # buckets is the accumulation's
        assert t == pytest.approx(ring + 2 * grads / 1000e9)


@pytest.mark.parametrize("rows", [512, 4096])          # one row chunk, then four
def test_cross_entropy_reference_counts_match_the_loss(rows):
    """The loss's reference bytes and operators, re-counted on the real function."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from fastpar.kernels.cross_entropy import REFERENCE_CHUNK
    from fastpar.tensor_parallel import vocab_parallel_cross_entropy

    free = {"view", "_unsafe_view", "permute", "transpose", "t", "expand", "slice", "select",
            "as_strided", "unsqueeze", "squeeze", "reshape", "alias", "detach", "split", "chunk",
            "unbind", "narrow", "split_with_sizes", "promote_types"}

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes = self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func._overloadpacket.__name__ not in free:
                self.ops += 1
                self.bytes += sum(t.numel() * t.element_size() for t in
                                  tree_flatten((args, kwargs, out))[0]
                                  if isinstance(t, torch.Tensor))
            return out

    V = 1024
    z = torch.randn(rows, V, requires_grad=True)
    target = torch.randint(0, V, (rows,))
    with Count() as fwd:
        loss = vocab_parallel_cross_entropy(z, target).mean()
    with Count() as bwd:
        loss.backward()
    unit, chunks = rows * V * 4, -(-rows * V // REFERENCE_CHUNK)
    (f, b), (fix, per) = cost.REFERENCE_BYTES["cross_entropy"], cost.CE_REFERENCE_OPS
    assert fwd.bytes / unit == pytest.approx(f, rel=0.05)
    assert bwd.bytes / unit == pytest.approx(b, rel=0.05)
    assert (fwd.ops, bwd.ops) == (pytest.approx(fix[0] + per[0] * chunks, rel=0.15),
                                  pytest.approx(fix[1] + per[1] * chunks, rel=0.15))


def test_sensitivity_varies_only_efficiency_and_links():
    from fastpar.plan.sensitivity import sensitivity, vary

    a100 = get_hardware("a100-80gb")
    same = vary(a100, a100.matmul_efficiency, 1.0)
    assert {k: v for k, v in same.to_dict().items() if k != "name"} == \
        {k: v for k, v in a100.to_dict().items() if k != "name"}
    fast = vary(a100, 0.9, 2.0)
    assert (fast.matmul_efficiency, fast.intra_node_gbps, fast.inter_node_gbps) == \
        (0.9, 600.0, 50.0) and fast.hbm_gbps == a100.hbm_gbps
    work, cfg = _work(32), ParallelConfig(tp=2, pp=2, dp=4, micro_batch_size=2)
    grid = sensitivity(lambda hw: evaluate(work, Cluster(16, 8, hw), cfg).step_time_s, a100,
                       (0.6, 0.8), (0.5, 1.0))
    assert grid[(0.8, 1.0)] == evaluate(work, Cluster(16, 8, a100), cfg).step_time_s
    assert grid[(0.6, 1.0)] > grid[(0.8, 1.0)] and grid[(0.8, 0.5)] > grid[(0.8, 1.0)]
    with pytest.raises(ValueError, match="matmul_curve"):
        vary(Hardware(**{**ROUND.to_dict(), "matmul_curve": [(1e6, 0.5)]}), 0.7, 1.0)


def test_context_parallelism_in_the_cost_model():
    """CP: a GPU holds seq/cp tokens (activations / cp), 1/cp of the causal attention, and the
    ring's k/v hops are exposed only beyond the block attention they overlap (all of them on
    a CPU, whose gloo threads share the cores)."""
    s, b = 2048, 2
    one, two = Shape(GPT, s, b), Shape(GPT, s, b, cp=2)
    assert two.tokens == one.tokens // 2
    assert cost.activation_bytes(two, "selective") == pytest.approx(
        cost.activation_bytes(one, "selective") / 2)
    flash = Features(flash_attention=True)
    assert cost._core_time(two, ROUND, flash) < cost._core_time(one, ROUND, flash)
    # One forward hop moves this rank's k and v: 2 * (b s/2) * h * 2 bytes over the link.
    kv = 2 * b * s // 2 * GPT.d_model * 2
    slow = cost.cp_ring_exposed(two, ROUND, 0.1, core_f=1e-4, core_b=2e-4)
    assert slow[0] == pytest.approx(kv / 0.1e9 - 1e-4 / 2)
    assert cost.cp_ring_exposed(two, ROUND, 1000.0, core_f=1.0, core_b=2.0)[0] == 0.0
    assert cost.cp_ring_exposed(one, ROUND, 0.1, 1e-4, 2e-4) == (0.0, 0.0)
    cpu = dataclasses.replace(ROUND, kind="cpu")
    assert cost.cp_ring_exposed(two, cpu, 1000.0, 1.0, 2.0)[0] == pytest.approx(kv / 1000e9)
    # Each hop posts an isend and an irecv: cp - 1 batches forward, 2 cp - 1 backward (the k/v
    # and the accumulators), each post costing the host p2p_post_us.
    posting = dataclasses.replace(cpu, p2p_post_us=100.0)
    four = Shape(GPT, s, b, cp=4)
    for shape, cp in ((two, 2), (four, 4)):
        base, more = (cost.cp_ring_exposed(shape, h, 1000.0, 1.0, 2.0) for h in (cpu, posting))
        assert more[0] - base[0] == pytest.approx(2 * (cp - 1) * 100e-6)
        assert more[1] - base[1] == pytest.approx(2 * (2 * cp - 1) * 100e-6)
    # The planner: half the activation memory, dp x cp in the gradient reduction, a bad
    # sequence length refused naming both numbers; search explores cp only when it is pinned.
    work = Workload(GPT, 2048, 16)
    cluster = Cluster(8, 8, ROUND)
    e1 = evaluate(work, cluster, ParallelConfig(tp=2, pp=1, dp=4, micro_batch_size=1))
    e2 = evaluate(work, cluster, ParallelConfig(tp=2, pp=1, dp=2, micro_batch_size=1, cp=2))
    assert e2.memory["activations"] < 0.6 * e1.memory["activations"]
    assert e2.cp_exposed_s >= 0.0 and e1.cp_exposed_s == 0.0
    with pytest.raises(ValueError, match="sequence length 2050 is not divisible by 2 x cp = 4"):
        evaluate(Workload(GPT.replace(max_seq_len=4096), 2050, 16), cluster,
                 ParallelConfig(tp=2, pp=1, dp=2, micro_batch_size=1, cp=2))
    found = list(planner.candidates(work, cluster, {"cp": 2, "tp": 2, "recompute": "none"}))
    assert found and all(c.cp == 2 and c.tp * c.pp * c.dp * c.cp == 8 for c in found)
    assert all(c.cp == 1 for c in planner.candidates(work, cluster, {"tp": 2}))


def _saved_layer_bytes(model, mode="fp32", recompute="none", seq=96, batch=3, tp_group=None,
                       sp=False):
    """Bytes of the distinct storages autograd saves for one layer's backward on the CPU path
    (the layer's input included, parameters and rotary tables excluded), per token of the
    whole sequence. ``mode`` "bf16": bf16 parameters under bf16 autocast, as ``--precision
    bf16`` trains. ``tp_group`` / ``sp``: this rank's layer under TP (and SP), built as GPT
    builds it (the column inputs gathered again under selective recompute)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from fastpar.mesh.groups import group_size
    from fastpar.models.layers import ParallelTransformerLayer, rotary_tables

    torch.manual_seed(0)
    layer = ParallelTransformerLayer(model, tp_group=tp_group, sequence_parallel=sp,
                                     regather_input=recompute == "selective")
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    layer = layer.to(dtype)
    rope = rotary_tables(model) if model.rotary else None
    rows = seq // group_size(tp_group) if sp else seq
    x = torch.randn(rows, batch, model.d_model, dtype=dtype, requires_grad=True)
    skip = {t.untyped_storage().data_ptr() for t in [*layer.parameters(), *(rope or ())]}
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            saved[s.data_ptr()] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", torch.bfloat16, enabled=mode == "bf16"):
        if recompute == "full":
            checkpoint(layer, x, rope, use_reentrant=False)
        else:
            layer(x, rope, recompute == "selective")
    return sum(saved.values()) / (seq * batch)


_TINY = get_config("tiny")


@pytest.mark.parametrize("model", [
    _TINY, _TINY.replace(n_kv_heads=2), _TINY.replace(dropout=0.1),
    GPTConfig(vocab_size=256, n_layers=1, d_model=128, n_heads=4, norm="layernorm",
              activation="gelu", rotary=False, bias=True)],
    ids=["tiny", "gqa", "dropout", "gpt2-like"])
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_reference_activation_bytes_match_what_autograd_saves(model, mode, recompute):
    """The CPU path's activation memory per layer is what autograd really keeps: every saved
    storage counted once (per-row statistics, left out of the model, are within 1%)."""
    E = 2 if mode == "bf16" else 4
    feat = Features(dropout=model.dropout > 0)
    want = cost.activation_bytes(Shape(model, 96, 3), recompute, feat, E, reference=True)
    assert want / (96 * 3) == pytest.approx(_saved_layer_bytes(model, mode, recompute), rel=0.01)


def _saved_tp_bytes(rank, tp, sp, recompute):
    import torch.distributed as dist

    return _saved_layer_bytes(_TINY, "fp32", recompute, tp_group=dist.new_group(list(range(tp))),
                              sp=sp)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_tp_activation_bytes_match_what_autograd_saves(sp, recompute):
    """Under TP (and SP) too, the model counts what one rank's layer keeps: under SP the
    column linears keep their gathered inputs, tp times the shard, except under selective
    recompute, where they gather them again in backward."""
    from fastpar.testing import run_ranks

    want = cost.activation_bytes(Shape(_TINY, 96, 3, tp=2, sp=sp), recompute, Features(), 4,
                                 reference=True)
    for got in run_ranks(_saved_tp_bytes, 2, sp, recompute, timeout=60):
        assert want / (96 * 3) == pytest.approx(got, rel=0.01)


def test_memory_per_gpu_is_evaluates_memory():
    """The public memory model is the one evaluate() uses; its defaults are the trainer's stage
    split and the schedule's own peak of live micro-batches."""
    work, cluster = Workload(GPT, 2048, 32), Cluster(8, 8, BUILTIN["a100-80gb"])
    for cfg in (ParallelConfig(tp=2, pp=1, dp=4, micro_batch_size=2),
                ParallelConfig(tp=1, pp=4, dp=2, micro_batch_size=1, schedule="gpipe"),
                ParallelConfig(tp=2, pp=2, dp=2, micro_batch_size=2, recompute="full",
                               sequence_parallel=True, zero=1)):
        est = evaluate(work, cluster, cfg)
        # evaluate() splits the stages by its own time costs; the default split is the
        # trainer's (by FLOPs), the same at pp = 1.
        ranges = planner._stage_costs(work, cluster, cfg, cost.FASTPAR, False)[1]
        mem = planner.memory_per_gpu(work, cluster, cfg, ranges=ranges)
        assert mem["total"] == pytest.approx(est.memory_gb_per_gpu)
        if cfg.pp == 1:
            assert planner.memory_per_gpu(work, cluster, cfg) == mem
        assert {k: pytest.approx(v) for k, v in est.memory.items()} == \
            {k: v for k, v in mem.items() if k != "params_per_gpu"}
    # GPipe keeps every micro-batch of the step alive (16 here); the trainer's split gives
    # rank 1 the most layers, 3 of the 8.
    gpipe = ParallelConfig(tp=1, pp=4, dp=2, micro_batch_size=1, schedule="gpipe")
    assert [len(r) for r in planner.partition(GPT.piece_flops(2048), 4)] == [2, 3, 2, 1]
    layer = cost.activation_bytes(Shape(GPT, 2048, 1), "none")
    assert planner.memory_per_gpu(work, cluster, gpipe)["activations"] == \
        pytest.approx(16 * 3 * layer / 1e9)


def test_logits_are_kept_in_the_activation_dtype():
    """The cross entropy saves the logits as they are and writes their gradient in the same
    dtype: bf16 activations hold half the fp32 logits' bytes (no fp32 copy)."""
    model = GPTConfig(vocab_size=51200, n_layers=1, d_model=64, n_heads=4)
    work, cfg = Workload(model, 128, 4), ParallelConfig(tp=1, pp=1, dp=1, micro_batch_size=4)
    acts = {}
    for E in (2, 4):
        hw = Hardware(**{**ROUND.to_dict(), "bytes_per_element": E})
        acts[E] = planner.memory_per_gpu(work, Cluster(1, 1, hw), cfg)["activations"] * 1e9
    logits = 2 * 4 * 128 * model.padded_vocab
    layer = cost.activation_bytes(Shape(model, 128, 4), "none", cost.FASTPAR, 2)
    final_norm = cost.norm_bytes(Shape(model, 128, 4), 2)
    assert acts[2] == pytest.approx(layer + final_norm + logits * 2)
    assert acts[4] == pytest.approx(2 * (layer + final_norm) + logits * 4)


def test_search_records_the_smallest_memory_need():
    """When memory rejects configurations, the search names the one that needs the least:
    the least need of every rejected candidate, evaluated one by one."""
    for work, cluster in ((Workload(get_config("small"), 256, 16),
                           Cluster(4, 4, Hardware(**{**CPU_LIKE.to_dict(), "hbm_gb": 0.1}))),
                          (Workload(GPT, 2048, 16),
                           Cluster(8, 8, Hardware(**{**BUILTIN["a100-80gb"].to_dict(),
                                                     "hbm_gb": 1.5})))):
        every = [evaluate(work, cluster, cfg) for cfg in planner.candidates(work, cluster)]
        too_big = [e for e in every if not e.fits]
        best, rejected = search(work, cluster, top=3)
        assert rejected["memory"] == len(too_big) > 0
        small = rejected["smallest"]
        assert not small.fits and small.memory_gb_per_gpu > cluster.hardware.hbm_gb
        assert small.memory_gb_per_gpu == pytest.approx(
            min(e.memory_gb_per_gpu for e in too_big))
        assert set(small.memory) >= {"weights", "gradients", "optimizer", "activations",
                                     "reserve", "total"}
    best, rejected = search(_work(32), Cluster(8, 8, BUILTIN["a100-80gb"]), top=2)
    assert best and rejected == {"memory": 0, "smallest": None}


def test_cpu_profile_mechanisms():
    """What a CPU profile adds: a forward's own per-operator overhead, the link's curve, the
    host time of posting pipeline messages and ranks sharing cores."""
    cpu = Hardware(**{**ROUND.to_dict(), "kind": "cpu", "kernel_overhead_us": 5.0,
                      "bytes_per_element": 4, "collective_latency_us": 100.0})
    tiny = get_config("tiny")
    shape = Shape(tiny, 128, 4)
    base = cost.layer_cost(shape, cpu)
    slow_fwd = cost.layer_cost(shape, dataclasses.replace(cpu, forward_overhead_us=15.0))
    f_ops = cost.reference_ops(tiny)[0] + len(cost._linears(shape))   # its operators, GEMMs
    assert slow_fwd.f - base.f == pytest.approx(f_ops * 10e-6, rel=0.05)
    assert (slow_fwd.b, slow_fwd.w) == (base.b, base.w)
    # The link curve scales each collective's ring time where it was measured.
    curved = dataclasses.replace(cpu, link_curve=((1e4, 2.0), (1e8, 2.0)))
    nbytes = 2 ** 20
    assert cost.collective_time("all_reduce", nbytes, 2, 1.0, curved) == pytest.approx(
        2 * cost.collective_time("all_reduce", nbytes, 2, 1.0, cpu))
    # Posting messages costs the pipeline's ranks; a DP-only layout sends none.
    work = Workload(tiny, 128, 16)
    pp2 = ParallelConfig(tp=1, pp=2, dp=1, micro_batch_size=4)
    dp2 = ParallelConfig(tp=1, pp=1, dp=2, micro_batch_size=4)
    posting = dataclasses.replace(cpu, p2p_post_us=500.0)
    assert evaluate(work, Cluster(2, 2, posting), pp2).step_time_s > \
        evaluate(work, Cluster(2, 2, cpu), pp2).step_time_s + 8 * 500e-6 * 0.99
    assert evaluate(work, Cluster(2, 2, posting), dp2).step_time_s == pytest.approx(
        evaluate(work, Cluster(2, 2, cpu), dp2).step_time_s)
    # A split backward's autograd calls: per micro-batch and stage, one per layer in B and one
    # per deferred module in W (2 norms + 2 column linears a layer; the embedding, final norm,
    # head).
    zb = dataclasses.replace(pp2, schedule="zb-h1")
    calls = dataclasses.replace(cpu, split_call_us=100.0)
    fbw = [planner._stage_costs(work, Cluster(2, 2, h), zb, cost.FASTPAR, True)[0]
           for h in (cpu, calls)]
    layers = tiny.n_layers // 2
    assert fbw[1][0][1] - fbw[0][0][1] == pytest.approx(layers * 100e-6)
    assert fbw[1][0][2] - fbw[0][0][2] == pytest.approx((4 * layers + 1) * 100e-6)
    assert fbw[1][1][2] - fbw[0][1][2] == pytest.approx((4 * layers + 2) * 100e-6)
    assert evaluate(work, Cluster(2, 2, calls), pp2).step_time_s == pytest.approx(
        evaluate(work, Cluster(2, 2, cpu), pp2).step_time_s)      # 1F1B: no split
    # Four ranks on cores that run two at once: slower than on four cores, at most 2x.
    shared = dataclasses.replace(cpu, concurrent_ranks=2.0)
    pp4 = ParallelConfig(tp=1, pp=4, dp=1, micro_batch_size=4)
    alone, crowded = (evaluate(work, Cluster(4, 4, h), pp4).step_time_s for h in (cpu, shared))
    assert alone < crowded <= 2 * alone
    assert evaluate(work, Cluster(2, 2, shared), pp2).step_time_s == pytest.approx(
        evaluate(work, Cluster(2, 2, cpu), pp2).step_time_s)   # two ranks: nothing shared


def _turn_times(rank, world):
    import functools
    import time

    import torch.distributed as dist

    from fastpar.plan import calibrate

    turns = calibrate._turns(2)
    barrier = functools.partial(dist.barrier)

    def work(b):
        b()
        t0 = time.monotonic()
        time.sleep(0.2)
        return t0, time.monotonic()
    return turns[0], calibrate._in_turns(work, turns, barrier)


def test_ranks_beyond_the_cores_measure_in_turns():
    from fastpar.testing import run_ranks
    out = run_ranks(_turn_times, 4, timeout=120)
    assert [t for t, _ in out] == [0, 0, 1, 1]
    (a0, a1), (b0, b1) = out[0][1], out[2][1]
    assert a1 <= b0 + 1e-3        # the second turn starts after the first has finished
    assert abs(out[0][1][0] - out[1][1][0]) < 0.15      # a turn's ranks run together


def test_interleaved_micro_batches_in_the_model():
    """``interleave=2``: two micro-batches' activations (and logits) held at once, the
    blocks' forward all-reduces hidden behind the other micro-batch's forward and the column
    layers' backward ones behind its backward; offered by the
    search only where the trainer accepts it."""
    work, cluster = _work(64), Cluster(8, 8, BUILTIN["a100-80gb"])
    one = ParallelConfig(tp=8, pp=1, dp=1, micro_batch_size=4, fb_overlap=False)
    two = dataclasses.replace(one, interleave=2)
    m1, m2 = (planner.memory_per_gpu(work, cluster, c) for c in (one, two))
    logits = 4 * 2048 * GPT.padded_vocab / 8 * cluster.hardware.bytes_per_element / 1e9
    # each micro-batch's layers, final norm and logits twice; the logits' gradient once
    assert m2["activations"] == pytest.approx(2 * m1["activations"] - logits)
    assert m2["weights"] == m1["weights"] and m2["optimizer"] == m1["optimizer"]
    e1, e2 = evaluate(work, cluster, one), evaluate(work, cluster, two)
    shape = Shape(GPT, 2048, 4, 8)
    lc = cost.layer_cost(shape, cluster.hardware, "none", cluster.link_gbps(8))
    f1 = planner._stage_costs(work, cluster, one, cost.FASTPAR, False)[0][0][0]
    f2 = planner._stage_costs(work, cluster, two, cost.FASTPAR, False)[0][0][0]
    exposed = cost.exposed(lc.tp_comm_f, lc.gemm_f, cost.tp_pieces(shape, cluster.hardware,
                                                                  cost.FASTPAR))
    assert f1 - f2 == pytest.approx(GPT.n_layers * (exposed - max(0.0, exposed - lc.f)))
    # and each column's input-gradient all-reduce behind the other micro-batch's backward
    b1 = planner._stage_costs(work, cluster, one, cost.FASTPAR, False)[0][0][1]
    b2 = planner._stage_costs(work, cluster, two, cost.FASTPAR, False)[0][0][1]
    back = cost.exposed(lc.tp_comm_b, lc.gemm_b + lc.w, cost.tp_pieces(
        shape, cluster.hardware, cost.FASTPAR))
    assert b1 - b2 == pytest.approx(GPT.n_layers * (back - max(0.0, back - lc.b)))
    assert e2.step_time_s < e1.step_time_s and e2.tp_exposed_s < e1.tp_exposed_s
    offered = [c for c in planner.candidates(work, cluster) if c.interleave == 2]
    assert offered and all(c.tp > 1 and c.pp == 1 and not c.sequence_parallel and
                           c.recompute != "full" and c.zero != 3 for c in offered)
    assert {dataclasses.replace(c, interleave=1) for c in offered} <= \
        set(planner.candidates(work, cluster))


@pytest.mark.parametrize("fb,interleave", [(True, 1), (False, 2)])
def test_on_a_cpu_only_the_sync_of_an_all_reduce_hides(fb, interleave):
    """On a CPU whose cores all compute, another micro-batch's compute hides only each TP
    call's wait for the other ranks (``sync_us``), not the bytes gloo's threads move on the same
    cores: per layer at most (row linears) x sync forward, (column linears) x sync backward."""
    work = _work(64)
    hw = dataclasses.replace(ROUND, kind="cpu", sync_us=300.0, concurrent_ranks=8.0)
    cluster = Cluster(8, 8, hw)
    on = ParallelConfig(tp=8, pp=1, dp=1, micro_batch_size=4, fb_overlap=fb,
                        interleave=interleave)
    off = dataclasses.replace(on, fb_overlap=False, interleave=1)
    M = on.num_microbatches(work.global_batch)
    q = (M - 1) / M if fb else 1.0
    shape = Shape(GPT, 2048, 4, 8)
    lc = cost.layer_cost(shape, hw, "none", cluster.link_gbps(8))
    rows, columns = cost.tp_call_sites(shape)
    assert (rows, columns) == (2, 2)                # fastpar's fused QKV and gate-up
    (f_on, b_on, _), (f_off, b_off, _) = (
        planner._stage_costs(work, cluster, c, cost.FASTPAR, False)[0][0] for c in (on, off))
    assert lc.tp_comm_f > rows * 300e-6 and lc.b > rows * 300e-6      # the sync is the bound
    assert f_off - f_on == pytest.approx(GPT.n_layers * q * rows * 300e-6)
    assert b_off - b_on == pytest.approx(GPT.n_layers * q * columns * 300e-6)
    # with no sync nothing hides; on a GPU profile the bytes hide too
    none = Cluster(8, 8, dataclasses.replace(hw, sync_us=0.0))
    assert planner._stage_costs(work, none, on, cost.FASTPAR, False)[0][0][:2] == \
        planner._stage_costs(work, none, off, cost.FASTPAR, False)[0][0][:2]
    gpu = Cluster(8, 8, dataclasses.replace(hw, kind="gpu"))
    g_on, g_off = (planner._stage_costs(work, gpu, c, cost.FASTPAR, False)[0][0][0]
                   for c in (on, off))
    assert g_off - g_on > f_off - f_on


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_a_cpu_forward_pays_for_writing_what_it_saves(recompute):
    """A training forward writes what it saves for the backward to memory none of its later
    operators reuses (``saved_gbps``, measured on a CPU): each layer's forward costs its saved
    bytes (``cost.activation_bytes``, the torch reference's on a CPU) at that rate more; a full
    recompute saves the layer's input only in the forward and records the whole layer again
    in the backward. Nothing where the rate is not measured (the built-in GPU profiles)."""
    hw = dataclasses.replace(ROUND, kind="cpu", bytes_per_element=4)
    rate = dataclasses.replace(hw, saved_gbps=10.0)
    shape = Shape(GPT, 1024, 2, 2)
    plain, paid = (cost.layer_cost(shape, h, recompute) for h in (hw, rate))
    saved = cost.activation_bytes(shape, recompute, cost.FASTPAR, 4, reference=True)
    assert saved > 0
    assert paid.f - plain.f == pytest.approx(saved / 10e9)
    extra_b = 0.0 if recompute != "full" else \
        cost.activation_bytes(shape, "none", cost.FASTPAR, 4, reference=True) / 10e9
    assert paid.b - plain.b == pytest.approx(extra_b)
    assert (paid.w, paid.gemm_f) == (plain.w, plain.gemm_f)
    assert dataclasses.replace(ROUND, saved_gbps=0.0).saved_time(1e9) == 0.0
    with pytest.raises(ValueError, match="saved_gbps"):
        dataclasses.replace(hw, saved_gbps=-1.0)


def test_forward_inside_backward_in_the_model():
    """``fb_overlap`` (the default): but the first micro-batch's forward and the last one's
    backward, each forward all-reduce hidden behind the previous micro-batch's backward and
    each backward one behind the next one's forward; the next micro-batch's first block held
    next to this one's activations once the logits are freed; nothing where it does not run."""
    work, cluster = _work(64), Cluster(8, 8, BUILTIN["a100-80gb"])
    on = ParallelConfig(tp=8, pp=1, dp=1, micro_batch_size=4)
    off = dataclasses.replace(on, fb_overlap=False)
    M = on.num_microbatches(work.global_batch)
    q = (M - 1) / M
    shape = Shape(GPT, 2048, 4, 8)
    hw = cluster.hardware
    lc = cost.layer_cost(shape, hw, "none", cluster.link_gbps(8))
    pieces = cost.tp_pieces(shape, hw, cost.FASTPAR)
    (f_on, b_on, _), (f_off, b_off, _) = (
        planner._stage_costs(work, cluster, c, cost.FASTPAR, False)[0][0] for c in (on, off))
    fwd = cost.exposed(lc.tp_comm_f, lc.gemm_f, pieces)
    back = cost.exposed(lc.tp_comm_b, lc.gemm_b + lc.w, pieces)
    assert f_off - f_on == pytest.approx(GPT.n_layers * q * (fwd - max(0.0, fwd - lc.b)))
    assert b_off - b_on == pytest.approx(GPT.n_layers * q * (back - max(0.0, back - lc.f)))
    assert f_off > f_on and b_off > b_on
    m_on, m_off = (planner.memory_per_gpu(work, cluster, c) for c in (on, off))
    logits = 4 * 2048 * GPT.padded_vocab / 8 * hw.bytes_per_element / 1e9
    layer = cost.activation_bytes(shape, "none", cost.FASTPAR, hw.bytes_per_element,
                                  False) / 1e9
    assert m_on["activations"] == pytest.approx(
        max(m_off["activations"], m_off["activations"] - logits + layer))
    for where in (dict(sequence_parallel=True), dict(pp=2, tp=4), dict(micro_batch_size=64),
                  dict(tp=1, dp=8)):
        a, b = (dataclasses.replace(c, **where) for c in (on, off))
        assert evaluate(work, cluster, a).step_time_s == evaluate(work, cluster, b).step_time_s


@pytest.mark.parametrize("moe", [dict(n_experts=4, moe_top_k=2, moe_ffn=192),
                                 dict(n_experts=4, moe_top_k=2, moe_ffn=192,
                                      moe_shared_experts=1),
                                 dict(n_experts=8, moe_top_k=1, moe_ffn=64)],
                         ids=["top2", "shared", "top1"])
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_moe_activation_bytes_match_what_autograd_saves(moe, mode, recompute):
    """A mixture-of-experts layer (dropless): the rows gathered by expert, each expert's
    SwiGLU, the outputs and their weighed copy, the routing's indices and weights, as
    autograd keeps them."""
    model = _TINY.replace(**moe)
    E = 2 if mode == "bf16" else 4
    want = cost.activation_bytes(Shape(model, 96, 3), recompute, Features(), E, reference=True)
    assert want / (96 * 3) == pytest.approx(_saved_layer_bytes(model, mode, recompute), rel=0.01)


def test_the_chunked_dispatch_pipeline():
    """`cost._ep_pass` against timelines worked by hand: C transfers of one / C on a link
    that carries one at a time, chunk i's compute after its arrival, its return after it."""
    # Compute-bound, nothing before or after: the first dispatch and the last return show.
    assert cost._ep_pass(1.0, 2, 0.0, 10.0, 0.0) == pytest.approx(1.0)
    assert cost._ep_pass(1.0, 4, 0.0, 10.0, 0.0) == pytest.approx(0.5)
    # Work that needs no transfer, before and after, hides both.
    assert cost._ep_pass(1.0, 2, 0.5, 10.0, 0.5) == pytest.approx(0.0)
    assert cost._ep_pass(1.0, 2, 0.2, 10.0, 0.1) == pytest.approx(0.3 + 0.4)
    # Link-bound: the link runs throughout (two transfers), every compute under it.
    assert cost._ep_pass(1.0, 2, 0.0, 0.1, 0.0) == pytest.approx(2.0 - 0.2)
    # No compute: both transfers; one chunk, nothing around: as blocking.
    assert cost._ep_pass(1.0, 2, 0.0, 0.0, 0.0) == pytest.approx(2.0)
    assert cost._ep_pass(1.0, 1, 0.0, 5.0, 0.0) == pytest.approx(2.0)


def test_a_cpu_dispatch_hides_only_its_waits():
    """On a CPU (``overlap=False``) every transfer's bytes and ring steps show, and of each
    one's sync only what the host computes between issuing and waiting for it is hidden
    (`cost._ep_waits`, worked by hand); the counts' exchange pays its sync whole."""
    # sync 1; chunk 0's dispatch waited after 0.3, chunk 1's after 0.3 + 0.4; chunk 0's return
    # after chunk 1's compute and 0.2, chunk 1's after 0.2
    assert cost._ep_waits(1.0, 2, 0.3, 0.4, 0.2) == pytest.approx(0.7 + 0.3 + 0.4 + 0.8)
    assert cost._ep_waits(1.0, 2, 5.0, 1.0, 5.0) == 0.0
    assert cost._ep_waits(1.0, 3, 0.0, 0.0, 0.0) == pytest.approx(6.0)
    m = get_config("tiny-moe")
    shape, link = Shape(m, 512, 2), 1.0
    synced = dataclasses.replace(ROUND, kind="cpu", sync_us=400.0,
                                 sync_by_kind=(("all_to_all", 300.0),))
    rows = 512 * 2 * m.moe_top_k * m.d_model * synced.bytes_per_element
    bytes_ = 2 * cost.collective_time("all_to_all", rows / 2, 2, link, ROUND)
    counts = cost.collective_time("all_to_all", 8 * m.n_experts * 2, 2, link, synced)
    for hw, hidden in ((synced, False), (dataclasses.replace(synced, peak_tflops=1e-6), True)):
        f, b = cost.ep_alltoall(shape, hw, 2, 2, link, overlap=False)
        if hidden:      # experts computing for seconds: every wait but the counts' hidden
            assert (f, b) == pytest.approx((2 * bytes_ + counts, 2 * bytes_))
        else:           # this profile's experts compute for microseconds: nearly all shows
            assert f > 2 * bytes_ + counts + 4 * 250e-6 and b > 2 * bytes_ + 4 * 250e-6
            assert f <= 2 * bytes_ + counts + 4 * 300e-6 + 1e-12
    # one chunk: blocking, every sync whole
    one = cost.collective_time("all_to_all", rows, 2, link, synced)
    counts1 = cost.collective_time("all_to_all", 8 * m.n_experts, 2, link, synced)
    assert cost.ep_alltoall(shape, synced, 2, 1, link, overlap=False) == \
        pytest.approx((2 * one + counts1, 2 * one))


def test_moe_under_sequence_parallelism_in_the_model():
    """Under tp2 an MoE layer runs whole on each TP rank: on the hidden state without SP, on
    the rank's half of the tokens with SP (half the expert rows, half the bytes dispatched;
    its activations: tests/test_dry_run.py)."""
    m, hw = get_config("8x7b"), BUILTIN["h100-80gb"]
    whole, sp = Shape(m, 4096, 1, tp=2), Shape(m, 4096, 1, tp=2, sp=True)
    assert sp.moe_tokens * 2 == whole.moe_tokens == whole.tokens
    assert [g[0] * 2 for g in cost.expert_gemms(sp)] == [g[0] for g in cost.expert_gemms(whole)]
    assert cost._linears(sp)[:4] == cost._linears(whole)[:4]       # attention unchanged
    (_, b_whole), (_, b_sp) = (cost.ep_alltoall(s, hw, 8, 1, 400.0) for s in (whole, sp))
    half = 4096 // 2 * 2 * 4096 * hw.bytes_per_element     # rows x top 2 x d_model
    assert b_sp == pytest.approx(2 * cost.collective_time("all_to_all", half, 8, 400.0, hw))
    assert b_sp < b_whole


def test_expert_parallelism_in_the_model():
    """An MoE layer's GEMMs are the router's and top_k rows through the experts; ep divides
    the experts' parameters; each layer pays its dispatch: blocking (one chunk) both
    all-to-alls of each pass and the count exchange; in C chunks, when the experts compute
    longer, the first chunk's dispatch and the last one's return in the forward (less what
    the rows a rank keeps compute under them) and the first chunk in the backward (the last
    return behind the weight gradients); `fastpar plan` searches ep where the model has
    experts."""
    m = get_config("8x7b")
    shape, hw = Shape(m, 4096, 1), BUILTIN["h100-80gb"]
    mats = cost._linears(shape)
    assert mats[4] == (4096, 8, 4096) and mats[5:] == cost.expert_gemms(shape) == \
        [(8192, 14336, 4096), (8192, 14336, 4096), (8192, 4096, 14336)]
    assert m.layer_params() - m.layer_params(8) == 3 * 4096 * 14336 * 7
    link = 400.0
    rows = 4096 * 2 * 4096 * hw.bytes_per_element
    one = cost.collective_time("all_to_all", rows, 8, link, hw)
    counts = cost.collective_time("all_to_all", 8 * 8, 8, link, hw)
    f1, b1 = cost.ep_alltoall(shape, hw, 8, 1, link)
    assert f1 == pytest.approx(2 * one + counts) and b1 == pytest.approx(2 * one)
    f2, b2 = cost.ep_alltoall(shape, hw, 8, 2, link)
    experts = sum(hw.for_forward().gemm_time(*g) for g in cost.expert_gemms(shape))
    grads = sum(hw.gemm_time(*g) for g in cost.expert_gemms(shape))
    two = 2 * cost.collective_time("all_to_all", rows / 2, 8, link, hw)
    piece = two / 2
    assert experts * 7 / 8 / 2 > piece     # compute-bound: the chunks hide each other
    counts2 = cost.collective_time("all_to_all", 8 * 8 * 2, 8, link, hw)
    # Forward: the first chunk's dispatch less half the own rows' experts (1/8 of them), the
    # last return less the other half; backward: the first chunk less the own rows' input
    # gradients (the last returns under the weight gradients).
    own = experts / 8 / 2
    assert f2 == pytest.approx(2 * max(0.0, piece - own) + counts2)
    assert b2 == pytest.approx(max(0.0, piece - grads / 8))
    assert f2 - counts2 < two and b2 < two / 2
    assert cost.ep_alltoall(shape, hw, 1, 2, link) == (0.0, 0.0)
    # A shared expert computes under the first chunk's dispatch (here all of it).
    with_shared = Shape(m.replace(moe_shared_experts=1), 4096, 1)
    sf = sum(hw.for_forward().gemm_time(*g) for g in cost._linears(with_shared)[7:10])
    assert sf > piece
    assert cost.ep_alltoall(with_shared, hw, 8, 2, link)[0] == \
        pytest.approx(max(0.0, piece - own) + counts2)
    work, cluster = Workload(m, 4096, 512), Cluster(64, 8, hw)
    base = ParallelConfig(1, 4, 16, 1, 1, "1f1b", "full")
    blocking, chunked = (evaluate(work, cluster, dataclasses.replace(base, ep=8, ep_chunks=c))
                         for c in (1, 2))
    plain = evaluate(work, cluster, base)
    assert chunked.step_time_s < blocking.step_time_s
    assert plain.memory_gb_per_gpu - chunked.memory_gb_per_gpu > 50 and not plain.fits
    # The search (pp, recompute and micro-batch pinned, to keep it short): only ep > 1 fits.
    best, _ = planner.search(work, cluster, top=3,
                             fixed=dict(pp=4, recompute="full", micro_batch_size=1))
    assert best and all(e.config.ep > 1 for e in best)


def test_tp_folded_into_expert_parallelism_in_the_planner():
    """Folded, an ep group is whole TP groups: at tp2 ep8 its all-to-alls stay inside a node of
    8 (unfolded, 8 dp ranks tp apart span two nodes), at the unfolded layout's memory; and it
    holds half the experts per rank of the unfolded ep4 whose all-to-alls span the same node.
    The search offers it wherever SP is on."""
    m = get_config("8x7b")
    work, cluster = Workload(m, 4096, 512), Cluster(64, 8, BUILTIN["h100-80gb"])
    base = ParallelConfig(2, 4, 8, 1, 1, "1f1b", "full", True)
    plain8, fold8, plain4 = (evaluate(work, cluster, dataclasses.replace(base, **kw)) for kw in (
        dict(ep=8), dict(ep=8, ep_fold_tp=True), dict(ep=4)))
    assert fold8.step_time_s < plain8.step_time_s
    assert fold8.memory_gb_per_gpu == pytest.approx(plain8.memory_gb_per_gpu)
    assert fold8.memory_gb_per_gpu < plain4.memory_gb_per_gpu - 10
    found = {(c.ep, c.ep_fold_tp, c.sequence_parallel) for c in planner.candidates(
        work, cluster, dict(tp=2, pp=4, schedule="1f1b", recompute="full", zero=0,
                            micro_batch_size=1))}
    assert (8, True, True) in found and (4, True, True) in found
    assert not any(fold and not sp for _, fold, sp in found)


def test_sequence_parallel_sums_partial_gradients_and_moe_counts_over_tp(monkeypatch):
    """Under SP: once a step one fp32 all-reduce over TP of the parameters every TP rank holds
    whole (norms; an MoE layer's router and experts, the experts not when folded into ep),
    copied in and back; and per MoE layer and micro-batch the token counts all-reduced over
    the SP group (the auxiliary loss counts whole sequences)."""
    cpu = Hardware(**{**ROUND.to_dict(), "kind": "cpu"})
    cluster, moe = Cluster(2, 2, cpu), get_config("tiny-moe")
    work, ranges = Workload(moe, 128, 8), [range(moe.n_layers)]
    sp = ParallelConfig(tp=2, pp=1, dp=1, micro_batch_size=2, sequence_parallel=True)

    def expected(n):
        return cost.collective_time("all_reduce", 4 * n, 2, cluster.link_gbps(2), cpu) + \
            cpu.memory_time(16 * n, 2)
    whole = moe.replicated_layer_params() + moe.moe_params()
    assert planner._replicated_time(work, cluster, sp, ranges) == pytest.approx(
        expected(4 * whole + moe.d_model))
    folded = dataclasses.replace(sp, dp=2, ep=2, ep_fold_tp=True)
    assert planner._replicated_time(work, cluster, folded, ranges) == pytest.approx(
        expected(4 * (whole - moe.routed_expert_params()) + moe.d_model))      # router only
    assert planner._replicated_time(work, cluster, dataclasses.replace(
        sp, sequence_parallel=False), ranges) == 0.0
    tiny = get_config("tiny")
    assert planner._replicated_time(Workload(tiny, 128, 8), cluster, sp, ranges) == \
        pytest.approx(expected(4 * tiny.replicated_layer_params() + tiny.d_model))
    # The step pays it: evaluate's step is larger by exactly that.
    base = evaluate(work, cluster, sp).step_time_s
    monkeypatch.setattr(planner, "_replicated_time", lambda *a: 0.0)
    assert base - evaluate(work, cluster, sp).step_time_s == pytest.approx(
        expected(4 * whole + moe.d_model))
    monkeypatch.undo()

    seen = []
    real = cost.collective_time

    def spy(kind, nbytes, n, *args, **kw):
        seen.append((kind, nbytes, n))
        return real(kind, nbytes, n, *args, **kw)
    monkeypatch.setattr(cost, "collective_time", spy)
    planner._stage_costs(work, cluster, sp, cost.FASTPAR, False)
    assert ("all_reduce", 8 * moe.n_experts, 2) in seen
    seen.clear()
    planner._stage_costs(work, cluster, dataclasses.replace(sp, sequence_parallel=False),
                         cost.FASTPAR, False)
    assert ("all_reduce", 8 * moe.n_experts, 2) not in seen
