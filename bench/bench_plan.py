"""Check the planner's predictions: against published GPT runs on A100s, and against fastpar's own
training step measured on this machine.

    flock /tmp/fastpar-bench.lock python bench/bench_plan.py [--skip-cpu] [--skip-search]
    python bench/bench_plan.py --sensitivity      # arithmetic only: nothing is run or timed
    flock /tmp/fastpar-bench.lock python bench/bench_plan.py --set holdout   # out of sample

1. Published runs. Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
   Clusters Using Megatron-LM" (SC21), Table 1 (weak scaling, A100 80 GB in DGX A100 nodes:
   8 GPUs per node, NVLink/NVSwitch inside, 8 x 200 Gb/s HDR InfiniBand per node). Every model:
   sequence length 2048, vocabulary 51,200. Columns used here, as printed in the table:
   parameters (B), heads, hidden, layers, TP, PP, GPUs, global batch, achieved TFLOP/s per GPU:

       1.7  24  2304  24  1  1    32   512  137        145.6   96 12288  80  8  8  1536  2304  148
       3.6  32  3072  30  2  1    64   512  138        310.1  128 16384  96  8 16  1920  2160  155
       7.5  32  4096  36  4  1   128   512  142        529.6  128 20480 105  8 35  2520  2520  163
      18.4  48  6144  40  8  1   256  1024  135       1008.0  160 25600 128  8 64  3072  3072  163
      39.1  64  8192  48  8  2   512  1536  138
      76.1  80 10240  60  8  4  1024  1792  140

   These numbers are quoted from memory of that table (widely reproduced, e.g. in the Megatron-LM
   README); they were checked for consistency (GPUs = TP x PP x DP, parameters from the shape),
   not against the paper itself here. The paper counts FLOPs with full activation recomputation
   (its appendix: 96 B s l h^2 (1 + s/6h + V/16lh)), so the prediction compared is the FLOPs
   computed per second (``hw_tflops_per_gpu``), recompute included. What the table does not
   give is assumed, the same for every row, from the paper's description of the system at the
   time: micro-batch size 1, the 1F1B schedule, full recompute, fp16 weights with fp32 master
   weights and gradients (18 bytes per parameter), unfused attention with dropout, and no overlap
   of TP or DP communication with compute (``MEGATRON_2021`` below). No constant is fitted to
   them: the hardware is the built-in ``a100-80gb`` profile (datasheet numbers and an assumed 80%
   GEMM efficiency). They are in sample all the same: they were re-checked after every change
   to the cost model. The planner then searches each row's model, cluster and batch (same
   software features) and reports its best; ``best_vs_published_cfg`` (predicted step of the
   published layout / of the best) is >= 1 by construction, the published layout being one of
   the candidates, so it checks nothing: it is what the planner predicts its choice would gain,
   not a measured gain.
   ``--sensitivity`` predicts every row again at each ``matmul_efficiency`` and link bandwidth
   factor of ``fastpar.plan.sensitivity`` (0.6-0.9, x0.5-x2).

2. This machine. In one run per layout (pp=2, pp=4, tp=2, dp=2; the ``tiny`` model, sequence 128,
   global batch 16, micro-batch 4, 1F1B), every rank first calibrates (matmul rate, copy
   bandwidth, gloo all-reduce), all ranks at once as they then train; then fastpar's trainer
   runs ``--steps`` steps, and every rank calibrates again. The median step after the first
   two (slowest rank) is compared with the geometric mean of the predictions from rank 0's
   two profiles.

3. Out of sample (``--set holdout``): the same measurement on the ``HOLDOUT`` cases, other
   workloads, schedules and layouts than those of 2, fixed before their first run (in sample
   since 2026-12-03). ``--set holdout2``: the ``HOLDOUT2`` cases, fixed on 2026-12-03 after
   that day's changes, with the spread of each case's predictions and, per workload, whether
   the layout predicted fastest is the one measured fastest (in sample since the split
   backward's calls were modelled). ``--set holdout3``: the ``HOLDOUT3`` cases, the same way
   (in sample since); ``--set holdout4``: the ``HOLDOUT4`` cases (tp2 with interleaved
   micro-batches among them), the same way (in sample since); ``--set holdout5``: the
   ``HOLDOUT5`` cases (tp2 with and without the forward inside the backward); ``--set
   holdout6``: the ``HOLDOUT6`` cases (mixtures of experts: dp, ep, TP folded into ep, pp);
   ``--set holdout7``: the ``HOLDOUT7`` cases (mixtures of experts on new shapes); ``--set
   holdout8``: the ``HOLDOUT8`` cases (sequence and context parallelism, MoE and dense);
   ``--set holdout9``: the ``HOLDOUT9`` cases (CP, SP, dp, pp; dense and MoE); ``--set
   holdout10``: the ``HOLDOUT10`` cases (SP with and without recompute, CP, dp, ep, ZB-H1).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from fastpar.models import GPTConfig, get_config  # noqa: E402
from fastpar.models.config import PRESETS  # noqa: E402
from fastpar.plan import (Cluster, Features, ParallelConfig, Workload, evaluate,  # noqa: E402
                          get_hardware, search, trainer_features)
from fastpar.plan.sensitivity import EFFICIENCIES, LINK_SCALES, sensitivity  # noqa: E402

MEGATRON_2021 = Features(tp_overlap=False, dp_overlap=False, flash_attention=False,
                         dropout=True, weight_bytes=2, grad_bytes=4, optimizer_bytes=12,
                         fused_qkv=True)
# (parameters B, heads, hidden, layers, tp, pp, gpus, global batch, published TFLOP/s per GPU)
TABLE1 = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
          (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
          (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
          (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
          (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
          (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
          (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]
LAYOUTS = [dict(tp=1, pp=2, dp=1), dict(tp=1, pp=4, dp=1), dict(tp=2, pp=1, dp=1),
           dict(tp=1, pp=1, dp=2)]


def _published_case(params, heads, hidden, layers, tp, pp, gpus, batch):
    """The workload and the published layout of one Table 1 row."""
    model = GPTConfig(vocab_size=51200, n_layers=layers, d_model=hidden, n_heads=heads,
                      max_seq_len=2048, norm="layernorm", activation="gelu", rotary=False,
                      bias=True)
    return Workload(model, 2048, batch), ParallelConfig(tp, pp, gpus // (tp * pp), 1, 1, "1f1b",
                                                        "full")


def published(do_search: bool) -> list[dict]:
    hw, rows = get_hardware("a100-80gb"), []
    for params, heads, hidden, layers, tp, pp, gpus, batch, tflops in TABLE1:
        work, cfg = _published_case(params, heads, hidden, layers, tp, pp, gpus, batch)
        cluster = Cluster(gpus, 8, hw)
        est = evaluate(work, cluster, cfg, MEGATRON_2021)
        row = {"params_b": params, "tp": tp, "pp": pp, "dp": cfg.dp, "gpus": gpus,
               "batch": batch, "published": tflops, "predicted": round(est.hw_tflops_per_gpu, 1),
               "ratio": round(est.hw_tflops_per_gpu / tflops, 3),
               "bubble": round(est.bubble_fraction, 3), "mem_gb": round(est.memory_gb_per_gpu, 1),
               "fits": est.fits}
        if do_search:
            t0 = time.perf_counter()
            fixed = {"recompute": "full"} if params > 100 else None   # keeps the search short
            best, _ = search(work, cluster, MEGATRON_2021, fixed=fixed, top=1)
            b = best[0]
            c = b.config
            row["best"] = (f"tp{c.tp} pp{c.pp} dp{c.dp} v{c.virtual_stages} "
                           f"mbs{c.micro_batch_size} {c.schedule} {c.recompute}"
                           f"{' sp' if c.sequence_parallel else ''}"
                           f"{f' zero{c.zero}' if c.zero else ''}")
            row["best_vs_published_cfg"] = round(est.step_time_s / b.step_time_s, 3)
            row["search_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
    return rows


def published_sensitivity() -> tuple[list[dict], list[dict]]:
    """Predicted / published TFLOP/s of every Table 1 row at each matmul_efficiency and link
    bandwidth factor of ``fastpar.plan.sensitivity`` (arithmetic only); and per grid point the
    range over the rows and how many are within 15%."""
    hw, rows, schedules = get_hardware("a100-80gb"), [], {}
    for params, heads, hidden, layers, tp, pp, gpus, batch, tflops in TABLE1:
        work, cfg = _published_case(params, heads, hidden, layers, tp, pp, gpus, batch)
        grid = sensitivity(lambda h: evaluate(work, Cluster(gpus, 8, h), cfg, MEGATRON_2021,
                                              schedules).hw_tflops_per_gpu / tflops, hw)
        row = {"params_b": params, "tp": tp, "pp": pp, "dp": cfg.dp}
        row.update({_grid_key(e, s): round(r, 3) for (e, s), r in grid.items()})
        rows.append(row)
    summary = []
    for e in EFFICIENCIES:
        row = {"matmul_efficiency": e}
        for s in LINK_SCALES:
            r = [x[_grid_key(e, s)] for x in rows]
            row[f"link x{s:g}"] = (f"{min(r):.2f}-{max(r):.2f} "
                                   f"({sum(abs(x - 1) <= 0.15 for x in r)}/{len(r)} within 15%)")
        summary.append(row)
    return rows, summary


def _grid_key(e: float, s: float) -> str:
    return f"e{e:g} x{s:g}"


# (preset, sequence length, global batch, micro-batch) of the CPU runs: the tiny model, mostly
# per-operator overhead, and the small one (8 layers, d_model 256), mostly GEMMs.
CPU_RUNS = {"tiny": ("tiny", 128, 16, 4), "small": ("small", 256, 8, 2)}

# Out of sample (--set holdout). Fixed on 2026-12-01, before any of these cases was run or even
# predicted, and after the cost model's constants were frozen (fastpar/plan/hardware.py). None
# was used while the cost model was built: the development runs above were the tiny model at
# sequence 128 under 1F1B (pp2, pp4, tp2, dp2; the small run at 256 was defined, never
# reported). Here: the small preset at sequence 64 and the tiny one at 256, the GPipe, ZB-H1
# and interleaved schedules, and tp2 x pp2; 2-4 ranks each. What counts, decided now: every
# case's predicted / measured step (median of --repeats runs, every run kept), reported all
# together, none dropped or rerun alone; the aim is within 20% as for the development runs.
# A change to the cost model made after their numbers are seen puts them in sample.
HOLDOUT_RUNS = {"small-s64": ("small", 64, 8, 2), "tiny-s256": ("tiny", 256, 8, 2)}
HOLDOUT = [
    ("small-s64", dict(tp=1, pp=2, dp=1, schedule="gpipe")),
    ("small-s64", dict(tp=1, pp=2, dp=1, schedule="interleaved", virtual_stages=2)),
    ("small-s64", dict(tp=1, pp=4, dp=1, schedule="zb-h1")),
    ("small-s64", dict(tp=2, pp=1, dp=1)),
    ("small-s64", dict(tp=2, pp=2, dp=1, schedule="interleaved", virtual_stages=2)),
    ("tiny-s256", dict(tp=1, pp=2, dp=1, schedule="zb-h1")),
    ("tiny-s256", dict(tp=1, pp=2, dp=1, schedule="interleaved", virtual_stages=2)),
    ("tiny-s256", dict(tp=1, pp=1, dp=2)),
    ("tiny-s256", dict(tp=2, pp=2, dp=1, schedule="gpipe")),
]
# Second out-of-sample set (--set holdout2). Fixed on 2026-12-03 before any of these cases was
# run or predicted, after the cost model and calibration changes of that day were frozen
# (every case above, dev and holdout, was used while making them and is in sample). Other
# workloads than any used before: the small preset at sequence 128 and the tiny one at 64 with
# micro-batches of 8. Per workload every 2-rank layout the trainer runs (dp2, tp2, pp2 under
# 1F1B and ZB-H1), plus one 4-rank layout. What counts, decided now: per case, every run's
# predicted / measured step within 15%; the predictions of one case from run to run within 5%
# (max / min); and per workload, the layout the planner predicts fastest among the 2-rank ones
# is the one measured fastest (median of the runs). All reported, none dropped or rerun alone.
HOLDOUT2_RUNS = {"small-s128": ("small", 128, 8, 2), "tiny-s64": ("tiny", 64, 32, 8)}
HOLDOUT2 = [
    ("small-s128", dict(tp=1, pp=1, dp=2)),
    ("small-s128", dict(tp=2, pp=1, dp=1)),
    ("small-s128", dict(tp=1, pp=2, dp=1, schedule="1f1b")),
    ("small-s128", dict(tp=1, pp=2, dp=1, schedule="zb-h1")),
    ("small-s128", dict(tp=2, pp=2, dp=1, schedule="1f1b")),
    ("tiny-s64", dict(tp=1, pp=1, dp=2)),
    ("tiny-s64", dict(tp=2, pp=1, dp=1)),
    ("tiny-s64", dict(tp=1, pp=2, dp=1, schedule="1f1b")),
    ("tiny-s64", dict(tp=1, pp=2, dp=1, schedule="zb-h1")),
    ("tiny-s64", dict(tp=1, pp=2, dp=2, schedule="1f1b")),
]
# Third out-of-sample set (--set holdout3). Fixed on 2026-12-03 (morning) before any of these
# cases was run or predicted, after the model was frozen with the split backward's calls
# (split_call_us) and the CPU trainer's fp32 precision; every case above is in sample. Two
# workloads no earlier run used: small at sequence 96 in 4 micro-batches of 4, tiny at sequence
# 192 in 6 micro-batches of 2. Per workload every 2-rank layout (dp2, tp2, pp2 under 1F1B and
# ZB-H1) and one 4-rank layout not in the earlier sets (tp2 x dp2; pp4 1F1B). The same targets
# as HOLDOUT2, all reported, none dropped or rerun alone.
HOLDOUT3_RUNS = {"small-s96": ("small", 96, 16, 4), "tiny-s192": ("tiny", 192, 12, 2)}
HOLDOUT3 = [
    ("small-s96", dict(tp=1, pp=1, dp=2)),
    ("small-s96", dict(tp=2, pp=1, dp=1)),
    ("small-s96", dict(tp=1, pp=2, dp=1, schedule="1f1b")),
    ("small-s96", dict(tp=1, pp=2, dp=1, schedule="zb-h1")),
    ("small-s96", dict(tp=2, pp=1, dp=2)),
    ("tiny-s192", dict(tp=1, pp=1, dp=2)),
    ("tiny-s192", dict(tp=2, pp=1, dp=1)),
    ("tiny-s192", dict(tp=1, pp=2, dp=1, schedule="1f1b")),
    ("tiny-s192", dict(tp=1, pp=2, dp=1, schedule="zb-h1")),
    ("tiny-s192", dict(tp=1, pp=4, dp=1, schedule="1f1b")),
]
# Fourth out-of-sample set (--set holdout4). Fixed on 2026-12-03 (night) before any of these
# cases was run or predicted, with the model as of the interleaved micro-batches' term (a layer's
# forward all-reduces hidden behind the other micro-batches' forward; written from the
# mechanism, never compared with a planner run); every case above is in sample, and this
# machine (an AMD EPYC VM) is not the one they ran on. Two workloads no earlier run used: small
# at sequence 160 in 4 micro-batches of 2, tiny at sequence 96 in 4 micro-batches of 4. Per
# workload every 2-rank layout, tp2 with and without --interleave 2 among them, and one 4-rank
# layout. The same targets as HOLDOUT2, all reported, none dropped or rerun alone.
HOLDOUT4_RUNS = {"small-s160": ("small", 160, 8, 2), "tiny-s96": ("tiny", 96, 16, 4)}
HOLDOUT4 = [
    ("small-s160", dict(tp=1, pp=1, dp=2)),
    ("small-s160", dict(tp=2, pp=1, dp=1)),
    ("small-s160", dict(tp=2, pp=1, dp=1, interleave=2)),
    ("small-s160", dict(tp=1, pp=2, dp=1, schedule="1f1b")),
    ("small-s160", dict(tp=1, pp=2, dp=1, schedule="zb-h1")),
    ("small-s160", dict(tp=2, pp=1, dp=2, interleave=2)),
    ("tiny-s96", dict(tp=1, pp=1, dp=2)),
    ("tiny-s96", dict(tp=2, pp=1, dp=1)),
    ("tiny-s96", dict(tp=2, pp=1, dp=1, interleave=2)),
    ("tiny-s96", dict(tp=1, pp=2, dp=1, schedule="1f1b")),
    ("tiny-s96", dict(tp=1, pp=2, dp=1, schedule="zb-h1")),
    ("tiny-s96", dict(tp=2, pp=2, dp=1, schedule="1f1b")),
]
# Fifth out-of-sample set (--set holdout5). Fixed on 2026-12-04 before any of these cases was
# run or predicted, with the model as of the forward-inside-backward term (on (M - 1) / M of the
# micro-batches a layer's forward all-reduces hidden behind its backward compute and the
# backward's behind its forward compute; written from the mechanism, never compared with a
# planner run; the tp2 steps of bench_train.py had been measured); every case above is in
# sample. Two workloads no earlier run used: small at sequence 224 in 4 micro-batches of 2,
# tiny at sequence 160 in 6 micro-batches of 2. Per workload dp2, tp2 (forward inside
# backward, the default) and tp2 with --no-fb-overlap, one pp2 schedule, and tp2 x dp2. The
# same targets as HOLDOUT2, all reported, none dropped or rerun alone.
HOLDOUT5_RUNS = {"small-s224": ("small", 224, 8, 2), "tiny-s160": ("tiny", 160, 12, 2)}
HOLDOUT5 = [
    ("small-s224", dict(tp=1, pp=1, dp=2)),
    ("small-s224", dict(tp=2, pp=1, dp=1)),
    ("small-s224", dict(tp=2, pp=1, dp=1, fb_overlap=False)),
    ("small-s224", dict(tp=1, pp=2, dp=1, schedule="1f1b")),
    ("small-s224", dict(tp=2, pp=1, dp=2)),
    ("tiny-s160", dict(tp=1, pp=1, dp=2)),
    ("tiny-s160", dict(tp=2, pp=1, dp=1)),
    ("tiny-s160", dict(tp=2, pp=1, dp=1, fb_overlap=False)),
    ("tiny-s160", dict(tp=1, pp=2, dp=1, schedule="zb-h1")),
    ("tiny-s160", dict(tp=2, pp=1, dp=2)),
]
# Sixth out-of-sample set (--set holdout6): mixtures of experts. Fixed on 2026-12-04 before any
# of these cases was run or predicted, with the model as of that day (the MoE layer's GEMMs, its
# dispatch as cost.ep_alltoall, TP folded into ep; no MoE step was ever compared with a
# prediction); every case above is in sample. The tiny-moe preset (4 experts, top 2) at
# sequence 192 in 4 micro-batches of 2. Every 2-rank layout the trainer runs it with: dp2 with
# the experts replicated, dp2 ep2 (two chunks, the default) and blocking (one chunk), tp2 with
# SP, and with TP folded into ep 2, pp2 1F1B; and one 4-rank layout, dp2 x pp2 ep2. The same
# targets as HOLDOUT2, all reported, none dropped or rerun alone.
HOLDOUT6_RUNS = {"moe-s192": ("tiny-moe", 192, 8, 2)}
HOLDOUT6 = [
    ("moe-s192", dict(tp=1, pp=1, dp=2)),
    ("moe-s192", dict(tp=1, pp=1, dp=2, ep=2)),
    ("moe-s192", dict(tp=1, pp=1, dp=2, ep=2, ep_chunks=1)),
    ("moe-s192", dict(tp=2, pp=1, dp=1, sequence_parallel=True)),
    ("moe-s192", dict(tp=2, pp=1, dp=1, sequence_parallel=True, ep=2, ep_fold_tp=True)),
    ("moe-s192", dict(tp=1, pp=2, dp=1, schedule="1f1b")),
    ("moe-s192", dict(tp=1, pp=2, dp=2, ep=2, schedule="1f1b")),
]
# Seventh out-of-sample set (--set holdout7): mixtures of experts again, on shapes never run or
# predicted. Fixed on 2026-12-04 after the MoE layer's operators, bytes and per-expert GEMM loop
# entered the cost model (counted on the module, tests/test_plan.py) and before any case below
# ran; HOLDOUT6 is in sample since (its under-prediction is what sent us to count them). A
# model of 8 experts of 128 with one shared expert at sequence 256 (4 micro-batches of 2), and
# tiny-moe at sequence 128 (4 micro-batches of 4). The same targets, all reported.
PRESETS.setdefault("bench-moe8", get_config("tiny-moe", n_experts=8, moe_ffn=128,
                                            moe_shared_experts=1))
HOLDOUT7_RUNS = {"moe8-s256": ("bench-moe8", 256, 8, 2), "moe-s128": ("tiny-moe", 128, 16, 4)}
HOLDOUT7 = [
    ("moe8-s256", dict(tp=1, pp=1, dp=2)),
    ("moe8-s256", dict(tp=1, pp=1, dp=2, ep=2)),
    ("moe8-s256", dict(tp=1, pp=1, dp=2, ep=2, ep_chunks=1)),
    ("moe8-s256", dict(tp=2, pp=1, dp=1, sequence_parallel=True)),
    ("moe8-s256", dict(tp=1, pp=2, dp=1, schedule="1f1b")),
    ("moe-s128", dict(tp=1, pp=1, dp=2)),
    ("moe-s128", dict(tp=2, pp=1, dp=1, sequence_parallel=True, ep=2, ep_fold_tp=True)),
    ("moe-s128", dict(tp=1, pp=2, dp=1, schedule="zb-h1")),
]
# Eighth out-of-sample set (--set holdout8): sequence and context parallelism, where the
# partial gradients' all-reduce once a step and the MoE layer's count all-reduces entered the
# model (1efb58b, after HOLDOUT7 ran: HOLDOUT7 is in sample since). Fixed before any case below
# ran: bench-moe8 at sequence 128 (4 micro-batches of 4), tiny-moe at 256 (4 of 2), and the
# dense small model at 192 (4 of 2).
HOLDOUT8_RUNS = {"moe8-s128": ("bench-moe8", 128, 16, 4), "moe-s256": ("tiny-moe", 256, 8, 2),
                 "small-s192": ("small", 192, 8, 2)}
HOLDOUT8 = [
    ("moe8-s128", dict(tp=1, pp=1, dp=2)),
    ("moe8-s128", dict(tp=2, pp=1, dp=1, sequence_parallel=True)),
    ("moe8-s128", dict(tp=2, pp=1, dp=1, sequence_parallel=True, ep=2, ep_fold_tp=True)),
    ("moe8-s128", dict(tp=1, pp=1, dp=1, cp=2)),
    ("moe-s256", dict(tp=2, pp=1, dp=1, sequence_parallel=True)),
    ("moe-s256", dict(tp=1, pp=1, dp=1, cp=2)),
    ("small-s192", dict(tp=2, pp=1, dp=1, sequence_parallel=True)),
    ("small-s192", dict(tp=1, pp=1, dp=2)),
]
# Ninth out-of-sample set (--set holdout9): after the CP ring's posts entered the model (CP's
# under-prediction in HOLDOUT8, in sample since). Fixed before any case below ran: the dense
# tiny model at sequence 256 (4 micro-batches of 2) and bench-moe8 at 192 (4 of 2), under cp2,
# tp2 SP, dp2 and pp2, and one 4-rank cp2 x dp2.
HOLDOUT9_RUNS = {"tiny-s256": ("tiny", 256, 8, 2), "moe8-s192": ("bench-moe8", 192, 8, 2)}
HOLDOUT9 = [
    ("tiny-s256", dict(tp=1, pp=1, dp=1, cp=2)),
    ("tiny-s256", dict(tp=2, pp=1, dp=1, sequence_parallel=True)),
    ("tiny-s256", dict(tp=1, pp=1, dp=2)),
    ("moe8-s192", dict(tp=1, pp=1, dp=1, cp=2)),
    ("moe8-s192", dict(tp=2, pp=1, dp=1, sequence_parallel=True)),
    ("moe8-s192", dict(tp=1, pp=1, dp=2)),
    ("moe8-s192", dict(tp=1, pp=2, dp=1, schedule="1f1b")),
    ("moe8-s192", dict(tp=1, pp=1, dp=2, cp=2)),
]
# Tenth out-of-sample set (--set holdout10): after SP's backward reduce-scatters were charged
# as gloo's all-reduces (HOLDOUT9's tp2 SP cases, in sample since). Fixed before any case below
# ran: the small model at sequence 128 (4 micro-batches of 2) and tiny-moe at 160 (4 of 2),
# under tp2 SP (with and without selective recompute), cp2, dp2 and pp2 ZB-H1.
HOLDOUT10_RUNS = {"small-s128": ("small", 128, 8, 2), "moe-s160": ("tiny-moe", 160, 8, 2)}
HOLDOUT10 = [
    ("small-s128", dict(tp=2, pp=1, dp=1, sequence_parallel=True)),
    ("small-s128", dict(tp=2, pp=1, dp=1, sequence_parallel=True, recompute="selective")),
    ("small-s128", dict(tp=1, pp=1, dp=1, cp=2)),
    ("small-s128", dict(tp=1, pp=1, dp=2)),
    ("moe-s160", dict(tp=2, pp=1, dp=1, sequence_parallel=True)),
    ("moe-s160", dict(tp=1, pp=1, dp=1, cp=2)),
    ("moe-s160", dict(tp=1, pp=1, dp=2, ep=2)),
    ("moe-s160", dict(tp=1, pp=2, dp=1, schedule="zb-h1")),
]
# Eleventh out-of-sample set (--set holdout11): after the calibration took rounds (compute: the
# median of 3; collective call sites timed after computing, their mean over 8 rounds), which
# was judged by how far one profile's predictions move from calibration to calibration, not by
# any step. Fixed before any case below ran: the small model at sequence 112 (6 micro-batches
# of 2) and bench-moe8 at 160 (4 of 2), under tp2 with and without SP, pp2, dp2, dp2 ep2, cp2,
# ZB-H1, and one 4-rank dp2 x pp2.
HOLDOUT11_RUNS = {"small-s112": ("small", 112, 12, 2), "moe8-s160": ("bench-moe8", 160, 8, 2)}
HOLDOUT11 = [
    ("small-s112", dict(tp=2, pp=1, dp=1)),
    ("small-s112", dict(tp=2, pp=1, dp=1, sequence_parallel=True)),
    ("small-s112", dict(tp=1, pp=2, dp=1, schedule="1f1b")),
    ("small-s112", dict(tp=1, pp=1, dp=2)),
    ("moe8-s160", dict(tp=1, pp=1, dp=2, ep=2)),
    ("moe8-s160", dict(tp=1, pp=1, dp=1, cp=2)),
    ("moe8-s160", dict(tp=1, pp=2, dp=1, schedule="zb-h1")),
    ("moe8-s160", dict(tp=1, pp=2, dp=2, schedule="1f1b")),
]
# Twelfth out-of-sample set (--set holdout12): after HOLDOUT11 showed every small collective
# over-charged. Its cause, found by timing: the calibration's call sites took turns by size, and
# a 64 KB all-reduce right after a 16 MB one costs about 0.4 ms more; each size now runs as a
# run of calls, as a layer issues them, and the latency is the back-to-back 64 KB all-reduce's
# fastest round. Fixed before any case below ran: the small model at sequence 144 (4
# micro-batches of 2) and tiny-moe at 224 (4 of 2), under tp2 with and without SP, cp2, dp2,
# dp2 ep2, pp2 1F1B and ZB-H1.
HOLDOUT12_RUNS = {"small-s144": ("small", 144, 8, 2), "moe-s224": ("tiny-moe", 224, 8, 2)}
HOLDOUT12 = [
    ("small-s144", dict(tp=2, pp=1, dp=1)),
    ("small-s144", dict(tp=2, pp=1, dp=1, sequence_parallel=True)),
    ("small-s144", dict(tp=1, pp=1, dp=1, cp=2)),
    ("small-s144", dict(tp=1, pp=1, dp=2)),
    ("moe-s224", dict(tp=1, pp=1, dp=2, ep=2)),
    ("moe-s224", dict(tp=2, pp=1, dp=1, sequence_parallel=True)),
    ("moe-s224", dict(tp=1, pp=2, dp=1, schedule="1f1b")),
    ("moe-s224", dict(tp=1, pp=2, dp=1, schedule="zb-h1")),
]
# Thirteenth out-of-sample set (--set holdout13): after the CPU rule for what another
# micro-batch's compute hides of TP all-reduces (only the sync; HOLDOUT11's and HOLDOUT12's tp2
# cases without SP, in sample since) and the link curve made monotone. Fixed before any case
# below ran: the small model at sequence 176 (4 micro-batches of 2) and the tiny one at 224 (4
# of 4), under tp2 (forward inside backward), tp2 with interleaved micro-batches (the first
# such case of any set), tp2 SP, dp2, cp2 and pp2 1F1B.
HOLDOUT13_RUNS = {"small-s176": ("small", 176, 8, 2), "tiny-s224": ("tiny", 224, 16, 4)}
HOLDOUT13 = [
    ("small-s176", dict(tp=2, pp=1, dp=1)),
    ("small-s176", dict(tp=2, pp=1, dp=1, interleave=2)),
    ("small-s176", dict(tp=2, pp=1, dp=1, sequence_parallel=True)),
    ("small-s176", dict(tp=1, pp=1, dp=2)),
    ("tiny-s224", dict(tp=2, pp=1, dp=1)),
    ("tiny-s224", dict(tp=1, pp=1, dp=1, cp=2)),
    ("tiny-s224", dict(tp=1, pp=2, dp=1, schedule="1f1b")),
    ("tiny-s224", dict(tp=1, pp=1, dp=2)),
]
# Fourteenth out-of-sample set (--set holdout14): after the forward's writes of what it saves
# for the backward were counted (``Hardware.saved_gbps``, measured by the calibration; found on
# the small model's layer at sequence 176, in sample: a layer's forward measured 15% over the
# model, the same forward without recording at the model). Fixed before any case below ran: the
# small model at sequence 208 (4 micro-batches of 2) and the tiny one at 192 (4 of 4), under
# tp2, tp2 SP, dp2, cp2, pp2 1F1B and pp2 ZB-H1.
HOLDOUT14_RUNS = {"small-s208": ("small", 208, 8, 2), "tiny-s192": ("tiny", 192, 16, 4)}
HOLDOUT14 = [
    ("small-s208", dict(tp=2, pp=1, dp=1)),
    ("small-s208", dict(tp=2, pp=1, dp=1, sequence_parallel=True)),
    ("small-s208", dict(tp=1, pp=1, dp=2)),
    ("small-s208", dict(tp=1, pp=2, dp=1, schedule="zb-h1")),
    ("tiny-s192", dict(tp=2, pp=1, dp=1)),
    ("tiny-s192", dict(tp=1, pp=1, dp=1, cp=2)),
    ("tiny-s192", dict(tp=1, pp=2, dp=1, schedule="1f1b")),
    ("tiny-s192", dict(tp=1, pp=1, dp=2)),
]
# Fifteenth out-of-sample set (--set holdout15): the model as HOLDOUT14 checked it, unchanged.
# Fixed before any case below ran: the small model at sequence 240 (4 micro-batches of 2) under
# tp2 with interleaved micro-batches, tp2 SP with selective recompute, dp2 and pp2 ZB-H1, and
# the 8-expert MoE at 96 (4 of 2) under dp2 ep2, tp2 SP, pp2 1F1B and dp2.
HOLDOUT15_RUNS = {"small-s240": ("small", 240, 8, 2), "moe8-s96": ("bench-moe8", 96, 8, 2)}
HOLDOUT15 = [
    ("small-s240", dict(tp=2, pp=1, dp=1, interleave=2)),
    ("small-s240", dict(tp=2, pp=1, dp=1, sequence_parallel=True, recompute="selective")),
    ("small-s240", dict(tp=1, pp=1, dp=2)),
    ("small-s240", dict(tp=1, pp=2, dp=1, schedule="zb-h1")),
    ("moe8-s96", dict(tp=1, pp=1, dp=2, ep=2)),
    ("moe8-s96", dict(tp=2, pp=1, dp=1, sequence_parallel=True)),
    ("moe8-s96", dict(tp=1, pp=2, dp=1, schedule="1f1b")),
    ("moe8-s96", dict(tp=1, pp=1, dp=2)),
]
# Sixteenth out-of-sample set (--set holdout16): after the link's call sites took calls by how
# much each size varies from call to call (``calibrate.LINK_CALLS``; chosen on six link
# measurements in a row, with the predicted steps of HOLDOUT14-15's TP and ep cases as the
# check: in sample for repeatability). The cost model as HOLDOUT14-15 checked it, unchanged.
# Fixed before any case below ran: the small model at sequence 200 (4 micro-batches of 2) under
# tp2, tp2 SP, dp2 and pp2 1F1B, and the 8-expert MoE at 112 (4 of 2) under dp2 ep2, tp2,
# tp2 SP with selective recompute and dp2.
HOLDOUT16_RUNS = {"small-s200": ("small", 200, 8, 2), "moe8-s112": ("bench-moe8", 112, 8, 2)}
HOLDOUT16 = [
    ("small-s200", dict(tp=2, pp=1, dp=1)),
    ("small-s200", dict(tp=2, pp=1, dp=1, sequence_parallel=True)),
    ("small-s200", dict(tp=1, pp=1, dp=2)),
    ("small-s200", dict(tp=1, pp=2, dp=1, schedule="1f1b")),
    ("moe8-s112", dict(tp=1, pp=1, dp=2, ep=2)),
    ("moe8-s112", dict(tp=2, pp=1, dp=1)),
    ("moe8-s112", dict(tp=2, pp=1, dp=1, sequence_parallel=True, recompute="selective")),
    ("moe8-s112", dict(tp=1, pp=1, dp=2)),
]
# Seventeenth out-of-sample set (--set holdout17): the same model and calibration as HOLDOUT16.
# Fixed before any case below ran: the tiny model at sequence 176 (4 micro-batches of 4) under
# tp2, tp2 SP with selective recompute, cp2 and dp2, and the 8-expert MoE at 144 (4 of 2) under
# dp2 ep2, tp2 SP, pp2 ZB-H1 and dp2.
HOLDOUT17_RUNS = {"tiny-s176": ("tiny", 176, 16, 4), "moe8-s144": ("bench-moe8", 144, 8, 2)}
HOLDOUT17 = [
    ("tiny-s176", dict(tp=2, pp=1, dp=1)),
    ("tiny-s176", dict(tp=2, pp=1, dp=1, sequence_parallel=True, recompute="selective")),
    ("tiny-s176", dict(tp=1, pp=1, dp=1, cp=2)),
    ("tiny-s176", dict(tp=1, pp=1, dp=2)),
    ("moe8-s144", dict(tp=1, pp=1, dp=2, ep=2)),
    ("moe8-s144", dict(tp=2, pp=1, dp=1, sequence_parallel=True)),
    ("moe8-s144", dict(tp=1, pp=2, dp=1, schedule="zb-h1")),
    ("moe8-s144", dict(tp=1, pp=1, dp=2)),
]
# Eighteenth out-of-sample set (--set holdout18): after a call's sync grows with the compute
# before it (``Hardware.sync_per_gap``, measured by the calibration; the diagnostics that found
# it ran on HOLDOUT16-17's shapes, so their TP cases are in sample for it). Fixed before any case
# below ran: the small model at sequence 184 (4 micro-batches of 2) under tp2, tp2 SP with
# selective recompute, dp2 and pp2 ZB-H1, and the 8-expert MoE at 176 (4 of 2) under tp2,
# tp2 SP, dp2 ep2 and dp2.
HOLDOUT18_RUNS = {"small-s184": ("small", 184, 8, 2), "moe8-s176": ("bench-moe8", 176, 8, 2)}
HOLDOUT18 = [
    ("small-s184", dict(tp=2, pp=1, dp=1)),
    ("small-s184", dict(tp=2, pp=1, dp=1, sequence_parallel=True, recompute="selective")),
    ("small-s184", dict(tp=1, pp=1, dp=2)),
    ("small-s184", dict(tp=1, pp=2, dp=1, schedule="zb-h1")),
    ("moe8-s176", dict(tp=2, pp=1, dp=1)),
    ("moe8-s176", dict(tp=2, pp=1, dp=1, sequence_parallel=True)),
    ("moe8-s176", dict(tp=1, pp=1, dp=2, ep=2)),
    ("moe8-s176", dict(tp=1, pp=1, dp=2)),
]
# Nineteenth out-of-sample set (--set holdout19): the same model and calibration as HOLDOUT18.
# Fixed before any case below ran: the tiny model at sequence 208 (4 micro-batches of 4) under
# tp2, tp2 SP, cp2 and dp2, and the 8-expert MoE at 208 (4 of 2) under tp2, tp2 SP with
# selective recompute, pp2 1F1B and dp2 ep2.
HOLDOUT19_RUNS = {"tiny-s208": ("tiny", 208, 16, 4), "moe8-s208": ("bench-moe8", 208, 8, 2)}
HOLDOUT19 = [
    ("tiny-s208", dict(tp=2, pp=1, dp=1)),
    ("tiny-s208", dict(tp=2, pp=1, dp=1, sequence_parallel=True)),
    ("tiny-s208", dict(tp=1, pp=1, dp=1, cp=2)),
    ("tiny-s208", dict(tp=1, pp=1, dp=2)),
    ("moe8-s208", dict(tp=2, pp=1, dp=1)),
    ("moe8-s208", dict(tp=2, pp=1, dp=1, sequence_parallel=True, recompute="selective")),
    ("moe8-s208", dict(tp=1, pp=2, dp=1, schedule="1f1b")),
    ("moe8-s208", dict(tp=1, pp=1, dp=2, ep=2)),
]
# Twentieth out-of-sample set (--set holdout20): after the calibration took the link's latency
# from the median back-to-back call and spread its compute rounds among the link's (found on
# back-to-back calibrations, no training run). Fixed before any case below ran: the tiny model
# at sequence 240 (4 micro-batches of 4) under tp2, tp2 SP, cp2 and pp2 ZB-H1, and the
# 8-expert MoE at 152 (4 of 2) under tp2, tp2 SP with selective recompute, dp2 ep2 and dp2.
HOLDOUT20_RUNS = {"tiny-s240": ("tiny", 240, 16, 4), "moe8-s152": ("bench-moe8", 152, 8, 2)}
HOLDOUT20 = [
    ("tiny-s240", dict(tp=2, pp=1, dp=1)),
    ("tiny-s240", dict(tp=2, pp=1, dp=1, sequence_parallel=True)),
    ("tiny-s240", dict(tp=1, pp=1, dp=1, cp=2)),
    ("tiny-s240", dict(tp=1, pp=2, dp=1, schedule="zb-h1")),
    ("moe8-s152", dict(tp=2, pp=1, dp=1)),
    ("moe8-s152", dict(tp=2, pp=1, dp=1, sequence_parallel=True, recompute="selective")),
    ("moe8-s152", dict(tp=1, pp=1, dp=2, ep=2)),
    ("moe8-s152", dict(tp=1, pp=1, dp=2)),
]
# Twenty-first out-of-sample set (--set holdout21): after each kind of call got its own sync
# and a CPU hides an EP dispatch's and an SP call's sync behind the compute between its issue
# and its wait (found on HOLDOUT20's tiny-s240 tp2 SP and moe8-s152 dp2 ep2 and tp2 SP, timed
# inside the trainer). Fixed before any case below ran: the tiny model at sequence 232 (4
# micro-batches of 4) under tp2, tp2 SP, tp2 SP with selective recompute and cp2, and the
# 8-expert MoE at 136 (4 of 2) under tp2 SP, dp2 ep2, tp2 and pp2 1F1B.
HOLDOUT21_RUNS = {"tiny-s232": ("tiny", 232, 16, 4), "moe8-s136": ("bench-moe8", 136, 8, 2)}
HOLDOUT21 = [
    ("tiny-s232", dict(tp=2, pp=1, dp=1)),
    ("tiny-s232", dict(tp=2, pp=1, dp=1, sequence_parallel=True)),
    ("tiny-s232", dict(tp=2, pp=1, dp=1, sequence_parallel=True, recompute="selective")),
    ("tiny-s232", dict(tp=1, pp=1, dp=1, cp=2)),
    ("moe8-s136", dict(tp=2, pp=1, dp=1, sequence_parallel=True)),
    ("moe8-s136", dict(tp=1, pp=1, dp=2, ep=2)),
    ("moe8-s136", dict(tp=2, pp=1, dp=1)),
    ("moe8-s136", dict(tp=1, pp=2, dp=1, schedule="1f1b")),
]
# Twenty-second out-of-sample set (--set holdout22): after the host-work figures (the per-
# operator overheads, the split backward's calls) took both parts of each difference in the
# same call and the median of five windows (found on six calibrations in a row, one of which
# read the backward's overhead 10.6 us against 6.4-7.8). Fixed before any case below ran: the
# tiny model at sequence 216 (4 micro-batches of 4) under tp2, tp2 SP, cp2 and pp2 ZB-H1, and
# the 8-expert MoE at 168 (4 of 2) under dp2 ep2, tp2 SP, dp2 and pp2 1F1B.
HOLDOUT22_RUNS = {"tiny-s216": ("tiny", 216, 16, 4), "moe8-s168": ("bench-moe8", 168, 8, 2)}
HOLDOUT22 = [
    ("tiny-s216", dict(tp=2, pp=1, dp=1)),
    ("tiny-s216", dict(tp=2, pp=1, dp=1, sequence_parallel=True)),
    ("tiny-s216", dict(tp=1, pp=1, dp=1, cp=2)),
    ("tiny-s216", dict(tp=1, pp=2, dp=1, schedule="zb-h1")),
    ("moe8-s168", dict(tp=1, pp=1, dp=2, ep=2)),
    ("moe8-s168", dict(tp=2, pp=1, dp=1, sequence_parallel=True)),
    ("moe8-s168", dict(tp=1, pp=1, dp=2)),
    ("moe8-s168", dict(tp=1, pp=2, dp=1, schedule="1f1b")),
]
# Twenty-third out-of-sample set (--set holdout23 --calibrate-repeats 4): after the calibration
# could run every round N times (``--calibrate-repeats``; HOLDOUT22's per-run predictions moved
# 10-17% for two layouts when the host's slow spells met a minute's calibration). Each workload's
# four layouts run, in an order rotated each repeat, between two calibrations of four times the
# rounds. Fixed before any case below ran: the tiny model at sequence 248 (4 micro-batches of
# 4) under tp2, tp2 SP, cp2 and pp2 1F1B, and the 8-expert MoE at 184 (4 of 2) under dp2 ep2,
# tp2 SP, dp2 and pp2 ZB-H1.
HOLDOUT23_RUNS = {"tiny-s248": ("tiny", 248, 16, 4), "moe8-s184": ("bench-moe8", 184, 8, 2)}
HOLDOUT23 = [
    ("tiny-s248", dict(tp=2, pp=1, dp=1)),
    ("tiny-s248", dict(tp=2, pp=1, dp=1, sequence_parallel=True)),
    ("tiny-s248", dict(tp=1, pp=1, dp=1, cp=2)),
    ("tiny-s248", dict(tp=1, pp=2, dp=1, schedule="1f1b")),
    ("moe8-s184", dict(tp=1, pp=1, dp=2, ep=2)),
    ("moe8-s184", dict(tp=2, pp=1, dp=1, sequence_parallel=True)),
    ("moe8-s184", dict(tp=1, pp=1, dp=2)),
    ("moe8-s184", dict(tp=1, pp=2, dp=1, schedule="zb-h1")),
]
RUNS = {**CPU_RUNS, **HOLDOUT_RUNS, **HOLDOUT2_RUNS, **HOLDOUT3_RUNS, **HOLDOUT4_RUNS,
        **HOLDOUT5_RUNS, **HOLDOUT6_RUNS, **HOLDOUT7_RUNS, **HOLDOUT8_RUNS, **HOLDOUT9_RUNS,
        **HOLDOUT10_RUNS, **HOLDOUT11_RUNS, **HOLDOUT12_RUNS,
        **HOLDOUT13_RUNS, **HOLDOUT14_RUNS, **HOLDOUT15_RUNS, **HOLDOUT16_RUNS,
        **HOLDOUT17_RUNS, **HOLDOUT18_RUNS, **HOLDOUT19_RUNS, **HOLDOUT20_RUNS,
        **HOLDOUT21_RUNS, **HOLDOUT22_RUNS, **HOLDOUT23_RUNS}
HOLDOUTS = {"holdout2": HOLDOUT2, "holdout3": HOLDOUT3, "holdout4": HOLDOUT4,
            "holdout5": HOLDOUT5, "holdout6": HOLDOUT6, "holdout7": HOLDOUT7,
            "holdout8": HOLDOUT8, "holdout9": HOLDOUT9, "holdout10": HOLDOUT10,
            "holdout11": HOLDOUT11, "holdout12": HOLDOUT12,
            "holdout13": HOLDOUT13, "holdout14": HOLDOUT14, "holdout15": HOLDOUT15,
            "holdout16": HOLDOUT16, "holdout17": HOLDOUT17,
            "holdout18": HOLDOUT18, "holdout19": HOLDOUT19, "holdout20": HOLDOUT20,
            "holdout21": HOLDOUT21, "holdout22": HOLDOUT22, "holdout23": HOLDOUT23}


def _rank_shared(rank, world, cases, steps, out, repeats):
    """One rank of a CPU run: calibrate (``repeats`` times the rounds), train each of ``cases``
    ([(run, layout)]) in turn in the same process group, calibrate again."""
    import torch
    import torch.distributed as dist

    from fastpar.plan.calibrate import measure
    from fastpar.train import TrainConfig, train

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    before = measure("cpu-gloo", repeats=repeats)
    times = []
    for i, (run, layout) in enumerate(cases):
        preset, seq, batch, mbs = RUNS[run]
        cfg = TrainConfig(model=preset, seq_len=seq, global_batch_size=batch,
                          micro_batch_size=mbs, steps=steps, warmup_steps=1, log_every=1000,
                          out=os.path.join(out, str(i)), save_every=10 ** 6,
                          **{"schedule": "1f1b", **layout})
        times.append([r["step_time_s"] for r in train(cfg)])
    return (before, measure("cpu-gloo", repeats=repeats)), times


def world_of(layout: dict) -> int:
    return layout["tp"] * layout["pp"] * layout["dp"] * layout.get("cp", 1)


def cpu_once(run: str, layout: dict, steps: int) -> dict:
    """One run: calibrate on every rank, train, calibrate again; the prediction is the
    geometric mean of those from rank 0's two profiles, which bracket the training in time
    (on a shared machine the rates drift by tens of percent within seconds)."""
    return cpu_shared(run, [layout], steps, 1)[0]


def cpu_shared(run: str, layouts: list[dict], steps: int, repeats: int) -> list[dict]:
    """One run of a workload's layouts (one world size): calibrate on every rank with
    ``repeats`` times the rounds, train every layout in the order given, calibrate again; each
    layout judged as :func:`cpu_once` judges its own run, on the same two profiles."""
    from fastpar.testing import run_ranks

    world = world_of(layouts[0])
    if any(world_of(x) != world for x in layouts):
        raise ValueError(f"{run}: the layouts' world sizes differ "
                         f"({[world_of(x) for x in layouts]})")
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_rank_shared, world, [(run, x) for x in layouts], steps, tmp,
                            repeats, timeout=900 + 600 * repeats, init_pg=False)
    return [_judged(run, layout, results[0][0], [r[1][i] for r in results], steps)
            for i, layout in enumerate(layouts)]


def _judged(run: str, layout: dict, profiles, rank_times: list, steps: int) -> dict:
    """One run's row: the median step after the first two (slowest rank) against the geometric
    mean of the predictions from rank 0's two profiles."""
    world = world_of(layout)
    measured = statistics.median(max(t[i] for t in rank_times) for i in range(2, steps))
    preset, seq, batch, mbs = RUNS[run]
    model = get_config(preset, max_seq_len=max(seq, get_config(preset).max_seq_len))
    # The CPU trainer's precision ("auto"): fp32 weights, gradients and reductions.
    preds = [evaluate(Workload(model, seq, batch), Cluster(world, world, hw),
                      ParallelConfig(micro_batch_size=mbs, **layout),
                      trainer_features("fp32")).step_time_s
             for hw in profiles]
    predicted = math.sqrt(preds[0] * preds[1])

    def mean(field):
        return statistics.fmean(getattr(hw, field) for hw in profiles)
    return {"gflops": mean("peak_tflops") * 1e3, "op_us": mean("kernel_overhead_us"),
            "act_gbps": mean("activation_gbps"), "link_gbps": mean("intra_node_gbps"),
            "latency_us": mean("collective_latency_us"), "sync_us": mean("sync_us"),
            "sync_per_gap": mean("sync_per_gap"), "post_us": mean("p2p_post_us"),
            **{f"{k}_sync_us": statistics.fmean(hw.call_sync(k) * 1e6 for hw in profiles)
               for k in ("all_gather", "all_to_all")},
            "saved_gbps": mean("saved_gbps"), "before_ms": preds[0] * 1e3,
            "after_ms": preds[1] * 1e3, "predicted_ms": predicted * 1e3,
            "measured_ms": measured * 1e3, "ratio": predicted / measured,
            "profiles": [hw.to_dict() for hw in profiles]}


