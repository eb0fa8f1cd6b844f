"""fastpar.kernels.launch: launch grids obey CUDA's limits (axis 0 up to 2^31 - 1, axes 1 and 2 up
to 65,535), which the interpreter does not enforce. The launchers' real grid arithmetic runs on
meta tensors (no memory) at huge shapes with each kernel replaced by a recorder of its grid; then
kernels run under the interpreter with axes 1-2 capped at 2, as a stand-in for the real limit."""
import importlib

import pytest
import torch

from fastpar.kernels import launch
from kernel_testing import assert_close, randn, triton_path

OPS = ("bias_dropout_add", "bias_gelu", "cross_entropy", "layer_norm", "rms_norm", "rotary",
       "swiglu")
MODULES = {op: importlib.import_module(f"fastpar.kernels.{op}") for op in OPS}
SMS = 132                                 # H100 / H200: reduction programs, one per SM

# 2-D (rows, columns) shapes: a 1-D input of ~67M elements (one row: 65,537 column blocks of 1024),
# many rows of a model width, 2^25 narrow rows (2^19 row blocks), and rows of 2^30 elements.
HUGE = [(1, 2**26 + 5), (70000, 8192), (2**25, 16), (3, 2**30)]


class _Recorder:
    """Stands in for a JIT kernel: ``kernel[grid](*args, **meta)`` records the grid, runs nothing."""

    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        def launch_(*args, **meta):
            self.log.append(tuple(grid))
        return launch_


@pytest.fixture
def grids(monkeypatch):
    """The grids every launcher asks for, with GPU block sizes and SM counts."""
    log = []
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    for mod in MODULES.values():
        for name in dir(mod):
            if name.startswith("_") and name.endswith("_kernel"):
                monkeypatch.setattr(mod, name, _Recorder(log))
        if hasattr(mod, "reduction_programs"):
            monkeypatch.setattr(mod, "reduction_programs", lambda d, blocks: max(1, min(blocks,
                                                                                         SMS)))
    return log


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


