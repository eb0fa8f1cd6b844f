"""``fastpar plan``: the command-line edge of the planner (argparse lives only here)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..models import PRESETS, GPTConfig, get_config
from .cost import trainer_features
from .hardware import BUILTIN, get_hardware
from ..mesh.layout import check_sizes, require_positive
from ..models.parallel_config import ParallelConfig
from .planner import Cluster, Workload, evaluate, search
from ..train.config import TrainConfig
from ..train.flags import add_flags, flags_of

_FIXED = ("virtual_stages", "micro_batch_size", "schedule", "recompute", "cp", "zero", "ep",
          "ep_chunks", "ep_fold_tp")
# The layout fields a plan can pin, as fastpar train names them (dp follows from --gpus).
LAYOUT_FLAGS = ("tp", "pp") + _FIXED + ("sequence_parallel", "dp_shard")


def add_plan(sub) -> None:
    p = sub.add_parser("plan", help="predict step time, TFLOP/s, MFU and memory; pick a layout",
                       description="Search tp, pp, dp, virtual stages, micro-batch size, "
                                   "schedule and recompute for a model on a cluster (or "
                                   "evaluate one with --tp and --pp), from fastpar's cost model "
                                   "and pipeline simulator.")
    m = p.add_argument_group("model")
    m.add_argument("--model", choices=sorted(PRESETS), help="a preset (else give --layers ...)")
    for flag in ("--layers", "--hidden", "--heads", "--ffn-hidden"):
        m.add_argument(flag, type=int)
    m.add_argument("--vocab", type=int, default=None, help="vocabulary (default 51200)")
    m.add_argument("--seq-len", type=int, default=2048)
    m.add_argument("--global-batch-size", type=int, default=512)
    m.add_argument("--doc-span", type=float, default=None, metavar="N",
                   help="packed documents: the keys a token's document holds on average "
                        "(token-weighted; what fastpar train computes from the data); default: "
                        "attention over whole sequences")
    c = p.add_argument_group("cluster")
    c.add_argument("--gpus", type=int, default=8)
    c.add_argument("--gpus-per-node", type=int, default=8)
    c.add_argument("--hardware", default="a100-80gb",
                   help=f"one of {', '.join(sorted(BUILTIN))}, or a JSON profile")
    k = p.add_argument_group("configuration (with --tp and --pp: evaluate one; else search; "
                             "a search tries cp = 1 only unless --cp pins it)")
    add_flags(k, ParallelConfig, LAYOUT_FLAGS, unset=True)   # fastpar train's, unset
    p.add_argument("--top", type=int, default=5, help="configurations shown by a search")
    p.add_argument("--json", action="store_true", help="print JSON (an object, or a list)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine (and, under torchrun, its links); write a profile")
    p.add_argument("--out", default="hardware.json",
                   help="where --calibrate writes the profile (a new file: see --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="let --calibrate replace an existing --out file")
    p.add_argument("--calibrate-repeats", type=int, default=1, metavar="N",
                   help="--calibrate runs every measurement round N times: a steadier profile "
                        "on a shared host (N=4: about 5 minutes on 2 CPU ranks)")


def _model(args) -> GPTConfig:
    if args.model:
        base = get_config(args.model)
        return base.replace(max_seq_len=max(args.seq_len, base.max_seq_len))
    missing = [f for f in ("layers", "hidden", "heads") if getattr(args, f) is None]
    if missing:
        raise ValueError("give --model or all of --layers, --hidden, --heads (missing "
                         + ", ".join("--" + f for f in missing) + ")")
    return GPTConfig(vocab_size=args.vocab or 51200, n_layers=args.layers, d_model=args.hidden,
                     n_heads=args.heads, d_ff=args.ffn_hidden or 4 * args.hidden,
                     max_seq_len=args.seq_len, norm="layernorm", activation="gelu",
                     rotary=False, bias=True)


def run_plan(args) -> int:
    if args.calibrate:
        from .calibrate import calibrate

        try:
            require_positive({"calibrate_repeats": args.calibrate_repeats}, flags=True)
        except ValueError as e:
            print(f"fastpar plan: error: {e}", file=sys.stderr)
            return 2
        out = Path(args.out)
        if out.is_dir() or (out.exists() and not args.overwrite):
            what = "a folder" if out.is_dir() else "an existing file: pass --overwrite to replace it"
            print(f"fastpar plan: error: --out {out} is {what}", file=sys.stderr)
            return 2
        hw, path = calibrate(out, repeats=args.calibrate_repeats)
        print(json.dumps(hw.to_dict(), indent=2) if args.json else f"wrote {path}")
        return 0
    try:
        work = Workload(_model(args), args.seq_len, args.global_batch_size, args.doc_span)
        cluster = Cluster(args.gpus, args.gpus_per_node, get_hardware(args.hardware))
        require_positive({"top": args.top}, flags=True)
        # What the trainer runs on that device with its default precision ("auto"): bf16
        # weights and fp32 masters on a GPU, fp32 throughout on a CPU.
        feat = trainer_features("bf16" if cluster.hardware.kind == "gpu" else "fp32")
        if args.tp is not None and args.pp is not None:
            require_positive({"tp": args.tp, "pp": args.pp}, flags=True)
            dp = check_sizes(args.gpus, args.tp, args.pp, None, "--gpus=", cp=args.cp or 1)
            opts = {k: getattr(args, k) for k in _FIXED if getattr(args, k) is not None}
            if "schedule" not in opts and opts.get("virtual_stages", 1) > 1:
                opts["schedule"] = "interleaved"
            cfg = ParallelConfig(args.tp, args.pp, dp,
                                 sequence_parallel=args.sequence_parallel, **opts)
            est = evaluate(work, cluster, cfg, feat)
            print(json.dumps(est.to_dict(), indent=2) if args.json else _describe(est))
            return 0 if est.fits else 1
        fixed = {k: getattr(args, k) for k in ("tp", "pp") + _FIXED if getattr(args, k)
                 is not None}
        best, rejected = search(work, cluster, feat, fixed=fixed, top=args.top)
    except ValueError as e:
        print(f"fastpar plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([e.to_dict() for e in best], indent=2))
    elif not best:
        print(no_fit(rejected, cluster))
    else:
        print(_table(best) + "\n\n" + _why(best, rejected) + "\n\n"
              + train_command(best[0].config, work, cluster, args.model, args.hardware))
    return 0 if best else 1


def no_fit(rejected: dict, cluster: Cluster) -> str:
    """The one line a search that found nothing prints: the least memory any rejected
    configuration needs, which one, against the GPU's memory."""
    hw, small = cluster.hardware, rejected.get("smallest")
    if small is None:
        return "no configuration fits: no layout of the model runs on this cluster"
    parts = ", ".join(f"{k} {v:.1f}" for k, v in small.memory.items() if k != "total")
    n = rejected["memory"]
    return (f"no configuration fits: the smallest memory need is {small.memory_gb_per_gpu:.1f} "
            f"GB per GPU ({describe_layout(small.config)}: {parts}), more than the "
            f"{hw.hbm_gb:g} GB of {hw.name} ({n:,} configuration{'s' * (n != 1)} rejected for "
            f"memory)")


