// Properties of the current CUDA device that the work splits depend on (no torch headers).
#pragma once

namespace sbd_cuda {

// Number of SMs of the current device (cached per device; 1 if it cannot be queried).
int sm_count();

}  // namespace sbd_cuda
