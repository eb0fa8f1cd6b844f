// The one binding file of fastpar._C: every Python entry point of the extension is declared here
// (the multi-tensor ops' kernels are registered per device beside their code).
#include <torch/python.h>
#include <torch/version.h>

#include <string>
#include <vector>

#include "cpu_memory.h"
#include "tp_overlap.h"
#include "trace.h"

#ifdef FASTPAR_WITH_CUDA
// Defined in cuda_info.cu.
int fastpar_cuda_runtime_version();
int fastpar_cuda_device_count();
#endif

#define FASTPAR_STR_(...) #__VA_ARGS__
#define FASTPAR_STR(...) FASTPAR_STR_(__VA_ARGS__)
#ifdef FASTPAR_CUDA_ARCHS
#define FASTPAR_CUDA_ARCHS_STR FASTPAR_STR(FASTPAR_CUDA_ARCHS)  // e.g. "8.0,9.0"
#else
#define FASTPAR_CUDA_ARCHS_STR ""
#endif

namespace {

[[maybe_unused]] std::vector<std::string> split_archs(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == ';' || c == ' ' || c == ',') {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(c);
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

// What this build of the extension is: for users, bug reports and `fastpar info`.
pybind11::dict build_info() {
  pybind11::dict info;
  info["torch_version"] = std::string(TORCH_VERSION);
  info["cxx11_abi"] = static_cast<bool>(_GLIBCXX_USE_CXX11_ABI);
#ifdef FASTPAR_WITH_CUDA
  info["cuda"] = true;
  info["cuda_archs"] = split_archs(FASTPAR_CUDA_ARCHS_STR);
  const int v = fastpar_cuda_runtime_version();  // e.g. 13000 -> "13.0"
  info["cuda_runtime"] = std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
#else
  info["cuda"] = false;
  info["cuda_archs"] = std::vector<std::string>{};
  info["cuda_runtime"] = pybind11::none();
#endif
  return info;
}

// CUDA devices the extension's runtime sees (0 on a CPU-only build or a machine without GPUs).
int cuda_device_count() {
#ifdef FASTPAR_WITH_CUDA
  return fastpar_cuda_device_count();
#else
  return 0;
#endif
}

}  // namespace

// Torch ops (callable as torch.ops.fastpar.*; fake implementations live in fastpar/extension.py so
// torch.compile can trace them). Groups are passed by ProcessGroup.group_name.
TORCH_LIBRARY(fastpar, m) {
  m.def("matmul_allreduce(Tensor x, Tensor w, str group, int chunks) -> Tensor");
  m.def("allgather_matmul(Tensor x, Tensor w, str group) -> (Tensor, Tensor)");
  m.def("matmul_reducescatter(Tensor x, Tensor w, str group) -> Tensor");
  m.def(
      "column_linear_backward(Tensor grad_out, Tensor input, Tensor w, str group, "
      "bool sequence_parallel, bool need_input_grad, bool need_weight_grad, int chunks) -> "
      "(Tensor, Tensor)");
  m.def("multi_tensor_pack(Tensor[] tensors, Tensor(a!) out, float scale) -> ()");
  m.def("multi_tensor_unpack(Tensor flat, Tensor(a!)[] tensors, float scale) -> ()");
  m.def("multi_tensor_scale(Tensor(a!)[] tensors, float scale) -> ()");
}

// One implementation for every device: the collectives go through c10d, which picks gloo or NCCL.
TORCH_LIBRARY_IMPL(fastpar, CompositeExplicitAutograd, m) {
  m.impl("matmul_allreduce", &fastpar::matmul_allreduce);
  m.impl("allgather_matmul", &fastpar::allgather_matmul);
  m.impl("matmul_reducescatter", &fastpar::matmul_reducescatter);
  m.impl("column_linear_backward", &fastpar::column_linear_backward);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastpar's compiled extension";
  m.def("trace_enable", &fastpar::trace_enable,
        "Clear the overlap event log and switch recording on or off.");
  m.def("trace_take", &fastpar::trace_take,
        "Return and clear the recorded (event, index, nanoseconds) tuples.");
  m.def("cpu_memory_install", &fastpar::cpu_memory_install,
        "Count CPU tensor memory from now on (a counting allocator replaces c10's CPU one).");
  m.def("cpu_memory_installed", &fastpar::cpu_memory_installed);
  m.def("cpu_memory_allocated", &fastpar::cpu_memory_allocated,
        "Bytes of live CPU tensors allocated since the install, on every thread.");
  m.def("cpu_max_memory_allocated", &fastpar::cpu_max_memory_allocated,
        "The most bytes live at once since the install or the last reset.");
  m.def("cpu_reset_peak_memory", &fastpar::cpu_reset_peak_memory,
        "Restart the peak from what is live now.");
  m.def("build_info", &build_info, "How this extension was built (torch version, CUDA, archs).");
  m.def("cuda_device_count", &cuda_device_count,
        "CUDA devices visible to the extension's runtime; 0 without CUDA.");
}
