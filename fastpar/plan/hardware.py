"""Hardware profiles: what one accelerator and its links can do, as a frozen dataclass.

The built-in profiles come from vendor datasheets (peak dense bf16 tensor-core rate, HBM size and
bandwidth, NVLink bandwidth per direction, one InfiniBand NIC per GPU as in DGX / HGX nodes) and
from first principles for what a kernel achieves:

- a GEMM of ``2 m n k`` FLOPs moving ``(m k + k n + m n)`` elements runs at the roofline
  ``max(flops / (peak * matmul_efficiency), bytes / hbm_bandwidth)`` plus ``kernel_overhead_us``;
  small or thin GEMMs are therefore memory- or launch-bound and large ones reach
  ``matmul_efficiency`` of the datasheet peak (the fraction dense-GEMM microbenchmarks reach at
  sustained clocks, not a training-run number);
- an elementwise kernel moves its bytes at ``hbm_bandwidth``, plus the same overhead;
- a ring collective step costs ``collective_latency_us`` plus its bytes over the link, and a
  collective call site ``sync_us`` more: ranks that computed apart meet there (0 in the built-in
  profiles, which have no measured drift to go on).

``kind`` says which code path fastpar runs: ``"gpu"`` (fused Triton kernels, launches queued
ahead of the device, TP collectives on their own streams overlapping the GEMMs) or ``"cpu"``
(torch reference ops, run eagerly one after another on the host, gloo collectives on the same
cores). On a CPU every operator pays ``kernel_overhead_us`` of host work (Python, dispatch,
autograd bookkeeping; ``forward_overhead_us`` in a forward), which dominates a small model, and
communication does not overlap compute.

Measured profiles may carry curves, tuples of ``(size, value)`` points interpolated in log size
and clamped at the ends: ``matmul_curve`` (FLOPs of one GEMM -> fraction of peak),
``memory_curve`` (bytes one kernel moves -> GB/s; caches make small kernels faster than a large
copy) and ``attention_curve`` (FLOPs of one fused attention call -> fraction of peak). Empty
curves fall back to ``matmul_efficiency`` / ``hbm_gbps`` / ``attention_efficiency``.

``fastpar plan --calibrate`` measures the same fields on this machine (see ``calibrate.py``).
"""
from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path


