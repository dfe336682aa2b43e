// backend="cuda" of distill_loss (DESIGN.md section 9): the two kernels of fused_is/distill.py's plan, the counterparts
// of triton_kernels/distill.py's, with the per-column math of csrc/distill_math.h (bound in csrc/cuda/bindings.cpp).
//
// Cost per row of V columns, s and t bytes per student and teacher element (the teacher is only ever read):
//   distill_stats_kernel: forward and reverse KL read V (s + t) once: each thread keeps an online state of both rows
//     (maxes, sums of 2^a and 2^b, the KL's cross sum; csrc/distill_math.h cross_term), the block merges the states with
//     warp shuffles and one shared-memory round; JSD reads both rows a second time, backwards, for KL(p || m) and
//     KL(q || m) given the log-sum-exps, with a persistent grid (device.cuh persistent_grid over both rows' bytes) so
//     that the row is still in L2. Writes kNumStats floats; a masked row reads nothing.
//   distill_gradient_kernel: one block per row; reads V (s + t) and writes V s (d loss / d z, into a new buffer or over
//     the student's logits: each column is read and then written by the same thread, and no pointer that may alias the
//     logits is __restrict__, so no load of them takes the non-coherent path); a row of weight 0 (masked) is written
//     with zeros, its logits unread.
// Loads: packs of VEC = 16 / max(s, t) columns of each row (16 bytes of the wider model) where both rows (and the
// gradient's) are contiguous and reach a pack boundary after the same number of columns; the columns before it, after
// the last pack, and every column of a row with other strides or alignments go one at a time. Arithmetic in fp32 with
// MUFU exp2 / log2 (ex2.approx.ftz, lg2.approx), as the Triton kernels; offsets int64.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "../distill_math.h"
#include "../rows.h"
#include "device.cuh"