def layout_name(layout: dict) -> str:
    name = f"tp{layout['tp']} pp{layout['pp']} dp{layout['dp']}" + (
        f" cp{layout['cp']}" if layout.get("cp", 1) > 1 else "")
    if layout["pp"] > 1:
        name += f" {layout.get('schedule', '1f1b')}"
    if layout.get("interleave", 1) > 1:
        name += f" il{layout['interleave']}"
    if layout.get("fb_overlap") is False:
        name += " seq"
    if layout.get("sequence_parallel"):
        name += " sp"
    if layout.get("ep", 1) > 1:
        name += f" ep{layout['ep']}" + (" fold" if layout.get("ep_fold_tp") else "") + \
            (f" c{layout['ep_chunks']}" if "ep_chunks" in layout else "")
    if layout.get("recompute", "none") != "none":
        name += f" {layout['recompute']}"
    return name + (f" v{layout['virtual_stages']}" if layout.get("virtual_stages", 1) > 1 else "")


def cpu(steps: int, cases: list[tuple[str, dict]], repeats: int,
        calibrate_repeats: int | None = None) -> list[dict]:
    """Per (run, layout) case, the medians over ``repeats`` runs (each calibrated anew), every
    run's ratio and two predictions, and how far the predictions and the measured steps spread
    (max / min - 1). ``calibrate_repeats``: each workload's layouts share their runs
    (:func:`cpu_shared`, in an order rotated by one each repeat) and calibrations of that many
    times the rounds; else every case runs between its own two calibrations."""
    if calibrate_repeats is None:
        every = [[cpu_once(run, layout, steps) for _ in range(repeats)] for run, layout in cases]
    else:
        got: dict = {}
        for r in range(repeats):
            for run in dict.fromkeys(c[0] for c in cases):
                mine = [i for i, c in enumerate(cases) if c[0] == run]
                order = mine[r % len(mine):] + mine[:r % len(mine)]
                for i, row in zip(order, cpu_shared(run, [cases[i][1] for i in order], steps,
                                                    calibrate_repeats)):
                    got.setdefault(i, []).append(row)
        every = [got[i] for i in range(len(cases))]
    out = []
    for (run, layout), tries in zip(cases, every):
        row = {"model": run, "layout": layout_name(layout)}
        for key in [k for k in tries[0] if k != "profiles"]:
            row[key] = round(statistics.median(t[key] for t in tries), 3 if key == "ratio"
                             else 1 if key != "link_gbps" else 2)
        row["ratios"] = " ".join(f"{t['ratio']:.2f}" for t in tries)
        preds = [t["predicted_ms"] for t in tries]
        row["prediction_spread"] = round(max(preds) / min(preds) - 1, 3)
        # What the step itself did from run to run, and each run's two calibrations.
        measured = [t["measured_ms"] for t in tries]
        row["measured_spread"] = round(max(measured) / min(measured) - 1, 3)
        row["predictions"] = " ".join(f"{t['before_ms']:.0f}/{t['after_ms']:.0f}" for t in tries)
        row["world"] = world_of(layout)
        row["measured_runs"] = " ".join(f"{t:.0f}" for t in measured)
        print(row, flush=True)
        # Each run's two profiles, for the JSON only: what moved a prediction between runs.
        row["profiles"] = [t["profiles"] for t in tries]
        out.append(row)
    return out


