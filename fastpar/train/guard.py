"""Non-finite steps: a NaN or inf loss or gradient skips the optimizer step; K in a row stop.

Every rank decides the same: each contributes a flag (its loss or the gradient norm is not
finite) to one all-reduce (max) of a single number over the whole world, so a NaN on one rank
only (say a DP replica whose norm is computed locally) still skips the step everywhere and the
replicas never drift apart. A skipped step leaves the weights and the optimizer state as they
were; the data moves on, as after any step.
"""
from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist


class NonFiniteError(RuntimeError):
    """The loss or gradients were not finite for too many steps in a row."""


class NonFiniteGuard:
    """``ok = guard.check(step, loss, grad_norm)`` on every rank, once per step (collective)."""

    def __init__(self, limit: int, device: torch.device, verbose: bool):
        self.limit, self.device, self.verbose = limit, device, verbose
        self.in_a_row: list[int] = []         # the steps skipped since the last good one
        self.skipped = 0

    def check(self, step: int, loss: float, grad_norm: float) -> bool:
        bad = torch.tensor([0.0 if math.isfinite(loss) and math.isfinite(grad_norm) else 1.0],
                           device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if not bad.item():
            self.in_a_row = []
            return True
        self.in_a_row.append(step)
        self.skipped += 1
        if self.verbose:
            print(f"fastpar: warning: step {step}: loss {loss:.4g}, gradient norm "
                  f"{grad_norm:.4g} on rank 0 (a rank saw a NaN or inf): the optimizer step is "
                  f"skipped ({len(self.in_a_row)} in a row; the run stops at {self.limit})",
                  file=sys.stderr, flush=True)
        return False

    @property
    def exhausted(self) -> bool:
        return len(self.in_a_row) >= self.limit

    def error(self, last_good) -> NonFiniteError:
        steps = self.in_a_row
        where = f"{last_good}" if last_good is not None else "none was saved"
        return NonFiniteError(f"the loss or gradients were not finite at {len(steps)} steps in "
                              f"a row (steps {steps[0]}-{steps[-1]}, --max-skipped-steps "
                              f"{self.limit}); training stops. The last good checkpoint: {where}")
