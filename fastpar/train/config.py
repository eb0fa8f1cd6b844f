"""TrainConfig: everything a training run needs, validated before any process group exists."""
from __future__ import annotations

import importlib.util
import re
from dataclasses import asdict, dataclass
from functools import cached_property

from ..mesh.layout import Layout, require_positive
from ..models.parallel_config import ParallelConfig
from ..models import GPTConfig, get_config
from ..pipeline.schedules import PLACEMENT, build_schedule
from .init_from import source_config

PRECISIONS = ("auto", "bf16", "amp", "fp32")
REDUCE_DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class TrainConfig(ParallelConfig):
    """A :class:`~fastpar.mesh.ParallelConfig` (tp, pp, dp, schedule, ...) and the rest of a run.

    Each field is a flag of ``fastpar train`` (``micro_batch_size`` -> ``--micro-batch-size``);
    the comment after it is the flag's help."""

    model: str = "tiny"                 # a preset of fastpar.models.PRESETS
    vocab_size: int | None = None       # the model's vocabulary, instead of the preset's (e.g.
                                        # the one a prepared data folder was tokenized with)
    micro_batch_size: int = 4           # sequences per micro-batch
    global_batch_size: int = 16         # sequences per optimizer step, over all DP ranks
    seq_len: int = 128                  # tokens per sequence
    steps: int = 200                    # optimizer steps
    lr: float = 3e-3                    # peak learning rate
    min_lr: float = 3e-4                # floor of the cosine decay
    warmup_steps: int = 20              # linear warm-up
    weight_decay: float = 0.1           # AdamW's decoupled decay, on matrices only
    grad_clip: float = 1.0              # clip by the true global norm; 0 disables
    seed: int = 0                       # model init and data order
    init_from: str | None = None        # start from these weights (fine-tuning): a Hugging Face
                                        # directory (Llama or GPT-2) or a fastpar checkpoint; the
                                        # model's shape is theirs (--model is not used)
    data: str | None = None             # a folder fastpar prepare-data wrote, a token file, a text
                                        # file or folder (bytes); None = stdlib corpus
    out: str | None = None              # metrics, plot, config, checkpoints; None = a fresh
                                        # folder under runs/ (fastpar.train.outdir)
    save_every: int = 0                 # steps between checkpoints; 0 = only at the end
    no_save: bool = False               # write no checkpoint at all (benchmarks, smoke runs)
    resume: bool | str = False          # continue the run in OUT from its latest checkpoint;
                                        # "auto": resume if there is one, else start fresh
    overwrite: bool = False             # move an earlier run in OUT aside, then start anew
    adopt_changes: bool = False         # with --resume: continue with this command's --steps,
                                        # --lr, --min-lr, --warmup-steps, batch sizes, seed or
                                        # data where they differ from the run's (each change is
                                        # printed); without it such a resume is refused
    keep_last: int = 0                  # complete checkpoints kept, the newest; 0 keeps all
    async_save: bool = False            # write checkpoints on a background thread
    timeout: float = 600.0              # seconds a rank may go without progress (no collective,
                                        # no step region) before every rank dumps its record of
                                        # collectives and the run stops, naming where they differ
    max_skipped_steps: int = 5          # non-finite steps in a row (skipped) before stopping
    deterministic: bool = False         # deterministic kernels on GPU (CPU always is)
    compile: bool = False               # torch.compile each Transformer block (fullgraph, inductor;
                                        # fastpar.models.compile_blocks); needs dropout 0, a
                                        # schedule without a split backward, no --interleave
    precision: str = "auto"             # bf16: Megatron's mixed precision (bf16 parameters and
                                        # activations, fp32 main gradients and master weights) |
                                        # amp: bf16 autocast over fp32 weights | fp32 |
                                        # auto: bf16 on GPU, fp32 on CPU (bf16 runs on CPU too)
    grad_reduce_dtype: str = "fp32"     # dtype of the data-parallel gradient reduction
    log_every: int = 10                 # steps between log lines
    pack_documents: bool = True         # prepared data of two or more documents: pack whole
                                        # documents into each sequence, attention stopping at
                                        # each one's end and positions restarting, the target
                                        # across a boundary not trained (--no-pack-documents:
                                        # sequences cut anywhere, attending across documents)
    cp_balance: str = "work"            # packed documents under context parallelism: deal each
                                        # micro-batch's 2 x cp chunks out by attention work
                                        # ("work") or as the fixed zigzag pairs ("zigzag")
    pad_documents: bool = False         # one document (or a piece of a long one) per sequence,
                                        # padded; the baseline packing is measured against
    eval_every: int = 0                 # steps between validation-loss evaluations on the data's
                                        # held-out split (and one at the last step); 0 = none
    eval_batches: int = 4               # held-out global batches per evaluation (the same ones
                                        # every time)
    profile_steps: str | None = None    # A:B: a torch.profiler trace per rank of steps A to B,
                                        # in OUT/profile (open in Perfetto or chrome://tracing)
    tensorboard: bool = False           # also log the metrics to OUT/tensorboard (needs the
                                        # tensorboard package)
    sample_tokens: int = 48             # after training, print this many tokens the model writes
                                        # after a held-out prompt; 0 = none
    peak_tflops: float | None = None    # per device, for MFU; None = not reported
    no_memory_check: bool = False       # start even when the planner's memory estimate per rank
                                        # exceeds the device's memory (on CPU: the host's,
                                        # shared by its ranks)

    def __post_init__(self):
        mc = self.model_config          # an unknown model or a bad --init-from raises here
        if self.seq_len > mc.max_seq_len:
            raise ValueError(f"--seq-len={self.seq_len} is longer than the model's learned "
                             f"positions ({mc.max_seq_len})")
        self.check_fields(flags=True)
        require_positive({k: getattr(self, k) for k in ("global_batch_size", "seq_len",
                                                        "log_every", "max_skipped_steps",
                                                        "eval_batches")},
                         flags=True)
        self.profile_window                     # a bad --profile-steps raises here
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ValueError("--tensorboard needs the tensorboard package (pip install "
                             "tensorboard); the metrics are in OUT/metrics.jsonl either way")
        if self.steps < 1:
            raise ValueError(f"--steps={self.steps} must be >= 1: a run trains at least one "
                             "step (to evaluate or convert a checkpoint, load it with "
                             "fastpar.train.load_checkpoint)")
        if self.resume not in (False, True, "auto"):
            raise ValueError(f"--resume={self.resume!r} must be given alone or as 'auto'")
        if self.adopt_changes and not self.resume:
            raise ValueError("--adopt-changes only applies to --resume (it takes this "
                             "command's options where they differ from the run's)")
        if self.resume and self.overwrite:
            raise ValueError("--resume and --overwrite contradict each other: continue the run "
                             "in --out, or move it aside and start anew")
        for name in ("save_every", "keep_last", "warmup_steps", "eval_every", "sample_tokens", "weight_decay",
                     "grad_clip", "min_lr"):
            if not getattr(self, name) >= 0:        # also refuses NaN
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be >= 0")
        for name in ("lr", "timeout") + (("peak_tflops",) if self.peak_tflops is not None else ()):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be > 0")
        if self.cp_balance not in ("work", "zigzag"):
            raise ValueError(f"--cp-balance={self.cp_balance!r} must be work or zigzag")
        if self.no_save and self.save_every:
            raise ValueError(f"--no-save contradicts --save-every={self.save_every}")
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr={self.min_lr} is above --lr={self.lr}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision={self.precision!r} is not one of {PRECISIONS}")
        if self.grad_reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"--grad-reduce-dtype={self.grad_reduce_dtype!r} is not one of "
                             f"{REDUCE_DTYPES}")
        if self.pp > 1 and PLACEMENT.get(self.schedule) == "v" and self.virtual_stages == 1:
            object.__setattr__(self, "virtual_stages", 2)   # a V holds two stages per rank
        if self.virtual_stages > 1 and self.schedule != "interleaved" and \
                not (PLACEMENT.get(self.schedule) == "v" and self.virtual_stages == 2):
            raise ValueError(f"--virtual-stages={self.virtual_stages} needs "
                             f"--schedule interleaved (or 2 with a V-shape schedule, the "
                             f"default there), not {self.schedule!r}")
        if self.compile:
            self._check_compile(mc)

    def fb_overlapped(self, micro_batches: int) -> bool:
        """As :meth:`ParallelConfig.fb_overlapped`, and not compiled (a compiled block runs
        whole)."""
        return not self.compile and super().fb_overlapped(micro_batches)

    def _check_compile(self, mc: GPTConfig) -> None:
        """What a compiled block cannot do: draw a dropout seed on the host (a graph break), or
        split its backward into input and weight halves (it computes both in one piece)."""
        if mc.n_experts:
            raise ValueError(f"--compile with a mixture of experts (n_experts={mc.n_experts}) "
                             f"is not supported: its experts read their token counts on the "
                             f"host (a graph break)")
        if mc.dropout:
            raise ValueError(f"--compile needs a model without dropout (dropout={mc.dropout}: "
                             "each mask's seed is drawn on the host, a graph break per block)")
        if self.pp > 1 and build_schedule(self.schedule, self.pp, self.pp,
                                          self.virtual_stages).split_backward:
            raise ValueError(f"--compile with --schedule {self.schedule} is not supported: its "
                             "split backward (input gradients first, weight gradients later) "
                             "cannot reach inside a compiled block; use 1f1b or interleaved")
        if self.interleave > 1:
            raise ValueError(f"--compile with --interleave {self.interleave} is not supported: "
                             "interleaved micro-batches pause inside each block, between its "
                             "two halves, which a compiled block runs as one graph")

    @cached_property
    def model_config(self) -> GPTConfig:
        """The model's shape: the preset, or what ``init_from`` holds (read once)."""
        if self.init_from and self.vocab_size is not None:
            raise ValueError(f"--vocab-size={self.vocab_size} contradicts --init-from: the "
                             "model's vocabulary is that of the weights it starts from")
        try:
            base = source_config(self.init_from) if self.init_from else get_config(self.model)
        except ValueError as e:
            raise ValueError(f"--init-from: {e}" if self.init_from else str(e)) from None
        if self.vocab_size is not None:
            require_positive({"vocab_size": self.vocab_size}, flags=True)
            base = base.replace(vocab_size=self.vocab_size)
        if not base.rotary:                 # learned positions: the table has its own length
            return base.replace(init_seed=self.seed)
        return base.replace(max_seq_len=max(self.seq_len, base.max_seq_len), init_seed=self.seed)

    def check_layout(self, world_size: int) -> Layout:
        """The run's :class:`~fastpar.mesh.Layout` of ``world_size`` ranks, once the config is
        checked against it. Raises ValueError naming the numbers."""
        return self.check(self.model_config, world_size, self.global_batch_size, self.seq_len)

    @property
    def profile_window(self) -> tuple[int, int] | None:
        """``--profile-steps A:B`` as (A, B), the steps traced (both included)."""
        if self.profile_steps is None:
            return None
        m = re.fullmatch(r"(\d+):(\d+)", self.profile_steps)
        if not m or not 1 <= int(m[1]) <= int(m[2]) <= self.steps:
            raise ValueError(f"--profile-steps={self.profile_steps!r} must be A:B with "
                             f"1 <= A <= B <= --steps={self.steps}, e.g. 3:5")
        return int(m[1]), int(m[2])

    @property
    def warmup(self) -> int:
        """The warm-up actually used: at most half the run, so a short run still decays."""
        return min(self.warmup_steps, self.steps // 2)

    def bf16_params(self, device_type: str) -> bool:
        """Whether the model's parameters are bf16 (with fp32 main gradients and masters)."""
        return self.precision == "bf16" or (self.precision == "auto" and device_type == "cuda")

    def autocast(self, device_type: str) -> bool:
        """Whether steps run under bf16 autocast (both bf16 modes: ops autocast keeps in fp32,
        such as softmax, stay fp32 with bf16 parameters too)."""
        return self.precision == "amp" or self.bf16_params(device_type)

    def train_context(self, device_type: str):
        """The one context of training, evaluation and generation: bf16 autocast when
        :meth:`autocast` (bf16 parameters, or autocast over fp32 ones), else none."""
        import torch

        return torch.autocast(device_type, torch.bfloat16, enabled=self.autocast(device_type))

    def to_dict(self) -> dict:
        return asdict(self)
