// Multi-tensor pack / unpack / scale: one call moves many tensors into or out of one flat buffer,
// converting dtypes and scaling on the way. Data parallelism uses them where gradient buckets
// cannot be views (a reduce dtype that differs from the parameters', ZeRO shards).
//
// Every op is a list of (source segment, destination segment) copies computed as
// dst[i] = dst_t(acc_t(src[i]) * scale), acc_t being double if either side is double, else float.
// All tensors must be contiguous; the sources share one dtype, the destinations share one dtype.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace fastpar {

// out[off_i : off_i + n_i] = tensors[i] * scale, with off_0 = 0 and off_{i+1} = off_i + n_i.
// out may be longer than the tensors together; its tail is left untouched.
void multi_tensor_pack(at::TensorList tensors, const at::Tensor& out, double scale);

// tensors[i] = flat[off_i : off_i + n_i] * scale (the inverse of pack).
void multi_tensor_unpack(const at::Tensor& flat, at::TensorList tensors, double scale);

// tensors[i] *= scale, in place.
void multi_tensor_scale(at::TensorList tensors, double scale);

// One contiguous run of elements to copy: what the device implementations consume.
struct CopySegment {
  const void* src;
  void* dst;
  int64_t numel;
};

#ifdef FASTPAR_WITH_CUDA
// Defined in multi_tensor_kernel.cu (named apart from this file's .cpp, as both compile to an
// object file named after the source): every segment in one kernel launch on the current
// stream of `device`.
void scaled_copy_cuda(const std::vector<CopySegment>& segments, at::ScalarType src_dtype,
                      at::ScalarType dst_dtype, double scale, const at::Device& device);
#endif

}  // namespace fastpar
