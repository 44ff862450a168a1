#include "cpu/isa.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif
#if defined(__linux__) && (defined(__x86_64__) || defined(_M_X64))
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace sbd_cpu {
namespace {

bool cpu_supports(Isa isa) {
#if defined(__x86_64__) || defined(_M_X64)
  switch (isa) {
    case Isa::AVX512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
    case Isa::AVX2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
             __builtin_cpu_supports("bmi2");
    default:
      return true;
  }
#else
  return isa == Isa::DEFAULT;
#endif
}

bool built(Isa isa) {
  switch (isa) {
#if defined(SBD_EXT_HAVE_AVX512)
    case Isa::AVX512:
      return true;
#endif
#if defined(SBD_EXT_HAVE_AVX2)
    case Isa::AVX2:
      return true;
#endif
    case Isa::DEFAULT:
      return true;
    default:
      return false;
  }
}

bool usable(Isa isa) { return built(isa) && cpu_supports(isa); }

Isa parse(const std::string& name) {
  if (name == "default") return Isa::DEFAULT;
  if (name == "avx2") return Isa::AVX2;
  if (name == "avx512") return Isa::AVX512;
  TORCH_CHECK_VALUE(false, "sbd_ext: unknown CPU ISA \"", name, "\"; expected \"default\", \"avx2\" or \"avx512\"");
}

Isa widest() {
  for (Isa isa : {Isa::AVX512, Isa::AVX2})
    if (usable(isa)) return isa;
  return Isa::DEFAULT;
}

Isa initial() {
  const char* env = std::getenv("SBD_EXT_CPU_ISA");
  if (env != nullptr && *env != '\0') {
    Isa isa = parse(env);
    if (usable(isa)) return isa;
  }
  return widest();
}

std::atomic<int>& current() {
  static std::atomic<int> value{static_cast<int>(initial())};
  return value;
}

}  // namespace

Isa active_isa() { return static_cast<Isa>(current().load(std::memory_order_relaxed)); }

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::AVX512:
      return "avx512";
    case Isa::AVX2:
      return "avx2";
    default:
      return "default";
  }
}

std::vector<std::string> available_isas() {
  std::vector<std::string> out;
  for (Isa isa : {Isa::DEFAULT, Isa::AVX2, Isa::AVX512})
    if (usable(isa)) out.emplace_back(isa_name(isa));
  return out;
}

void set_isa(const std::string& name) {
  if (name.empty()) {
    current().store(static_cast<int>(widest()));
    return;
  }
  Isa isa = parse(name);
  TORCH_CHECK_VALUE(usable(isa), "sbd_ext: CPU ISA \"", name, "\" is not usable here (",
                    built(isa) ? "the CPU lacks it" : "it was not built", ")");
  current().store(static_cast<int>(isa));
}

namespace {

// Why AMX-INT8 cannot run here, or "" (usable). Asks Linux for the tile data once (the grant is per process).
std::string amx_check() {
#if defined(__x86_64__) || defined(_M_X64)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_max(0, nullptr) < 7) return "the CPU has no CPUID leaf 7";
  __cpuid_count(7, 0, a, b, c, d);
  if (!(d & (1u << 24)) || !(d & (1u << 25))) return "the CPU does not report AMX-TILE and AMX-INT8";
  __cpuid(1, a, b, c, d);
  if (!(c & (1u << 27))) return "the OS has not enabled XSAVE (OSXSAVE)";
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & (3u << 17)) != (3u << 17)) return "the OS has not enabled the tile state (XCR0 bits 17-18)";
#if defined(__linux__)
  constexpr long kArchReqXcompPerm = 0x1023, kArchGetXcompPerm = 0x1022, kXtileData = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXtileData) != 0) return "Linux refused the tile data (arch_prctl)";
  unsigned long long granted = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &granted) != 0 || !(granted & (1ull << kXtileData)))
    return "Linux did not grant the tile data (arch_prctl)";
  return "";
#else
  return "AMX is used on Linux only";
#endif
#else
  return "not an x86-64 CPU";
#endif
}

const std::string& amx_reason() {
  static const std::string reason = amx_check();
  return reason;
}

