// The one binding file of fastpar._C: every Python entry point of the extension is declared here.
#include <torch/extension.h>
#include <torch/version.h>

#include <string>
#include <vector>

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

std::vector<std::string> split_archs(const std::string& s) {
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastpar's compiled extension";
  m.def("build_info", &build_info, "How this extension was built (torch version, CUDA, archs).");
  m.def("cuda_device_count", &cuda_device_count,
        "CUDA devices visible to the extension's runtime; 0 without CUDA.");
}