def _columns(rows: list[dict]) -> list[str]:
    """The table's columns: every key but the profiles (kept in the JSON)."""
    return [k for k in rows[0] if k != "profiles"]


def fastest(rows: list[dict]) -> list[dict]:
    """Per workload, among its 2-rank layouts: the one predicted fastest and the one measured
    fastest (medians)."""
    out = []
    for run in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == run and r["world"] == 2]
        pred = min(mine, key=lambda r: r["predicted_ms"])
        meas = min(mine, key=lambda r: r["measured_ms"])
        out.append({"model": run, "predicted fastest": pred["layout"],
                    "measured fastest": meas["layout"], "same": pred is meas,
                    "measured ms": " ".join(f"{r['layout']}: {r['measured_ms']}" for r in mine)})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip-cpu", action="store_true")
    p.add_argument("--skip-search", action="store_true")
    p.add_argument("--skip-published", action="store_true")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3, help="CPU runs per layout (median)")
    p.add_argument("--models", default="tiny,small", help="CPU runs: " + ",".join(CPU_RUNS))
    p.add_argument("--set", choices=("dev", "holdout", *HOLDOUTS), default="dev",
                   help="dev: the published rows and the CPU runs of --models (used while the "
                        "cost model was built); holdout: the CPU cases HOLDOUT (out of sample "
                        "on 2026-12-01, in sample since); holdout2: the CPU cases HOLDOUT2 "
                        "(in sample since the split backward's calls were modelled); holdout3: "
                        "the CPU cases HOLDOUT3 (in sample since ZB-H1's row weight GEMMs moved "
                        "to B); holdout4: the CPU cases HOLDOUT4 (in sample since); holdout5: "
                        "the CPU cases HOLDOUT5; holdout6: the MoE cases HOLDOUT6 (in sample "
                        "since the MoE layer's operators were counted); holdout7: the MoE "
                        "cases HOLDOUT7 (in sample since SP's partial gradients were "
                        "modelled); holdout8: SP and CP cases HOLDOUT8 (in sample since the CP "
                        "ring's posts were modelled); holdout9: HOLDOUT9 (its SP cases in sample "
                        "since); holdout10: HOLDOUT10; holdout11: HOLDOUT11 (in sample since "
                        "the call sites ran by size); holdout12: HOLDOUT12 (its tp2 case in "
                        "sample since the CPU rule for hidden all-reduces); holdout13: "
                        "HOLDOUT13; holdout14: HOLDOUT14; holdout15: HOLDOUT15; holdout16: "
                        "HOLDOUT16; holdout17: HOLDOUT17; holdout18: HOLDOUT18; holdout19: "
                        "HOLDOUT19; holdout20: HOLDOUT20; holdout21: HOLDOUT21; holdout22: "
                        "HOLDOUT22; holdout23: HOLDOUT23 (with --calibrate-repeats 4), fixed "
                        "before its first run")
    p.add_argument("--calibrate-repeats", type=int, default=None, metavar="N",
                   help="a workload's layouts run in turn between two calibrations of N times "
                        "the rounds (fastpar plan --calibrate-repeats N); unset: each run "
                        "between its own two calibrations of the default length")
    p.add_argument("--sensitivity", action="store_true",
                   help="only print how the published rows' predictions move with "
                        "matmul_efficiency and link bandwidth (arithmetic, no runs)")
    args = p.parse_args()
    if args.calibrate_repeats is not None and args.calibrate_repeats < 1:
        p.error(f"--calibrate-repeats={args.calibrate_repeats} must be >= 1")
    if args.sensitivity:
        rows, summary = published_sensitivity()
        common.report("plan_sensitivity", rows, list(rows[0]))
        common.report("plan_sensitivity_summary", summary, list(summary[0]))
        return
    if args.set == "holdout":
        rows = cpu(args.steps, HOLDOUT, args.repeats)
        common.report("plan_holdout", rows, _columns(rows))
        return
    if args.set in HOLDOUTS:
        rows = cpu(args.steps, HOLDOUTS[args.set], args.repeats, args.calibrate_repeats)
        common.report(f"plan_{args.set}", rows, _columns(rows))
        picks = fastest(rows)
        common.report(f"plan_{args.set}_fastest", picks, list(picks[0]))
        return
    if not args.skip_published:
        rows = published(not args.skip_search)
        common.report("plan_published", rows, list(rows[0]))
    if not args.skip_cpu:
        cases = [(run, layout) for run in args.models.split(",") for layout in LAYOUTS]
        rows = cpu(args.steps, cases, args.repeats)
        common.report("plan_cpu", rows, _columns(rows))


if __name__ == "__main__":
    main()
