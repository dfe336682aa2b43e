// backend="cuda": the fused policy-loss kernel of DESIGN.md section 4 (math in csrc/fused_is_math.h).
//
// One thread block per row. Sweep 1 reads the row with 16-byte vector loads (8 bf16/fp16 or 4 fp32 per
// load) and keeps per-thread online-softmax state (max m, s = sum e^d, t = sum e^d d with d = (z - m) / tau);
// the block merges the states with warp shuffles and one shared-memory round. Thread 0 forms lp, H and the per-row
// coefficients g, h in double (csrc/fused_is_math.h). Sweep 2 re-reads the row, mostly from L2, and writes
// d loss / d z = e^d (c0 + c1 d); the target column is then rewritten from double sums, so
// 1 - p_y keeps its digits when p_y is close to 1. Offsets are int64 (N x V beyond 2**31 elements).
//
// Block size: 1024 threads for V >= 32k (V = 151936 bf16 is 18992 16-byte vectors, about 19 per thread per
// sweep), fewer for small V so that no warp idles. ptxas gives 43 registers per thread (nvcc -Xptxas -v), so
// one 1024-thread block fits per SM: an H100/H200 (132 SMs, 50 MB L2) has 132 rows = 40 MB of bf16 logits in
// flight at V = 152k, which L2 can hold for sweep 2. Whether more rows in flight (smaller blocks) would win
// is measured by bench/gpu_suite.sh (cuda vs triton rows), not assumed.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "../fused_is_math.h"
#include "../rows.h"

namespace fused_is {
namespace {

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

// Online softmax state of a set of logits, kept in raw logit units so that differences are taken before the
// 1/tau scaling (exact for bf16/fp16 logits; scaling first would leave an absolute error of ulp(z / tau) on
// lp, which swamps it when p_y is close to 1): m = max z, s = sum e^d, t = sum e^d d, d = (z - m) / tau.
// An empty state has s = 0 and is skipped rather than combined (no inf arithmetic).
struct State {
  float m, s, t;
};

// A -inf logit enters as -1e30: e^d is then exactly 0 and e^d d is 0, not 0 * -inf = NaN (and a lane that has
// seen only -inf entries carries m = -1e30, which the merge weighs by e^(-1e30 - m) = 0). NaN and +inf go in
// as they are and make s or t NaN: the row's flag (fused_is/checks.py).
__device__ __forceinline__ float finite_floor(float z) { return z == -INFINITY ? -1.0e30f : z; }

__device__ __forceinline__ void push(State& st, float z, float inv_tau) {
  z = finite_floor(z);
  if (st.s == 0.0f) {
    st = State{z, 1.0f, 0.0f};
  } else if (z > st.m) {  // rescale to the new max: d_k' = d_k + (m - m') / tau
    const float d = (st.m - z) * inv_tau;
    const float a = __expf(d);
    st.t = (st.t + st.s * d) * a;
    st.s = st.s * a + 1.0f;
    st.m = z;
  } else {
    const float d = (z - st.m) * inv_tau;
    const float e = __expf(d);
    st.s += e;
    st.t += e * d;
  }
}

__device__ __forceinline__ State merge(State a, State b, float inv_tau) {
  if (a.s == 0.0f) return b;
  if (b.s == 0.0f) return a;
  const float m = fmaxf(a.m, b.m);
  const float da = (a.m - m) * inv_tau, db = (b.m - m) * inv_tau;
  const float ea = __expf(da), eb = __expf(db);
  return State{m, a.s * ea + b.s * eb, (a.t + a.s * da) * ea + (b.t + b.s * db) * eb};
}

__device__ __forceinline__ State warp_merge(State st, float inv_tau) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    State other{__shfl_xor_sync(0xffffffffu, st.m, offset), __shfl_xor_sync(0xffffffffu, st.s, offset),
                __shfl_xor_sync(0xffffffffu, st.t, offset)};
    st = merge(st, other, inv_tau);
  }
  return st;
}