@dataclass(frozen=True)
class Hardware:
    """One accelerator model and the links between accelerators of a cluster."""

    name: str
    peak_tflops: float                  # dense tensor-core rate in the training dtype, per GPU
    matmul_efficiency: float            # fraction of peak a large GEMM sustains (0, 1]
    #                                     (see BUILTIN for the built-ins' source)
    hbm_gb: float                       # memory per GPU, GB (1e9 bytes)
    hbm_gbps: float                     # memory bandwidth, GB/s
    intra_node_gbps: float              # GPU <-> GPU inside a node, per GPU per direction, GB/s
    inter_node_gbps: float              # per GPU across nodes (its NIC), per direction, GB/s
    # The defaults below are what the built-in GPU profiles use; none is measured for them
    # (calibrate.py measures each on the machine it runs on).
    collective_latency_us: float = 10.0   # per ring step of a collective / per p2p message;
    #                                       assumed: NCCL's per-step latency over NVLink or
    #                                       InfiniBand is a few us, 10 rounds it up
    kernel_overhead_us: float = 4.0       # per kernel: launch and tail, even for tiny work;
    #                                       assumed: a CUDA launch costs a few us end to end
    sync_us: float = 0.0                  # per collective call site, where ranks that computed
    #                                       apart meet: their drift and wake-up (measured; 0 in
    #                                       the built-in profiles: nothing measured to go on)
    sync_per_gap: float = 0.0             # the sync's growth per second a rank computed since
    #                                       its previous call beyond sync_gap_us (measured; 0 in
    #                                       the built-in profiles: a GPU's host does not wait)
    sync_gap_us: float = 0.0              # the compute before the calls sync_us was measured at
    sync_by_kind: tuple = ()              # ((collective kind, us), ...): the sync of a call site
    #                                       of another kind than the all-reduce (measured: on a
    #                                       CPU gloo's all-reduce runs more message rounds than
    #                                       a pairwise exchange); a kind not listed pays sync_us
    bytes_per_element: int = 2            # training dtype of activations (bf16 = 2, fp32 = 4)
    memory_reserve_gb: float = 1.0        # runtime context and communication buffers; assumed:
    #                                       a CUDA context and NCCL's buffers take about 1 GB
    kind: str = "gpu"                     # "gpu" or "cpu": the code path fastpar runs
    attention_efficiency: float = 0.0     # fused attention, fraction of peak; 0: matmul's
    activation_gbps: float = 0.0          # transcendental elementwise kernels (SiLU, GELU, exp),
    #                                       bytes read + written per second; 0: memory-bound
    matmul_curve: tuple = ()              # ((flops of one GEMM, fraction of peak), ...)
    memory_curve: tuple = ()              # ((bytes of one kernel, GB/s), ...)
    attention_curve: tuple = ()           # ((flops of one attention call, fraction), ...)
    forward_overhead_us: float = 0.0      # per operator of a forward, where it differs from
    #                                       kernel_overhead_us (measured on a CPU); 0: the same
    p2p_post_us: float = 0.0              # host time to post one send or receive (measured;
    #                                       0 in the built-in profiles: a launch, in the noise)
    split_call_us: float = 0.0            # host time per autograd call of a zero-bubble split
    #                                       backward (one per layer in B, one per deferred module
    #                                       in W, with the forward's capture hooks; measured on a
    #                                       CPU, 0 in the built-in profiles: hidden by the device)
    saved_gbps: float = 0.0               # on a CPU: bytes per second at which a training
    #                                       forward writes what it saves for the backward, beyond
    #                                       the same forward without recording (no buffer of
    #                                       the forward reuses that memory; measured on a CPU,
    #                                       0: not counted, as in the built-in profiles)
    link_curve: tuple = ()                # ((bytes of one collective, measured less sync /
    #                                       ring model time), ...): the link's departure from the
    #                                       ring model (calibrate.measure_link)
    concurrent_ranks: float = 0.0         # on a CPU: ranks of a node that compute at once at
    #                                       the measured rates (cores / threads per rank); more
    #                                       share the cores. 0: a device per rank, no sharing

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"hardware: name={self.name!r} must be a non-empty string")
        if self.kind not in KINDS:
            raise ValueError(f"hardware {self.name!r}: kind={self.kind!r} is not one of {KINDS}")
        for f in fields(self):
            if f.name.endswith("_curve"):
                object.__setattr__(self, f.name, _check_curve(self.name, f.name,
                                                              getattr(self, f.name)))
                continue
            if f.name in ("name", "kind"):
                continue
            if f.name == "sync_by_kind":
                object.__setattr__(self, f.name, _check_syncs(self.name, self.sync_by_kind))
                continue
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):
                raise ValueError(f"hardware {self.name!r}: {f.name}={value!r} must be a number")
            zero_ok = f.name in ("collective_latency_us", "kernel_overhead_us",
                                 "memory_reserve_gb", "attention_efficiency", "activation_gbps",
                                 "sync_us", "concurrent_ranks", "forward_overhead_us",
                                 "p2p_post_us", "split_call_us", "saved_gbps", "sync_per_gap",
                                 "sync_gap_us")
            if value < 0 or (value == 0 and not zero_ok):
                raise ValueError(f"hardware {self.name!r}: {f.name}={value!r} must be "
                                 f"{'>= 0' if zero_ok else '> 0'}")
        for name in ("matmul_efficiency", "attention_efficiency"):
            if getattr(self, name) > 1:
                raise ValueError(f"hardware {self.name!r}: {name}={getattr(self, name)} must "
                                 f"be <= 1 (a fraction of peak)")
        if self.memory_reserve_gb >= self.hbm_gb:
            raise ValueError(f"hardware {self.name!r}: memory_reserve_gb="
                             f"{self.memory_reserve_gb} leaves nothing of hbm_gb={self.hbm_gb}")

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    def matmul_fraction(self, flops: float) -> float:
        """Fraction of peak one GEMM of ``flops`` sustains (the curve, else the constant)."""
        return _interp(self.matmul_curve, flops) if self.matmul_curve else self.matmul_efficiency

    def attention_fraction(self, flops: float) -> float:
        """Fraction of peak one fused attention call of ``flops`` sustains."""
        if self.attention_curve:
            return _interp(self.attention_curve, flops)
        return self.attention_efficiency or self.matmul_fraction(flops)

    def bandwidth(self, nbytes_per_kernel: float) -> float:
        """Bytes per second a memory-bound kernel moving ``nbytes_per_kernel`` sustains."""
        gbps = _interp(self.memory_curve, nbytes_per_kernel) if self.memory_curve \
            else self.hbm_gbps
        return gbps * 1e9

    def gemm_time(self, m: int, n: int, k: int, count: int = 1) -> float:
        """Seconds for ``count`` GEMMs (m, k) @ (k, n) by the roofline above."""
        flops = 2.0 * m * n * k
        nbytes = self.bytes_per_element * (m * k + k * n + m * n)
        t = max(flops / (self.peak_flops * self.matmul_fraction(flops)),
                nbytes / self.bandwidth(nbytes))
        return count * (t + self.kernel_overhead_us * 1e-6)

    def gemm_efficiency(self, m: int, n: int, k: int) -> float:
        """Achieved fraction of peak for one (m, k) @ (k, n) GEMM."""
        return 2.0 * m * n * k / self.gemm_time(m, n, k) / self.peak_flops

    def memory_time(self, nbytes: float, kernels: int = 1) -> float:
        """Seconds for memory-bound kernels moving ``nbytes`` in all."""
        if nbytes <= 0:
            return kernels * self.kernel_overhead_us * 1e-6
        per = nbytes / max(kernels, 1)
        return nbytes / self.bandwidth(per) + kernels * self.kernel_overhead_us * 1e-6

    def saved_time(self, nbytes: float) -> float:
        """Seconds a training forward spends writing ``nbytes`` it saves for the backward,
        beyond what its operators cost without recording (0 where not measured)."""
        return nbytes / (self.saved_gbps * 1e9) if self.saved_gbps and nbytes > 0 else 0.0

    def activation_time(self, nbytes: float) -> float:
        """Seconds a transcendental elementwise kernel takes to read and write ``nbytes``
        (no launch overhead: it is counted with the operator)."""
        if nbytes <= 0:
            return 0.0
        return nbytes / (self.activation_gbps * 1e9 if self.activation_gbps
                         else self.bandwidth(nbytes))

    def for_forward(self) -> "Hardware":
        """This profile with a forward's per-operator overhead (itself if there is none)."""
        if not self.forward_overhead_us or self.forward_overhead_us == self.kernel_overhead_us:
            return self
        return replace(self, kernel_overhead_us=self.forward_overhead_us)

    def link_factor(self, nbytes: float) -> float:
        """Measured / modelled time of a collective of ``nbytes`` (1 without a link curve)."""
        return _interp(self.link_curve, nbytes) if self.link_curve else 1.0

    def call_sync(self, kind: str) -> float:
        """Seconds of sync a call site of collective ``kind`` pays (``sync_by_kind``, else
        ``sync_us``)."""
        return dict(self.sync_by_kind).get(kind, self.sync_us) * 1e-6

    def to_dict(self) -> dict:
        out = asdict(self)
        for k in [k for k in out if k.endswith("_curve")]:
            out[k] = [list(p) for p in out[k]]
        return out


