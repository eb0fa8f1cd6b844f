"""How a prediction moves with a profile's assumed numbers: GEMM efficiency and link bandwidth.

The built-in profiles' ``matmul_efficiency`` is assumed, not measured (see ``hardware.py``), and
their link bandwidths are datasheet peaks that collectives reach only in part. This recomputes a
prediction over a grid of both, nothing else changed::

    grid = sensitivity(lambda hw: evaluate(work, Cluster(64, 8, hw), cfg).step_time_s,
                       get_hardware("a100-80gb"))
    grid[(0.7, 0.5)]          # the step at 70% GEMM efficiency and half the link bandwidth

Attention follows ``matmul_efficiency`` in profiles whose ``attention_efficiency`` is 0 (the
built-ins). Pure arithmetic: nothing is measured or run.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from .hardware import Hardware

EFFICIENCIES = (0.6, 0.7, 0.8, 0.9)       # matmul_efficiency
LINK_SCALES = (0.5, 1.0, 2.0)             # factor on intra_node_gbps and inter_node_gbps


def vary(hw: Hardware, matmul_efficiency: float, link_scale: float) -> Hardware:
    """``hw`` with ``matmul_efficiency`` set and every link's bandwidth times ``link_scale``."""
    if hw.matmul_curve:
        raise ValueError(f"hardware {hw.name!r} has a matmul_curve, which overrides "
                         f"matmul_efficiency: vary a profile without one")
    if not link_scale > 0:
        raise ValueError(f"link_scale={link_scale!r} must be > 0")
    return replace(hw, name=f"{hw.name} e{matmul_efficiency:g} link x{link_scale:g}",
                   matmul_efficiency=matmul_efficiency,
                   intra_node_gbps=hw.intra_node_gbps * link_scale,
                   inter_node_gbps=hw.inter_node_gbps * link_scale)


def sensitivity(predict: Callable[[Hardware], float], hw: Hardware,
                efficiencies=EFFICIENCIES, link_scales=LINK_SCALES) -> dict:
    """``{(matmul_efficiency, link_scale): predict(profile)}`` over the grid."""
    return {(e, s): predict(vary(hw, e, s)) for e in efficiencies for s in link_scales}