// d loss / d z of one non-target column: e^d (c0 + c1 d) with d floored at -1e30 (a -inf logit: e^d = 0 times
// a finite factor); 0 in a masked row, whatever it holds.
__device__ __forceinline__ float grad_of(float z, float m, float inv_tau, float c0, float c1, bool live) {
  const float d = fmaxf((z - m) * inv_tau, -1.0e30f);
  return live ? __expf(d) * (c0 + c1 * d) : 0.0f;
}

template <typename S, int VEC>
struct alignas(sizeof(S) * VEC) Pack {
  S v[VEC];
};

// VECTOR: the row is contiguous and 16-byte aligned (checked on the host), so loads are Pack<S, VEC>.
template <typename S, bool VECTOR>
__global__ void __launch_bounds__(1024) fused_rows_kernel(const S* __restrict__ logits, Layout in, S* grad,
                                                          Layout out, const int64_t* __restrict__ tokens,
                                                          RowTable table, LossParams p, double* lp_out,
                                                          double* ent_out) {
  constexpr int VEC = 16 / sizeof(S);
  using E = Elem<S>;
  using P = Pack<S, VEC>;
  __shared__ State warp_states[32];
  __shared__ float row_scalars[4];  // m, c0, c1, d loss / d z_y
  __shared__ bool row_live;          // g or h nonzero: a masked row (g = h = 0) gets exact zeros

  const int64_t row = blockIdx.x;
  const int64_t V = in.vocab;
  const float inv_tau = static_cast<float>(p.inv_tau);
  const S* x = logits + in.row_offset(row);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  // sweep 1: per-thread online softmax
  State st{0.0f, 0.0f, 0.0f};  // empty
  if (VECTOR) {
    const P* xv = reinterpret_cast<const P*>(x);
    const int64_t nvec = V / VEC;
    for (int64_t k = threadIdx.x; k < nvec; k += blockDim.x) {
      const P pk = xv[k];
#pragma unroll
      for (int i = 0; i < VEC; ++i) push(st, E::load(pk.v[i]), inv_tau);
    }
    for (int64_t j = nvec * VEC + threadIdx.x; j < V; j += blockDim.x) push(st, E::load(x[j]), inv_tau);
  } else {
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) push(st, E::load(x[j * in.stride_col]), inv_tau);
  }
  st = warp_merge(st, inv_tau);
  if (lane == 0) warp_states[warp] = st;
  __syncthreads();
  if (warp == 0) {
    const int nwarps = (blockDim.x + 31) >> 5;
    st = lane < nwarps ? warp_states[lane] : State{0.0f, 0.0f, 0.0f};
    st = warp_merge(st, inv_tau);
    if (lane == 0) {
      const int64_t y = tokens[row];
      const double s = st.s;
      const double d_y = (static_cast<double>(E::load(x[y * in.stride_col])) - static_cast<double>(st.m)) * p.inv_tau;
      const RowStats r = finish_row(s, st.t, d_y);
      lp_out[row] = r.lp;
      ent_out[row] = r.entropy;
      if (grad != nullptr) {
        const RowGradient gr = row_gradient(r, s, d_y, table.at(row), p);
        row_live = gr.live;
        row_scalars[0] = st.m;
        row_scalars[1] = static_cast<float>(gr.c0);
        row_scalars[2] = static_cast<float>(gr.c1);
        row_scalars[3] = static_cast<float>(gr.grad_y);  // written by this thread after sweep 2 (below)
      }
    }
  }
  if (grad == nullptr) return;
  __syncthreads();

  // sweep 2: d loss / d z_j = e^d_j (c0 + c1 d_j), the row mostly still in L2. d is floored at -1e30 (a -inf
  // logit gives e^d = 0 times a finite factor); a masked row writes zeros, whatever its logits hold.
  const float m = row_scalars[0], c0 = row_scalars[1], c1 = row_scalars[2];
  const bool live = row_live;
  S* o = grad + out.row_offset(row);
  if (VECTOR && out.stride_col == 1) {
    const P* xv = reinterpret_cast<const P*>(x);
    P* ov = reinterpret_cast<P*>(o);
    const int64_t nvec = V / VEC;
    for (int64_t k = threadIdx.x; k < nvec; k += blockDim.x) {
      const P pk = xv[k];
      P r;
#pragma unroll
      for (int i = 0; i < VEC; ++i) r.v[i] = E::store(grad_of(E::load(pk.v[i]), m, inv_tau, c0, c1, live));
      ov[k] = r;
    }
    for (int64_t j = nvec * VEC + threadIdx.x; j < V; j += blockDim.x) {
      o[j] = E::store(grad_of(E::load(x[j]), m, inv_tau, c0, c1, live));
    }
  } else {
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      o[j * out.stride_col] = E::store(grad_of(E::load(x[j * in.stride_col]), m, inv_tau, c0, c1, live));
    }
  }
  __syncthreads();  // every write of sweep 2 is done: the target column can be overwritten
  if (threadIdx.x == 0) o[tokens[row] * out.stride_col] = E::store(live ? row_scalars[3] : 0.0f);
}