namespace fused_is {
namespace distill {
namespace {

// Threads per block: 16 warps hold the state of both rows (five floats a thread) and two packs of each in flight.
constexpr int kStatsThreads = 512, kGradientThreads = 1024;

// The math policy of csrc/distill_math.h on the GPU (the host side is never called: it only makes the templates
// instantiable as __host__ __device__).
struct FastMath {
  static FIS_HD float exp2(float x) {
#if defined(__CUDA_ARCH__)
    return fast_exp2(x);
#else
    return std::exp2(x);
#endif
  }
  static FIS_HD float log2_1p(float t) {
#if defined(__CUDA_ARCH__)
    return __log2f(1.0f + t);
#else
    return std::log2(1.0f + t);
#endif
  }
};
using M = FastMath;

// Columns per pack: 16 bytes of the wider model's elements.
template <typename S, typename T>
constexpr int pack_columns() {
  return 16 / static_cast<int>(sizeof(S) > sizeof(T) ? sizeof(S) : sizeof(T));
}

// Columns before the first VEC-column pack boundary of a row at p (0 when aligned), at most V.
template <typename S, int VEC>
__device__ __forceinline__ int64_t pack_head(const S* p, int64_t V) {
  constexpr uintptr_t kBytes = sizeof(S) * VEC;
  const int64_t head = static_cast<int64_t>(((kBytes - (reinterpret_cast<uintptr_t>(p) % kBytes)) % kBytes) / sizeof(S));
  return head < V ? head : V;
}

// Where a row pair's columns go by packs: [head, head + nvec VEC); the rest one at a time. A pair (or gradient row)
// whose rows are not all contiguous, or reach a pack boundary after different numbers of columns, has no packs.
struct Split {
  int64_t head, nvec;
};

template <typename S, typename T, int VEC>
__device__ __forceinline__ Split split_of(const S* x, int64_t sx, const T* y, int64_t sy, const S* o, int64_t so,
                                          int64_t V) {
  const int64_t head = pack_head<S, VEC>(x, V);
  const bool packs = sx == 1 && sy == 1 && so == 1 && pack_head<T, VEC>(y, V) == head &&
                     (o == nullptr || pack_head<S, VEC>(o, V) == head);
  return packs ? Split{head, (V - head) / VEC} : Split{V, 0};
}

// One thread's online state of both rows in raw units of the logits: maxes (from kNeg), s = sum 2^a and t = sum 2^b
// with a = (z - m_s) c_s, b = (u - m_t) c_t against the current maxes, and the KL's cross sum w (0 for JSD).
struct PairState {
  float m_s, s_s, m_t, s_t, w;
};

__device__ __forceinline__ PairState empty_state() { return PairState{kNeg, 0.0f, kNeg, 0.0f, 0.0f}; }

// The state moved to maxes m_s >= st.m_s, m_t >= st.m_t: each a (b) moves by shift_s (shift_t) <= 0 units and each
// weight by 2^shift, so w = sum 2^b (b - a) becomes 2^shift_t (w + (shift_t - shift_s) t) (forward; reverse with the
// roles swapped). shift_t - shift_s is finite for maxes in [kNeg, 1e29] at tau >= 1e-8; where it is huge (a model's
// state saw only -inf so far) the sum it multiplies is 0, or w is +inf already.
template <int kDivergence>
__device__ __forceinline__ void rescale(PairState& st, float m_s, float m_t, float c_s, float c_t) {
  const float shift_s = (st.m_s - m_s) * c_s, shift_t = (st.m_t - m_t) * c_t;
  const float e_s = fast_exp2(shift_s), e_t = fast_exp2(shift_t);
  if (kDivergence == kForwardKL) st.w = e_t * (st.w + (shift_t - shift_s) * st.s_t);
  if (kDivergence == kReverseKL) st.w = e_s * (st.w + (shift_s - shift_t) * st.s_s);
  st.s_s *= e_s;
  st.s_t *= e_t;
  st.m_s = m_s;
  st.m_t = m_t;
}

// Push K columns of both rows (fp32, raw): the maxes first (fmaxf skips NaN, which then makes the sums NaN; +inf makes
// a = NaN), one rescale, then one exp2 per column of each model. A -inf logit keeps its raw value (cross_term).
template <int kDivergence, int K>
__device__ __forceinline__ void push(PairState& st, const float (&z)[K], const float (&u)[K], float c_s, float c_t) {
  float m_s = st.m_s, m_t = st.m_t;
#pragma unroll
  for (int i = 0; i < K; ++i) {
    m_s = fmaxf(m_s, z[i]);
    m_t = fmaxf(m_t, u[i]);
  }
  rescale<kDivergence>(st, m_s, m_t, c_s, c_t);
#pragma unroll
  for (int i = 0; i < K; ++i) {
    const float a = (z[i] - m_s) * c_s, b = (u[i] - m_t) * c_t;
    const float p = fast_exp2(a), q = fast_exp2(b);
    st.s_s += p;
    st.s_t += q;
    if (kDivergence != kJSD) st.w += cross_term<kDivergence>(p, q, a, b);
  }
}

template <int kDivergence>
__device__ __forceinline__ PairState merge(PairState a, PairState b, float c_s, float c_t) {
  const float m_s = fmaxf(a.m_s, b.m_s), m_t = fmaxf(a.m_t, b.m_t);
  rescale<kDivergence>(a, m_s, m_t, c_s, c_t);
  rescale<kDivergence>(b, m_s, m_t, c_s, c_t);
  return PairState{m_s, a.s_s + b.s_s, m_t, a.s_t + b.s_t, a.w + b.w};
}

template <int kDivergence>
__device__ __forceinline__ PairState warp_merge(PairState st, float c_s, float c_t) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const PairState other{__shfl_xor_sync(0xffffffffu, st.m_s, offset), __shfl_xor_sync(0xffffffffu, st.s_s, offset),
                          __shfl_xor_sync(0xffffffffu, st.m_t, offset), __shfl_xor_sync(0xffffffffu, st.s_t, offset),
                          __shfl_xor_sync(0xffffffffu, st.w, offset)};
    st = merge<kDivergence>(st, other, c_s, c_t);
  }
  return st;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The block's merged state, in thread 0 (warp_states: 32 states of shared memory; the caller syncs before reusing it).
template <int kDivergence>
__device__ __forceinline__ PairState block_merge(PairState st, float c_s, float c_t, PairState* warp_states) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  st = warp_merge<kDivergence>(st, c_s, c_t);
  if (lane == 0) warp_states[warp] = st;
  __syncthreads();
  if (warp == 0) {
    st = lane < static_cast<int>((blockDim.x + 31) >> 5) ? warp_states[lane] : empty_state();
    st = warp_merge<kDivergence>(st, c_s, c_t);
  }
  return st;
}

// Sum of (a, b) over the block, in thread 0 (pairs: 32 float2 of shared memory).
__device__ __forceinline__ float2 block_sum(float a, float b, float2* pairs) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  a = warp_sum(a);
  b = warp_sum(b);
  if (lane == 0) pairs[warp] = make_float2(a, b);
  __syncthreads();
  if (warp == 0) {
    const float2 mine = lane < static_cast<int>((blockDim.x + 31) >> 5) ? pairs[lane] : make_float2(0.0f, 0.0f);
    a = warp_sum(mine.x);
    b = warp_sum(mine.y);
  }
  return make_float2(a, b);
}

