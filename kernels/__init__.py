"""fastpar.kernels: Triton kernels for the hot paths, each beside its torch reference.

    rms_norm, layer_norm             norms over the last dim (two-stage weight-gradient reduction)
    swiglu, bias_gelu                gated and biased activations
    bias_dropout_add                 residual + dropout(x + bias), mask fixed by (seed, offset)
    rotary                           RoPE on q and k, in place or out of place
    cross_entropy                    per-row loss, fused softmax backward; the vocab-parallel
    cross_entropy_shard_stats/_grad  building blocks for tensor-parallel cross-entropy
    grouped_mm                       one GEMM per group of rows: mixture-of-experts experts

Every op picks its implementation through :func:`impl_for`: Triton for CUDA tensors, the torch
reference otherwise. ``FASTPAR_KERNEL_IMPL=triton`` forces Triton (on CPU that needs
``TRITON_INTERPRET=1``), ``FASTPAR_KERNEL_IMPL=torch`` forces the reference. Each op's module
(``fastpar.kernels.rms_norm`` imported as a module, e.g. ``from fastpar.kernels.rms_norm import
RMSNormFunction``) also holds its kernels, launchers, autograd Function and reference.
"""
from .bias_dropout_add import bias_dropout_add
from .bias_gelu import bias_gelu
from .cross_entropy import cross_entropy, cross_entropy_shard_grad, cross_entropy_shard_stats
from .dispatch import impl_for
from .grouped_gemm import grouped_mm
from .layer_norm import layer_norm
from .rms_norm import rms_norm
from .rotary import rotary
from .swiglu import swiglu

__all__ = ["bias_dropout_add", "bias_gelu", "cross_entropy", "cross_entropy_shard_grad",
           "cross_entropy_shard_stats", "grouped_mm", "impl_for", "layer_norm", "rms_norm",
           "rotary", "swiglu"]
