// The CPU ops' own clock (sbd_ext._C.set_op_clock / op_clock): where a compiled forward's time goes, measured inside
// the forward. Off by default (then a call costs one relaxed load); while on, each call of a clocked CPU op adds the
// wall time of its C++ body (checks, output allocation, x's preparation, the kernel; not the dispatcher's or a
// compiled graph's way to it) and one call to the op's slot. A clocked call made inside another on the same thread
// (row_linear on bf16 rows widens them and calls itself) counts in the outer one only.
//
// Why: the profile suite (bench/report_profile.py) first timed the linears as a Python loop of op calls less a loop
// of tiny calls; a Python call of a real linear costs ~2-4 us more than a tiny one beyond its kernel (SmolLM2 w8a8,
// 121 calls over the same 135 MB ran at 0.79x a plain read where one call ran at 0.95x, while perf put the kernel
// itself at ~0.93x in the compiled step; AMD EPYC Zen 4, 1 thread, 2026-12-08): the loop measured Python.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>

namespace sbd_ext {

enum class Clocked : int {
  kRowLinear,
  kGatedLoraLinear,
  kScreenedHead,
  kBlockAttention,
  kEntropySample,
  kMaskReplace,
  kTopkLogsumexp,
  kCount
};
inline constexpr const char* kClockedNames[] = {"row_linear",     "gated_lora_linear", "screened_head",
                                                "block_attention", "entropy_sample",    "mask_replace",
                                                "topk_logsumexp"};
static_assert(sizeof(kClockedNames) / sizeof(kClockedNames[0]) == static_cast<int>(Clocked::kCount));

struct OpClockState {
  std::atomic<bool> on{false};
  std::array<std::atomic<int64_t>, static_cast<int>(Clocked::kCount)> ns{}, calls{};
};

inline OpClockState& op_clock_state() {
  static OpClockState state;
  return state;
}

// Put one at the top of a clocked op's CPU function.
class OpClock {
 public:
  explicit OpClock(Clocked op) : op_(static_cast<int>(op)) {
    if (!op_clock_state().on.load(std::memory_order_relaxed)) return;
    entered_ = true;
    if (depth()++ > 0) return;  // inside another clocked call: that one counts
    active_ = true;
    start_ = std::chrono::steady_clock::now();
  }
  ~OpClock() {
    if (!entered_) return;
    --depth();
    if (!active_) return;
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_);
    op_clock_state().ns[op_].fetch_add(ns.count(), std::memory_order_relaxed);
    op_clock_state().calls[op_].fetch_add(1, std::memory_order_relaxed);
  }
  OpClock(const OpClock&) = delete;
  OpClock& operator=(const OpClock&) = delete;

 private:
  static int& depth() {
    static thread_local int d = 0;
    return d;
  }
  int op_;
  bool entered_ = false, active_ = false;
  std::chrono::steady_clock::time_point start_{};
};

}  // namespace sbd_ext