// The statistics of each row (stats: float32 [kNumStats, N], rows named by FIS_DISTILL_STATS): both models' raw max and
// log2 sum, D_t and (JSD) K_t in nats; zeros at a row where valid is false, its logits unread. Student and teacher
// share the [B, T, V] or [N, V] shape, not their strides. Block b takes rows b, b + gridDim.x, ... (one row per block
// for the KLs; JSD's persistent grid bounds the rows in flight between its two sweeps).
template <typename S, typename T, int kDivergence>
__global__ void __launch_bounds__(kStatsThreads) distill_stats_kernel(const S* logits, Layout ls, const T* teacher,
                                                                      Layout lt, const bool* __restrict__ valid,
                                                                      float* __restrict__ stats, Scalars k) {
  constexpr int VEC = pack_columns<S, T>();
  using PS = Pack<S, VEC>;
  using PT = Pack<T, VEC>;
  __shared__ PairState warp_states[32];
  __shared__ float2 warp_pairs[32];
  __shared__ float row_stats[4];  // m_s, log2 sum s, m_t, log2 sum t: JSD's second sweep reads them
  const int64_t n = ls.rows, V = ls.vocab, step = blockDim.x;
  const float c_s = static_cast<float>(k.student_scale), c_t = static_cast<float>(k.teacher_scale);
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
    if (!valid[row]) {
      if (threadIdx.x < kNumStats) stats[threadIdx.x * n + row] = 0.0f;
      continue;
    }
    const S* x = logits + ls.row_offset(row);
    const T* y = teacher + lt.row_offset(row);
    const Split split = split_of<S, T, VEC>(x, ls.stride_col, y, lt.stride_col, nullptr, 1, V);
    const PS* xv = reinterpret_cast<const PS*>(x + split.head);
    const PT* yv = reinterpret_cast<const PT*>(y + split.head);

    // sweep 1: the online state of both rows
    PairState st = empty_state();
    for (int64_t j = threadIdx.x; j < split.head; j += step) {
      const float z[1] = {Elem<S>::load(x[j * ls.stride_col])}, u[1] = {Elem<T>::load(y[j * lt.stride_col])};
      push<kDivergence, 1>(st, z, u, c_s, c_t);
    }
    for (int64_t r = threadIdx.x; r < split.nvec; r += 2 * step) {  // two packs of each row in flight
      const bool second = r + step < split.nvec;
      const PS px0 = xv[r], px1 = xv[second ? r + step : r];
      const PT py0 = yv[r], py1 = yv[second ? r + step : r];
      float z[VEC], u[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        z[i] = Elem<S>::load(px0.v[i]);
        u[i] = Elem<T>::load(py0.v[i]);
      }
      push<kDivergence, VEC>(st, z, u, c_s, c_t);
      if (second) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          z[i] = Elem<S>::load(px1.v[i]);
          u[i] = Elem<T>::load(py1.v[i]);
        }
        push<kDivergence, VEC>(st, z, u, c_s, c_t);
      }
    }
    for (int64_t j = split.head + split.nvec * VEC + threadIdx.x; j < V; j += step) {
      const float z[1] = {Elem<S>::load(x[j])}, u[1] = {Elem<T>::load(y[j])};
      push<kDivergence, 1>(st, z, u, c_s, c_t);
    }
    st = block_merge<kDivergence>(st, c_s, c_t, warp_states);
    if (threadIdx.x == 0) {
      const float log2_sum_s = log2f(st.s_s), log2_sum_t = log2f(st.s_t);
      row_stats[0] = st.m_s;
      row_stats[1] = log2_sum_s;
      row_stats[2] = st.m_t;
      row_stats[3] = log2_sum_t;
      if (kDivergence != kJSD) {
        const double divergence =
            kDivergence == kForwardKL ? kl_of_sums(st.w, st.s_t, log2_sum_t, log2_sum_s)
                                      : kl_of_sums(st.w, st.s_s, log2_sum_s, log2_sum_t);
        stats[k_divergence * n + row] = static_cast<float>(divergence);
        stats[k_student_kl * n + row] = 0.0f;
      }
      stats[k_student_max * n + row] = st.m_s;
      stats[k_student_log2_sum * n + row] = log2_sum_s;
      stats[k_teacher_max * n + row] = st.m_t;
      stats[k_teacher_log2_sum * n + row] = log2_sum_t;
    }
    __syncthreads();  // row_stats written; warp_states read (the next row may write them)
    if (kDivergence != kJSD) continue;

    // sweep 2 (JSD): KL(p || m) and KL(q || m) given the log2 sums, backwards over the packs (the row's end was read
    // last by sweep 1, so it is the likeliest still in L2)
    const RowConstants rc = row_constants(row_stats[0], row_stats[1], row_stats[2], row_stats[3], 0.0f, k);
    float kl_p = 0.0f, kl_q = 0.0f, term_p, term_q;
    for (int64_t j = split.head + split.nvec * VEC + threadIdx.x; j < V; j += step) {
      jsd_terms<M>(Elem<S>::load(x[j]), Elem<T>::load(y[j]), rc, &term_p, &term_q);
      kl_p += term_p;
      kl_q += term_q;
    }
    for (int64_t r = threadIdx.x; r < split.nvec; r += step) {
      const PS px = xv[split.nvec - 1 - r];
      const PT py = yv[split.nvec - 1 - r];
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        jsd_terms<M>(Elem<S>::load(px.v[i]), Elem<T>::load(py.v[i]), rc, &term_p, &term_q);
        kl_p += term_p;
        kl_q += term_q;
      }
    }
    for (int64_t j = threadIdx.x; j < split.head; j += step) {
      jsd_terms<M>(Elem<S>::load(x[j * ls.stride_col]), Elem<T>::load(y[j * lt.stride_col]), rc, &term_p, &term_q);
      kl_p += term_p;
      kl_q += term_q;
    }
    const float2 sums = block_sum(kl_p, kl_q, warp_pairs);
    if (threadIdx.x == 0) {  // beta KL(q || m) + (1 - beta) KL(p || m)
      stats[k_student_kl * n + row] = static_cast<float>(sums.x * kLn2);
      stats[k_divergence * n + row] = static_cast<float>((k.beta * sums.y + (1.0 - k.beta) * sums.x) * kLn2);
    }
    __syncthreads();  // warp_pairs and row_stats read
  }
}

