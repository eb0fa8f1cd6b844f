// A counting CPU allocator. Every CPU tensor torch allocates after cpu_memory_install() comes
// from here, on any thread (autograd's, gloo's), and every free of one goes through
// counted_delete on whichever thread drops the last reference: the live and peak byte counts are
// balanced across threads, which the profiler's per-thread memory events are not.
//
// Each block carries its size in a header one alignment unit wide, so the data pointer is its own
// context (Allocator::raw_allocate relies on that) and a free needs no lookup.
#include "cpu_memory.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <atomic>
#include <mutex>

namespace fastpar {
namespace {

constexpr size_t kHeader = 64;  // c10's CPU alignment, so data stays as aligned as c10's own

std::atomic<int64_t> g_live{0};
std::atomic<int64_t> g_peak{0};
std::atomic<bool> g_installed{false};

void raise_peak(int64_t live) {
  int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (live > peak && !g_peak.compare_exchange_weak(peak, live, std::memory_order_relaxed)) {
  }
}

void counted_delete(void* data) {
  if (data == nullptr) return;
  char* block = static_cast<char*>(data) - kHeader;
  g_live.fetch_sub(static_cast<int64_t>(*reinterpret_cast<size_t*>(block)),
                   std::memory_order_relaxed);
  c10::free_cpu(block);
}

struct CountingCPUAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0) return {nullptr, nullptr, &counted_delete, c10::Device(c10::DeviceType::CPU)};
    char* block = static_cast<char*>(c10::alloc_cpu(nbytes + kHeader));
    *reinterpret_cast<size_t*>(block) = nbytes;
    raise_peak(g_live.fetch_add(static_cast<int64_t>(nbytes), std::memory_order_relaxed) +
               static_cast<int64_t>(nbytes));
    void* data = block + kHeader;
    return {data, data, &counted_delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counted_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

}  // namespace

void cpu_memory_install() {
  static std::once_flag once;
  std::call_once(once, [] {
    static CountingCPUAllocator allocator;  // never destroyed before tensors that use it
    c10::SetCPUAllocator(&allocator, /*priority=*/100);
    g_installed = true;
  });
}

bool cpu_memory_installed() { return g_installed.load(); }
int64_t cpu_memory_allocated() { return g_live.load(); }
int64_t cpu_max_memory_allocated() { return g_peak.load(); }
void cpu_reset_peak_memory() { g_peak.store(g_live.load()); }

}  // namespace fastpar