KINDS = ("gpu", "cpu")


# ---- The cost model's constants ----------------------------------------------------------------
# With a profile's fields, these are every number the cost model (cost.py, planner.py) takes that
# is not a formula's arithmetic (FLOPs and bytes of an operation, written where they are used)
# and not counted on fastpar's own code (cost.REFERENCE_OPS, REFERENCE_BYTES, CE_REFERENCE_OPS:
# the CPU path's operators and bytes, re-counted on the real layer and loss by
# tests/test_plan.py); fastpar's own settings (bytes per parameter, TP chunks, DP bucket size)
# are cost.Features, whose defaults are the trainer's. These constants are frozen: changing one
# changes every prediction, and a check of the predictions out of sample (bench/RESULTS.md)
# holds only for the values it was run with.

# Causal attention: a fused kernel skips the blocks above the diagonal, about half of the
# s x s scores (arithmetic, exact as s grows past the block size).
CAUSAL_FRACTION = 0.5
# Attention core's backward over its forward. Fused: FlashAttention-2 (Dao 2023, sec. 3) runs
# five matmuls backward (it recomputes q k^T) against the forward's two: 2.5. Unfused: each of
# the two batched GEMMs has two GEMMs of its size backward: 2.0 (arithmetic).
ATTENTION_BACKWARD_FLASH = 2.5
ATTENTION_BACKWARD_UNFUSED = 2.0

