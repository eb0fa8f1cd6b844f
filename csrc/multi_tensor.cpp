// Multi-tensor pack / unpack / scale (see multi_tensor.h). Each op turns its tensor list into
// (source, destination, numel) segments, checked once here, for the device's implementation:
// this file's CPU one splits them into chunks run in parallel by ATen's thread pool, the CUDA one
// (multi_tensor_kernel.cu) runs them all in one kernel launch. Each registers its own kernels.
#include "multi_tensor.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace fastpar {
namespace {

constexpr int64_t kCpuChunk = 1 << 15;  // elements per parallel work item on CPU

bool is_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// Every tensor of `list` on `device`, of one floating dtype, contiguous; returns the dtype.
at::ScalarType check_list(const char* op, const char* arg, at::TensorList list,
                          const at::Device& device) {
  const at::ScalarType dtype = list.empty() ? at::kFloat : list[0].scalar_type();
  for (size_t i = 0; i < list.size(); ++i) {
    const at::Tensor& t = list[i];
    TORCH_CHECK(t.defined(), op, ": ", arg, "[", i, "] is undefined (None)");
    TORCH_CHECK(t.device() == device, op, ": ", arg, "[", i, "] is on ", t.device(),
                " but must be on ", device);
    TORCH_CHECK(t.scalar_type() == dtype, op, ": ", arg, "[", i, "] is ", t.scalar_type(), " but ",
                arg, "[0] is ", dtype, " (one dtype per list)");
    TORCH_CHECK(is_float(dtype), op, ": ", arg, " must be float, double, half or bfloat16, got ",
                dtype);
    TORCH_CHECK(t.is_contiguous(), op, ": ", arg, "[", i, "] (shape ", t.sizes(),
                ") must be contiguous");
  }
  return dtype;
}

void check_flat(const char* op, const char* arg, const at::Tensor& flat, int64_t needed) {
  TORCH_CHECK(flat.defined(), op, ": ", arg, " is undefined (None)");
  TORCH_CHECK(is_float(flat.scalar_type()), op, ": ", arg,
              " must be float, double, half or bfloat16, got ", flat.scalar_type());
  TORCH_CHECK(flat.is_contiguous(), op, ": ", arg, " must be contiguous");
  TORCH_CHECK(flat.numel() >= needed, op, ": ", arg, " has ", flat.numel(),
              " elements but the tensors need ", needed);
}

int64_t total_numel(at::TensorList list) {
  int64_t n = 0;
  for (const auto& t : list) n += t.numel();
  return n;
}

template <typename src_t, typename dst_t, typename acc_t>
void copy_run(const CopySegment& s, acc_t scale) {
  const auto* src = static_cast<const src_t*>(s.src);
  auto* dst = static_cast<dst_t*>(s.dst);
  if constexpr (std::is_same_v<src_t, dst_t>) {
    if (scale == acc_t(1)) {
      if (src != dst) std::memcpy(dst, src, s.numel * sizeof(dst_t));
      return;
    }
  }
  for (int64_t i = 0; i < s.numel; ++i) {
    dst[i] = static_cast<dst_t>(static_cast<acc_t>(src[i]) * scale);
  }
}

void scaled_copy_cpu(const std::vector<CopySegment>& segments, at::ScalarType src_dtype,
                     at::ScalarType dst_dtype, double scale, const at::Device&) {
  const auto chunks = split_segments(segments, src_dtype, dst_dtype, kCpuChunk);
  dispatch_copy_types(src_dtype, dst_dtype, [&](auto src_v, auto dst_v, auto acc_v) {
    using src_t = decltype(src_v);
    using dst_t = decltype(dst_v);
    using acc_t = decltype(acc_v);
    const acc_t s = static_cast<acc_t>(scale);
    at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) copy_run<src_t, dst_t, acc_t>(chunks[i], s);
    });
  });
}