// d loss / d z = w_t F / tau of every row into grad (the student's shape, its own strides; it may be the student's
// logits: no __restrict__ on either); weight: float64 [N], w_t = a_t grad_output, times k.grad_scale (1 / tau, or
// (1 - beta) / tau for JSD); stats: distill_stats_kernel's. A row with coefficient 0 (masked) gets exact zeros, its
// logits (NaN or anything) unread. k.accumulate: grad += the term instead (masked rows untouched).
template <typename S, typename T, int kDivergence>
__global__ void __launch_bounds__(kGradientThreads) distill_gradient_kernel(const S* logits, Layout ls,
                                                                            const T* teacher, Layout lt, S* grad,
                                                                            Layout lo, const float* __restrict__ stats,
                                                                            const double* __restrict__ weight,
                                                                            Scalars k) {
  constexpr int VEC = pack_columns<S, T>();
  using PS = Pack<S, VEC>;
  using PT = Pack<T, VEC>;
  using E = Elem<S>;
  const int64_t n = ls.rows, V = ls.vocab, step = blockDim.x;
  const bool accumulate = k.accumulate != 0.0;  // grad += the term (grad a separate buffer), one rounding
  // the stored value of column j: the term, or the term added to what grad holds there
  auto value = [&](float term, S old) { return E::store(accumulate ? E::load(old) + term : term); };
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
    S* o = grad + lo.row_offset(row);
    const float coef = static_cast<float>(weight[row] * k.grad_scale);
    if (coef == 0.0f) {
      if (accumulate) continue;
      for (int64_t j = threadIdx.x; j < V; j += step) o[j * lo.stride_col] = E::store(0.0f);
      continue;
    }
    const S* x = logits + ls.row_offset(row);
    const T* y = teacher + lt.row_offset(row);
    const RowConstants rc = row_constants(stats[k_student_max * n + row], stats[k_student_log2_sum * n + row],
                                          stats[k_teacher_max * n + row], stats[k_teacher_log2_sum * n + row],
                                          stats[(kDivergence == kJSD ? k_student_kl : k_divergence) * n + row], k);
    const Split split = split_of<S, T, VEC>(x, ls.stride_col, y, lt.stride_col, o, lo.stride_col, V);
    for (int64_t j = threadIdx.x; j < split.head; j += step) {
      const float g = gradient_term<kDivergence, M>(E::load(x[j * ls.stride_col]), Elem<T>::load(y[j * lt.stride_col]),
                                                    rc);
      o[j * lo.stride_col] = value(g * coef, o[j * lo.stride_col]);
    }
    const PS* xv = reinterpret_cast<const PS*>(x + split.head);
    const PT* yv = reinterpret_cast<const PT*>(y + split.head);
    PS* ov = reinterpret_cast<PS*>(o + split.head);
    for (int64_t r = threadIdx.x; r < split.nvec; r += step) {
      const PS px = xv[r];
      const PT py = yv[r];
      PS res{};
      if (accumulate) res = ov[r];
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float term = gradient_term<kDivergence, M>(E::load(px.v[i]), Elem<T>::load(py.v[i]), rc) * coef;
        res.v[i] = value(term, res.v[i]);
      }
      ov[r] = res;
    }
    for (int64_t j = split.head + split.nvec * VEC + threadIdx.x; j < V; j += step) {
      o[j] = value(gradient_term<kDivergence, M>(E::load(x[j]), Elem<T>::load(y[j]), rc) * coef, o[j]);
    }
  }
}

