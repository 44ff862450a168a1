// Properties of the current CUDA device that the work splits depend on (no torch headers).
#pragma once

namespace sbd_cuda {

// Number of SMs of the current device (cached per device; 1 if it cannot be queried).
int sm_count();
// Shared memory per SM of the current device, in bytes (cached per device; 0 if it cannot be queried).
int smem_per_sm();

}  // namespace sbd_cuda