Core detect_core() {
#if defined(__x86_64__) || defined(_M_X64)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(0, &a, &b, &c, &d) == 0) return Core::OTHER;
  const bool amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;    // "AuthenticAMD"
  const bool intel = b == 0x756e6547u && d == 0x49656e69u && c == 0x6c65746eu;  // "GenuineIntel"
  if (intel) return __builtin_cpu_supports("avx512f") ? Core::INTEL : Core::OTHER;
  if (!amd || __get_cpuid(1, &a, &b, &c, &d) == 0) return Core::OTHER;
  const unsigned base = (a >> 8) & 0xF, family = base == 0xF ? base + ((a >> 20) & 0xFF) : base;
  if (family == 0x1A) return Core::ZEN5;
  return family == 0x19 && __builtin_cpu_supports("avx512f") ? Core::ZEN4 : Core::OTHER;
#else
  return Core::OTHER;
#endif
}

bool emulate_usable() {
#if defined(__x86_64__) || defined(_M_X64)
  return usable(Isa::AVX512) && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// The mode `name` asks for. An unknown name throws (naming `what`); "on" or "emulate" where unusable throws when
// `strict`, else gives the automatic choice (a start-up setting that this machine cannot honour).
Amx parse_amx(const std::string& name, bool strict, const char* what) {
  const Amx automatic = amx_int8_usable() ? Amx::HW : Amx::OFF;
  if (name == "auto") return automatic;
  if (name == "off") return Amx::OFF;
  if (name == "on") {
    if (!strict && !amx_int8_usable()) return automatic;
    TORCH_CHECK_VALUE(amx_int8_usable(), "sbd_ext: AMX-INT8 is not usable here: ", amx_reason());
    return Amx::HW;
  }
  if (name == "emulate") {
    if (!strict && !emulate_usable()) return automatic;
    TORCH_CHECK_VALUE(emulate_usable(), "sbd_ext: the AMX emulation runs in the AVX-512 variant and needs an "
                                        "AVX512-VNNI CPU");
    return Amx::EMULATE;
  }
  TORCH_CHECK_VALUE(false, "sbd_ext: unknown ", what, " \"", name, "\"; expected \"auto\", \"off\", \"on\" or \"emulate\"");
}

std::atomic<int>& amx_current() {
  static std::atomic<int> value{[] {
    const char* env = std::getenv("SBD_EXT_CPU_AMX");
    const std::string name = env != nullptr && *env != '\0' ? env : "auto";
    return static_cast<int>(parse_amx(name, false, "SBD_EXT_CPU_AMX value"));
  }()};
  return value;
}

std::atomic<long>& amx_calls() {
  static std::atomic<long> n{0};
  return n;
}

}  // namespace

bool amx_int8_usable() { return amx_reason().empty(); }

const std::string& amx_int8_status() {
  static const std::string usable_text = "usable";
  return amx_int8_usable() ? usable_text : amx_reason();
}

Amx amx_mode() { return static_cast<Amx>(amx_current().load(std::memory_order_relaxed)); }

void set_amx(const std::string& name) { amx_current().store(static_cast<int>(parse_amx(name, true, "AMX mode"))); }

const char* amx_mode_name(Amx mode) {
  switch (mode) {
    case Amx::HW:
      return "on";
    case Amx::EMULATE:
      return "emulate";
    default:
      return "off";
  }
}

bool amx_bf16_usable() {
#if defined(__x86_64__) || defined(_M_X64)
  static const bool bf16 = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!amx_int8_usable()) return false;  // leaf 7, the tile state and Linux's grant, checked there
    __cpuid_count(7, 0, a, b, c, d);
    return (d & (1u << 22)) != 0;  // AMX-BF16
  }();
  return bf16;
#else
  return false;
#endif
}

Amx bf16_tiles_mode() {
  if (active_isa() != Isa::AVX512) return Amx::OFF;
  const Amx mode = amx_mode();
  return mode == Amx::HW && !amx_bf16_usable() ? Amx::OFF : mode;
}

bool amx_rows(long M) { return M >= kAmxMinRows && amx_mode() != Amx::OFF && active_isa() == Isa::AVX512; }

long amx_range_calls() { return amx_calls().load(std::memory_order_relaxed); }

void count_amx_range() { amx_calls().fetch_add(1, std::memory_order_relaxed); }

Core cpu_core() {
  static const Core core = detect_core();
  return core;
}

const char* core_name(Core core) {
  switch (core) {
    case Core::ZEN5:
      return "zen5";
    case Core::ZEN4:
      return "zen4";
    case Core::INTEL:
      return "intel";
    default:
      return "other";
  }
}

}  // namespace sbd_cpu
