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

// The core family, for the few tunings measured to differ between cores of one ISA (a software prefetch distance):
// ZEN5 for an AMD family 0x1A core (CPUID leaf 1), ZEN4 for an AMD family 0x19 core with AVX-512F (the family's
// Zen 3 cores have none), OTHER for everything else. Never changes a result.
// INTEL for an Intel core with AVX-512F.
enum class Core : int { OTHER = 0, ZEN5 = 1, ZEN4 = 2, INTEL = 3 };
Core cpu_core();
const char* core_name(Core core);

// AMX-INT8 (Intel Sapphire Rapids and later): row_linear's packed int8 weights times several quantised x rows on the
// matrix tiles (row_linear_amx_kernel.cpp), in the AVX-512 variant. Usable when the CPU reports AMX-TILE and
// AMX-INT8, the OS has enabled the tile state (XCR0 bits 17-18: a VM may hide it while CPUID shows AMX) and Linux
// grants this process the tile data (arch_prctl ARCH_REQ_XCOMP_PERM, asked once); anything else falls back to VNNI.
// The mode: HW (the tiles), EMULATE (the same kernel over a C++ model of the tile instructions: tests the kernel's
// layouts and sums on any AVX512-VNNI CPU, slowly) or OFF. The two paths give the same bits (integer block sums).
enum class Amx : int { OFF = 0, HW = 1, EMULATE = 2 };
Amx amx_mode();
bool amx_int8_usable();
// "usable", or why not (which check failed)
const std::string& amx_int8_status();
// "auto" (HW where usable, else OFF; the start-up choice unless SBD_EXT_CPU_AMX names another), "off", "on" (HW;
// throws where unusable) or "emulate" (throws without an AVX-512 variant on an AVX512-VNNI CPU).
void set_amx(const std::string& name);
const char* amx_mode_name(Amx mode);
// x rows from which a packed int8 row_linear runs on the tiles (one row: the VNNI tile, at the weight stream's bound).
// A compiled SmolLM2 w8a8 forward on an Intel Xeon (AMX, 1 thread, 2026-12-06), tiles against VNNI panels, one
// process alternating: 2 rows 1.09x / 1.10x one row, 3 rows 1.14x / 1.18x, 4 rows 1.18x / 1.21x, 6 rows 1.31x / 1.37x
// (the bits do not depend on it: row_linear_amx_kernel.cpp).
constexpr long kAmxMinRows = 2;
// AMX-BF16 as well (CPUID leaf 7 EDX bit 22, with everything amx_int8_usable checks).
bool amx_bf16_usable();
// How row_linear runs a bf16 weight in tiles (sbd_ext.packing, tiles=True) under the current ISA and mode
// (RowLinearParams::tiles_mode): HW on the AMX-BF16 tiles (mode HW where AMX-BF16 is usable), EMULATE on the emulated
// tiles, OFF the same model on the vector units (anything else: OFF, not the AVX-512 variant, no AMX-BF16).
// sbd_ext.quantize(model, "bf16") packs in tiles unless this is OFF.
Amx bf16_tiles_mode();
// Whether a packed int8 row_linear of M x rows takes the AMX path under the current ISA and mode.
bool amx_rows(long M);
// row_linear_range calls that ran on the tiles (HW or EMULATE) since the process started.
long amx_range_calls();
void count_amx_range();

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
