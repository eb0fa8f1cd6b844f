"""The ``fastpar`` command (also ``python -m fastpar``)."""
from __future__ import annotations

# Only what the signal handling needs is imported here: the rest loads inside main(), once a
# Ctrl-C or SIGTERM is answered with one line (see main).
import signal
import sys


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt, so that one ``except`` ends the
    command cleanly on either (exit 143 instead of 130)."""

    signum = signal.SIGTERM


def _raise_terminated(signum, frame):
    raise Terminated()


def exit_code(interrupt: KeyboardInterrupt) -> int:
    """The shell's exit code of a process stopped by the signal: 128 + SIGINT / SIGTERM."""
    return 128 + getattr(interrupt, "signum", signal.SIGINT)


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def collect_info() -> dict:
    """Versions, the extension's build, CUDA devices and distributed backends, as a dict."""
    import torch
    import torch.distributed as dist

    import fastpar

    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    backends = {name: bool(getattr(dist, f"is_{name}_available", lambda: False)())
                for name in ("gloo", "nccl", "mpi", "ucc")}
    return {
        "fastpar": fastpar.__version__,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "python": sys.version.split()[0],
        "extension": fastpar._C.build_info(),
        "torch_cuda": torch.version.cuda,
        "cuda_devices": devices,
        "distributed_available": dist.is_available(),
        "backends": backends,
    }


def _print_info(info: dict) -> None:
    ext = info["extension"]
    cuda = (f"yes (CUDA {ext['cuda_runtime']}, archs {', '.join(ext['cuda_archs'])})"
            if ext["cuda"] else "no")
    rows = [
        ("fastpar", info["fastpar"]),
        ("torch", f"{info['torch']} (CUDA {info['torch_cuda'] or 'none'})"),
        ("triton", info["triton"] or "not installed"),
        ("python", info["python"]),
        ("extension built for torch", ext["torch_version"]),
        ("extension CUDA sources", cuda),
        ("CUDA devices", ", ".join(info["cuda_devices"]) or "none"),
        ("distributed backends", ", ".join(k for k, v in info["backends"].items() if v) or "none"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def main(argv: list[str] | None = None) -> int:
    """The command. Ctrl-C or SIGTERM at any moment, from the first import on, ends it with one
    line and exit code 130 / 143 (``fastpar train`` says how far the run got)."""
    import threading

    main_thread = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _raise_terminated) if main_thread else None
    try:
        return _main(argv)
    except KeyboardInterrupt as e:
        print(f"fastpar: {'terminated' if isinstance(e, Terminated) else 'interrupted'}",
              file=sys.stderr, flush=True)
        return exit_code(e)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, before)


def _main(argv: list[str] | None) -> int:
    # Imported here, after the signal handling is in place: they load torch (seconds).
    import argparse
    import json

    from .plan.cli import add_plan, run_plan
    from .data.prepare import add_prepare, run_prepare
    from .train.sample import add_generate, run_generate

    parser = argparse.ArgumentParser(prog="fastpar", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="store_true", help="print fastpar's version and exit")
    sub = parser.add_subparsers(dest="command")
    info = sub.add_parser("info", help="versions, the extension's build, devices and backends")
    info.add_argument("--json", action="store_true", help="print the information as JSON")
    _add_train(sub)
    add_plan(sub)
    export = sub.add_parser("export", help="write a fastpar checkpoint in another format",
                            description="Write a fastpar checkpoint (of any layout) as a Hugging "
                                        "Face directory: config.json and model.safetensors.")
    export.add_argument("--format", choices=("hf",), default="hf")
    export.add_argument("checkpoint", help="a checkpoint folder (runs/.../checkpoints/step_N)")
    export.add_argument("out", help="the folder to write (a new one: see --overwrite)")
    export.add_argument("--overwrite", action="store_true",
                        help="if OUT holds anything, move it aside to OUT.replaced-<time> once "
                             "the new folder is written")
    add_prepare(sub)
    add_generate(sub)
    args = parser.parse_args(argv)
    if args.version:
        import fastpar

        print(f"fastpar {fastpar.__version__}")
        return 0
    if args.command == "info":
        data = collect_info()
        print(json.dumps(data, indent=2)) if args.json else _print_info(data)
        return 0
    if args.command == "train":
        return _train(args)
    if args.command == "plan":
        return run_plan(args)
    if args.command == "prepare-data":
        return run_prepare(args)
    if args.command == "generate":
        return run_generate(args)
    if args.command == "export":
        from .train.hf import export_checkpoint
        from .train.outdir import fresh_folder

        try:
            with fresh_folder(args.out, "OUT", args.overwrite, "export") as tmp:
                export_checkpoint(args.checkpoint, tmp)
            print(f"fastpar export: wrote {args.out}")
        except ValueError as e:
            print(f"fastpar export: error: {e}", file=sys.stderr)
            return 2
        return 0
    parser.print_help()
    return 2


def _add_train(sub) -> None:
    import argparse

    from .train.config import TrainConfig
    from .train.flags import add_flags, field_help, resume_arg

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


def _train(args) -> int:
    import os

    from .mesh.layout import require_positive
    from .train.config import TrainConfig
    from .train.launch import launch

    opts = {k: v for k, v in vars(args).items()
            if k not in ("command", "version", "nproc", "max_restarts")}
    try:
        cfg = TrainConfig(**opts)
        # Default: all ranks of the torchrun job, else tp*cp*pp*dp here (dp=2 when not given).
        if args.nproc is not None:
            require_positive({"nproc": args.nproc}, flags=True)
        nproc = args.nproc or int(os.environ.get("WORLD_SIZE", 0)) or \
            cfg.tp * cfg.cp * cfg.pp * (cfg.dp or 2)
        if args.max_restarts < 0:
            raise ValueError(f"--max-restarts={args.max_restarts} must be >= 0")
        launch(cfg, nproc, args.max_restarts)
    except ValueError as e:
        print(f"fastpar train: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
