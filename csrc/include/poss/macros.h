// Portability macros shared by the CPU (.cpp) and CUDA (.cu) translation units.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define POSS_HD __host__ __device__ __forceinline__
#else
#define POSS_HD inline
#endif
