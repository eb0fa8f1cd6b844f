// Allocator-level CPU memory statistics, the CPU analogue of torch.cuda.memory_allocated and
// max_memory_allocated: a counting allocator that replaces c10's CPU allocator once installed.
#pragma once
#include <cstdint>

namespace fastpar {

void cpu_memory_install();       // idempotent; tensors allocated before keep their own deleter
bool cpu_memory_installed();
int64_t cpu_memory_allocated();  // bytes of live tensors allocated since the install, all threads
int64_t cpu_max_memory_allocated();
void cpu_reset_peak_memory();    // the peak restarts from what is live now

}  // namespace fastpar
