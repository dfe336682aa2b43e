// backend="cuda": the fused policy-loss kernel of DESIGN.md section 4 (math in csrc/fused_is_math.h).
//
// A thread block runs one row at a time. Sweep 1 reads the row with 16-byte vector loads (8 bf16/fp16 or 4 fp32 per
// load), kFusedUnroll of them in flight per thread, and keeps per-thread online-softmax state in base-2 units (one
// exp2 per element and one rescale per vector, log2(e) / tau folded into one constant, ex2.approx.ftz); the block
// merges the states with warp shuffles and one shared-memory round. Thread 0 forms lp, H and the per-row
// coefficients g, h in double (csrc/fused_is_math.h). Sweep 2 re-reads the row, mostly from L2, and writes
// d loss / d z = 2^b (c0 + c1 b); the target column is then rewritten from double sums, so 1 - p_y keeps its
// digits when p_y is close to 1. A row whose start is not 16-byte aligned (odd V, a padded slice) is split into a
// scalar head up to the first 16-byte boundary, the vector body and a scalar tail, so only up to 2 x 7 elements
// per row go scalar.
// Offsets are int64 (N x V beyond 2**31 elements).
//
// Block size: 768 threads once a row has more than 512 16-byte vectors (V = 151936 bf16 is 18992 vectors: 6 full
// rounds of kFusedUnroll loads a thread and one predicated round per sweep), the power of two >= the vectors below
// that, so that no warp idles. The grid is persistent (persistent_grid: as many blocks per SM as the L2 and the
// register file allow, 1 at V = 152k, each looping over rows): an H200 (132 SMs, 60 MB L2) has 132 rows = 40 MB of
// bf16 logits in flight at V = 152k, and sweep 2 runs backwards over the row, so its first reads are the latest of
// sweep 1. A block copies its next row's inputs into shared memory while it sweeps the current one.
// bench/gpu/gpu_perf_report.py predicts the time statically; bench/gpu_suite.sh measures it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>

#include "../fused_is_math.h"
#include "../rows.h"
#include "device.cuh"

namespace fused_is {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr double kLn2 = 0.6931471805599453;
constexpr float kNeg = -1.0e30f;  // a finite "minus infinity": see finite_floor
// Threads per block and 16-byte loads in flight per thread in each sweep: fused_rows_kernel's blocks of at most 768
// threads have up to 80 registers a thread (it uses 74-78 on sm_90: at 64 its persistent row loop spills), 48 KiB of
// loads in flight per SM; given_rows_kernel's of 1024 have 64, 64 KiB.
constexpr int kFusedThreads = 768, kFusedUnroll = 4;
constexpr int kGivenThreads = 1024, kGivenUnroll = 4;

// Online softmax state of a set of logits in base-2 units, with differences taken in raw logit units before
// the scaling (exact for bf16/fp16 logits; scaling first would leave an absolute error of ulp(z / tau) on lp,
// which swamps it when p_y is close to 1): m = max z, s = sum 2^a, t = sum 2^a a, a = (z - m) c with
// c = log2(e) / tau. s is sum e^d with d = (z - m) / tau, and t ln 2 is sum e^d d. A thread that has seen no
// element has s = 0 and is skipped rather than combined (no inf arithmetic).
struct State {
  float m, s, t;
};

// A -inf logit enters as -1e30: its 2^a is then exactly 0 and 2^a a is 0, not 0 * -inf = NaN (and a thread
// that has seen only -inf entries carries m = -1e30, which the merge weighs by 2^((-1e30 - m) c) = 0). NaN and
// +inf go in as they are and make s or t NaN: the row's flag (fused_is/checks.py).
// The same for any value below -1e30 (a dtype's most negative value used as a mask: (z - m) c would overflow
// to -inf); NaN < kNeg is false, so NaN stays.
__device__ __forceinline__ float finite_floor(float z) { return z < kNeg ? kNeg : z; }

// One element into st (a row's scalar head and tail, a strided row): one exp2 and no branch. Above the running
// max, 2^-(z - m) c rescales the old state and the new element adds 2^0 = 1; otherwise the element adds
// 2^(z - m) c. From m = -1e30, s = 0 the first element lands in the first case with a factor of exactly 0. The
// old t is rescaled as t u + (s u) neg, not (t + s neg) u: s neg alone overflows at a tiny tau (tau = 1e-8 after
// -inf entries: neg = -1e30 c = -1.4e38) and t would be -inf x 0 = NaN, while s u is 0 there (and |neg| < 127
// otherwise).
__device__ __forceinline__ void push(State& st, float z, float c) {
  z = finite_floor(z);
  const float a = (z - st.m) * c;
  const bool up = a > 0.0f;
  const float neg = -fabsf(a);
  const float u = fast_exp2(neg);
  const float su = st.s * u;
  st.t = up ? fmaf(su, neg, st.t * u) : fmaf(u, neg, st.t);
  st.s = up ? su + 1.0f : st.s + u;
  st.m = up ? z : st.m;
}

// One 16-byte vector into st (a row's body), as the Triton kernel's _softmax_step: the vector's max first, so
// that the state is rescaled once per vector (one exp2 of (m_old - m) c <= 0), then per element one exp2, one add
// and one fma, and no select (push pays a select and a predicated rescale per element). The vector's sums are
// formed apart and added to the rescaled state, so that its exp2 do not wait on the rescale. The same floor and
// the same differences before the scaling as push; a NaN is dropped by the max and kept in its own exp2.
template <typename S, int VEC>
__device__ __forceinline__ void push_vector(State& st, const Pack<S, VEC>& pk, float c) {
  float z[VEC], top[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) top[i] = z[i] = finite_floor(Elem<S>::load(pk.v[i]));
#pragma unroll
  for (int w = VEC / 2; w > 0; w >>= 1) {
#pragma unroll
    for (int i = 0; i < w; ++i) top[i] = fmaxf(top[i], top[i + w]);
  }
  const float m = fmaxf(st.m, top[0]);
  float s = 0.0f, t = 0.0f;
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const float a = (z[i] - m) * c;
    const float u = fast_exp2(a);
    s += u;
    t = fmaf(u, a, t);
  }
  const float shift = (st.m - m) * c;
  const float scale = fast_exp2(shift);
  const float rescaled = st.s * scale;
  st.t = fmaf(rescaled, shift, fmaf(st.t, scale, t));  // (s 2^shift) shift: see push
  st.s = rescaled + s;
  st.m = m;
}

