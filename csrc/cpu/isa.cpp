#include "cpu/isa.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>

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

}  // namespace sbd_cpu
