// A small, opt-in event log so tests can see what overlapped with what: each entry is
// (event name, chunk index, steady-clock nanoseconds). Off by default; costs one branch when off.
#pragma once
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace fastpar {

void trace_enable(bool on);
bool trace_enabled();
void trace_event(const char* name, int64_t index);
std::vector<std::tuple<std::string, int64_t, int64_t>> trace_take();

}  // namespace fastpar
