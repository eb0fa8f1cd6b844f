// Multi-tensor pack / unpack / scale: one call moves many tensors into or out of one flat buffer,
// converting dtypes and scaling on the way. Data parallelism uses them where gradient buckets
// cannot be views (a reduce dtype that differs from the parameters', ZeRO shards).
//
// Every op is a list of (source segment, destination segment) copies computed as
// dst[i] = dst_t(acc_t(src[i]) * scale), acc_t being double if either side is double, else float.
// All tensors must be contiguous; the sources share one dtype, the destinations share one dtype.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cstdint>
#include <type_traits>
#include <vector>

namespace fastpar {

// One contiguous run of elements to copy: what the device implementations consume.
struct CopySegment {
  const void* src;
  void* dst;
  int64_t numel;
};

// A device's implementation of the ops: every segment converted and scaled, all on `device`.
using ScaledCopy = void (*)(const std::vector<CopySegment>& segments, at::ScalarType src_dtype,
                            at::ScalarType dst_dtype, double scale, const at::Device& device);

// `segments` cut into runs of at most `chunk` elements: the unit a device works on in parallel.
std::vector<CopySegment> split_segments(const std::vector<CopySegment>& segments,
                                        at::ScalarType src_dtype, at::ScalarType dst_dtype,
                                        int64_t chunk);

// Calls body(src_t{}, dst_t{}, acc_t{}) with the element types of the two dtypes and the type the
// arithmetic runs in (double if either side is double, else float): every device's dispatch.
template <typename Body>
void dispatch_copy_types(at::ScalarType src_dtype, at::ScalarType dst_dtype, Body&& body) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src_dtype, "multi_tensor src", [&] {
    using src_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dst_dtype, "multi_tensor dst", [&] {
      using dst_t = scalar_t;
      using acc_t = std::conditional_t<
          std::is_same_v<src_t, double> || std::is_same_v<dst_t, double>, double, float>;
      body(src_t{}, dst_t{}, acc_t{});
    });
  });
}

// Registers the ops' kernels for the dispatch key of `m` (a TORCH_LIBRARY_IMPL block): each op
// checks its arguments and hands their segments to `copy`, a null `copy` standing for a device
// with no implementation (an error unless there is nothing to copy).
//   multi_tensor_pack(tensors, out, scale): out[off_i : off_i + n_i] = tensors[i] * scale, with
//     off_0 = 0 and off_{i+1} = off_i + n_i; out may be longer, its tail is left untouched.
//   multi_tensor_unpack(flat, tensors, scale): tensors[i] = flat[off_i : off_i + n_i] * scale.
//   multi_tensor_scale(tensors, scale): tensors[i] *= scale, in place.
void impl_multi_tensor_ops(torch::Library& m, ScaledCopy copy);

}  // namespace fastpar