__device__ __forceinline__ State merge(State a, State b, float c) {
  if (a.s == 0.0f) return b;
  if (b.s == 0.0f) return a;
  const float m = fmaxf(a.m, b.m);
  const float da = (a.m - m) * c, db = (b.m - m) * c;
  const float ea = fast_exp2(da), eb = fast_exp2(db);
  const float sa = a.s * ea, sb = b.s * eb;  // t e + (s e) d, not (t + s d) e: see push
  return State{m, sa + sb, fmaf(sa, da, fmaf(a.t, ea, fmaf(sb, db, b.t * eb)))};
}

__device__ __forceinline__ State warp_merge(State st, float c) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    State other{__shfl_xor_sync(0xffffffffu, st.m, offset), __shfl_xor_sync(0xffffffffu, st.s, offset),
                __shfl_xor_sync(0xffffffffu, st.t, offset)};
    st = merge(st, other, c);
  }
  return st;
}

// d loss / d z of one non-target column: 2^b (c0 + c1 b) with b = (z - m) c floored at -1e30 (a -inf logit:
// 2^b = 0 times a finite factor); 0 in a masked row, whatever it holds.
__device__ __forceinline__ float grad_of(float z, float m, float c, float c0, float c1, bool live) {
  const float b = fmaxf((z - m) * c, kNeg);
  return live ? fast_exp2(b) * fmaf(c1, b, c0) : 0.0f;
}

// L2 eviction hints of the 16-byte loads and stores of the sweeps (bench/gpu/gpu_perf_report.py reads them from the
// SASS as LDG.E.EL and LDG/STG.E.EF): sweep 1's loads evict_last, so that the row stays in L2 until sweep 2
// re-reads it, and sweep 2's loads and stores evict_first (ld/st.global.cs), so that a row done with leaves first
// instead of pushing out the other rows' first sweeps. evict_last is a createpolicy cache policy on
// ld.global.L2::cache_hint, with the L1 hint of the same name. All loads are coherent (no .nc): the gradient may be
// written over the logits. Each is one asm volatile, issued where the source puts it: __ldcs and __stcs are asm too,
// and a store under an `if` is a branch per vector (the compiler does not predicate an asm), so the store takes its
// predicate as an operand.
__device__ __forceinline__ uint64_t evict_last_policy() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

template <typename P>
__device__ __forceinline__ P load_evict_last(const P* at, uint64_t policy) {
  static_assert(sizeof(P) == 16, "a 16-byte vector");
  uint32_t w[4];
  asm volatile("ld.global.L1::evict_last.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
               : "l"(at), "l"(policy));
  P out;
  memcpy(&out, w, sizeof(out));
  return out;
}

template <typename P>
__device__ __forceinline__ P load_evict_first(const P* at) {
  static_assert(sizeof(P) == 16, "a 16-byte vector");
  uint32_t w[4];
  asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
               : "l"(at));
  P out;
  memcpy(&out, w, sizeof(out));
  return out;
}

template <typename P>
__device__ __forceinline__ void store_evict_first(P* at, const P& value, bool write) {
  static_assert(sizeof(P) == 16, "a 16-byte vector");
  uint32_t w[4];
  memcpy(w, &value, sizeof(w));
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.u32 p, %5, 0;\n @p st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};\n}"
      ::"l"(at), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]), "r"(static_cast<uint32_t>(write))
      : "memory");
}

// Sweep 1 over the 16-byte vectors [begin, end) of xv, thread t taking begin + t, begin + t + step, ...: rounds of
// UNROLL loads issued together, each vector pushed into st (and, KEEP, stored to keep[k - begin]: the cluster kernel's
// slice). In the last, partial round the loads past the end read vector end - 1 again and are skipped: the
// remainder predicated inside the loop. Without KEEP sweep 2 re-reads the vectors from L2: loaded evict_last.
template <typename S, int UNROLL, bool KEEP>
__device__ __forceinline__ void push_vectors(const Pack<S, 16 / sizeof(S)>* xv, int64_t begin, int64_t end,
                                             int64_t step, State& st, float c, Pack<S, 16 / sizeof(S)>* keep) {
  constexpr int VEC = 16 / sizeof(S);
  const uint64_t policy = KEEP ? 0 : evict_last_policy();
  for (int64_t k = begin + threadIdx.x; k < end; k += UNROLL * step) {
    Pack<S, VEC> pk[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const Pack<S, VEC>* at = xv + (k + u * step < end ? k + u * step : end - 1);
      pk[u] = KEEP ? *at : load_evict_last(at, policy);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (k + u * step < end) {
#pragma unroll
        push_vector(st, pk[u], c);
        if (KEEP) keep[k + u * step - begin] = pk[u];
      }
    }
  }
}

