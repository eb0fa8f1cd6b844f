// CUDA side of build_info: the runtime version compiled against and a device query that never
// throws (a machine with no GPU or no driver simply has 0 devices).
#include <cuda_runtime.h>

int fastpar_cuda_runtime_version() { return CUDART_VERSION; }

int fastpar_cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error so later CUDA calls are not poisoned
    return 0;
  }
  return n;
}
