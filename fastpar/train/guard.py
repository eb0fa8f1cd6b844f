"""Non-finite steps: a NaN or inf loss or gradient skips the optimizer step; K in a row stop.

Every rank decides the same: each contributes a flag (its loss or the gradient norm is not
finite) to one all-reduce (max) of a single number over the whole world, so a NaN on one rank
only (say a DP replica whose norm is computed locally) still skips the step everywhere and the
replicas never drift apart. A skipped step leaves the weights and the optimizer state as they
were; the data moves on, as after any step.

The flag stays on the device: the optimizer skips on the device (``found_inf``), so a step that
does not log never waits for it. The host reads the flags of the steps since the last read at
the next log step (and before any evaluation or checkpoint), all at once, and only then counts
the skipped steps, prints their warnings and, at K in a row, raises :class:`NonFiniteError`
naming the same steps as if it had read every step: the run may go on a few steps past the K-th
(skipping them too while they stay non-finite), but never saves a checkpoint after it.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from ..mesh import collectives


class NonFiniteError(RuntimeError):
    """The loss or gradients were not finite for too many steps in a row."""


class NonFiniteGuard:
    """``bad = guard.flag(loss, grad_norm)`` on every rank, once per step (a collective, no
    host sync); ``ok = guard.settle(step, bad, loss, grad_norm)`` once the host has read them."""

    def __init__(self, limit: int, device: torch.device, verbose: bool):
        self.limit, self.device, self.verbose = limit, device, verbose
        self.in_a_row: list[int] = []         # the steps skipped since the last good one
        self.skipped = 0

    def flag(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """A 0-dim float32 tensor on the device: 1 where any rank's loss or norm is not
        finite (the world's max), else 0; what ``DistributedOptimizer.step(found_inf=...)``
        takes."""
        bad = (~(torch.isfinite(loss) & torch.isfinite(grad_norm))).to(torch.float32)
        bad = bad.reshape(()).to(self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            collectives.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bad

    def settle(self, step: int, bad: bool, loss: float, grad_norm: float) -> bool:
        """Count step ``step`` as read back (in step order); returns whether it stepped."""
        if not bad:
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