// Sweep 2 of one row: d loss / d z_j = 2^b_j (c0 + c1 b_j), backwards over the row (its end was read last, so it
// is the likeliest still in L2). b is floored at -1e30 (a -inf logit gives 0 times a finite factor); a masked row
// writes zeros, whatever its logits hold. The target column is left to the caller.
template <typename S, bool CONTIGUOUS, int UNROLL>
__device__ __forceinline__ void gradient_sweep(const S* x, S* o, const Layout& out, int64_t V, float m, float c,
                                               float c0, float c1, bool live, int64_t in_stride_col) {
  constexpr int VEC = 16 / sizeof(S);
  using E = Elem<S>;
  using P = Pack<S, VEC>;
  const int64_t step = blockDim.x;
  const int64_t head = CONTIGUOUS ? head_of(x, V) : 0;
  if (CONTIGUOUS && out.stride_col == 1 && head_of(o, V) == head) {
    const int64_t nvec = (V - head) / VEC;
    const P* xv = reinterpret_cast<const P*>(x + head);
    P* ov = reinterpret_cast<P*>(o + head);
    for (int64_t j = head + nvec * VEC + threadIdx.x; j < V; j += step) {
      o[j] = E::store(grad_of(E::load(x[j]), m, c, c0, c1, live));
    }
    // vectors k = nvec - 1 - r for r = threadIdx.x, threadIdx.x + step, ...: the body from its end, in rounds of
    // UNROLL loads issued together; in the last, partial one the loads past the end read vector 0 again and their
    // writes are skipped (the remainder predicated inside the loop). A masked row's body is zeros, not read.
    if (!live) {
      P zero;
#pragma unroll
      for (int i = 0; i < VEC; ++i) zero.v[i] = E::store(0.0f);
      for (int64_t r = threadIdx.x; r < nvec; r += step) store_evict_first(ov + nvec - 1 - r, zero, true);
    }
    for (int64_t r = threadIdx.x; live && r < nvec; r += UNROLL * step) {
      P pk[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        pk[u] = load_evict_first(xv + (r + u * step < nvec ? nvec - 1 - (r + u * step) : 0));
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const bool inside = r + u * step < nvec;
        P res;
#pragma unroll
        for (int i = 0; i < VEC; ++i) res.v[i] = E::store(grad_of(E::load(pk[u].v[i]), m, c, c0, c1, true));
        store_evict_first(ov + (inside ? nvec - 1 - (r + u * step) : 0), res, inside);
      }
    }
    for (int64_t j = threadIdx.x; j < head; j += step) o[j] = E::store(grad_of(E::load(x[j]), m, c, c0, c1, live));
  } else {
    for (int64_t j = V - 1 - threadIdx.x; j >= 0; j -= step) {
      o[j * out.stride_col] = E::store(grad_of(E::load(x[j * in_stride_col]), m, c, c0, c1, live));
    }
  }
}

// Outputs per row: lp, H, the row's max (raw logit) and log s (s = sum exp((z - max) / tau)), the last two for
// fused_is.logprobs' backward and for combining the statistics of vocabulary shards.
struct RowOutputs {
  double *lp, *entropy, *row_max, *log_s;
};

// The per-row inputs a block prefetches for its next row: the row table's kNumRow values (RowTable order) and the
// row's token (int64, kept as the bits of a double).
constexpr int kNumRow = 0
#define FIS_COUNT_ROW(name) +1
    FIS_ROW_INPUTS(FIS_COUNT_ROW)
#undef FIS_COUNT_ROW
    ;
constexpr int kPrefetch = kNumRow + 1;

// Thread k < kPrefetch copies its share of a row's inputs (row table entry k, or for k = kNumRow the token) into
// shared memory without holding a register: cp.async (sm_80 and later; a plain copy before), waited for by
// __pipeline_wait_prior(0) before the next barrier.
__device__ __forceinline__ void prefetch_row(double* dst, const RowTable& table, const int64_t* tokens, int64_t row) {
  const int k = threadIdx.x;
  const void* src = k < kNumRow ? static_cast<const void*>(table.data + k * table.n + row)
                                : static_cast<const void*>(tokens + row);
  __pipeline_memcpy_async(dst + k, src, sizeof(double));
}

// The 4-byte word holding element y of a row, copied asynchronously into *dst; logit_in_word reads the element back.
// A 2-byte element in the word's high half comes with the element before it (inside the tensor); one in the low half
// is copied alone (2 bytes, the high half zero-filled), so nothing past the tensor's last element is read.
template <typename S>
__device__ __forceinline__ void prefetch_logit(uint32_t* dst, const S* at) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(at);
  const size_t zero_fill = sizeof(S) == 2 && (address & 2u) == 0 ? 2 : 0;
  __pipeline_memcpy_async(dst, reinterpret_cast<const void*>(address & ~static_cast<uintptr_t>(3)), 4, zero_fill);
}
template <typename S>
__device__ __forceinline__ float logit_in_word(uint32_t word, const S* at) {
  if (sizeof(S) == 4) return __uint_as_float(word);
  const uint16_t bits = static_cast<uint16_t>(word >> ((reinterpret_cast<uintptr_t>(at) & 2u) * 8));
  S v;
  memcpy(&v, &bits, sizeof(bits));
  return Elem<S>::load(v);
}

