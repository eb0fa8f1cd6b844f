"""Every Triton kernel compiles for Hopper (sm_90) with no GPU: ``triton.compile`` of an
``ASTSource`` with ``GPUTarget("cuda", 90, 32)`` down to PTX and cubin, at the block sizes the
launchers pick for 1-8B-parameter shapes. GPU-only compile errors (layouts, shared memory,
register spills that ptxas rejects) are caught here. ``ptxas -v`` on each kernel's PTX reports its
register spills: the norms must not spill even on rows of 16K and 64K elements (a whole such row
held in registers spills up to ~9 KB a thread).

The compiles run in subprocesses with the interpreter off (``triton.jit`` then yields compilable
JITFunctions): this file, run as a script, is that worker.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

HIDDEN, FFN, VOCAB, HEAD_DIM, HEADS = 8192, 28672, 128256, 128, 64
EXPERTS = 128                             # groups of the grouped GEMM (its BLOCK_G)
MAX_SHARED = 232448                       # bytes of shared memory per block on H100 / H200
WORKERS = 2
WIDE_HIDDEN = (16384, 65536)              # norm rows that must be walked in chunks, not spilled


def _specs():
    """(name, JITFunction, constexprs, compile options) for every kernel."""
    import importlib

    import torch
    import triton
    from fastpar.kernels.launch import elementwise_blocks, row_blocks, warps_for

    # The op modules (fastpar.kernels.<op> as an attribute is the op's function).
    (bias_dropout_add, bias_gelu, cross_entropy, grouped_gemm, layer_norm, rms_norm, rotary,
     swiglu) = (importlib.import_module(f"fastpar.kernels.{op}") for op in (
        "bias_dropout_add", "bias_gelu", "cross_entropy", "grouped_gemm", "layer_norm",
        "rms_norm", "rotary", "swiglu"))

    def norms(hidden, suffix=""):
        """The norm kernels at the blocks their launchers pick for rows of ``hidden``."""
        bm, bn, warps, chunked = row_blocks(hidden)
        blocks, opts = dict(BLOCK_M=bm, BLOCK_N=bn, CHUNKED=chunked), dict(num_warps=warps)
        return [
            (f"rms_norm_fwd{suffix}", rms_norm._rms_norm_fwd_kernel, blocks, opts),
            (f"rms_norm_bwd{suffix}", rms_norm._rms_norm_bwd_kernel, blocks, opts),
            (f"layer_norm_fwd{suffix}", layer_norm._layer_norm_fwd_kernel,
             dict(blocks, HAS_BIAS=True), opts),
            (f"layer_norm_bwd{suffix}", layer_norm._layer_norm_bwd_kernel, blocks, opts),
        ]

    em, en, ew = elementwise_blocks(FFN)
    elem = dict(BLOCK_M=em, BLOCK_N=en)
    bv = cross_entropy._block_v(VOCAB, None)
    r2 = HEAD_DIM // 4                    # partial rotary: half of each head is rotated
    bh = min(triton.next_power_of_2(HEADS), 2048 // r2)
    gm, gn, gk, gw, gs = grouped_gemm.blocks(torch.bfloat16)
    gmm = dict(FP32=False, BLOCK_M=gm, BLOCK_N=gn, BLOCK_K=gk, BLOCK_G=EXPERTS)
    gopts = dict(num_warps=gw, num_stages=gs)
    specs = norms(HIDDEN) + [s for h in WIDE_HIDDEN for s in norms(h, f"_h{h}")] + [
        ("swiglu_fwd", swiglu._swiglu_fwd_kernel, elem, dict(num_warps=ew)),
        ("swiglu_bwd", swiglu._swiglu_bwd_kernel, elem, dict(num_warps=ew)),
        ("bias_gelu_fwd_tanh", bias_gelu._bias_gelu_fwd_kernel,
         dict(elem, HAS_BIAS=True, TANH=True), dict(num_warps=ew)),
        ("bias_gelu_bwd_erf", bias_gelu._bias_gelu_bwd_kernel,
         dict(elem, HAS_BIAS=True, TANH=False), dict(num_warps=ew)),
        ("bias_gelu_bwd_tanh_no_bias", bias_gelu._bias_gelu_bwd_kernel,
         dict(elem, HAS_BIAS=False, TANH=True), dict(num_warps=ew)),
        ("bias_dropout_add_fwd", bias_dropout_add._bias_dropout_add_fwd_kernel,
         dict(elem, HAS_BIAS=True, DROPOUT=True), dict(num_warps=ew)),
        ("bias_dropout_add_bwd", bias_dropout_add._bias_dropout_add_bwd_kernel,
         dict(elem, HAS_BIAS=True, DROPOUT=True), dict(num_warps=ew)),
        ("rotary_fwd", rotary._rotary_fwd_kernel,
         dict(CONJUGATE=True, COPY_REST=True, BLOCK_H=bh, BLOCK_R2=r2,
              BLOCK_REST=HEAD_DIM - 2 * r2),
         dict(num_warps=warps_for(2 * bh * r2))),
        ("cross_entropy_fwd", cross_entropy._cross_entropy_fwd_kernel, dict(BLOCK_V=bv),
         dict(num_warps=warps_for(bv))),
        ("cross_entropy_bwd", cross_entropy._cross_entropy_bwd_kernel, dict(BLOCK_V=bv),
         dict(num_warps=warps_for(bv))),
        ("grouped_mm_fwd", grouped_gemm._grouped_mm_kernel, dict(gmm, W_T=True), gopts),
        ("grouped_mm_dx", grouped_gemm._grouped_mm_kernel, dict(gmm, W_T=False), gopts),
        ("grouped_mm_dw", grouped_gemm._grouped_mm_dw_kernel,
         dict(FP32=False, BLOCK_N=gn, BLOCK_R=gk, BLOCK_G=EXPERTS), gopts),
    ]
    return specs


def _compile(kernel, constexprs, options):
    """Compile ``kernel`` for sm_90; returns (shared memory bytes, cubin bytes, spills). Pointers,
    sizes and strides carry the JIT's divisible-by-16 hint, as they do at model shapes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pointer = {"rstd_ptr": "fp32", "mean_ptr": "fp32", "dw_part_ptr": "fp32",
               "db_part_ptr": "fp32", "max_ptr": "fp32", "sumexp_ptr": "fp32", "zt_ptr": "fp32",
               "logsum_ptr": "fp32", "dloss_ptr": "fp32", "stats_ptr": "fp32", "t_ptr": "i64",
               "counts_ptr": "i64"}
    scalar = {"eps": "fp32", "scale": "fp32", "seed": "i64", "offset": "i64"}
    sizes = {"M", "N", "K", "V", "D", "H", "T", "R2"}
    signature, attrs = {}, {}
    for i, p in enumerate(kernel.params):
        if p.is_constexpr or p.name in constexprs:
            signature[p.name] = "constexpr"
            continue
        if p.name.endswith("_ptr"):
            signature[p.name] = "*" + pointer.get(p.name, "bf16")
        else:
            signature[p.name] = scalar.get(p.name, "i32")
        if p.name.endswith("_ptr") or p.name in sizes or p.name.startswith("stride"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    missing = [p.name for p in kernel.params if p.is_constexpr and p.name not in constexprs]
    assert not missing, f"no value for constexprs {missing}"
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    assert "sm_90" in compiled.asm["ptx"] and compiled.asm["cubin"]
    return compiled.metadata.shared, len(compiled.asm["cubin"]), _spills(compiled.asm["ptx"])


def _ptxas():
    """``(ptxas path, --gpu-name)`` as Triton runs it for sm_90, or None without a ptxas."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
        path, arch = get_ptxas(90).path, sm_arch_from_capability(90)
    except Exception:                                        # another Triton layout: the toolkit's
        path, arch = shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas", "sm_90a"
    return (path, arch) if path and os.access(path, os.X_OK) else None


def _spills(ptx):
    """``{"registers", "spill_stores", "spill_loads"}`` (bytes a thread) from ``ptxas -v`` on the
    PTX, with Triton's register-allocation flag; None without a ptxas."""
    tool = _ptxas()
    if tool is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([tool[0], "-v", "--regAllocOptLevel=2", f"--gpu-name={tool[1]}", src,
                              "-o", src + ".cubin"], capture_output=True, text=True, check=True)
    stores, loads = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads",
                              log.stderr).groups()
    registers = re.search(r"Used (\d+) registers", log.stderr).group(1)
    return {"registers": int(registers), "spill_stores": int(stores), "spill_loads": int(loads)}


