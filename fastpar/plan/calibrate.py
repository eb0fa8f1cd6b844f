"""Measure this machine into a :class:`Hardware` profile: ``fastpar plan --calibrate``.

- matmul: square GEMMs from 64 to 1024 and skinny ones (rows 4x or 16x the other sizes, or an
  inner size of 32 / 64 as in attention) in the training dtype (bf16 on a GPU, fp32 on a CPU),
  each shape taking turns over operands that do not fit in the cache, as in a model;
  the best rate is the profile's peak, every shape's fraction of it goes into ``matmul_curve``
  (by FLOPs per GEMM) and ``matmul_efficiency`` is the median fraction;
- per-operator overhead: on a GPU the time of a tiny GEMM; on a CPU, where every operator runs
  eagerly on the host, fastpar's own transformer layer at 4 tokens and width 64, a forward's
  and a backward's time apart, less what the cost model gives their GEMMs, attention and bytes,
  over the operators it counts for each (``forward_overhead_us``, ``kernel_overhead_us``;
  Python, modules, dispatch and autograd's bookkeeping, with no arithmetic to speak of);
- memory: an elementwise operator on 256 KB to 64 MB, reading inputs other operators wrote
  since and writing a new tensor, as a model's do (read + write), into ``memory_curve``;
  ``hbm_gbps`` is the 64 MB one;
- activations: SiLU, tanh-GELU and exp on 1M elements, the median bytes read + written per
  second (``activation_gbps``): on a CPU core these transcendental kernels are compute-bound,
  several times slower than a copy;
- attention: forward and backward of torch's causal scaled-dot-product attention at a few
  sizes, as a fraction of peak on the FLOPs the cost model counts (``attention_curve``);
- links, under torchrun (or any initialised process group): all-reduces of 64 KB and 16 MB back to
  back (the 64 KB one's median call), solved for the per-step latency and the bandwidth of the
  ring model of :func:`cost.ring_time`; all-reduces of 64 KB to 16 MB each issued right after
  every rank computed on its own, as in training: the 64 KB one's excess over the ring model is
  ``sync_us`` (paid once per collective call site), and each size's time less the sync, as a
  ratio to the model, is ``link_curve``; the 64 KB call site again after three times the
  computing, whose extra over the computing's is ``sync_per_gap`` (``sync_gap_us``: the call
  sites' own computing); 64 KB all-gather and all-to-all call sites, each one's own sync
  (``sync_by_kind``); and the host time of posting one pipeline message (``p2p_post_us``);
- on a CPU, the host time per autograd call of a zero-bubble split backward (``split_call_us``):
  the same layers as one pipeline stage, split B and W against a plain backward;
- on a CPU, the rate at which a training forward writes what it saves for the backward
  (``saved_gbps``): fastpar's layers forward with the graph kept against the same forward
  without recording, per byte the cost model says they save.

On a CPU every time is the mean of its calls (the step pays the slow ones too; the host-work
figures, small differences of two times, take both in each call and the median of five
windows' means), and every figure the median of ``CPU_ROUNDS`` rounds of them, spread among
the link's rounds (a slow spell of the host falls on one round); on a GPU the median call,
one round. With several ranks on one machine every rank measures at the same time, as they
will train: run it under torchrun with the training run's ``--nproc-per-node`` so that every
rate is the one a rank gets while the others share the cores (each rank keeps its share of
the threads).
Ranks that need more cores than the machine has measure compute in turns, and the profile's
``concurrent_ranks`` lets the planner share the cores itself. The only model code it runs is the
layer of the per-operator overhead.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import operator
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..mesh.layout import require_positive
from .hardware import Hardware, save_hardware


CPU_ROUNDS = 3                  # rounds of every compute measurement on a CPU (``measure``)


def _timed(fn, device, iters: int, barrier=None, window: bool = False) -> float:
    """Seconds of ``fn`` over ``iters`` calls, after two untimed ones and ``barrier()`` (when
    several ranks calibrate together: all ranks time the same thing at the same moment).

    On a GPU the median call (each synchronised). On a CPU the mean: its ranks share the cores
    and the operating system's scheduler, and a rank that has to wait for a core, or whose
    gloo threads take one, waits between calls for a time slice; a median of calls shorter
    than the slice leaves those waits out (four ranks on two cores then time their GEMMs at
    a whole core's rate), a training step pays them all. ``window``: the mean of the calls
    timed as one window on any device (synchronised once, at its end), what a sum of such
    calls costs."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    for _ in range(2):
        fn()
    sync()
    if barrier is not None:
        barrier()
    if window:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        return (time.perf_counter() - t0) / iters
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) if device.type == "cuda" else statistics.fmean(times)