__device__ __forceinline__ RowInputs unpack_row(const double* v) {
  RowInputs in;
  int k = 0;
#define FIS_ROW_UNPACK(name) in.name = v[k++];
  FIS_ROW_INPUTS(FIS_ROW_UNPACK)
#undef FIS_ROW_UNPACK
  return in;
}

// CONTIGUOUS: the row's columns are contiguous (stride_col == 1, checked on the host); each row is split into
// a scalar head up to its first 16-byte boundary, a body of Pack<S, VEC> loads and a scalar tail.
//
// Persistent: block b runs rows b, b + gridDim.x, ... (the grid is launch_typed's, a few blocks per SM; a row runs
// the same code whatever the grid, so its outputs do not depend on N). While a block sweeps row r it already
// copies what row r + gridDim.x starts from (its table entries and token, one value a thread for threads 0..9) and
// row r's target logit (thread 10) into shared memory with cp.async, waited for before the merge: no round trip to
// HBM is left between two rows' sweeps, only the merge and thread 0's float64 coefficient math.
template <typename S, bool CONTIGUOUS>
__global__ void __launch_bounds__(kFusedThreads, 1) fused_rows_kernel(const S* logits, Layout in, S* grad,
                                                          Layout out, const int64_t* __restrict__ tokens,
                                                          RowTable table, LossParams p, RowOutputs rows_out) {
  constexpr int VEC = 16 / sizeof(S);
  using E = Elem<S>;
  using P = Pack<S, VEC>;
  __shared__ State warp_states[32];
  __shared__ float row_scalars[4];         // m, c0, c1 (per base-2 unit), d loss / d z_y
  __shared__ bool row_live;                // g or h nonzero: a masked row (g = h = 0) gets exact zeros
  __shared__ double inputs[2][kPrefetch];  // this row's inputs and the next row's, by the parity of the turn
  __shared__ uint32_t target_word;         // the word holding this row's target logit (prefetch_logit)
  __shared__ int64_t target_column;        // this row's token, for thread 0's write after sweep 2
  __shared__ int64_t block_row[2];         // this turn's row and the next one's

  const int64_t V = in.vocab;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t step = blockDim.x;
  // the first row's inputs (the grid has at most one block per row; the guard costs nothing)
  if (threadIdx.x < kPrefetch && blockIdx.x < in.rows) prefetch_row(inputs[0], table, tokens, blockIdx.x);
  __pipeline_commit();
  __pipeline_wait_prior(0);
  __syncthreads();

  // The row of each turn lives in shared memory (block_row[turn parity], the next one written by thread 0 between
  // the barriers), and each phase reads it, and what derives from it, anew: the row loop then carries one register
  // (the parity) across thread 0's float64 code, which would spill otherwise.
  if (threadIdx.x == 0) block_row[0] = blockIdx.x;
  __syncthreads();
  for (int turn = 0;; turn ^= 1) {
    const int64_t row = block_row[turn];
    if (row >= in.rows) break;
    const double* now = inputs[turn];
    const float c = static_cast<float>(unpack_row(now).inv_tau) * kLog2e;  // log2(e) / tau of this row
    const S* x = logits + in.row_offset(row);
    // in flight during sweep 1: the target logit and the next row's inputs, into shared memory
    // (a token outside [0, V) is never read: the front door replaces it, and a direct caller gets lp = NaN)
    const int64_t y_now = __double_as_longlong(now[kNumRow]);
    if (threadIdx.x == kPrefetch && y_now >= 0 && y_now < V) prefetch_logit(&target_word, x + y_now * in.stride_col);
    if (threadIdx.x < kPrefetch && row + gridDim.x < in.rows) {
      prefetch_row(inputs[turn ^ 1], table, tokens, row + gridDim.x);
    }
    __pipeline_commit();

    // sweep 1: per-thread online softmax
    State st{kNeg, 0.0f, 0.0f};
    if (CONTIGUOUS) {
      const int64_t head = head_of(x, V);
      const int64_t nvec = (V - head) / VEC;
      const P* xv = reinterpret_cast<const P*>(x + head);
      // the scalar head (none for an aligned row) as a loop of at most one turn, laid out off the straight path
      for (int64_t j = threadIdx.x; j < head; j += step) push(st, E::load(x[j]), c);
      push_vectors<S, kFusedUnroll, false>(xv, 0, nvec, step, st, c, nullptr);
      for (int64_t j = head + nvec * VEC + threadIdx.x; j < V; j += step) push(st, E::load(x[j]), c);
    } else {
      for (int64_t j = threadIdx.x; j < V; j += step) push(st, E::load(x[j * in.stride_col]), c);
    }
    st = warp_merge(st, c);
    if (lane == 0) warp_states[warp] = st;
    __pipeline_wait_prior(0);  // the prefetches have long landed (a sweep takes microseconds)
    __syncthreads();
    if (warp == 0) {
      const int nwarps = (blockDim.x + 31) >> 5;
      st = lane < nwarps ? warp_states[lane] : State{kNeg, 0.0f, 0.0f};
      st = warp_merge(st, c);
      if (lane == 0) {
        const int64_t row = block_row[turn];
        block_row[turn ^ 1] = row + gridDim.x;
        const double s = st.s;
        const RowInputs row_in = unpack_row(now);
        const int64_t y = __double_as_longlong(now[kNumRow]);
        const bool inside = y >= 0 && y < V;
        target_column = inside ? y : -1;
        const float z_y = inside ? logit_in_word(target_word, x + y * in.stride_col) : __int_as_float(0x7fc00000);
        const double d_y = (static_cast<double>(z_y) - static_cast<double>(st.m)) * row_in.inv_tau;
        const RowStats r = finish_row(s, static_cast<double>(st.t) * kLn2, d_y);
        rows_out.lp[row] = r.lp;
        rows_out.entropy[row] = r.entropy;
        rows_out.row_max[row] = st.m;
        rows_out.log_s[row] = r.log_s;
        if (grad != nullptr) {
          const RowGradient gr = row_gradient(r, s, d_y, row_in, p);
          row_live = gr.live;
          row_scalars[0] = st.m;
          row_scalars[1] = static_cast<float>(gr.c0);
          row_scalars[2] = static_cast<float>(gr.c1 * kLn2);  // c1 d = (c1 ln 2) b
          row_scalars[3] = static_cast<float>(gr.grad_y);  // written by this thread after sweep 2 (below)
        }
      }
    }
    __syncthreads();  // the merge's shared state is read; in the stats-only case, the next turn may start
    if (grad == nullptr) continue;

    // sweep 2 (the row, its logits and c read anew: see block_row)
    const float m = row_scalars[0], c0 = row_scalars[1], c1 = row_scalars[2];
    const bool live = row_live;
    const int64_t row2 = block_row[turn];
    const float c2 = static_cast<float>(unpack_row(inputs[turn]).inv_tau) * kLog2e;
    S* o = grad + out.row_offset(row2);
    gradient_sweep<S, CONTIGUOUS, kFusedUnroll>(logits + in.row_offset(row2), o, out, V, m, c2, c0, c1, live,
                                                in.stride_col);
    __syncthreads();  // every write of sweep 2 is done: the target column can be overwritten
    // (row_scalars[3] and target_column are thread 0's own: the next turn's merge rewrites them)
    if (threadIdx.x == 0 && target_column >= 0) {
      o[target_column * out.stride_col] = E::store(live ? row_scalars[3] : 0.0f);
    }
  }
}

