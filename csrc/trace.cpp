#include "trace.h"

#include <atomic>
#include <chrono>
#include <mutex>

namespace fastpar {
namespace {
std::atomic<bool> enabled{false};
std::mutex mu;
std::vector<std::tuple<std::string, int64_t, int64_t>> events;
}  // namespace

void trace_enable(bool on) {
  std::lock_guard<std::mutex> lock(mu);
  events.clear();
  enabled = on;
}

bool trace_enabled() { return enabled.load(std::memory_order_relaxed); }

void trace_event(const char* name, int64_t index) {
  if (!enabled.load(std::memory_order_relaxed)) return;
  const int64_t t = std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now().time_since_epoch())
                        .count();
  std::lock_guard<std::mutex> lock(mu);
  events.emplace_back(name, index, t);
}

std::vector<std::tuple<std::string, int64_t, int64_t>> trace_take() {
  std::lock_guard<std::mutex> lock(mu);
  auto out = std::move(events);
  events.clear();
  return out;
}

}  // namespace fastpar
