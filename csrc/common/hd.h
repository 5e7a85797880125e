// Spellings for code that is compiled both for the GPU (nvcc) and for the host.
#pragma once

#if defined(__CUDACC__)
#define PYCOLL_HD __host__ __device__
#define PYCOLL_HD_INLINE __host__ __device__ __forceinline__
#else
#define PYCOLL_HD
#define PYCOLL_HD_INLINE inline
#endif
