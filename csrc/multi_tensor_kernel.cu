// CUDA side of the multi-tensor ops (see multi_tensor.h): the segments are cut into chunks of
// at most kChunk elements, the chunk table is copied to the device asynchronously through pinned
// memory, and one block per chunk converts and scales its elements. One launch per call, on the
// current stream, whatever the number of tensors. (Named apart from multi_tensor.cpp, as both
// compile to an object file named after the source.)
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "multi_tensor.h"

namespace fastpar {
namespace {

constexpr int64_t kChunk = 1 << 14;  // elements per block
constexpr int kThreads = 256;

template <typename src_t, typename dst_t, typename acc_t>
__global__ void scaled_copy_kernel(const CopySegment* __restrict__ chunks, acc_t scale) {
  const CopySegment c = chunks[blockIdx.x];
  const src_t* src = static_cast<const src_t*>(c.src);
  dst_t* dst = static_cast<dst_t*>(c.dst);
  for (int64_t i = threadIdx.x; i < c.numel; i += blockDim.x) {
    dst[i] = static_cast<dst_t>(static_cast<acc_t>(src[i]) * scale);
  }
}

void scaled_copy_cuda(const std::vector<CopySegment>& segments, at::ScalarType src_dtype,
                      at::ScalarType dst_dtype, double scale, const at::Device& device) {
  const c10::cuda::CUDAGuard guard(device);
  const auto chunks = split_segments(segments, src_dtype, dst_dtype, kChunk);
  if (chunks.empty()) return;
  // The table rides to the device on the current stream; the caching allocators keep both
  // copies alive until the stream has used them.
  const int64_t bytes = static_cast<int64_t>(chunks.size() * sizeof(CopySegment));
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), chunks.data(), bytes);
  at::Tensor table = host.to(at::TensorOptions().device(device), /*non_blocking=*/true);
  const auto* table_ptr = static_cast<const CopySegment*>(table.data_ptr());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  const auto blocks = static_cast<unsigned int>(chunks.size());
  dispatch_copy_types(src_dtype, dst_dtype, [&](auto src_v, auto dst_v, auto acc_v) {
    using src_t = decltype(src_v);
    using dst_t = decltype(dst_v);
    using acc_t = decltype(acc_v);
    scaled_copy_kernel<src_t, dst_t, acc_t>
        <<<blocks, kThreads, 0, stream>>>(table_ptr, static_cast<acc_t>(scale));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace fastpar

TORCH_LIBRARY_IMPL(fastpar, CUDA, m) {
  fastpar::impl_multi_tensor_ops(m, fastpar::scaled_copy_cuda);
}
