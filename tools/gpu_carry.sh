#!/usr/bin/env bash
# Make room in the working tree for a GPU call that carries a 48 MiB part of the SmolLM2 GGUF (bench/run_gpu.sh's
# header): a call carries at most 64 MiB, tracked files included, and sbd_ext/demo/models/ holds ~52 MB.
#   bash tools/gpu_carry.sh a        every model folder out (the gguf-part call: nothing needs a model)
#   bash tools/gpu_carry.sh a-arith  all but ntp-arith and sbd-arith out (gguf-part with e2e / e2e-cuda)
#   bash tools/gpu_carry.sh b        all but smollm2-drafter out (the drafter-cuda / smollm2 call)
#   bash tools/gpu_carry.sh restore  every folder back (run it before committing: git would see them deleted)
set -euo pipefail
cd "$(dirname "$0")/.."
MODELS=sbd_ext/demo/models
ASIDE=${SBD_CARRY_ASIDE:-/tmp/sbd_models_aside}
restore() {
  if [ -d "$ASIDE" ]; then
    for d in "$ASIDE"/*/; do
      [ -d "$d" ] && mv "$d" "$MODELS/"
    done
  fi
  return 0
}
keep=()
case "${1:-}" in
  a) ;;
  a-arith) keep=(ntp-arith sbd-arith) ;;
  b) keep=(smollm2-drafter) ;;
  restore) restore; git status --short -- "$MODELS"; exit 0 ;;
  *) echo "usage: bash tools/gpu_carry.sh {a|a-arith|b|restore}" >&2; exit 2 ;;
esac
restore
mkdir -p "$ASIDE"
for d in "$MODELS"/*/; do
  name=$(basename "$d")
  case " ${keep[*]:-} " in *" $name "*) continue ;; esac
  mv "$d" "$ASIDE/"
done
echo "tracked files now: $(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) bytes; kept: ${keep[*]:-none}"