void scaled_copy(const char* op, const std::vector<CopySegment>& segments,
                 at::ScalarType src_dtype, at::ScalarType dst_dtype, double scale,
                 const at::Device& device, ScaledCopy copy) {
  if (segments.empty()) return;
  TORCH_CHECK(copy, op, ": tensors on ", device, " are not supported by this build of fastpar._C");
  copy(segments, src_dtype, dst_dtype, scale, device);
}

// (tensor i, its slice of `flat`) pairs; `into_flat` picks the direction.
std::vector<CopySegment> segments_of(at::TensorList list, const at::Tensor& flat,
                                     bool into_flat) {
  std::vector<CopySegment> out;
  char* base = static_cast<char*>(flat.data_ptr());
  const int64_t size = flat.element_size();
  int64_t off = 0;
  for (const auto& t : list) {
    const int64_t n = t.numel();
    if (n > 0) {
      void* slot = base + off * size;
      out.push_back(into_flat ? CopySegment{t.data_ptr(), slot, n}
                              : CopySegment{slot, t.data_ptr(), n});
    }
    off += n;
  }
  return out;
}

}  // namespace

std::vector<CopySegment> split_segments(const std::vector<CopySegment>& segments,
                                        at::ScalarType src_dtype, at::ScalarType dst_dtype,
                                        int64_t chunk) {
  const int64_t src_size = c10::elementSize(src_dtype), dst_size = c10::elementSize(dst_dtype);
  std::vector<CopySegment> out;
  for (const auto& s : segments) {
    for (int64_t off = 0; off < s.numel; off += chunk) {
      out.push_back({static_cast<const char*>(s.src) + off * src_size,
                     static_cast<char*>(s.dst) + off * dst_size, std::min(chunk, s.numel - off)});
    }
  }
  return out;
}

void impl_multi_tensor_ops(torch::Library& m, ScaledCopy copy) {
  m.impl("multi_tensor_pack", [copy](at::TensorList tensors, const at::Tensor& out, double scale) {
    const char* op = "multi_tensor_pack";
    check_flat(op, "out", out, total_numel(tensors));
    const at::ScalarType dtype = check_list(op, "tensors", tensors, out.device());
    scaled_copy(op, segments_of(tensors, out, /*into_flat=*/true), dtype, out.scalar_type(), scale,
                out.device(), copy);
  });
  m.impl("multi_tensor_unpack", [copy](const at::Tensor& flat, at::TensorList tensors,
                                       double scale) {
    const char* op = "multi_tensor_unpack";
    check_flat(op, "flat", flat, total_numel(tensors));
    const at::ScalarType dtype = check_list(op, "tensors", tensors, flat.device());
    scaled_copy(op, segments_of(tensors, flat, /*into_flat=*/false), flat.scalar_type(), dtype,
                scale, flat.device(), copy);
  });
  m.impl("multi_tensor_scale", [copy](at::TensorList tensors, double scale) {
    const char* op = "multi_tensor_scale";
    if (tensors.empty()) return;
    const at::Device device = tensors[0].device();
    const at::ScalarType dtype = check_list(op, "tensors", tensors, device);
    std::vector<CopySegment> segments;
    for (const auto& t : tensors) {
      if (t.numel() > 0) segments.push_back({t.data_ptr(), t.data_ptr(), t.numel()});
    }
    scaled_copy(op, segments, dtype, dtype, scale, device, copy);
  });
}

}  // namespace fastpar

TORCH_LIBRARY_IMPL(fastpar, CPU, m) { fastpar::impl_multi_tensor_ops(m, fastpar::scaled_copy_cpu); }

// Devices with no kernel of their own, and calls with no tensor at all (multi_tensor_scale of an
// empty list, which the dispatcher cannot route by device).
TORCH_LIBRARY_IMPL(fastpar, CompositeExplicitAutograd, m) {
  fastpar::impl_multi_tensor_ops(m, nullptr);
}
