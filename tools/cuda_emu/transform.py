"""Copy csrc/cuda/kernels/* into a build folder, adapted for the CPU emulator (tools/cuda_emu/emu.h).

Textual and loud: every rule must match at least once where expected, so a change in the kernel sources that
the emulator cannot follow fails here rather than silently testing something else.
  kernel<<<grid, block, smem, stream>>>(args);  ->  ::sbd_emu::launch(kernel, grid, block, smem, stream, args);
  extern __shared__ __align__(N) T name[];       ->  T* name = ::sbd_emu::dyn_smem<T>();
  __shared__ (static arrays)                     ->  static   (blocks run one at a time)
  cudaGetLastError() / cudaFuncSetAttribute(     ->  the emulator's
  the PTX-wrapper section of common.cuh          ->  #include "emu_ptx.h"
"""

from __future__ import annotations

import pathlib
import re
import sys

LAUNCH = re.compile(r"([\w:<>, ]+?)<<<(.+?)>>>\((.*?)\);")
DYN_SMEM = re.compile(r"extern __shared__ (?:__align__\(\d+\) )?([\w: ]+?) (\w+)\[\];")


def transform(text: str, name: str) -> str:
    text = text.replace('#include "cuda/kernels/common.cuh"', '#include "emu.h"\n#include "cuda/kernels/common.cuh"')
    if name == "common.cuh":
        start = text.index("// ---- PTX wrappers")
        end = text.rindex("}  // namespace sbd_cuda")
        text = text[:start] + '}  // namespace sbd_cuda\n#include "emu_ptx.h"\nnamespace sbd_cuda {\n' + text[end:]
    text, n_launch = LAUNCH.subn(lambda m: f"::sbd_emu::launch({m[1].strip()}, {m[2]}, {m[3]});", text)
    text = DYN_SMEM.sub(lambda m: f"{m[1]}* {m[2]} = ::sbd_emu::dyn_smem<{m[1]}>();", text)
    text = text.replace("__shared__ ", "static ")
    text = text.replace("cudaGetLastError()", "::sbd_emu::last_error()")
    text = text.replace("cudaFuncSetAttribute(", "::sbd_emu::func_set_attribute(")
    if "<<<" in text:
        raise SystemExit(f"transform: a kernel launch in {name} was not rewritten")
    if "extern __shared__" in text:
        raise SystemExit(f"transform: a dynamic shared-memory declaration in {name} was not rewritten")
    if name.endswith(".cuh") and name != "common.cuh" and n_launch == 0:
        raise SystemExit(f"transform: expected kernel launches in {name}")
    return text


def main(src: str, dst: str) -> None:
    out = pathlib.Path(dst) / "cuda" / "kernels"
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(pathlib.Path(src).iterdir()):
        if f.suffix in (".h", ".cuh"):
            (out / f.name).write_text(transform(f.read_text(), f.name))


if __name__ == "__main__":
    main(*sys.argv[1:3])
