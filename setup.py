"""Build fastpar and its extension fastpar._C.

C++ sources in csrc/ are always built; CUDA sources (csrc/*.cu) only when torch has CUDA and a
toolkit is found. FASTPAR_SKIP_CUDA=1 turns CUDA off, FASTPAR_REQUIRE_CUDA=1 makes a missing CUDA
build an error, TORCH_CUDA_ARCH_LIST picks the archs (default "8.0;9.0"): machine code for each,
and PTX of the newest so the extension also loads on newer GPUs (:func:`nvcc_arch_flags`).
Install with `pip install --no-build-isolation -e .` into an environment that has torch.
"""
import glob
import os
import re

from setuptools import find_packages, setup
import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension


DEFAULT_ARCHS = "8.0;9.0"           # A100, H100 / H200


def _flag(name):
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _cuda_build():
    if _flag("FASTPAR_SKIP_CUDA"):
        reason = "FASTPAR_SKIP_CUDA is set"
    elif torch.version.cuda is None:
        reason = f"torch {torch.__version__} has no CUDA"
    elif CUDA_HOME is None:
        reason = "no CUDA toolkit found (set CUDA_HOME)"
    else:
        return True
    if _flag("FASTPAR_REQUIRE_CUDA"):
        raise RuntimeError(f"FASTPAR_REQUIRE_CUDA=1 but the CUDA sources cannot be built: {reason}")
    print(f"fastpar: building without CUDA ({reason})")
    return False


def cuda_archs(arch_list: str) -> list[str]:
    """The archs of a TORCH_CUDA_ARCH_LIST ("8.0;9.0", "8.0 9.0+PTX", "9.0a"), each as "X.Y" or
    "X.Ya" (a "+PTX" suffix dropped: :func:`nvcc_arch_flags` embeds PTX anyway)."""
    archs = []
    for token in arch_list.replace(";", " ").replace(",", " ").split():
        arch = token.removesuffix("+PTX")
        if not re.fullmatch(r"\d+\.\d+a?", arch):
            raise ValueError(f"TORCH_CUDA_ARCH_LIST={arch_list!r}: {token!r} is not an arch such "
                             "as 8.0, 9.0, 9.0a or 9.0+PTX")
        if arch not in archs:
            archs.append(arch)
    if not archs:
        raise ValueError(f"TORCH_CUDA_ARCH_LIST={arch_list!r} names no arch (e.g. '8.0;9.0')")
    return archs


def nvcc_arch_flags(arch_list: str) -> list[str]:
    """nvcc's -gencode flags for ``arch_list``: machine code (SASS) for every arch, and PTX of the
    newest, which the driver compiles when the extension loads on a newer GPU than any listed
    (without it the extension fails to load there). An arch-specific target such as 9.0a has no
    forward-compatible PTX, so the PTX is its family's (compute_90). Given to nvcc, these replace
    torch's own arch flags (torch adds none when the nvcc flags name an arch)."""
    archs = cuda_archs(arch_list)
    flags = []
    for arch in archs:
        num = arch.replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
    newest = max(archs, key=lambda a: tuple(int(p) for p in a.rstrip("a").split(".")))
    ptx = newest.rstrip("a").replace(".", "")
    flags.append(f"-gencode=arch=compute_{ptx},code=compute_{ptx}")
    return flags


def _extension():
    sources = sorted(glob.glob("csrc/*.cpp"))
    # -g0: no debug info (Python's own flags ask for -g): a third of the compile time and a
    # fiftieth of the object size go to torch's headers' debug info otherwise. The C++ standard
    # is the one torch.utils.cpp_extension picks for this torch.
    cxx = ["-O3", "-g0"]
    if not _cuda_build():
        return CppExtension("fastpar._C", sources, extra_compile_args={"cxx": cxx})
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_ARCHS
    # Passed as bare tokens (no quotes or ';' to survive the shell); the C++ side stringizes them.
    arch_tokens = ",".join(cuda_archs(arch_list))
    # The arch list goes to the C++ compiler only (fastpar.cpp reports it): nvcc splits a -D
    # value at its commas.
    macros = ["-DFASTPAR_WITH_CUDA"]
    return CUDAExtension(
        "fastpar._C", sources + sorted(glob.glob("csrc/*.cu")),
        extra_compile_args={"cxx": cxx + macros + [f"-DFASTPAR_CUDA_ARCHS={arch_tokens}"],
                            "nvcc": ["-O3"] + macros + nvcc_arch_flags(arch_list)})


if __name__ == "__main__":      # pip and `python setup.py` run it so; tests import the helpers
    setup(
        name="fastpar",
        version="0.1.0",
        description="3D-parallel Transformer training that hides communication behind computation",
        python_requires=">=3.10",
        # fastpar/kernels is a symlink (in git) to kernels/, followed by find_packages, checkouts.
        packages=find_packages(include=["fastpar", "fastpar.*"]),
        ext_modules=[_extension()],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
        # The floor is what CI tests (.ci/run step 2: torch 2.11.0 with its triton 3.6.0). triton
        # publishes wheels for Linux only; fastpar.kernels imports it, so elsewhere it must be
        # installed by hand.
        install_requires=["torch>=2.11", 'triton>=3.6; platform_system == "Linux"', "numpy",
                          "safetensors", "tqdm", "matplotlib"],
        entry_points={"console_scripts": ["fastpar = fastpar.cli:run"]},
    )
