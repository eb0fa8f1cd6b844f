// GEMM <-> collective pipelines for tensor parallelism, over any c10d process group (gloo on
// CPU, NCCL on GPU). Every matrix product is out = x @ w^T with x (rows, K) and w (N, K), the
// nn.Linear convention. Groups are passed by name (ProcessGroup.group_name) and resolved here.
#pragma once
#include <ATen/core/Tensor.h>

#include <string>
#include <tuple>

namespace fastpar {

// Row-chunked GEMM + all-reduce: the GEMM of chunk i+1 runs while chunk i is all-reduced;
// each chunk is computed straight into its rows of the output and reduced in place.
at::Tensor matmul_allreduce(const at::Tensor& x, const at::Tensor& w, const std::string& group,
                            int64_t chunks);

// Ring all-gather of row shards fused with the GEMM: the shard that just arrived is multiplied
// while the next one is in flight. Returns (out (tp*m, N), gathered input (tp*m, K)).
std::tuple<at::Tensor, at::Tensor> allgather_matmul(const at::Tensor& x, const at::Tensor& w,
                                                    const std::string& group);

// GEMM + ring reduce-scatter over row blocks: the partial product for the next block is
// computed while the running sum of the previous one travels. Returns (M/tp, N).
at::Tensor matmul_reducescatter(const at::Tensor& x, const at::Tensor& w,
                                const std::string& group);

// ColumnParallelLinear backward: the input-gradient all-reduce (reduce-scatter under sequence
// parallelism) runs while the weight-gradient GEMM computes; without SP the input gradient is
// computed in `chunks` row chunks, each all-reduced while the next computes; under SP the input
// all-gather runs while the input-gradient GEMM computes, unless `input` is already the whole
// gathered input (as many rows as grad_out). Returns (grad_input, grad_weight); a
// gradient that is not needed comes back as an empty tensor.
std::tuple<at::Tensor, at::Tensor> column_linear_backward(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& w,
    const std::string& group, bool sequence_parallel, bool need_input_grad,
    bool need_weight_grad, int64_t chunks);

}  // namespace fastpar
