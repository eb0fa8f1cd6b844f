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


def run() -> None:
    """The entry point of the ``fastpar`` script and ``python -m fastpar``: :func:`main`, then
    what the interpreter's exit does that matters (other threads finished, exit handlers run,
    output flushed), without tearing down the modules, which with torch loaded takes most of a
    second a command."""
    import atexit
    import os
    import threading

    code = main()
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _main(argv: list[str] | None) -> int:
    # Imported here, after the signal handling is in place: they load torch (seconds).
    import argparse

    from .data import prepare
    from .plan import cli as plan
    from .train import cli as train, sample

    # Every command is add_<command>(subparsers), which adds its parser, and run_<command>(args)
    # -> exit code, in its module (the command's dashes as underscores).
    commands = {"info": sys.modules[__name__], "train": train, "plan": plan, "export": train,
                "prepare-data": prepare, "generate": sample}
    parser = argparse.ArgumentParser(prog="fastpar", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="store_true", help="print fastpar's version and exit")
    sub = parser.add_subparsers(dest="command")
    for name, module in commands.items():
        getattr(module, "add_" + name.replace("-", "_"))(sub)
    args = parser.parse_args(argv)
    if args.version:
        import fastpar

        print(f"fastpar {fastpar.__version__}")
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    return getattr(commands[args.command], "run_" + args.command.replace("-", "_"))(args)


def add_info(sub) -> None:
    info = sub.add_parser("info", help="versions, the extension's build, devices and backends")
    info.add_argument("--json", action="store_true", help="print the information as JSON")


def run_info(args) -> int:
    import json

    data = collect_info()
    print(json.dumps(data, indent=2)) if args.json else _print_info(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