// f(S*, T*) with the element types of the dtype codes (student 0 fp32, 1 bf16, 2 fp16; teacher the same or 3 fp64).
template <typename F>
void with_types(int student, int teacher, F&& f) {
  auto with_teacher = [&](auto* s) {
    switch (teacher) {
      case 0: return f(s, static_cast<float*>(nullptr));
      case 1: return f(s, static_cast<__nv_bfloat16*>(nullptr));
      case 2: return f(s, static_cast<__half*>(nullptr));
      case 3: return f(s, static_cast<double*>(nullptr));
      default: throw std::invalid_argument("fused_is cuda distillation kernel: teacher dtype code must be 0 to 3");
    }
  };
  switch (student) {
    case 0: return with_teacher(static_cast<float*>(nullptr));
    case 1: return with_teacher(static_cast<__nv_bfloat16*>(nullptr));
    case 2: return with_teacher(static_cast<__half*>(nullptr));
    default: throw std::invalid_argument("fused_is cuda distillation kernel: logits dtype code must be 0, 1 or 2");
  }
}

// f(std::integral_constant<int, divergence>)
template <typename F>
void with_divergence(int divergence, F&& f) {
  switch (divergence) {
    case kForwardKL: return f(std::integral_constant<int, kForwardKL>());
    case kReverseKL: return f(std::integral_constant<int, kReverseKL>());
    case kJSD: return f(std::integral_constant<int, kJSD>());
    default: throw std::invalid_argument("fused_is cuda distillation kernel: unknown divergence code");
  }
}