// The gradient sweep alone, from given row statistics (float64 [4, N]: max, log s, lp, H of each row) and given
// coefficients (coef_source given): fused_is.logprobs' backward, policy_loss(inplace=True)'s sweep in backward and
// fp16's deferred gradient (the CPU kernel's given path). A token outside [0, V) has no column here.
template <typename S, bool CONTIGUOUS>
__global__ void __launch_bounds__(kGivenThreads) given_rows_kernel(const S* logits, Layout in, S* grad,
                                                          Layout out, const int64_t* __restrict__ tokens,
                                                          RowTable table, LossParams p,
                                                          const double* __restrict__ given) {
  using E = Elem<S>;
  __shared__ float row_scalars[4];  // m, c0, c1 (per base-2 unit), d loss / d z_y
  __shared__ bool row_live;

  const int64_t row = blockIdx.x;
  const int64_t n = in.rows;
  const int64_t V = in.vocab;
  const float c = static_cast<float>(table.at(row).inv_tau) * kLog2e;
  if (threadIdx.x == 0) {
    const RowInputs row_in = table.at(row);
    RowStats r;
    r.log_s = given[n + row];
    r.lp = given[2 * n + row];
    r.entropy = given[3 * n + row];
    const double s = exp(r.log_s);
    const RowGradient gr = row_gradient(r, s, r.lp + r.log_s, row_in, p);
    row_live = gr.live;
    row_scalars[0] = static_cast<float>(given[row]);
    row_scalars[1] = static_cast<float>(gr.c0);
    row_scalars[2] = static_cast<float>(gr.c1 * kLn2);
    row_scalars[3] = static_cast<float>(gr.grad_y);
  }
  __syncthreads();
  const bool live = row_live;
  S* o = grad + out.row_offset(row);
  gradient_sweep<S, CONTIGUOUS, kGivenUnroll>(logits + in.row_offset(row), o, out, V, row_scalars[0], c, row_scalars[1],
                                row_scalars[2], live, in.stride_col);
  __syncthreads();
  const int64_t y = tokens[row];
  if (threadIdx.x == 0 && y >= 0 && y < V) o[y * out.stride_col] = E::store(live ? row_scalars[3] : 0.0f);
}

// ---- backend="cuda" with FUSED_IS_CUDA_CLUSTER=1 on a Hopper GPU (compute capability 9.0 or later): one row split
// across a thread-block cluster of 2-8 CTAs, each keeping its slice of the row in shared memory, so that the row is
// read from HBM once and written once whatever the L2 holds (the persistent kernel above relies on the L2 for its
// second sweep: at V = 256k, 132 rows in flight are 69 MB, more than an H200's L2 keeps). Sweep 1 loads the slice
// with 16-byte vectors, pushes it into the per-thread online softmax and stores it to shared memory; the CTAs'
// states are merged through distributed shared memory in rank order (every CTA gets the same bits), each CTA's
// thread 0 forms the row's coefficients (rank 0 writes lp, H and the statistics), and sweep 2 writes the gradient
// from shared memory. A slice is at most kClusterSliceBytes (two CTAs per SM, one's serial code overlapping the
// other's sweeps). Used only where it applies (cluster_plan): contiguous, 16-byte aligned rows (and gradient rows)
// with V a whole number of vectors, more than one slice and at most 8, the fused path with a gradient (not the
// statistics alone, nor the given-statistics sweep), sm_90 code in this build and a device that schedules such a
// cluster; otherwise the persistent kernel runs. Opt-in until it has been measured and checked on a GPU.
constexpr int kClusterThreads = 512;
constexpr int kClusterMax = 8;  // the portable cluster size
constexpr int64_t kClusterSliceBytes = 100 * 1024;

