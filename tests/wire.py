"""A test-side recorder of what goes on the wire: every collective and p2p message, logical.

Python-issued ones (``dist.all_reduce``, ``batch_isend_irecv``, ...) are seen as the c10d ops they
dispatch to; the extension's GEMM <-> collective ops report theirs through the extension's trace
(``coll:<kind>`` events, one per logical collective, however many ring steps or chunks carry it).
Each record is ``(kind, bytes)``, bytes being the whole tensor gathered, reduced or sent: an
all-gather or reduce-scatter of S*B*H elements counts S*B*H, as Megatron's volumes are written.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastpar import extension


def _nbytes(ts) -> int:
    if isinstance(ts, torch.Tensor):
        return ts.numel() * ts.element_size()
    return sum(_nbytes(t) for t in ts)


# c10d op -> (kind, which argument holds the logical tensor(s))
_C10D = {"allreduce_": ("all_reduce", 0), "_allgather_base_": ("all_gather", 0),
         "allgather_": ("all_gather", 0), "allgather_into_tensor_coalesced_": ("all_gather", 0),
         "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
         "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
         "broadcast_": ("broadcast", 0), "gather_": ("gather", 1), "alltoall_base_": ("all_to_all", 1),
         "send": ("send", 0), "recv_": ("recv", 0)}


# torch's functional collectives (what DTensor issues): op -> (kind, argument)
_FUNCTIONAL = {"all_gather_into_tensor": ("all_gather", 0), "all_reduce": ("all_reduce", 0),
               "reduce_scatter_tensor": ("reduce_scatter", 0),
               "all_to_all_single": ("all_to_all", 0)}


class WireRecorder(TorchDispatchMode):
    """``with WireRecorder() as wire: ...`` then ``wire.records`` / ``wire.summary()``."""

    def __init__(self):
        super().__init__()
        self.records: list[tuple[str, int]] = []

    def __enter__(self):
        extension.events.enable()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self.records += [(name[5:], n) for name, n, _ in extension.events.take()
                         if name.startswith("coll:")]
        extension.events.enable(False)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns, name = func.namespace, func._schema.name.split("::")[-1]
        if ns == "c10d" and name in _C10D:
            kind, arg = _C10D[name]
            self.records.append((kind, _nbytes(args[arg])))
        elif ns == "_c10d_functional" and name in _FUNCTIONAL:
            kind, arg = _FUNCTIONAL[name]
            n = _nbytes(args[arg])
            self.records.append((kind, n * args[1] if kind == "all_gather" else n))
        return func(*args, **(kwargs or {}))

    def summary(self, min_bytes: int = 0) -> dict[str, tuple[int, int]]:
        """kind -> (count, total bytes) of the records of at least ``min_bytes``."""
        count, total = Counter(), Counter()
        for kind, n in self.records:
            if n >= min_bytes:
                count[kind] += 1
                total[kind] += n
        return {k: (count[k], total[k]) for k in count}