# fastpar's GPU path (fused kernels; not counted on a GPU, none in CI). Assumed:
# kernels of one layer's forward outside its GEMMs and attention: two norms, two
# bias-dropout-adds and the activation (five named kernels) and two more not traced to a
# kernel; rotary adds one kernel per rotated tensor (q and k);
GPU_LAYER_KERNELS = 7
GPU_ROTARY_KERNELS = 2
# each backward kernel reads the output gradient and the saved input and writes one: twice the
# forward's traffic, in twice its kernels;
GPU_BACKWARD_FACTOR = 2
# the embedding's lookup and its backward: one kernel each; the final norm (forward, backward)
# and the fused cross entropy (forward, backward);
GPU_EMBED_KERNELS = 1
GPU_NORM_KERNELS = (1, 2)
GPU_CROSS_ENTROPY_KERNELS = (2, 1)
# the optimizer step (multi-tensor AdamW and the clipping's norm and scale) in 8 kernels in all.
GPU_OPTIMIZER_KERNELS = 8

# The CPU path's embedding: torch's reference lookup, two operators forward and two backward
# (assumed; not re-counted by a test).
CPU_EMBED_OPS = 2

# The CPU path's optimizer: torch's foreach ops loop over the parameter tensors off CUDA, so each
# tensor pays the per-operator overhead this many times. Assumed 14; a dispatch count of
# AdamW(foreach=True) with the trainer's clipping (torch 2.13, CPU) finds 11 foreach operators
# and 2 scalar reads per tensor (the step count), 13.
CPU_OPTIMIZER_OPS_PER_TENSOR = 14

# Bytes per parameter of the optimizer step on fp32 masters (arithmetic): AdamW reads weight,
# gradient and both moments (16) and writes weight and moments (12); clipping reads the
# gradient for its norm (4) and scales it (a read and a write, 8: like torch's
# clip_grad_norm_, it multiplies by the clamped coefficient whatever the norm, so that the host
# never waits to read it).
OPTIMIZER_STEP_BYTES = 40
# Passes over the gradient bytes (arithmetic). Every layout's gradients live in DataParallel's
# bucket buffers: the first micro-batch's gradient is copied into its bucket view (divided by dp
# on the way: read, write), each later micro-batch's is added into it by autograd (read two,
# write one). With fp32 main gradients (bf16 weights) every micro-batch's is added into the
# zeroed main gradient (and the buffer is zeroed and, under DP, divided in place).
BUCKET_COPY_PASSES = 2
ACCUMULATE_PASSES = 3


def _check_curve(hw: str, name: str, curve) -> tuple:
    """A curve as a tuple of (size, value) pairs, sizes increasing, all positive."""
    try:
        points = tuple(sorted((float(x), float(y)) for x, y in curve))
    except (TypeError, ValueError):
        raise ValueError(f"hardware {hw!r}: {name} must be a list of (size, value) pairs, "
                         f"got {curve!r}") from None
    for x, y in points:
        if not (math.isfinite(x) and math.isfinite(y) and x > 0 and y > 0):
            raise ValueError(f"hardware {hw!r}: {name} point ({x}, {y}) must be positive")
    return points


SYNC_KINDS = ("all_gather", "reduce_scatter", "all_to_all")   # kinds ``sync_by_kind`` may list


def _check_syncs(hw: str, pairs) -> tuple:
    """``sync_by_kind`` as a tuple of (kind, us) pairs, one per kind of :data:`SYNC_KINDS`."""
    try:
        out = tuple(sorted((k, float(v)) for k, v in pairs))
    except (TypeError, ValueError):
        raise ValueError(f"hardware {hw!r}: sync_by_kind must be a list of (kind, us) pairs, "
                         f"got {pairs!r}") from None
    for k, v in out:
        if k not in SYNC_KINDS or not math.isfinite(v) or v < 0:
            raise ValueError(f"hardware {hw!r}: sync_by_kind entry ({k!r}, {v}) needs a kind "
                             f"of {SYNC_KINDS} and a sync >= 0")
    if len({k for k, _ in out}) < len(out):
        raise ValueError(f"hardware {hw!r}: sync_by_kind lists a kind twice: {out}")
    return out


def _interp(curve: tuple, x: float) -> float:
    """Piecewise-linear in log(x) through the curve's points, flat beyond its ends."""
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x <= x1:
            if x1 == x0:
                return y1
            u = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + u * (y1 - y0)
    return curve[-1][1]