template <typename S>
__global__ void __launch_bounds__(kClusterThreads, 2) cluster_rows_kernel(const S* logits, Layout in,
                                                                         S* grad, Layout out,
                                                                         const int64_t* __restrict__ tokens,
                                                                         RowTable table, LossParams p,
                                                                         RowOutputs rows_out, int64_t slice_vecs) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  constexpr int kClusterUnroll = 4;  // 16-byte loads in flight per thread in sweep 1 (2 x 512 threads: 64 KiB / SM)
  constexpr int VEC = 16 / sizeof(S);
  using E = Elem<S>;
  using P = Pack<S, VEC>;
  extern __shared__ __align__(16) unsigned char slice_storage[];
  P* slice = reinterpret_cast<P*>(slice_storage);
  __shared__ State warp_states[32];
  __shared__ State cta_state;
  __shared__ float row_scalars[4];         // m, c0, c1 (per base-2 unit), d loss / d z_y
  __shared__ bool row_live;
  __shared__ double inputs[kPrefetch];     // the row's table entries and token (prefetch_row)
  __shared__ int64_t target_column;        // the token's column when this CTA's slice holds it, else -1
  __shared__ int64_t slice_at[3];          // row, lo, hi, for sweep 2 (read anew: nothing is carried across the
                                           // float64 code of thread 0, which would spill)

  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int ranks = static_cast<int>(cluster.num_blocks());
  const int64_t row = blockIdx.x / ranks;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t step = blockDim.x;
  const int64_t nvec = in.vocab / VEC;
  const int64_t lo = rank * slice_vecs;
  const int64_t hi = lo + slice_vecs < nvec ? lo + slice_vecs : nvec;
  if (threadIdx.x < kPrefetch) prefetch_row(inputs, table, tokens, row);  // waited for before the cluster barrier
  if (threadIdx.x == 0) {
    slice_at[0] = row;
    slice_at[1] = lo;
    slice_at[2] = hi;
  }
  __pipeline_commit();
  const float c = static_cast<float>(table.at(row).inv_tau) * kLog2e;  // every thread: sweep 1 needs it at once
  const P* xv = reinterpret_cast<const P*>(logits + in.row_offset(row));

  // sweep 1: the slice from HBM into registers (the online softmax) and into shared memory
  State st{kNeg, 0.0f, 0.0f};
  push_vectors<S, kClusterUnroll, true>(xv, lo, hi, step, st, c, slice);
  st = warp_merge(st, c);
  if (lane == 0) warp_states[warp] = st;
  __syncthreads();
  if (warp == 0) {
    const int nwarps = (blockDim.x + 31) >> 5;
    st = lane < nwarps ? warp_states[lane] : State{kNeg, 0.0f, 0.0f};
    st = warp_merge(st, c);
    if (lane == 0) cta_state = st;
  }
  __pipeline_wait_prior(0);
  cluster.sync();  // every CTA's state, slice and inputs are written (and visible across the cluster)

  if (warp == 0) {
    // lanes 0..ranks-1 read one CTA's state each through distributed shared memory; lane 0 merges them in rank order
    // (every CTA the same bits)
    const State mine = lane < ranks ? *cluster.map_shared_rank(&cta_state, lane) : State{kNeg, 0.0f, 0.0f};
    State total{kNeg, 0.0f, 0.0f};
    for (int r = 0; r < ranks; ++r) {
      const State other{__shfl_sync(0xffffffffu, mine.m, r), __shfl_sync(0xffffffffu, mine.s, r),
                        __shfl_sync(0xffffffffu, mine.t, r)};
      total = merge(total, other, c);
    }
    if (lane == 0) {
      const int64_t y = __double_as_longlong(inputs[kNumRow]);
      const bool valid = y >= 0 && y < in.vocab;  // the contract's (validate.py); no stray shared-memory read if not
      const int owner = valid ? static_cast<int>((y / VEC) / slice_vecs) : 0;  // the rank whose slice holds y
      target_column = valid && owner == rank ? y : -1;
      const S* owner_slice = reinterpret_cast<const S*>(cluster.map_shared_rank(slice, owner));
      const float z_y = valid ? E::load(owner_slice[y - static_cast<int64_t>(owner) * slice_vecs * VEC]) : 0.0f;
      const RowInputs row_in = unpack_row(inputs);
      const double s = total.s;
      const double d_y = (static_cast<double>(z_y) - static_cast<double>(total.m)) * row_in.inv_tau;
      const RowStats r = finish_row(s, static_cast<double>(total.t) * kLn2, d_y);
      if (rank == 0) {
        rows_out.lp[row] = r.lp;
        rows_out.entropy[row] = r.entropy;
        rows_out.row_max[row] = total.m;
        rows_out.log_s[row] = r.log_s;
      }
      const RowGradient gr = row_gradient(r, s, d_y, row_in, p);
      row_live = gr.live;
      row_scalars[0] = total.m;
      row_scalars[1] = static_cast<float>(gr.c0);
      row_scalars[2] = static_cast<float>(gr.c1 * kLn2);
      row_scalars[3] = gr.live ? static_cast<float>(gr.grad_y) : 0.0f;
    }
  }
  // this CTA's reads of the others' shared memory are done (their values are used above): arrive now, wait before
  // leaving, so that no CTA leaves while another may still read its shared memory, without a fence at the end
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
  {
    __syncthreads();
    // sweep 2: the gradient of the slice, from shared memory (not the logits: in place, they are being overwritten)
    const float m = row_scalars[0], c0 = row_scalars[1], c1 = row_scalars[2];
    const float c2 = static_cast<float>(unpack_row(inputs).inv_tau) * kLog2e;
    const bool live = row_live;
    const int64_t row2 = slice_at[0], lo2 = slice_at[1], hi2 = slice_at[2];
    S* o = grad + out.row_offset(row2);
    P* ov = reinterpret_cast<P*>(o);
    for (int64_t k = lo2 + threadIdx.x; k < hi2; k += blockDim.x) {
      const P pk = slice[k - lo2];
      P res;
#pragma unroll
      for (int i = 0; i < VEC; ++i) res.v[i] = E::store(grad_of(E::load(pk.v[i]), m, c2, c0, c1, live));
      ov[k] = res;
    }
    __syncthreads();  // every write of sweep 2 is done: the target column can be overwritten
    if (threadIdx.x == 0 && target_column >= 0) o[target_column] = E::store(row_scalars[3]);
  }
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
#else
  __trap();  // built without sm_90 code (a PTX of an older architecture): cluster_plan declines it; never silent
