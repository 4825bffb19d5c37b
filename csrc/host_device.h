// __host__ / __device__ / __forceinline__ for headers that both kernels and host-only test
// programs include: nvcc and the CUDA headers define them; a plain C++ compiler gets nothing.
#pragma once

#if !defined(__CUDACC__) && !defined(__host__)
#define __host__
#endif
#if !defined(__CUDACC__) && !defined(__device__)
#define __device__
#endif
#if !defined(__CUDACC__) && !defined(__forceinline__)
#define __forceinline__ inline
#endif
