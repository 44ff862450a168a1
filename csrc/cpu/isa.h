// Run-time choice of the CPU kernel variant. Each csrc/cpu/<op>_kernel.cpp is compiled once per instruction
// set into namespace sbd_cpu::<ISA> (see setup.py); a binding calls SBD_CPU_DISPATCH(fn, args...) to run the
// widest variant that was built and that the CPU supports. The choice can be narrowed for testing with
// sbd_ext._C.set_cpu_isa("default" | "avx2" | "avx512") or the environment variable SBD_EXT_CPU_ISA.
#pragma once

#include <string>
#include <vector>

namespace sbd_cpu {

enum class Isa : int { DEFAULT = 0, AVX2 = 1, AVX512 = 2 };

Isa active_isa();
const char* isa_name(Isa isa);
// The variants usable on this machine (built and supported by the CPU), narrowest first.
std::vector<std::string> available_isas();
// "" restores the automatic choice; an unknown or unusable name throws.
void set_isa(const std::string& name);

}  // namespace sbd_cpu

#if defined(SBD_EXT_HAVE_AVX512)
#define SBD_CPU_CASE_AVX512(FN, ...) \
  case ::sbd_cpu::Isa::AVX512:       \
    return ::sbd_cpu::AVX512::FN(__VA_ARGS__);
#else
#define SBD_CPU_CASE_AVX512(FN, ...)
#endif
#if defined(SBD_EXT_HAVE_AVX2)
#define SBD_CPU_CASE_AVX2(FN, ...) \
  case ::sbd_cpu::Isa::AVX2:       \
    return ::sbd_cpu::AVX2::FN(__VA_ARGS__);
#else
#define SBD_CPU_CASE_AVX2(FN, ...)
#endif

#define SBD_CPU_DISPATCH(FN, ...)                  \
  [&] {                                            \
    switch (::sbd_cpu::active_isa()) {             \
      SBD_CPU_CASE_AVX512(FN, __VA_ARGS__)         \
      SBD_CPU_CASE_AVX2(FN, __VA_ARGS__)           \
      default:                                     \
        return ::sbd_cpu::DEFAULT::FN(__VA_ARGS__); \
    }                                              \
  }()

// Declares a kernel entry point in every ISA namespace (only the built ones are defined and referenced).
#define SBD_CPU_DECLARE_KERNEL(RET, FN, ...)   \
  namespace DEFAULT {                          \
  RET FN(__VA_ARGS__);                         \
  }                                            \
  namespace AVX2 {                             \
  RET FN(__VA_ARGS__);                         \
  }                                            \
  namespace AVX512 {                           \
  RET FN(__VA_ARGS__);                         \
  }