#endif
}

// The cluster launch of cluster_rows_kernel for these rows, or {0, 0} where it does not apply (see above).
struct ClusterPlan {
  int ranks = 0;
  int64_t slice_vecs = 0;
};

bool env_flag(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && value[0] == '1' && value[1] == '\0';
}

bool rows_aligned(const void* base, const Layout& l, int vec) {
  return (reinterpret_cast<uintptr_t>(base) & 15u) == 0 && l.stride_col == 1 && l.stride_row % vec == 0 &&
         (l.rows_per_seq >= l.rows || l.stride_seq % vec == 0);
}

// The launch configuration of cluster_rows_kernel: `blocks` CTAs of kClusterThreads in clusters of `ranks`, each with
// `smem` bytes of dynamic shared memory; *attribute holds the cluster dimension the configuration points to.
cudaLaunchConfig_t cluster_config(int64_t blocks, int ranks, int64_t smem, cudaStream_t stream,
                                  cudaLaunchAttribute* attribute) {
  attribute->id = cudaLaunchAttributeClusterDimension;
  attribute->val.clusterDim.x = static_cast<unsigned>(ranks);
  attribute->val.clusterDim.y = 1;
  attribute->val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(kClusterThreads);
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  return config;
}

// Per device and dtype, once: whether this build has sm_90 code for cluster_rows_kernel<S> (a build for an older
// architecture has only its PTX, whose body is a trap), its shared-memory attributes set (the largest slice, two
// CTAs per SM), and how many clusters of each size fit the device at once (0: none, e.g. under MPS or MIG).
struct ClusterSupport {
  bool ready = false, usable = false;
  int fit[kClusterMax + 1] = {};
};

