// Stands in for the header a CUDA LibTorch build generates (Debian's CPU-only
// LibTorch ships c10/cuda's headers without it), for the compile-only
// tandem_cuda_check target. Never used by a real CUDA build.
#pragma once
#define C10_CUDA_BUILD_SHARED_LIBS