void check_launch() {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("fused_is cuda distillation kernel launch: ") + cudaGetErrorString(err));
  }
}

}  // namespace

// The launches of bindings.cpp's distill_stats and distill_gradient (their checks done): dtype codes as with_types.
void launch_distill_stats(const void* logits, int student_dtype, const Layout& ls, const void* teacher,
                          int teacher_dtype, const Layout& lt, const bool* valid, float* stats, int divergence,
                          const Scalars& k, int64_t stream_handle) {
  if (ls.rows == 0) return;
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  with_types(student_dtype, teacher_dtype, [&](auto* s, auto* t) {
    using S = std::remove_pointer_t<decltype(s)>;
    using T = std::remove_pointer_t<decltype(t)>;
    constexpr int VEC = pack_columns<S, T>();
    with_divergence(divergence, [&](auto code) {
      constexpr int kDivergence = decltype(code)::value;
      const auto kernel = distill_stats_kernel<S, T, kDivergence>;
      const bool contiguous = ls.stride_col == 1 && lt.stride_col == 1;
      const int threads = block_threads(ls.vocab, contiguous ? VEC : 1, kStatsThreads);
      const int64_t row_bytes = ls.vocab * static_cast<int64_t>(sizeof(S) + sizeof(T));
      const int64_t most = 0x7fffffffLL;
      const unsigned blocks = kDivergence == kJSD ? persistent_grid(kernel, ls.rows, row_bytes, threads)
                                                  : static_cast<unsigned>(ls.rows < most ? ls.rows : most);
      kernel<<<blocks, threads, 0, stream>>>(static_cast<const S*>(logits), ls, static_cast<const T*>(teacher), lt,
                                             valid, stats, k);
    });
  });
  check_launch();
}

void launch_distill_gradient(const void* logits, int student_dtype, const Layout& ls, const void* teacher,
                             int teacher_dtype, const Layout& lt, void* grad, const Layout& lo, const float* stats,
                             const double* weight, int divergence, const Scalars& k, int64_t stream_handle) {
  if (ls.rows == 0) return;
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  with_types(student_dtype, teacher_dtype, [&](auto* s, auto* t) {
    using S = std::remove_pointer_t<decltype(s)>;
    using T = std::remove_pointer_t<decltype(t)>;
    constexpr int VEC = pack_columns<S, T>();
    with_divergence(divergence, [&](auto code) {
      constexpr int kDivergence = decltype(code)::value;
      const bool contiguous = ls.stride_col == 1 && lt.stride_col == 1 && lo.stride_col == 1;
      const int threads = block_threads(ls.vocab, contiguous ? VEC : 1, kGradientThreads);
      const int64_t most = 0x7fffffffLL;
      const unsigned blocks = static_cast<unsigned>(ls.rows < most ? ls.rows : most);
      distill_gradient_kernel<S, T, kDivergence><<<blocks, threads, 0, stream>>>(
          static_cast<const S*>(logits), ls, static_cast<const T*>(teacher), lt, static_cast<S*>(grad), lo, stats,
          weight, k);
    });
  });
  check_launch();
}

}  // namespace distill
}  // namespace fused_is