def _launch_every_op(M, N):
    """Call every launcher on (M, N) meta tensors (rotary on (1, M, 1, N) heads)."""
    m = MODULES
    x, dy, w = _meta(M, N), _meta(M, N), _meta(N)
    m["swiglu"].swiglu_forward(x, x)
    m["swiglu"].swiglu_backward(dy, x, x)
    m["bias_gelu"].bias_gelu_forward(x, w, "tanh")
    m["bias_gelu"].bias_gelu_backward(dy, x, w, "none")
    args = (True, 1234, 0, 2**23, 2.0)
    m["bias_dropout_add"].bias_dropout_add_forward(x, w, x, *args)
    m["bias_dropout_add"].bias_dropout_add_backward(dy, True, x.dtype, *args)
    stats = _meta(M, dtype=torch.float32)
    m["rms_norm"].rms_norm_forward(x, w, 1e-6)
    m["rms_norm"].rms_norm_backward(dy, x, w, stats)
    m["layer_norm"].layer_norm_forward(x, w, w, 1e-5)
    m["layer_norm"].layer_norm_backward(dy, x, w, stats, stats)
    target = _meta(M, dtype=torch.int64)
    m["cross_entropy"].cross_entropy_forward(x, target)
    m["cross_entropy"].cross_entropy_backward(x, target, stats, stats, stats)
    cos = _meta(M, N // 2 // 2 or 1, dtype=torch.float32)
    m["rotary"].rotary_forward(_meta(1, M, 1, N), cos, cos)


@pytest.mark.parametrize("shape", HUGE, ids=lambda s: "x".join(map(str, s)))
def test_every_launcher_grid_obeys_cuda_limits_at_huge_shapes(grids, shape):
    M, N = shape
    _launch_every_op(M, N)
    assert len(grids) >= 13, grids
    for grid in grids:
        assert 1 <= len(grid) <= 3, grid
        assert all(1 <= g for g in grid), grid
        assert all(g <= limit for g, limit in zip(grid, launch.MAX_GRID)), (
            f"grid {grid} breaks CUDA's limits {launch.MAX_GRID} at {shape}")


def test_the_one_dimensional_case_needs_the_fold():
    # 67M elements in one row: its column blocks alone exceed axis 1's 65,535.
    _, BLOCK_N, _ = launch.elementwise_blocks(2**26 + 5)
    assert -(-(2**26 + 5) // BLOCK_N) > launch.MAX_GRID[1]
    assert launch.elementwise_grid("op", 1, 2**26 + 5, 1, BLOCK_N) == (65537,)


def test_checked_grid_refuses_what_cuda_refuses():
    assert launch.checked_grid("op", 2**31 - 1, 65535, 65535) == (2**31 - 1, 65535, 65535)
    with pytest.raises(ValueError, match=r"swiglu: grid \(1, 65536\) has 65536 programs on axis 1"):
        launch.checked_grid("swiglu", 1, 65536)
    with pytest.raises(ValueError, match="on axis 0; CUDA allows at most 2147483647"):
        launch.checked_grid("rms_norm", 2**31)
    with pytest.raises(ValueError, match="on axis 2"):
        launch.checked_grid("op", 1, 1, 70000)
    with pytest.raises(ValueError, match="1 to 3 axes"):
        launch.checked_grid("op", 1, 1, 1, 1)


def test_a_launcher_past_the_limit_is_one_clear_error(grids):
    # 2^31 rows of logits: one program per row would be one too many on axis 0.
    with pytest.raises(ValueError, match="cross_entropy: grid .* on axis 0"):
        MODULES["cross_entropy"].cross_entropy_forward(_meta(2**31, 8),
                                                       _meta(2**31, dtype=torch.int64))


@pytest.fixture
def tight_grid(monkeypatch):
    """Triton on CPU with grid axes 1-2 capped at 2: a kernel that would put more programs there
    (several column blocks, as a 1-D input of 67M elements would on CUDA) must fold them."""
    monkeypatch.setattr(launch, "MAX_GRID", (2**31 - 1, 2, 2))
    with triton_path(monkeypatch):
        yield


def test_elementwise_kernels_fold_many_column_blocks(tight_grid):
    # (5, 3000): 3 column blocks of 1024, and 1-D (5000,): 5; both over the cap on axis 1.
    from fastpar.kernels import bias_dropout_add, bias_gelu, swiglu
    from fastpar.kernels.bias_dropout_add import dropout_keep_mask
    torch.manual_seed(0)
    for shape in [(5, 3000), (5000,)]:
        n = shape[-1]
        gate, up = (randn(*shape, dtype=torch.float32, requires_grad=True) for _ in range(2))
        y = swiglu(gate, up)
        y.backward(torch.ones_like(y))
        g64, u64 = gate.detach().double(), up.detach().double()
        assert_close(y, torch.nn.functional.silu(g64) * u64, torch.float32, "swiglu")
        s = torch.sigmoid(g64)
        assert_close(gate.grad, u64 * s * (1 + g64 * (1 - s)), torch.float32, "dgate")
        x = randn(*shape, dtype=torch.float32, requires_grad=True)
        b = randn(n, dtype=torch.float32, requires_grad=True)
        y = bias_gelu(x, b, "none")
        y.backward(torch.ones_like(y))
        z64 = x.detach().double() + b.detach().double()
        assert_close(y, torch.nn.functional.gelu(z64), torch.float32, "gelu")
        cdf = 0.5 * (1 + torch.erf(z64 / 2**0.5))
        grad = cdf + z64 * torch.exp(-0.5 * z64 * z64) / (2 * torch.pi) ** 0.5
        assert_close(x.grad, grad, torch.float32, "dx")
        assert_close(b.grad, grad.reshape(-1, n).sum(0), torch.float32, "db", scale=4)
        x, b = x.detach().requires_grad_(), b.detach().requires_grad_()
        res = randn(*shape, dtype=torch.float32)
        y = bias_dropout_add(x, b, res, p=0.5, seed=7)
        y.backward(torch.ones_like(y))
        dx = dropout_keep_mask(shape, 0.5, seed=7).double() * 2.0
        assert_close(y, res.double() + z64 * dx, torch.float32, "bias_dropout_add")
        assert_close(x.grad, dx, torch.float32, "dropout dx")
        assert_close(b.grad, dx.reshape(-1, n).sum(0), torch.float32, "dropout db")
