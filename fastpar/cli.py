"""The ``fastpar`` command (also ``python -m fastpar``)."""
from __future__ import annotations

import argparse
import json
import sys
from importlib import metadata


def _version(package: str) -> str | None:
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
    parser = argparse.ArgumentParser(prog="fastpar", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="store_true", help="print fastpar's version and exit")
    sub = parser.add_subparsers(dest="command")
    info = sub.add_parser("info", help="versions, the extension's build, devices and backends")
    info.add_argument("--json", action="store_true", help="print the information as JSON")
    args = parser.parse_args(argv)
    if args.version:
        import fastpar

        print(f"fastpar {fastpar.__version__}")
        return 0
    if args.command == "info":
        data = collect_info()
        print(json.dumps(data, indent=2)) if args.json else _print_info(data)
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