int block_threads(int64_t vocab, int vec) {
  int64_t work = (vocab + vec - 1) / vec;
  int threads = 32;
  while (threads < 1024 && threads < work) threads <<= 1;
  return threads;
}

template <typename S>
void launch_typed(const void* logits, const Layout& in, void* grad, const Layout& out, const int64_t* tokens,
                  const RowTable& table, const LossParams& p, double* lp, double* ent, cudaStream_t stream) {
  constexpr int VEC = 16 / sizeof(S);
  const bool aligned = in.stride_col == 1 && (reinterpret_cast<uintptr_t>(logits) % 16 == 0) &&
                       (in.stride_row * sizeof(S)) % 16 == 0 && (in.stride_seq * sizeof(S)) % 16 == 0 &&
                       (grad == nullptr || ((reinterpret_cast<uintptr_t>(grad) % 16 == 0) &&
                                            (out.stride_row * sizeof(S)) % 16 == 0 &&
                                            (out.stride_seq * sizeof(S)) % 16 == 0));
  const int threads = block_threads(in.vocab, aligned ? VEC : 1);
  const dim3 grid(static_cast<unsigned>(in.rows));
  if (aligned) {
    fused_rows_kernel<S, true><<<grid, threads, 0, stream>>>(static_cast<const S*>(logits), in, static_cast<S*>(grad),
                                                             out, tokens, table, p, lp, ent);
  } else {
    fused_rows_kernel<S, false><<<grid, threads, 0, stream>>>(static_cast<const S*>(logits), in,
                                                              static_cast<S*>(grad), out, tokens, table, p, lp, ent);
  }
}

}  // namespace

// dtype: 0 fp32, 1 bf16, 2 fp16. grad may be null (stats only) or equal to logits (in place).
void launch_forward(const void* logits, int dtype, const Layout& in, void* grad, const Layout& out,
                    const int64_t* tokens, const RowTable& table, const LossParams& p, double* lp, double* ent,
                    int64_t stream_handle) {
  if (in.rows == 0) return;
  if (in.rows > 0x7fffffffLL) throw std::invalid_argument("fused_is cuda kernel: more than 2**31 - 1 rows");
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  switch (dtype) {
    case 0: launch_typed<float>(logits, in, grad, out, tokens, table, p, lp, ent, stream); break;
    case 1: launch_typed<__nv_bfloat16>(logits, in, grad, out, tokens, table, p, lp, ent, stream); break;
    case 2: launch_typed<__half>(logits, in, grad, out, tokens, table, p, lp, ent, stream); break;
    default: throw std::invalid_argument("fused_is cuda kernel: dtype code must be 0, 1 or 2");
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("fused_is cuda kernel launch: ") + cudaGetErrorString(err));
  }
}

}  // namespace fused_is