# Datasheets: NVIDIA A100 (SXM4) and H100 / H200 (SXM5) datasheets; DGX A100 / DGX H100 /
# HGX H200 system guides (NVLink 3: 600 GB/s, NVLink 4: 900 GB/s per GPU, both directions
# together; one 200 Gb/s HDR (A100) or 400 Gb/s NDR (H100, H200) NIC per GPU). Those give
# peak_tflops (dense bf16), hbm_gb, hbm_gbps, intra_node_gbps and inter_node_gbps.
# matmul_efficiency is assumed, not measured here and not taken from a cited source: 0.80 on
# A100 and 0.70 on H100 / H200 (whose peak assumes boost clocks that power limits cut under
# dense tensor-core load) are the shares of the datasheet peak that large bf16 cuBLAS GEMMs are
# commonly reported to sustain. Predictions scale with it almost in proportion wherever GEMMs
# dominate: bench/RESULTS.md ("sensitivity") shows the published rows at 0.6-0.9.
# `fastpar plan --calibrate` on the GPU measures it (the median of its GEMM shapes).
BUILTIN: dict[str, Hardware] = {
    "a100-40gb": Hardware("a100-40gb", peak_tflops=312.0, matmul_efficiency=0.80, hbm_gb=40.0,
                          hbm_gbps=1555.0, intra_node_gbps=300.0, inter_node_gbps=25.0),
    "a100-80gb": Hardware("a100-80gb", peak_tflops=312.0, matmul_efficiency=0.80, hbm_gb=80.0,
                          hbm_gbps=2039.0, intra_node_gbps=300.0, inter_node_gbps=25.0),
    "h100-80gb": Hardware("h100-80gb", peak_tflops=989.0, matmul_efficiency=0.70, hbm_gb=80.0,
                          hbm_gbps=3350.0, intra_node_gbps=450.0, inter_node_gbps=50.0),
    "h200": Hardware("h200", peak_tflops=989.0, matmul_efficiency=0.70, hbm_gb=141.0,
                     hbm_gbps=4800.0, intra_node_gbps=450.0, inter_node_gbps=50.0),
}


def load_hardware(path: str | Path) -> Hardware:
    """A profile from a JSON object with :class:`Hardware`'s fields; bad files raise ValueError."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"hardware file {str(path)!r} cannot be read as JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"hardware file {str(path)!r} must hold a JSON object")
    known = {f.name for f in fields(Hardware)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"hardware file {str(path)!r}: unknown field(s) {unknown}; "
                         f"fields are {sorted(known)}")
    required = required_fields()
    missing = [k for k in required if k not in data and k != "name"]
    if missing:
        raise ValueError(f"hardware file {str(path)!r} lacks field(s) {', '.join(missing)} "
                         f"(required: {', '.join(k for k in required if k != 'name')}; name "
                         f"defaults to the file's stem, {path.stem!r})")
    data.setdefault("name", path.stem)
    try:
        return Hardware(**data)
    except TypeError as e:          # not expected: every field was checked above
        raise ValueError(f"hardware file {str(path)!r}: {e}") from None


def required_fields() -> list[str]:
    """:class:`Hardware`'s fields without a default, in their order."""
    return [f.name for f in fields(Hardware)
            if f.default is MISSING and f.default_factory is MISSING]


def save_hardware(hw: Hardware, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(hw.to_dict(), indent=2) + "\n")
    return path


def device_profile(device_type: str, bytes_per_element: int, memory_gb: float) -> Hardware:
    """A profile of the device a run trains on, for memory questions only (``fastpar train``'s
    check before launch): ``memory_gb`` per rank, the activations' bytes per element, the code
    path (``"cuda"``: fastpar's GPU kernels, anything else torch's reference ops) and the
    reserve a measured profile gets (``calibrate``: 1 GB, at most a quarter of the memory).
    Its speeds are not known and set to 1: time nothing with it."""
    return Hardware(f"this {device_type} device", peak_tflops=1.0, matmul_efficiency=1.0,
                    hbm_gb=memory_gb, hbm_gbps=1.0, intra_node_gbps=1.0, inter_node_gbps=1.0,
                    bytes_per_element=bytes_per_element,
                    memory_reserve_gb=min(1.0, memory_gb / 4),
                    kind="gpu" if device_type == "cuda" else "cpu")


def get_hardware(name: str) -> Hardware:
    """A built-in profile by name, or a JSON file path (anything ending in .json)."""
    if name in BUILTIN:
        return BUILTIN[name]
    if str(name).endswith(".json"):
        return load_hardware(name)
    raise ValueError(f"unknown hardware {name!r}; choose one of {sorted(BUILTIN)} "
                     f"or give a .json profile")
