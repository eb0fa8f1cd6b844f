"""Megatron-style ColumnParallelLinear and RowParallelLinear.

Column: weight shard (out/tp, in), output features split over TP. Row: weight shard (out, in/tp),
input features split, partial products summed over TP; its bias is whole on every rank and added
once, after the reduction. Activations are sequence-first (S, B, H) or (T, H); under sequence
parallelism (SP) the activations outside the pair are split along dim 0, and the row bias, added
to this rank's rows only, gets a partial gradient that ``reduce_replicated_grads`` sums once per
step.

With ``overlap=True`` the communication runs inside the extension's GEMM <-> collective pipelines
(:mod:`fastpar.tensor_parallel.overlap`); ``overlap=False`` runs the plain sequence of mappings.
Both compute the same numbers.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..mesh.groups import group_rank, group_size
from ..mesh.layout import require_positive
from .mappings import (check_divisible, copy_to_tp, gather_from_sp, gather_from_tp, reduce_from_tp,
                       reduce_scatter_to_sp, scatter_to_tp, _gather)
from .overlap import ColumnLinearOverlap, RowLinearOverlap, defers_grads, wait_grad_later
from .sharding import mark_partial_grads


class TPSharded(nn.Module):
    """A module whose own parameters may be split over TP. ``tp_shard_dims`` maps parameter names
    to the dim split over the TP group, None where replicated; checkpoints read it."""

    tp_shard_dims: dict[str, int | None]


class _ParallelLinear(TPSharded):
    """Shared by both layers: sharding, nn.Linear's initialisation, gathering back."""

    shard_dim = property(lambda self: self.tp_shard_dims["weight"])  # of the (out, in) weight

    def __init__(self, in_features, out_features, bias, tp_group, sequence_parallel, overlap,
                 chunks, dtype, device, parts=None):
        super().__init__()
        require_positive({"chunks": chunks}, f"{type(self).__name__}: ")
        # At most this many row chunks of the overlapped GEMM + all-reduce, each at least
        # overlap.MIN_CHUNK_BYTES (overlap.row_chunks).
        self.chunks = chunks
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.sequence_parallel, self.overlap = tp_group, sequence_parallel, overlap
        self.tp_size, self.tp_rank = group_size(tp_group), group_rank(tp_group)
        name = type(self).__name__
        # The logical linears fused into this one, (name, out_features) in order; each is split
        # over TP on its own. One part: a plain linear.
        self.parts = tuple((str(n), int(k)) for n, k in parts) if parts else (("", out_features),)
        if sum(k for _, k in self.parts) != out_features:
            raise ValueError(f"{name}: parts {dict(self.parts)} add up to "
                             f"{sum(k for _, k in self.parts)}, not out_features={out_features}")
        if self.shard_dim == 0:
            for part, k in self.parts:
                check_divisible(k, self.tp_size, f"{name}: out_features"
                                + (f" of part {part!r}" if part else ""))
        else:
            check_divisible(in_features, self.tp_size, f"{name}: in_features")
        # Initialise the full weight exactly as nn.Linear would under this seed, keep the slice.
        full = torch.empty(out_features, in_features, dtype=dtype, device=device)
        nn.init.kaiming_uniform_(full, a=math.sqrt(5))
        self.weight = nn.Parameter(self._slice(full, self.shard_dim).clone())
        if bias:
            full_b = torch.empty(out_features, dtype=dtype, device=device)
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
            nn.init.uniform_(full_b, -bound, bound)
            self.bias = nn.Parameter(full_b if self.shard_dim == 1 else self._slice(full_b, 0).clone())
        else:
            self.register_parameter("bias", None)

    def _slice(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of a full tensor along ``dim``: of each part, for the output dim."""
        if self.tp_size == 1:
            return t
        if dim != 0 or len(self.parts) == 1:
            return t.chunk(self.tp_size, dim=dim)[self.tp_rank]
        blocks = t.split([k for _, k in self.parts], dim=0)
        return torch.cat([b.chunk(self.tp_size, dim=0)[self.tp_rank] for b in blocks], dim=0)

    def _unslice(self, gathered: torch.Tensor) -> torch.Tensor:
        """The full tensor from the ranks' slices stacked in rank order along dim 0."""
        if len(self.parts) == 1:
            return gathered
        local = [k // self.tp_size for _, k in self.parts]
        per_rank = [r.split(local, dim=0) for r in gathered.chunk(self.tp_size, dim=0)]
        return torch.cat([torch.cat([r[i] for r in per_rank], dim=0)
                          for i in range(len(local))], dim=0)

    def local_parts(self) -> list[tuple[str, int, int]]:
        """(name, offset, rows) of each part in this rank's weight (dim 0)."""
        out, offset = [], 0
        for name, k in self.parts:
            rows = k // self.tp_size if self.shard_dim == 0 else k
            out.append((name, offset, rows))
            offset += rows
        return out

    @classmethod
    def from_linear(cls, module: nn.Linear, tp_group=None, **kwargs):
        """Shard an existing nn.Linear: this rank keeps its slice of the weight (and bias)."""
        layer = cls(module.in_features, module.out_features, module.bias is not None,
                    tp_group=tp_group, dtype=module.weight.dtype, device="meta", **kwargs)
        layer.to_empty(device=module.weight.device)
        with torch.no_grad():
            layer.weight.copy_(layer._slice(module.weight, layer.shard_dim))
            layer.weight.requires_grad_(module.weight.requires_grad)
            if module.bias is not None:
                b = module.bias if layer.shard_dim == 1 else layer._slice(module.bias, 0)
                layer.bias.copy_(b)
                layer.bias.requires_grad_(module.bias.requires_grad)
        return layer

    @torch.no_grad()
    def to_linear(self) -> nn.Linear:
        """Gather the full layer back as an nn.Linear (collective over the TP group)."""
        w = self.weight.detach()
        if self.tp_size > 1:
            w = _gather(w, self.tp_group, self.shard_dim)
            w = self._unslice(w) if self.shard_dim == 0 else w
        out = nn.Linear(self.in_features, self.out_features, self.bias is not None,
                        device=w.device, dtype=w.dtype)
        out.weight.copy_(w)
        if self.bias is not None:
            b = self.bias.detach()
            out.bias.copy_(self._unslice(_gather(b, self.tp_group, 0)) if self.shard_dim == 0
                           and self.tp_size > 1 else b)
        return out

    def _cast(self, x: torch.Tensor):
        """(x, weight, bias) as ``F.linear`` sees them: under autocast all in the autocast dtype.

        The overlapped paths call the extension's ops and add the bias themselves, which autocast
        does not reach; without this they would get bf16 activations next to fp32 weights. The
        casts are differentiable, so the fp32 parameters still get fp32 gradients.
        """
        device = x.device.type
        if not torch.is_autocast_enabled(device):
            return x, self.weight, self.bias
        dtype = torch.get_autocast_dtype(device)
        cast = (lambda t: t if t is None or not t.is_floating_point() else t.to(dtype))
        return cast(x), cast(self.weight), cast(self.bias)

    def _weight_id(self) -> int:
        """``id()`` of the weight, naming it to :mod:`fastpar.split_backward`. 0 under
        torch.compile, which runs no split backward: an id would tie the graph to this layer."""
        return 0 if torch.compiler.is_compiling() else id(self.weight)

    def _check_width(self, x: torch.Tensor, expected: int) -> None:
        if x.dim() < 1 or x.shape[-1] != expected:
            raise ValueError(f"{type(self).__name__}: input has width {tuple(x.shape)[-1:]} "
                             f"(shape {tuple(x.shape)}) but expects {expected} (tp={self.tp_size})")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"tp={self.tp_size}, sequence_parallel={self.sequence_parallel}, "
                f"overlap={self.overlap}")


class ColumnParallelLinear(_ParallelLinear):
    """y = x W^T + b with W split by rows (output features) over the TP group."""

    tp_shard_dims = {"weight": 0, "bias": 0}

    def __init__(self, in_features, out_features, bias=True, *, tp_group=None,
                 gather_output=False, sequence_parallel=False, overlap=True, chunks=4,
                 parts=None, skip_bias_add=False, regather_input=False, dtype=None,
                 device=None):
        if parts and gather_output:
            raise ValueError("ColumnParallelLinear: gather_output with parts is not supported "
                             "(the gathered features would be interleaved by rank)")
        super().__init__(in_features, out_features, bias, tp_group, sequence_parallel, overlap,
                         chunks, dtype, device, parts)
        self.gather_output = gather_output
        # Under SP with overlap: gather the input again in backward for the weight gradient
        # instead of keeping the gathered copy (one more all-gather, 1/tp of its memory).
        self.regather_input = regather_input
        # Return (y, bias) with the bias not added, for a fused kernel to add it (bias_gelu).
        self.skip_bias_add = skip_bias_add
        if skip_bias_add and gather_output:
            raise ValueError("ColumnParallelLinear: skip_bias_add with gather_output is not "
                             "supported")

    @classmethod
    def fused(cls, linears: dict, tp_group=None, **kwargs) -> "ColumnParallelLinear":
        """One column-parallel linear from several ``nn.Linear`` of the same input, e.g.
        ``{"q": q, "k": k, "v": v}``: each is sharded on its own, so every rank holds its own
        query heads and its own key and value heads (GQA included)."""
        mods = list(linears.values())
        first = mods[0]
        if any(m.in_features != first.in_features or (m.bias is None) != (first.bias is None)
               for m in mods):
            raise ValueError("ColumnParallelLinear.fused: the linears must share in_features "
                             "and all have a bias or none")
        whole = nn.Linear(first.in_features, sum(m.out_features for m in mods),
                          first.bias is not None, device="meta", dtype=first.weight.dtype)
        whole.weight = nn.Parameter(torch.cat([m.weight.detach() for m in mods]))
        if first.bias is not None:
            whole.bias = nn.Parameter(torch.cat([m.bias.detach() for m in mods]))
        parts = [(name, m.out_features) for name, m in linears.items()]
        return cls.from_linear(whole, tp_group=tp_group, parts=parts, **kwargs)

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        """The output of each part (views of ``y``'s last dim), in order."""
        return list(y.split([rows for _, _, rows in self.local_parts()], dim=-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_width(x, self.in_features)
        x, weight, bias = self._cast(x)              # cast before the gather: half the bytes
        y = self._linear(x, weight, None if self.skip_bias_add else bias)
        return (y, bias) if self.skip_bias_add else y

    def _linear(self, x, weight, bias):
        if self.tp_size == 1:
            return F.linear(x, weight, bias)
        if self.overlap:
            rows = x.reshape(-1, x.shape[-1])        # (S*B, in); a sequence shard under SP
            pending = None
            if defers_grads() and not self.sequence_parallel and rows.requires_grad:
                rows, pending = wait_grad_later(rows)   # interleaved micro-batches
            y = ColumnLinearOverlap.apply(rows, weight, self.tp_group,
                                          self.sequence_parallel, self.chunks, self._weight_id(),
                                          self.regather_input, pending)
            lead = ((x.shape[0] * self.tp_size,) + x.shape[1:-1]) if self.sequence_parallel \
                else x.shape[:-1]
            y = y.view(*lead, -1)
            if bias is not None:
                y = y + bias
        else:
            x = gather_from_sp(x, self.tp_group) if self.sequence_parallel \
                else copy_to_tp(x, self.tp_group)
            y = F.linear(x, weight, bias)
        return gather_from_tp(y, self.tp_group) if self.gather_output else y   # (S, B, out[/tp])


class RowParallelLinear(_ParallelLinear):
    """y = sum over TP of x_r W_r^T, + b once; W split by columns (input features)."""

    tp_shard_dims = {"weight": 1, "bias": None}  # the bias is whole, added after the sum

    def __init__(self, in_features, out_features, bias=True, *, tp_group=None,
                 input_is_parallel=True, sequence_parallel=False, overlap=True, chunks=4,
                 skip_bias_add=False, dtype=None, device=None):
        super().__init__(in_features, out_features, bias, tp_group, sequence_parallel, overlap,
                         chunks, dtype, device)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel")
        self.input_is_parallel = input_is_parallel
        # Return (y, bias) with the bias not added, for a fused kernel to add it
        # (bias_dropout_add).
        self.skip_bias_add = skip_bias_add
        if bias and sequence_parallel and self.tp_size > 1:
            # Each rank adds the bias to its own rows only: its gradient is a partial sum,
            # summed over TP once per step (reduce_replicated_grads), not in every backward.
            mark_partial_grads(self, "bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            self._check_width(x, self.in_features)
            x, weight, bias = self._cast(x)
            y = F.linear(x, weight, None if self.skip_bias_add else bias)
            return (y, bias) if self.skip_bias_add else y
        if not self.input_is_parallel:
            self._check_width(x, self.in_features)
            x = scatter_to_tp(x, self.tp_group)
        self._check_width(x, self.in_features // self.tp_size)
        if self.sequence_parallel and x.shape[0] % self.tp_size:
            raise ValueError(f"RowParallelLinear: sequence length (dim 0) {x.shape[0]} is not "
                             f"divisible by tp={self.tp_size} under sequence parallelism")
        x, weight, bias = self._cast(x)
        if self.overlap:
            rows = x.reshape(-1, x.shape[-1])
            # Its all-reduce may be left in flight (overlap.deferred_reductions) only where
            # nothing here reads the output: the caller adds the bias after waiting.
            y = RowLinearOverlap.apply(rows, weight, self.tp_group, self.sequence_parallel,
                                       self.chunks, self._weight_id(),
                                       self.skip_bias_add or bias is None)
            lead = ((x.shape[0] // self.tp_size,) + x.shape[1:-1]) if self.sequence_parallel \
                else x.shape[:-1]
            y = y.view(*lead, -1)
        else:
            y = F.linear(x, weight)
            y = reduce_scatter_to_sp(y, self.tp_group) if self.sequence_parallel \
                else reduce_from_tp(y, self.tp_group)
        if self.skip_bias_add:
            return y, bias
        return y if bias is None else y + bias