template <typename S>
const ClusterSupport& cluster_support(int device) {
  constexpr int kDevices = 64;
  static ClusterSupport support[kDevices];
  static std::mutex lock;
  std::lock_guard<std::mutex> guard(lock);
  ClusterSupport& out = support[device >= 0 && device < kDevices ? device : 0];
  if (out.ready) return out;
  // Any query or attribute that fails (MPS, MIG, a virtualised driver) leaves the cluster path unused rather than
  // failing the call: the persistent kernel computes the same values. The error is cleared, so that the next
  // check() of an unrelated call does not report it.
  auto ok = [](cudaError_t err) {
    if (err == cudaSuccess) return true;
    (void)cudaGetLastError();
    return false;
  };
  out.ready = true;
  int major = 0;
  cudaFuncAttributes attributes;
  out.usable = ok(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device)) &&
               ok(cudaFuncGetAttributes(&attributes, cluster_rows_kernel<S>)) && major >= 9 &&
               attributes.ptxVersion >= 90 &&
               ok(cudaFuncSetAttribute(cluster_rows_kernel<S>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(kClusterSliceBytes))) &&
               ok(cudaFuncSetAttribute(cluster_rows_kernel<S>, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  for (int ranks = 2; out.usable && ranks <= kClusterMax; ++ranks) {
    cudaLaunchAttribute attribute;
    const cudaLaunchConfig_t config = cluster_config(ranks, ranks, kClusterSliceBytes, nullptr, &attribute);
    if (!ok(cudaOccupancyMaxActiveClusters(&out.fit[ranks], cluster_rows_kernel<S>, &config))) out.fit[ranks] = 0;
  }
  return out;
}

// The one-pass path with a gradient (the statistics alone are one sweep: nothing to keep on chip for).
template <typename S>
ClusterPlan cluster_plan(const void* logits, const Layout& in, const void* grad, const Layout& out) {
  constexpr int VEC = 16 / sizeof(S);
  ClusterPlan plan;
  if (grad == nullptr || !env_flag("FUSED_IS_CUDA_CLUSTER") || in.vocab % VEC != 0 || !rows_aligned(logits, in, VEC) ||
      !rows_aligned(grad, out, VEC)) {
    return plan;
  }
  const int64_t nvec = in.vocab / VEC;
  const int64_t slice_max = kClusterSliceBytes / 16;
  const int64_t ranks = (nvec + slice_max - 1) / slice_max;
  if (ranks < 2 || ranks > kClusterMax || in.rows * ranks > 0x7fffffffLL) return plan;
  int device = 0;
  check(cudaGetDevice(&device), "device query");
  const ClusterSupport& support = cluster_support<S>(device);
  if (!support.usable || support.fit[ranks] < 1) return plan;
  plan.ranks = static_cast<int>(ranks);
  plan.slice_vecs = (nvec + ranks - 1) / ranks;
  return plan;
}

template <typename S>
void launch_cluster(const ClusterPlan& plan, const S* x, const Layout& in, S* g, const Layout& out,
                    const int64_t* tokens, const RowTable& table, const LossParams& p, const RowOutputs& o,
                    cudaStream_t stream) {
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config =
      cluster_config(in.rows * plan.ranks, plan.ranks, plan.slice_vecs * 16, stream, &attribute);
  check(cudaLaunchKernelEx(&config, cluster_rows_kernel<S>, x, in, g, out, tokens, table, p, o, plan.slice_vecs),
        "cluster launch");
}

// Launches per kernel since the extension loaded (launch_counts in the binding: which kernel a call took).
std::atomic<int64_t> launches_given{0}, launches_persistent{0}, launches_cluster{0};

template <typename S>
void launch_typed(const void* logits, const Layout& in, void* grad, const Layout& out, const int64_t* tokens,
                  const RowTable& table, const LossParams& p, const RowOutputs& o, const double* given,
                  cudaStream_t stream) {
  constexpr int VEC = 16 / sizeof(S);
  const bool contiguous = in.stride_col == 1;  // rows of any alignment: head/body/tail per row
  const int threads = block_threads(in.vocab, contiguous ? VEC : 1, kFusedThreads);
  const int given_threads = block_threads(in.vocab, contiguous ? VEC : 1, kGivenThreads);
  const dim3 rows_grid(static_cast<unsigned>(in.rows));
  const int64_t row_bytes = in.vocab * static_cast<int64_t>(sizeof(S));
  const S* x = static_cast<const S*>(logits);
  S* g = static_cast<S*>(grad);
  if (given != nullptr && contiguous) {
    given_rows_kernel<S, true><<<rows_grid, given_threads, 0, stream>>>(x, in, g, out, tokens, table, p, given);
    ++launches_given;
  } else if (given != nullptr) {
    given_rows_kernel<S, false><<<rows_grid, given_threads, 0, stream>>>(x, in, g, out, tokens, table, p, given);
    ++launches_given;
  } else if (const ClusterPlan plan = cluster_plan<S>(logits, in, grad, out); plan.ranks > 0) {
    launch_cluster<S>(plan, x, in, g, out, tokens, table, p, o, stream);
    ++launches_cluster;
  } else if (contiguous) {
    const dim3 grid(persistent_grid(fused_rows_kernel<S, true>, in.rows, row_bytes, threads));
    fused_rows_kernel<S, true><<<grid, threads, 0, stream>>>(x, in, g, out, tokens, table, p, o);
    ++launches_persistent;
  } else {
    const dim3 grid(persistent_grid(fused_rows_kernel<S, false>, in.rows, row_bytes, threads));
    fused_rows_kernel<S, false><<<grid, threads, 0, stream>>>(x, in, g, out, tokens, table, p, o);
    ++launches_persistent;
  }
}

}  // namespace

// (given-statistics sweeps, persistent fused launches, cluster fused launches) since the extension loaded.
void launch_counts(int64_t* given, int64_t* persistent, int64_t* cluster) {
  *given = launches_given.load();
  *persistent = launches_persistent.load();
  *cluster = launches_cluster.load();
}

// dtype: 0 fp32, 1 bf16, 2 fp16. grad may be null (stats only) or equal to logits (in place). lp, ent, row_max,
// log_s: float64 [N] outputs; given: float64 [4, N] row statistics for the gradient sweep alone (then the outputs
// are not written), or null.
void launch_forward(const void* logits, int dtype, const Layout& in, void* grad, const Layout& out,
                    const int64_t* tokens, const RowTable& table, const LossParams& p, double* lp, double* ent,
                    double* row_max, double* log_s, const double* given, int64_t stream_handle) {
  const RowOutputs o{lp, ent, row_max, log_s};
  if (in.rows == 0) return;
  if (in.rows > 0x7fffffffLL) throw std::invalid_argument("fused_is cuda kernel: more than 2**31 - 1 rows");
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  switch (dtype) {
    case 0: launch_typed<float>(logits, in, grad, out, tokens, table, p, o, given, stream); break;
    case 1: launch_typed<__nv_bfloat16>(logits, in, grad, out, tokens, table, p, o, given, stream); break;
    case 2: launch_typed<__half>(logits, in, grad, out, tokens, table, p, o, given, stream); break;
    default: throw std::invalid_argument("fused_is cuda kernel: dtype code must be 0, 1 or 2");
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("fused_is cuda kernel launch: ") + cudaGetErrorString(err));
  }
}

}  // namespace fused_is