def _timed_parts(step, device, iters: int = 40, barrier=None, windows: int = 5) -> list[float]:
    """Seconds of each part of ``step(mark)`` (the parts between its calls of ``mark()``),
    for the host-work figures of a CPU, which are small differences of two times: ``iters``
    calls back to back in ``windows`` windows, each part's mean in each window, the median
    of those means.

    Both parts of a difference are timed in the same call, so a slow spell of the host falls on
    both: timed apart, a spell that met only the forward's 20 calls read as a backward 30-50%
    cheaper. And the host now and then stalls one call for 2-7 ms (not Python's collector: no
    collection ran in those calls): one such call in twenty moved a 3.6 ms backward's mean by
    6-19%, and the backward's per-operator overhead by 15-45%; the median of the windows
    leaves it out, while each window of several calls still pays every time slice a shared
    core takes from it."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    marks: list[float] = []

    def mark():
        sync()
        marks.append(time.perf_counter())
    for _ in range(2):
        step(mark)
    if barrier is not None:
        barrier()
    calls = []
    for _ in range(iters):
        marks.clear()
        mark()
        step(mark)
        mark()
        calls.append([b - a for a, b in itertools.pairwise(marks)])
    size = max(1, iters // windows)
    spans = range(0, size * (iters // size), size)
    return [statistics.median(statistics.fmean(c[part] for c in calls[i:i + size])
                              for i in spans) for part in range(len(calls[0]))]


def gemm_shapes(sizes=(64, 128, 256, 512, 1024)) -> list[tuple[int, int, int]]:
    """(m, n, k): squares, tall ones (a token batch through a projection) and thin inner sizes
    (attention's head dimension)."""
    shapes = []
    for n in sizes:
        shapes += [(n, n, n), (4 * n, n, n), (16 * n, n, n // 4 or 1), (n, n, 32), (n, 64, n)]
    return sorted(set(shapes), key=lambda s: s[0] * s[1] * s[2])


def measure_matmul(device: torch.device, dtype: torch.dtype, shapes=None,
                   working_set: float = 32e6, barrier=None) -> tuple[float, float, list]:
    """(best FLOP/s, seconds of a tiny GEMM, [(flops, FLOP/s)] per shape).

    Each shape's GEMMs take turns over operand pairs that together fill ``working_set`` bytes,
    so they read operands from memory as a model's GEMMs do (each layer's weights and
    activations were last touched by other operators), not from the cache the previous call
    left them in, which makes small GEMMs look 10-20% faster than they run in a model."""
    points = []
    for m, n, k in shapes or gemm_shapes():
        size = (m * k + k * n) * torch.finfo(dtype).bits // 8
        pairs = [(torch.randn(m, k, device=device, dtype=dtype),
                  torch.randn(k, n, device=device, dtype=dtype))
                 for _ in range(max(2, min(64, int(working_set // size))))]
        turn = itertools.cycle(pairs)
        flops = 2.0 * m * n * k
        t = _timed(lambda: operator.matmul(*next(turn)), device,
                   iters=max(3, min(50, int(1e9 / flops))), barrier=barrier)
        points.append((flops, flops / t))
    a = torch.randn(8, 8, device=device, dtype=dtype)
    return max(r for _, r in points), _timed(lambda: a @ a, device, 200, barrier), points


def _curve(points: list, peak: float) -> list:
    """(size, value / peak) averaged over points of the same size (within 10%), by size."""
    merged: list = []
    for x, y in sorted(points):
        if merged and x <= merged[-1][0] * 1.1:
            merged[-1][1].append(y)
        else:
            merged.append((x, [y]))
    return [(x, statistics.median(ys) / peak) for x, ys in merged]


def count_ops(fn) -> int:
    """Operators (views and metadata-only ops excluded) ``fn`` dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    free = {"view", "_unsafe_view", "permute", "transpose", "t", "expand", "slice", "select",
            "as_strided", "unsqueeze", "squeeze", "reshape", "alias", "detach", "split",
            "chunk", "unbind", "narrow", "_reshape_alias", "split_with_sizes", "promote_types"}

    class _Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._overloadpacket.__name__ not in free:
                _Count.n += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        fn()
    return _Count.n


def measure_op_overhead(device: torch.device, barrier=None) -> float:
    """Seconds per operator of eager forward + backward code on tiny tensors (a synthetic block
    of plain operators; :func:`measure_layer_overhead` measures fastpar's own layer)."""
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(16, 32, bias=False), torch.nn.Linear(32, 16, bias=False)
    w = torch.ones(16, requires_grad=True)
    lin1, lin2, w = lin1.to(device), lin2.to(device), w.to(device).detach().requires_grad_()
    x0 = torch.randn(4, 2, 16, device=device)

    def block():
        x = x0.requires_grad_()
        for _ in range(4):
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
            h = lin1(h).view(4, 2, 2, 16).permute(1, 2, 0, 3)
            h = torch.nn.functional.silu(h).permute(2, 0, 1, 3).reshape(4, 2, 32)
            x = x + lin2(h)
        x.sum().backward()

    ops = count_ops(block)
    return _timed(block, device, iters=30, barrier=barrier) / ops


def measure_layer_overhead(hw: Hardware, device: torch.device, barrier=None,
                           layers: int = 4, seq_len: int = 4) -> tuple[float, float]:
    """(forward, backward) seconds of host work per operator the cost model counts, measured
    on fastpar's own transformer layer (one rank, no tensor parallelism) at a shape whose
    arithmetic is nearly nil (4 tokens, width 64): each pass's time less what ``hw`` models
    for its GEMMs, attention and bytes, divided by the operators the model counts for it.

    A forward pays, besides dispatch, for its modules' calls, its Python autograd Functions,
    its views and autograd's recording of the graph: on a CPU core about 10 us per counted
    operator, twice a backward's, which autograd's engine runs from C++ (and 2.5x the plain
    operators of :func:`measure_op_overhead` in a tight loop)."""
    from ..models import GPT, get_config
    from .cost import Shape, layer_cost

    config = get_config("tiny", d_model=64, n_heads=2, n_layers=layers)
    model = GPT(config, device=device)
    params = list(model.parameters())
    rope = (model.rope_cos[:seq_len], model.rope_sin[:seq_len])
    x0 = torch.randn(seq_len, 1, config.d_model, device=device)
    blocks = list(model.layers.values())
    outs = []

    def forward():
        for p in params:
            p.grad = None
        h = x0.clone().requires_grad_()
        for block in blocks:
            h = block(h, rope, False)
        outs.append(h)

    def step(mark):
        forward()
        mark()
        h = outs.pop()
        h.backward(torch.ones_like(h))
    t_f, t_b = (t / layers for t in _timed_parts(step, device, barrier=barrier))
    shape = Shape(config, seq_len, 1, 1, False, 1)
    zero, one = (layer_cost(shape, dataclasses.replace(hw, kernel_overhead_us=us,
                                                       forward_overhead_us=us))
                 for us in (0.0, 1.0))
    per_f = max(0.0, t_f - zero.f) / ((one.f - zero.f) * 1e6)
    per_b = max(0.0, t_b - zero.b - zero.w) / ((one.b + one.w - zero.b - zero.w) * 1e6)
    return per_f, per_b


def measure_split_overhead(device: torch.device, barrier=None, layers: int = 4,
                           seq_len: int = 4) -> float:
    """Seconds of host work per autograd call a zero-bubble split backward adds (one per layer
    in B, one per deferred module in W; the forward's capture hooks with them), measured on
    fastpar's own layers as one pipeline stage at a shape whose arithmetic is nearly nil: the
    split step's time less the plain one's, over the calls it makes."""
    from ..models import GPT, get_config
    from ..pipeline.backward import Capture, backward_input, backward_weight, deferrable

    config = get_config("tiny", d_model=64, n_heads=2, n_layers=layers)
    stage = GPT(config, device=device, pre_process=False, post_process=False)
    leaves, eager, cuts = deferrable(stage)
    x0 = torch.randn(seq_len, 1, config.d_model, device=device)
    calls = []

    def plain():
        x = x0.clone().requires_grad_()
        y = stage(x)
        y.backward(torch.ones_like(y))

    def split():
        x = x0.clone().requires_grad_()
        with Capture(leaves, cuts) as cap:
            y = stage(x)
        _, pending = backward_input(y, torch.ones_like(y), x, cap, eager)
        backward_weight(pending)
        calls.append(len(pending) + len(cap.inputs))
    t_plain, t_split = _timed_parts(lambda mark: (plain(), mark(), split()), device,
                                    barrier=barrier)
    extra = t_split - t_plain
    return max(0.0, extra) / max(1, calls[-1])


def measure_saved_rate(device: torch.device, barrier=None, layers: int = 4, width: int = 256,
                       tokens: tuple = (128, 2)) -> float:
    """Bytes per second at which a training forward writes what it saves for the backward,
    beyond the same forward without recording: fastpar's own layers (width 256) at
    ``tokens`` (sequence, batch) forward with the graph recorded and kept until the next call
    (as training keeps it for the backward) against the same forward under ``no_grad``, which
    frees each intermediate at once and reuses its memory while it is still in the cache. The
    same difference at 4 tokens (recording's per-operator cost, which
    :func:`measure_layer_overhead` measures) is taken off; what is left, over the bytes the
    cost model says the layers save (:func:`cost.activation_bytes`), is the rate. 0 if the
    difference vanishes. On one core of this machine: 10-20% of a layer's forward at 128 to
    900 tokens, 8-21 GB/s."""
    from ..models import GPT, get_config
    from .cost import Shape, activation_bytes

    config = get_config("tiny", d_model=width, n_heads=4, n_layers=layers,
                        max_seq_len=max(256, tokens[0]))
    model = GPT(config, device=device)
    blocks = list(model.layers.values())
    kept: list = []

    def extra(seq_len, batch):
        rope = (model.rope_cos[:seq_len], model.rope_sin[:seq_len])
        x0 = torch.randn(seq_len, batch, width, device=device)

        def recorded():
            h = x0.clone().requires_grad_()
            for block in blocks:
                h = block(h, rope, False)
            kept.append(h)

        def unrecorded():
            with torch.no_grad():
                h = x0.clone()
                for block in blocks:
                    h = block(h, rope, False)
        # The two in alternation, the median call of each: the difference is a tenth of either,
        # and a mean carries a time slice of the other rank's into one side or the other.
        times: tuple = ([], [])
        for fn in (recorded, unrecorded):
            fn()
        if barrier is not None:
            barrier()
        for _ in range(max(8, min(40, 2 ** 14 // (seq_len * batch)))):
            for fn, out in zip((recorded, unrecorded), times):
                kept.clear()        # the previous graph freed untimed (a backward frees it)
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
        kept.clear()
        t = statistics.median(times[0]) - statistics.median(times[1])
        saved = activation_bytes(Shape(config, seq_len, batch, 1, False, 1), "none",
                                 bytes_per_element=4, reference=device.type == "cpu")
        return t, layers * saved
    (t_big, bytes_big), (t_small, bytes_small) = extra(*tokens), extra(4, 1)
    return (bytes_big - bytes_small) / (t_big - t_small) if t_big > t_small else 0.0


def measure_attention(device: torch.device, dtype: torch.dtype, overhead: float,
                      shapes=((2, 4, 128, 32), (2, 8, 256, 64), (1, 16, 512, 64)),
                      barrier=None) -> list:
    """[(modelled forward FLOPs, FLOP/s on forward + backward FLOPs)] of causal SDPA: the cost
    model's count (half the blocks, backward 2.5x), less its operators' overhead."""
    from .cost import REFERENCE_OPS
    from .hardware import ATTENTION_BACKWARD_FLASH, CAUSAL_FRACTION

    points = []
    for b, h, s, d in shapes:
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))

        def run():
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True) \
                .sum().backward()
        t = _timed(run, device, iters=10, barrier=barrier)
        t = max(0.5 * t, t - sum(REFERENCE_OPS["core"]) * overhead)
        flops = CAUSAL_FRACTION * 4.0 * b * h * s * s * d
        points.append((flops, (1 + ATTENTION_BACKWARD_FLASH) * flops / t))
    return points


def measure_memory(device: torch.device,
                   sizes=(2 ** 18, 2 ** 20, 2 ** 22, 2 ** 24, 2 ** 26), barrier=None,
                   working_set: float = 64e6) -> list:
    """[(bytes moved, bytes per second)] of an elementwise operator (read ``sizes`` bytes, write a
    new tensor of as many) as a model runs them.

    Each size's operator takes turns over inputs that together fill ``working_set`` bytes, so it
    reads what other operators wrote since, as a model's do: reading the same tensor again from
    the cache runs 2-3x faster at 256 KB to 1 MB on a CPU core (``copy_`` into a second resident
    tensor, the earlier measure, also reads each destination line before writing it)."""
    points = []
    for size in sizes:
        inputs = [torch.empty(size // 4, device=device, dtype=torch.float32).uniform_()
                  for _ in range(max(2, int(working_set // size)))]
        turn = itertools.cycle(inputs)
        t = _timed(lambda: next(turn) * 2.0, device, max(10, min(200, 2 ** 26 // size)),
                   barrier)
        points.append((2.0 * size, 2.0 * size / t))
        del inputs
    return points


def measure_activation(device: torch.device, dtype: torch.dtype, numel: int = 2 ** 20,
                       barrier=None) -> float:
    """Bytes per second (read + write) of SiLU, tanh-GELU and exp kernels: the median."""
    x = torch.randn(numel, device=device, dtype=dtype)
    nbytes = 2.0 * numel * x.element_size()
    fns = (torch.nn.functional.silu, lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
           torch.exp)
    return statistics.median(nbytes / _timed(lambda: fn(x), device, 20, barrier) for fn in fns)


# Calls per round of ``measure_link``'s call sites, by all-reduce size in bytes: about in
# proportion to the square of the call-to-call variation of each size on 2 gloo ranks of a
# 2-core machine (a standard deviation 1.0-1.2 times the mean at 64 and 256 KB, 0.7-0.8 at
# 1 MB, 0.4-0.45 at 4 MB, 0.2 at 16 MB: a few calls in each ten wait 1.5-6 ms), so
# that every size's mean over the rounds is about as precise (about 3%). Twenty of each size,
# as before, left the 256 KB mean 13-31% apart over six calibrations in a row.
LINK_CALLS = {2 ** 16: 250, 2 ** 18: 250, 2 ** 20: 90, 2 ** 22: 30, 2 ** 24: 10}


# The sync's growth with the compute before a call: the 64 KB call site is timed again after
# GAP_WORK times the call sites' three GEMMs, GAP_CALLS calls a round (its mean is 1.5-2 ms, a
# standard deviation about its mean: as many as the 64 KB call sites take).
GAP_WORK, GAP_CALLS = 3, 250
# The other kinds of call whose 64 KB call site is timed, KIND_CALLS calls a round each.
KIND_SITES, KIND_CALLS = ("all_gather", "all_to_all"), 100
LINK_ROUNDS = 8                 # rounds of ``measure_link`` in ``measure``


def measure_link(group=None, device=None, barrier=None, work_size: int = 320, rounds: int = 8,
                 calls: dict | None = None, gap_calls: int = GAP_CALLS, between=None,
                 kind_calls: int = KIND_CALLS) -> tuple:
    """(bytes per second, seconds of latency per ring step, seconds of sync per call, curve,
    seconds to post a send or a receive, sync per second of compute before a call, seconds of
    compute before the call sites, {kind: seconds of sync per call}) of all-reduce, the other
    kinds of collective and point-to-point over ``group``.

    ``curve``: ((bytes, measured / modelled time), ...) of all-reduces of 64 KB to 16 MB, each
    issued as training issues a collective call, right after every rank has computed on its own
    (three GEMMs of ``work_size``, about a millisecond on a CPU core, as a layer's operators
    between two of its collectives; only the collective's own call is timed): the ring model's
    time times the curve, plus the sync, is what such a call was measured to cost at each size
    (gloo's all-reduce of 256 KB to 2 MB takes up to 1.6x what a straight line between 64 KB
    and 16 MB gives on 2 ranks of a 2-core machine; a tensor-parallel layer's activations are
    that size). The sync is what the 64 KB call costs beyond the ring model: ranks that drifted
    apart wait for each other, and on cores the ranks share, the collective's threads wait to be
    scheduled. The post time is the host time of issuing one pipeline message (gloo's isend /
    irecv: a few hundred us of the calling thread on a CPU, paid by every pipeline rank for
    every message).

    Bandwidth and latency come from all-reduces of 64 KB and 16 MB back to back, as the chunks
    of one overlapped collective run (the latency from the 64 KB one's median call over all
    rounds). Only they do: back to back, small all-reduces of 2 gloo ranks on a 2-core machine
    take either about 0.3 or about 0.8 ms, spell by spell, while the same call after computing
    costs 1.0-1.3 ms in every spell. The earlier profile took the
    sync and the curve from differences against the back-to-back times, and they carried that
    noise into every call site's cost: the link's figures alone moved the predicted step of a
    tp2 or ep2 layout by up to 10% from one calibration to the next. The latency was then the
    fastest round's mean of the 64 KB calls, which still took a spell whole or not at all:
    0.49-1.70 ms over six measurements in a row on 2 gloo ranks of a 2-core machine, where the
    median call read 0.46-0.59 ms; the sync, the call site's mean less the ring model, took the
    rest, so the two moved against each other and every collective whose ring steps differ
    from the 64 KB all-reduce's (an all-gather, a reduce-scatter, an all-to-all) moved with
    them (10-16% of a predicted tp2, SP or ep2 step from one calibration to the next).

    Every figure is the mean of a window of calls, not the median call: a training step pays
    the sum of its collectives, and on cores the ranks share a few calls in ten take a
    scheduler's time slice, which makes the mean 1.5-2x the median call on 2 gloo ranks of a
    2-core machine. ``rounds`` rounds, each timing every case (each call site size in a run of
    ``calls[bytes]`` calls, :data:`LINK_CALLS` by default), so that a slow spell of a shared
    machine does not fall on one case only; the median round of each (the call sites' mean
    round).

    ``between(i)``, if given, runs before round ``i`` on every rank (``measure`` spreads its
    compute rounds over the link's this way).

    The sync grows with how long the ranks computed since their previous call: on 2 gloo ranks
    of a 2-core machine a 128 KB all-reduce cost 0.9-1.1 ms on average after 0.5-1.2 ms of
    computing, 1.5-1.7 ms after 3-4 ms and 2.0 ms after 6 ms, the median call the same
    0.35-0.45 ms throughout: the tail, not the ranks' drift (their wait for each other grew by
    0.1-0.3 ms of it). So the 64 KB call site is also timed after ``GAP_WORK`` times the work
    (``gap_calls`` calls a round): the difference over the difference of the two computes is the
    sync per second of compute beyond the call sites' (the sixth figure, never below 0; the
    seventh is the call sites' own compute, the mean time of their three GEMMs).

    The sync depends on the kind of call: on 2 gloo ranks of a 2-core machine, each after the
    same three GEMMs, runs of 120 calls of a 64 KB all-reduce cost 1.8-2.1 ms a call on
    average, of a 64 KB all-gather 1.0-2.0 and of a 64 KB all-to-all 0.4-1.8 (the all-reduce
    runs more message rounds, each a wait for a thread to wake). In the trainer the C++
    extension's ring exchanges of a sequence-parallel layer cost about 1.1 ms beyond their
    GEMMs, where the all-reduce's sync charged each of them 1.3 ms and more. So the 64 KB
    all-gather and all-to-all call sites are timed too (``kind_calls`` calls a round, in every
    round); each one's mean round less its ring model is that kind's sync (the eighth
    figure)."""
    n = dist.get_world_size(group)
    small, large = 16 * 2 ** 10, 4 * 2 ** 20           # float32 elements: 64 KB and 16 MB
    sizes = (small, 2 ** 16, 2 ** 18, 2 ** 20, large)   # and 256 KB, 1 MB, 4 MB between
    dev = device or torch.device("cpu")
    counts = {**LINK_CALLS, **(calls or {})}
    a, b = (torch.randn(work_size, work_size, device=dev) for _ in range(2))
    site_gemms = 3                                       # a call site computes three GEMMs

    def work(reps=site_gemms):
        for _ in range(reps):
            a @ b

    def slowest(t):
        t = torch.tensor([max(t, 0.0)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return float(t)
    xs = {numel: torch.ones(numel, device=device) for numel in sizes}
    waits: dict = {}

    def settle():                                        # a GPU's queue drained
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    computed: dict = {}
    # The 64 KB call site of the other kinds (64 KB gathered; 64 KB a rank all-to-all).
    gathered, exchanged = torch.empty(n * (small // n), device=device), torch.empty_like(xs[small])
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch 2.13
    issue = {"all_reduce": lambda x: dist.all_reduce(x, group=group),
             "all_gather": lambda x: gather(gathered, x[:small // n], group=group),
             "all_to_all": lambda x: dist.all_to_all_single(exchanged, x, group=group)}

    def call_site(numel, reps=site_gemms, kind="all_reduce"):
        t0 = time.perf_counter()
        work(reps)
        settle()
        t1 = time.perf_counter()
        issue[kind](xs[numel])
        settle()
        waits.setdefault((numel, reps, kind), []).append(time.perf_counter() - t1)
        computed.setdefault(reps, []).append(t1 - t0)
    # Posting a pipeline's messages: each rank sends 128 KB to the next and receives from the
    # previous, posted as one batch after computing on its own, as the executor posts them.
    rank = dist.get_rank(group)
    peers = [(rank + d) % n if group is None else dist.get_global_rank(group, (rank + d) % n)
             for d in (1, -1)]
    message = [torch.ones(32 * 2 ** 10, device=device) for _ in range(2)]
    posts: list = []

    def exchange():
        work()
        t0 = time.perf_counter()
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, message[0], peers[0], group),
                                        dist.P2POp(dist.irecv, message[1], peers[1], group)])
        posts.append((time.perf_counter() - t0) / 2)
        for w in works:
            w.wait()
    timed: dict = {}
    back_to_back: list = []                     # every 64 KB call, each timed alone
    for i in range(rounds):
        if between is not None:
            between(i)
        posts.clear()
        _timed(exchange, dev, 50, barrier, window=True)
        timed.setdefault("post", []).append(slowest(statistics.fmean(posts)))
        for j in range(2 + 100):                # after 2 untimed calls, as ``_timed``
            if j == 2:
                settle()
                dist.barrier(group=group)
            t0 = time.perf_counter()
            dist.all_reduce(xs[small], group=group)
            settle()
            if j >= 2:
                back_to_back.append(time.perf_counter() - t0)
        dist.barrier(group=group)
        timed.setdefault(large, []).append(slowest(_timed(
            functools.partial(dist.all_reduce, xs[large], group=group), dev, 4, barrier,
            window=True)))
        # Each size in a run of calls, as a layer issues its collectives (a 64 KB call right
        # after a 16 MB one costs about 0.4 ms more on 2 gloo ranks of a 2-core machine).
        for numel in sizes:
            dist.barrier(group=group)
            _timed(functools.partial(call_site, numel), dev, counts[4 * numel], barrier,
                   window=True)
            timed.setdefault(("site", numel), []).append(
                slowest(statistics.fmean(waits[numel, site_gemms, "all_reduce"][2:])))
        # The 64 KB call site after longer computing (the sync's growth with it).
        dist.barrier(group=group)
        _timed(functools.partial(call_site, small, site_gemms * GAP_WORK), dev, gap_calls, barrier,
               window=True)
        timed.setdefault("long", []).append(
            slowest(statistics.fmean(waits[small, site_gemms * GAP_WORK, "all_reduce"][2:])))
        for kind in KIND_SITES:                 # the other kinds' 64 KB call sites
            dist.barrier(group=group)
            _timed(functools.partial(call_site, small, kind=kind), dev, kind_calls, barrier,
                   window=True)
            timed.setdefault(("site", kind), []).append(
                slowest(statistics.fmean(waits[small, site_gemms, kind][2:])))
        waits.clear()
    # The call sites' mean round, the others' median: calls after computing run 1-2.5 ms in
    # spells of a second on 2 ranks of a 2-core machine, and a training step, which pays them
    # all, meets as many spells as it lasts; over rounds the mean repeats closer than the median
    # (resampled rounds of one such machine: a spread of 15% against 22-25% in ten).
    # The back-to-back 64 KB all-reduce's median call (the slower rank's): the link's own
    # latency, in a spell when no rank's threads wait for a core (the other spells' extra is
    # the call sites' to carry, and a latency that took it whole or not at all from one
    # calibration to the next moved every all-gather's and reduce-scatter's cost with it).
    times = {k: (statistics.fmean if isinstance(k, tuple) else statistics.median)(v)
             for k, v in timed.items()}
    times[small] = slowest(statistics.median(back_to_back))
    steps, share = 2 * (n - 1), 2 * (n - 1) / n
    bw = share * 4 * (large - small) / max(times[large] - times[small], 1e-9)
    latency = max(0.0, (times[small] - share * 4 * small / bw) / steps)

    def ring(numel):
        return steps * latency + share * 4 * numel / bw
    sync = max(0.0, times[("site", small)] - ring(small))
    # A larger all-reduce costs no less than a smaller one (a noisy round could say so).
    site = list(itertools.accumulate((times[("site", numel)] for numel in sizes), max))
    curve = tuple((4.0 * numel, max(site[i] - sync, ring(small)) / ring(numel))
                  for i, numel in enumerate(sizes))
    short, long = (slowest(statistics.fmean(computed[reps]))
                   for reps in (site_gemms, site_gemms * GAP_WORK))
    per_gap = max(0.0, (times["long"] - times[("site", small)]) / max(long - short, 1e-9))
    # An all-gather of 64 KB and an all-to-all of 64 KB a rank take n - 1 ring steps of
    # (n - 1) / n of it: beyond that, each kind's call site is its sync.
    kinds = {kind: max(0.0, times[("site", kind)] - (n - 1) * (latency + 4 * small / n / bw))
             for kind in KIND_SITES}
    return bw, latency, sync, curve, times["post"], per_gap, short, kinds


def measure(name: str = "calibrated", group=None, rounds: int | None = None,
            repeats: int = 1) -> Hardware:
    """This rank's profile; links are measured when a process group is initialised.

    All ranks measure at once, each with its own thread count, and start every measurement
    together (a barrier before each), so on a CPU whose cores the ranks share the rates are
    those a rank gets while the others run the same work, as they will in training. Where a
    CPU's ranks need more cores than it has (cores / threads per rank fewer than the ranks),
    they measure compute in turns of as many as the cores hold, so the rates are a core's; the
    profile's ``concurrent_ranks`` tells the planner how many ranks compute at once at those
    rates (its simulator shares the cores among the ranks that compute at each moment).

    ``rounds`` (default ``CPU_ROUNDS``, 3, on a CPU; 1 on a GPU): every compute measurement is
    taken that many times, and each figure is the median of its rounds, as the links' are. One
    round of each moved the predicted step of one layout by 7-16% from one calibration to the
    next on a quiet 2-core machine: a GEMM shape, the layer's overhead or a link's latency that
    met a slow spell of the host once went into the profile whole. Under a process group the
    rounds are spread among the link's (``measure_link``'s ``between``), a whole compute round
    (every figure once) at a time: three rounds in a row took 20-25 s of a 2-core machine and
    could all meet one slow spell (every GEMM shape 5-20% slower in one calibration of six
    back to back; the host's own rate holds within 4% over two-second windows otherwise).

    ``repeats``: every round, the link's and the compute's, that many times over, spread the
    same way (``fastpar plan --calibrate-repeats``). A host shared with other machines' work
    can run 20-30% slower for spells of 10-20 s: a calibration of about a minute meets a few of
    them, and the same layout's prediction then moved 10-17% from one calibration to the next
    on a 2-core machine. Four times the rounds (about 5 minutes on its 2 ranks) meet four times
    as many spells: two such calibrations 20 minutes apart predicted eight layouts within
    2.5-6.3% of each other; a host that changes speed for longer than that moves them all."""
    require_positive({"repeats": repeats})
    cuda = torch.cuda.is_available()
    grouped = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    barrier = functools.partial(dist.barrier, group=group) if grouped else None
    concurrent = 0.0 if cuda else float(max(1, len(os.sched_getaffinity(0))
                                            // max(1, torch.get_num_threads())))
    turns = _turns(int(concurrent)) if grouped and not cuda and group is None else None

    rounds = (rounds or (1 if cuda else CPU_ROUNDS)) * repeats
    link_rounds = LINK_ROUNDS * repeats
    kw = (lambda b: {"barrier": b} if b is not None else {})   # one rank: the plain calls
    done: list = []

    def compute_round():
        """Every compute figure once: the GEMMs, bytes and attention, then (on a CPU) the
        per-operator overheads on fastpar's layer, the split backward and the saved bytes."""
        compute = _in_turns(lambda b: _measure_compute(device, dtype, cuda, b), turns, barrier)
        if cuda:
            done.append((compute,))
            return
        # The layer's overhead: its time less what this round's rates model for its arithmetic.
        hw = _profile(name, cuda, max(r for _, r in compute[2]), *compute[1:])
        done.append((compute,
                     _in_turns(lambda b: measure_layer_overhead(hw, device, **kw(b)), turns,
                               barrier),
                     _in_turns(lambda b: measure_split_overhead(device, **kw(b)), turns, barrier),
                     _in_turns(lambda b: measure_saved_rate(device, **kw(b)), turns, barrier)))
    link = ()
    if grouped:
        # The compute rounds spread over the link's rounds (a slow spell of a shared host lasts
        # seconds to tens of seconds: three rounds in a row met the same one).
        spots = collections.Counter(min(link_rounds - 1, (2 * i + 1) * link_rounds // (2 * rounds))
                                    for i in range(rounds))
        link = measure_link(group, device if cuda else None, barrier, rounds=link_rounds,
                            between=lambda i: [compute_round() for _ in range(spots[i])])
    else:
        for _ in range(rounds):
            compute_round()
    compute, *host = _median_rounds(done)
    # The peak: the best of the GEMM shapes' median rates (not the median of the rounds' bests).
    hw = _profile(name, cuda, max(r for _, r in compute[2]), *compute[1:], link=link)
    if cuda:
        return hw
    (forward, backward), split, saved = host
    floor = hw.kernel_overhead_us * 1e-6
    return dataclasses.replace(hw, kernel_overhead_us=1e6 * max(floor, backward),
                               forward_overhead_us=1e6 * max(floor, forward),
                               split_call_us=1e6 * split, saved_gbps=saved / 1e9,
                               concurrent_ranks=concurrent)


def _median_rounds(results: list):
    """The median of each figure over rounds of the same measurements: numbers, and lists or
    tuples of them (points (size, rate) keep their size)."""
    first = results[0]
    if isinstance(first, (int, float)):
        return statistics.median(results)
    if first and isinstance(first, list) and isinstance(first[0], tuple):     # points
        return [(x, statistics.median(r[i][1] for r in results)) for i, (x, _) in
                enumerate(first)]
    return type(first)(_median_rounds(list(parts)) for parts in zip(*results))


def _turns(concurrent: int):
    """(this rank's turn, one process group per turn) when this node's ranks outnumber the
    ranks its cores run at once, else None. Turns go by local rank (``LOCAL_RANK``, else the
    rank): ranks ``concurrent * i`` to ``concurrent * (i + 1) - 1`` of every node measure
    together. Every rank of the world takes part (it makes process groups)."""
    rank = dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    if local_world <= concurrent:
        return None
    mine = local_rank // concurrent
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    count = -(-local_world // concurrent)
    return mine, [dist.new_group([r for r, t in enumerate(everyone) if t == i])
                  for i in range(count)]


def _in_turns(fn, turns, barrier):
    """``fn(barrier)`` on this rank, in its turn (``_turns``: the ranks of one turn run it
    together, with their own barrier, while the others wait), or at once if ``turns`` is None."""
    if turns is None:
        return fn(barrier)
    mine, subgroups = turns
    out = None
    for i, sub in enumerate(subgroups):
        if i == mine:
            out = fn(functools.partial(dist.barrier, group=sub))
        dist.barrier()
    return out


def _measure_compute(device, dtype, cuda, barrier):
    kw = {"barrier": barrier} if barrier is not None else {}    # one rank: the plain calls
    peak, tiny_gemm, gemms = measure_matmul(device, dtype, **kw)
    overhead = tiny_gemm if cuda else max(tiny_gemm, measure_op_overhead(device, **kw))
    memory = measure_memory(device, **kw)
    attention = measure_attention(device, dtype, overhead, **kw)
    return peak, overhead, gemms, memory, attention, measure_activation(device, dtype, **kw)


def _profile(name, cuda, peak, overhead, gemms, memory, attention, activation, link=()):
    """The profile from the compute figures and, if measured, ``measure_link``'s."""
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mem_bw = memory[-1][1]
    matmul_curve = _curve(gemms, peak)
    if cuda:
        hbm = torch.cuda.get_device_properties(device).total_memory / 1e9
    else:
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        hbm = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9 / ranks
    link, latency, sync, link_curve, post, per_gap, gap, kinds = link or (
        mem_bw, 0.0, 0.0, (), 0.0, 0.0, 0.0, {})
    return Hardware(name=name, peak_tflops=peak / 1e12,
                    matmul_efficiency=statistics.median(y for _, y in matmul_curve), hbm_gb=hbm,
                    hbm_gbps=mem_bw / 1e9, intra_node_gbps=link / 1e9, inter_node_gbps=link / 1e9,
                    collective_latency_us=latency * 1e6, sync_us=sync * 1e6,
                    kernel_overhead_us=overhead * 1e6,
                    bytes_per_element=2 if cuda else 4,
                    memory_reserve_gb=min(1.0, hbm / 4), kind="gpu" if cuda else "cpu",
                    attention_efficiency=min(1.0, statistics.median(
                        r for _, r in attention) / peak), activation_gbps=activation / 1e9,
                    matmul_curve=tuple(matmul_curve),
                    memory_curve=tuple((x, y / 1e9) for x, y in memory),
                    attention_curve=tuple((x, min(1.0, y / peak)) for x, y in attention),
                    link_curve=link_curve, p2p_post_us=post * 1e6, sync_per_gap=per_gap,
                    sync_gap_us=gap * 1e6,
                    sync_by_kind=tuple((k, v * 1e6) for k, v in sorted(kinds.items())))


def calibrate(out: str | Path = "hardware.json", name: str | None = None,
              repeats: int = 1) -> tuple[Hardware, Path]:
    """Measure (joining torchrun's process group if there is one; ``repeats`` as
    :func:`measure`'s) and write the profile from the first rank; returns it and the path."""
    require_positive({"repeats": repeats})            # before any process group
    started = False
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        started = True
    hw = measure(name or Path(out).stem, repeats=repeats)
    path = Path(out)
    if not dist.is_initialized() or dist.get_rank() == 0:
        save_hardware(hw, path)
    if started:
        dist.destroy_process_group()
    return hw, path
