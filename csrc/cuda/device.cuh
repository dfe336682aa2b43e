// What the CUDA kernels of csrc/cuda/ share: element conversions, 16-byte packs, the MUFU exp2, and the host side of
// a launch (block size, the device's SM count and L2 size, the persistent grid). Included by policy_loss_cuda.cu
// and distill_cuda.cu; the kernels themselves stay in their own files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>

namespace fused_is {

// Loads as fp32 and stores rounded to nearest; double is read only (a teacher's logits: distill_cuda.cu).
template <typename S> struct Elem;
template <> struct Elem<float> {
  static __device__ __forceinline__ float load(float v) { return v; }
  static __device__ __forceinline__ float store(float v) { return v; }
};
template <> struct Elem<__nv_bfloat16> {
  static __device__ __forceinline__ float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};
template <> struct Elem<__half> {
  static __device__ __forceinline__ float load(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half store(float v) { return __float2half_rn(v); }
};
template <> struct Elem<double> {
  static __device__ __forceinline__ float load(double v) { return __double2float_rn(v); }
};

// 2^x with flush-to-zero: one MUFU.EX2, no subnormal fix-up (a weight below 2^-126 adds nothing here)
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <typename S, int VEC>
struct alignas(sizeof(S) * VEC) Pack {
  S v[VEC];
};

// Elements before the first 16-byte boundary of a row starting at p (0 when p is aligned), at most V.
template <typename S>
__device__ __forceinline__ int64_t head_of(const S* p, int64_t V) {
  const int64_t head = static_cast<int64_t>(((16u - (reinterpret_cast<uintptr_t>(p) & 15u)) & 15u) / sizeof(S));
  return head < V ? head : V;
}

// The power of two >= a row's 16-byte vectors (its elements, strided), at least 32, capped at `most` (768 for
// fused_rows_kernel: not a power of two): no warp idles.
inline int block_threads(int64_t vocab, int vec, int most) {
  int64_t work = (vocab + vec - 1) / vec;
  int threads = 32;
  while (threads < most && threads < work) threads <<= 1;
  return threads < most ? threads : most;
}

// A persistent kernel's blocks per SM: as many as keep the rows in flight (blocks x SMs x row bytes) within 3/4 of
// the device's L2 (a second sweep over a row then re-reads it from L2) and can reside on the SM (`resident`: the
// occupancy calculator's count for this kernel and block size), at least 1. policy_loss_cuda.cu's 768-thread block of
// 76 registers leaves room for no second one: at V = 151936 bf16, 132 rows = 40 MB of the H200's 60 MB. Two rows per
// SM would be 80 MB in flight and sweep 2 would miss the L2 (bench/gpu/gpu_perf_report.py); the serial code between
// rows is hidden by the prefetch instead. Smaller rows get more blocks (V = 2048: 256 threads, 3). The same rule as
// the Triton kernels' grid (fused_is/backends/triton.py programs_per_sm); bench/gpu/gpu_perf_report.py mirrors it.
inline int blocks_per_sm(int64_t row_bytes, int sms, int64_t l2_bytes, int resident) {
  const int64_t fit = (l2_bytes / 4 * 3) / (static_cast<int64_t>(sms) * (row_bytes > 0 ? row_bytes : 1));
  const int64_t blocks = fit < resident ? fit : resident;
  return blocks > 1 ? static_cast<int>(blocks) : 1;
}

// A failed CUDA runtime call raises, naming `what`; the error is cleared, so that the launch's own check does not
// report it.
inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    cudaGetLastError();  // cleared: the launch's own check must not report it
    throw std::runtime_error(std::string("fused_is cuda kernel: ") + what + ": " + cudaGetErrorString(err));
  }
}

// The SM count and L2 size of a device, queried once (they do not change; a launch must not pay four queries).
struct DeviceShape {
  int sms = 0, l2 = 0;
};

inline DeviceShape device_shape(int device) {
  constexpr int kDevices = 64;
  static DeviceShape shapes[kDevices];
  static std::mutex lock;
  std::lock_guard<std::mutex> guard(lock);
  DeviceShape& shape = shapes[device >= 0 && device < kDevices ? device : 0];
  if (shape.sms == 0) {
    check(cudaDeviceGetAttribute(&shape.sms, cudaDevAttrMultiProcessorCount, device), "device query");
    check(cudaDeviceGetAttribute(&shape.l2, cudaDevAttrL2CacheSize, device), "device query");
  }
  return shape;
}

// The persistent grid of `kernel` on the current device for rows of `row_bytes` (both models' for distillation):
// blocks_per_sm x SMs blocks, at most one per row (N enters only as that cap: a row's outputs do not depend on the
// grid).
template <typename Kernel>
unsigned persistent_grid(Kernel kernel, int64_t rows, int64_t row_bytes, int threads) {
  int device = 0, resident = 1;
  check(cudaGetDevice(&device), "device query");
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, threads, 0), "occupancy query");
  const DeviceShape shape = device_shape(device);
  const int sms = shape.sms > 0 ? shape.sms : 1;
  const int per_sm = blocks_per_sm(row_bytes, sms, shape.l2, resident > 0 ? resident : 1);
  const int64_t blocks = static_cast<int64_t>(per_sm) * sms;
  return static_cast<unsigned>(blocks < rows ? blocks : rows);
}

}  // namespace fused_is
