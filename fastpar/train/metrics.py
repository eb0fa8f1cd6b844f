"""Per-step metrics: ``OUT/metrics.jsonl``, a progress bar and log lines, ``OUT/loss.png``
(training and validation curves), and with ``tensorboard`` the same scalars in
``OUT/tensorboard``.

A step's loss, gradient norm and non-finite flag stay on the device (:class:`PendingSteps`)
until a log step reads all of them back with one host sync: on a GPU reading them every step
would make the host wait for the device, so that the next step's launches start late. The rows
are then written per step, as if read every step. Each row's ``step_time_s`` is the host's time
from the step's start to its end: on a CPU that is the step; on a GPU the host returns from a
step that does not log once its work is queued, and the step that reads waits for the queue, so
only the sum (or mean) over the steps between two log steps is the device's time.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch


class Metrics:
    """Writes one JSON object per step; on the first rank only (``enabled``)."""

    def __init__(self, out: str, enabled: bool, total_steps: int, start_step: int = 0,
                 log_every: int = 10, peak_flops: float | None = None, resume: bool = False,
                 tensorboard: bool = False):
        self.enabled, self.log_every, self.peak_flops = enabled, log_every, peak_flops
        self.path = Path(out) / "metrics.jsonl"
        self.bar = self.board = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not resume:
            self.path.write_text("")
        else:   # drop the steps after the checkpoint we resume from: they will be redone
            kept = [line for line in self._read() if line["step"] <= start_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        from tqdm import tqdm

        # A bar only on a terminal: in a log file it would be a line per update.
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                        leave=True, disable=not sys.stderr.isatty())
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(str(Path(out) / "tensorboard"), purge_step=start_step + 1)

    def _read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def log(self, step: int, loss: float, lr: float, tokens: int, step_time: float,
            flops_per_step: float, world_size: int, skipped: bool = False,
            val_loss: float | None = None, extra: dict | None = None) -> dict:
        row = {"step": step, "loss": loss, "lr": lr, "tokens_per_s": tokens / step_time,
               "step_time_s": step_time, **(extra or {})}
        if skipped:         # a non-finite step: the optimizer did not step
            row["skipped"] = True
        if val_loss is not None:    # the mean loss on the held-out split, after this step
            row["val_loss"] = val_loss
            row["val_ppl"] = math.exp(min(val_loss, 700.0))
        if self.peak_flops:
            row["mfu"] = flops_per_step / step_time / (self.peak_flops * world_size)
        if torch.cuda.is_available():
            row["max_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
        if not self.enabled:
            return row
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.board is not None:
            for key, value in row.items():
                if key != "step" and not isinstance(value, bool):
                    self.board.add_scalar(key, value, step)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss:.4f}")
        if step % self.log_every == 0 or step == 1 or val_loss is not None:
            extra = f" mfu {row['mfu']:.1%}" if "mfu" in row else ""
            if val_loss is not None:
                extra += f" | val loss {val_loss:.4f} ppl {row['val_ppl']:.2f}"
            mem = f" mem {row['max_memory_gb']:.1f}GB" if "max_memory_gb" in row else ""
            line = (f"step {step:5d} | loss {loss:.4f} | lr {lr:.2e} | "
                    f"{row['tokens_per_s']:.0f} tok/s | {step_time * 1e3:.0f} ms{extra}{mem}")
            if self.bar.disable:
                print(line, flush=True)
            else:
                self.bar.write(line)
        return row

    def close(self) -> Path | None:
        """Finish the bar and draw ``loss.png`` from the whole metrics file; returns its path."""
        if not self.enabled:
            return None
        self.bar.close()
        if self.board is not None:
            self.board.close()
        rows = self._read()
        if not rows:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train")
        val = [r for r in rows if "val_loss" in r]
        if val:
            ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-",
                    label="validation")
            ax.legend()
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        png = self.path.with_name("loss.png")
        fig.savefig(png, dpi=100)
        plt.close(fig)
        return png


class PendingSteps:
    """The steps since the last read: per step, device scalars (e.g. loss, gradient norm,
    non-finite flag) and host values. :meth:`read` returns them as Python floats, all steps
    with one host sync."""

    def __init__(self):
        self._steps: list[tuple[int, tuple[torch.Tensor, ...], dict]] = []

    def add(self, step: int, values: tuple[torch.Tensor, ...], **host) -> None:
        self._steps.append((step, values, host))

    def __len__(self) -> int:
        return len(self._steps)

    def read(self) -> list[tuple[int, list[float], dict]]:
        """``[(step, [float per value], host values), ...]`` in step order; empties the list.
        Values are read as float64, so an fp32 loss reads as ``loss.item()`` would."""
        if not self._steps:
            return []
        flat = torch.stack([v.detach().reshape(()).to(torch.float64)
                            for _, values, _ in self._steps for v in values]).tolist()
        k = len(self._steps[0][1])
        out = [(step, flat[i * k:(i + 1) * k], host)
               for i, (step, _, host) in enumerate(self._steps)]
        self._steps = []
        return out