def _worker(shard: int, shards: int) -> None:
    results = {}
    for i, (name, kernel, constexprs, options) in enumerate(_specs()):
        if i % shards != shard:
            continue
        try:
            shared, size, spills = _compile(kernel, constexprs, options)
            results[name] = {"ok": True, "shared": shared, "cubin": size, "spills": spills}
        except Exception as e:                               # reported per kernel by the test
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[-3000:]}
    print(json.dumps(results))


@pytest.fixture(scope="module")
def compiled():
    env = dict(os.environ, TRITON_INTERPRET="0")
    procs = [subprocess.Popen([sys.executable, __file__, str(i), str(WORKERS)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(WORKERS)]
    results = {}
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        results.update(json.loads(out.strip().splitlines()[-1]))
    return results


def test_every_kernel_compiles_for_hopper(compiled):
    failed = {k: v["error"] for k, v in compiled.items() if not v["ok"]}
    assert not failed, "\n\n".join(f"{k}: {v}" for k, v in failed.items())
    expected = {"rms_norm_fwd", "rms_norm_bwd", "layer_norm_fwd", "layer_norm_bwd", "swiglu_fwd",
                "swiglu_bwd", "bias_gelu_fwd_tanh", "bias_gelu_bwd_erf", "bias_gelu_bwd_tanh_no_bias",
                "bias_dropout_add_fwd",
                "bias_dropout_add_bwd", "rotary_fwd", "cross_entropy_fwd", "cross_entropy_bwd",
                "grouped_mm_fwd", "grouped_mm_dx", "grouped_mm_dw"}
    assert expected <= set(compiled), expected - set(compiled)


def test_every_kernel_fits_hopper_shared_memory(compiled):
    too_big = {k: v["shared"] for k, v in compiled.items() if v["ok"] and v["shared"] > MAX_SHARED}
    assert not too_big, f"over {MAX_SHARED} bytes of shared memory: {too_big}"


def test_norms_do_not_spill_registers_on_wide_rows(compiled):
    if _ptxas() is None:
        pytest.skip("no ptxas (Triton's bundled one or /usr/local/cuda/bin/ptxas) to report spills")
    names = [f"{op}_{p}_h{h}" for op in ("rms_norm", "layer_norm") for p in ("fwd", "bwd")
             for h in WIDE_HIDDEN] + ["rms_norm_bwd", "layer_norm_bwd"]
    spills = {n: compiled[n]["spills"] for n in names}
    spilled = {n: v for n, v in spills.items() if v["spill_stores"] or v["spill_loads"]}
    assert not spilled, f"register spills on sm_90 (bytes a thread): {spilled}"


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]))
