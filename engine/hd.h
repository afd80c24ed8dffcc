// hd.h: HD_FN marks the small inline functions that engine/cpu/ (C) and engine/cuda/ (CUDA)
// share, so that a formula is written once for both backends.
#pragma once

#ifdef __CUDACC__
#define HD_FN static __host__ __device__ __forceinline__
#else
#define HD_FN static inline
#endif
