"""``fastpar train`` and ``fastpar export``: each command's parser (``add_<command>``) and what
it runs (``run_<command>``), as :mod:`fastpar.cli` registers every command."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from ..data.tokenizer import run_tokenizer_file
from ..mesh.layout import require_positive
from ..models.gpt import GPT
from ..models.hf import save_hf
from .checkpoint import load_checkpoint
from .config import TrainConfig
from .flags import add_flags, field_help, resume_arg
from .init_from import source_config
from .launch import launch
from .outdir import fresh_folder


def add_train(sub) -> None:
    p = sub.add_parser("train", help="train a GPT with any mix of TP, PP and DP",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="Train a GPT. Without torchrun it starts its own ranks "
                                   "(--nproc, default tp*cp*pp*dp) and restarts failed ones.")
    add_flags(p, TrainConfig, skip=("resume",))        # one flag per TrainConfig field
    p.add_argument("--resume", nargs="?", const=True, default=False, type=resume_arg,
                   metavar="auto", help=field_help(TrainConfig)["resume"])
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks to start on this machine (default tp*cp*pp*dp, dp=2 if not "
                        "given)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart failed workers this many times, resuming from the checkpoint")
    p.add_argument("--dry-run", action="store_true",
                   help="start nothing: check the launch of --nproc ranks (any number) and "
                        "print each pipeline rank's memory, built in this process on a fake "
                        "process group and the meta device, with the planner's step time")
    p.add_argument("--hardware", default="h100-80gb",
                   help="--dry-run: the GPU each rank has (a built-in planner profile or a "
                        ".json)")


def run_train(args) -> int:
    opts = {k: v for k, v in vars(args).items()
            if k not in ("command", "version", "nproc", "max_restarts", "dry_run", "hardware")}
    try:
        cfg = TrainConfig(**opts)
        # Default: all ranks of the torchrun job, else tp*cp*pp*dp here (dp=2 when not given).
        if args.nproc is not None:
            require_positive({"nproc": args.nproc}, flags=True)
        nproc = args.nproc or int(os.environ.get("WORLD_SIZE", 0)) or \
            cfg.tp * cfg.cp * cfg.pp * (cfg.dp or 2)
        if args.max_restarts < 0:
            raise ValueError(f"--max-restarts={args.max_restarts} must be >= 0")
        if args.dry_run:
            from .dry_run import dry_run, format_report

            report = dry_run(cfg, nproc, args.hardware)
            print(format_report(report), flush=True)
            return 0 if report.fits else 2
        launch(cfg, nproc, args.max_restarts)
    except ValueError as e:
        print(f"fastpar train: error: {e}", file=sys.stderr)
        return 2
    return 0


def add_export(sub) -> None:
    p = sub.add_parser("export", help="write a fastpar checkpoint in another format",
                       description="Write a fastpar checkpoint (of any layout) as a Hugging "
                                   "Face directory: config.json and model.safetensors.")
    p.add_argument("--format", choices=("hf",), default="hf")
    p.add_argument("checkpoint", help="a checkpoint folder (runs/.../checkpoints/step_N)")
    p.add_argument("out", help="the folder to write (a new one: see --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="if OUT holds anything, move it aside to OUT.replaced-<time> once "
                        "the new folder is written")


def run_export(args) -> int:
    try:
        with fresh_folder(args.out, "OUT", args.overwrite, "export") as tmp:
            export_checkpoint(args.checkpoint, tmp)
        print(f"fastpar export: wrote {args.out}")
    except ValueError as e:
        print(f"fastpar export: error: {e}", file=sys.stderr)
        return 2
    return 0


def export_checkpoint(ckpt, out) -> Path:
    """A fastpar checkpoint of any layout as a Hugging Face directory (``fastpar export``)."""
    model = GPT(source_config(ckpt))
    load_checkpoint(ckpt, [model], None, None)
    out = save_hf(model, out)
    tok = run_tokenizer_file(ckpt)          # the tokenizer the run's data was prepared with
    if tok is not None:
        shutil.copyfile(tok, Path(out) / "tokenizer.json")
    return out
