// hd.h: HD_FN marks the small inline functions that C code (engine/cpu/, data/) and CUDA
// (engine/cuda/) share, so that a formula is written once for both.
#pragma once

#ifdef __CUDACC__
#define HD_FN static __host__ __device__ __forceinline__
#else
#define HD_FN static inline
#endif