def describe_layout(cfg: ParallelConfig) -> str:
    """``tp=8 pp=4 dp=1 mbs=1 1f1b, full recompute`` (and v, cp, sp, zero when used)."""
    words = [f"tp={cfg.tp}", f"pp={cfg.pp}", f"dp={cfg.dp}"]
    words += [f"cp={cfg.cp}"] * (cfg.cp > 1) + [f"v={cfg.virtual_stages}"] * \
        (cfg.virtual_stages > 1) + [f"mbs={cfg.micro_batch_size}"]
    words += [cfg.schedule] * (cfg.pp > 1) + ["sp"] * cfg.sequence_parallel + \
        [f"zero{cfg.zero}"] * bool(cfg.zero) + [f"hsdp{cfg.dp_shard}"] * bool(cfg.dp_shard) + \
        [f"ep={cfg.ep}" + (" fold-tp" if cfg.ep_fold_tp else "")] * (cfg.ep > 1)
    return " ".join(words) + f", {cfg.recompute} recompute"


def train_command(cfg: ParallelConfig, work: Workload, cluster: Cluster,
                  preset: str | None, hardware: str | None = None) -> str:
    """The ``fastpar train`` line that runs ``cfg`` (a torchrun line per node on several), and
    the ``--dry-run`` line that checks it first, on this machine, for every rank role."""
    names = ("tp", "pp", "dp") + tuple(k for k in LAYOUT_FLAGS[2:]
                                       if k != "schedule" or cfg.pp > 1)
    flags = flags_of(cfg, names, TrainConfig(), always=("tp", "pp", "dp"))
    flags += [f"--global-batch-size {work.global_batch}", f"--seq-len {work.seq_len}"]
    model = f"--model {preset}" if preset else "--model <preset>"
    args = " ".join([model] + flags)
    nodes = -(-cluster.gpus // cluster.gpus_per_node)
    if nodes == 1:
        line = f"fastpar train {args} --nproc {cluster.gpus}"
    else:
        line = (f"torchrun --nnodes {nodes} --nproc-per-node {cluster.gpus_per_node} "
                f"--rdzv-backend c10d --rdzv-endpoint <first node>:29500 "
                f"-m fastpar train {args}      # on each of the {nodes} nodes")
    note = "" if preset else ("\n(fastpar train builds presets only: this shape is not one; "
                              "give the layout to your own training script)")
    check = ""
    if preset:
        check = (f"\ncheck it first, here (each pipeline rank built on a fake process group, "
                 f"its memory printed):\n  fastpar train {args} --nproc {cluster.gpus} "
                 f"--dry-run" + (f" --hardware {hardware}" if hardware else ""))
    return f"run it:\n  {line}{note}{check}"


_COLUMNS = (("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("cp", "cp"), ("v", "virtual_stages"),
            ("mbs", "micro_batch_size"), ("schedule", "schedule"), ("recompute", "recompute"),
            ("sp", "sequence_parallel"), ("zero", "zero"), ("shard", "dp_shard"), ("ep", "ep"),
            ("fold", "ep_fold_tp"), ("step s", "step_time_s"),
            ("TFLOP/s", "tflops_per_gpu"), ("MFU", "mfu"), ("GB/GPU", "memory_gb_per_gpu"),
            ("bubble", "bubble_fraction"))


def _table(ests) -> str:
    rows = [[_fmt(e.to_dict()[key]) for _, key in _COLUMNS] for e in ests]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, (h, _) in enumerate(_COLUMNS)]
    lines = ["  ".join(h.rjust(w) for (h, _), w in zip(_COLUMNS, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "on" if v else "-"
    if isinstance(v, float):
        return f"{v:.3f}" if v < 10 else f"{v:.1f}"
    return str(v)


def _shares(e) -> str:
    s = e.step_time_s
    cp = f"exposed CP ring {e.cp_exposed_s / s:.1%}, " if e.config.cp > 1 else ""
    return (f"bubble {e.bubble_fraction:.1%}, exposed TP comm {e.tp_exposed_s / s:.1%}, {cp}"
            f"DP comm {e.dp_exposed_s / s:.1%} of the step; {e.memory_gb_per_gpu:.1f} GB/GPU")


def _describe(e) -> str:
    head = _table([e])
    if not e.fits:
        return head + f"\n\nrejected: {e.reason}"
    return head + f"\n\n{e.tflops_per_gpu:.1f} TFLOP/s per GPU, MFU {e.mfu:.1%}: {_shares(e)}"


def _why(best, rejected) -> str:
    b = best[0]
    lines = [f"best: {b.step_time_s:.3f} s per step, {b.tflops_per_gpu:.1f} TFLOP/s per GPU, "
             f"MFU {b.mfu:.1%}: {_shares(b)}"]
    if len(best) > 1:
        r = best[1]
        lines.append(f"next: {r.step_time_s / b.step_time_s - 1:+.1%} slower: {_shares(r)}")
    if rejected.get("memory"):
        lines.append(f"{rejected['memory']} configurations rejected: they do not fit in "
                     f"memory")
    return "\n".join(lines)
