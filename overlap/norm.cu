// The fused all-reduce + residual add + RMSNorm (overlap/norm.py): for each row of `hidden`
// elements, r = (the sum over ranks of x, in rank order) + residual, rounded to T once, and
// y = r * rsqrt(mean(r * r) + eps) * weight, computed in fp32 from the rounded r and rounded once.
//
// Compiled after collectives/peer/peer.cuh (collectives/peer/_launch.py), against its context,
// flags, barrier, packs and low-latency words (collectives/peer/kernels.cu). Block b takes rows
// b, b + grid, ...: it pushes those rows of x to every peer and then sums the same rows, so it only
// ever waits for block b of its peers, as every peer kernel does (every rank launches the same
// grid: the same rows). The sums run in rank order on every rank, so every rank's r and y are the
// same bits.
//
// Three entry points per dtype:
//   ar_rmsnorm_ll_*   messages within the low-latency words' area (collectives/peer/_layout.py):
//                     every 4 bytes of x travel with the call's number in one 8-byte store, and the
//                     reader spins on each word (no flag round trip); rows of whole words.
//   ar_rmsnorm_*      rows within one rank's share of a set of slots: pushed, one barrier, summed.
//   add_rmsnorm_*     one rank (no peers, no context used): r = x + residual, then the norm.
// Arguments after the context: x, residual, weight, y, r, rows, hidden, eps (the bits of a float),
// and the slot stride (words for _ll, elements otherwise; unused by add_rmsnorm).

// The sum of v over the block, the same on every thread (and the same order of additions on
// every rank). Ends with the block's threads in step, so consecutive calls can reuse `part`.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float part[32];
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = 0.f;
  for (int i = 0; i < (int)(blockDim.x >> 5); ++i) s += part[i];
  __syncthreads();
  return s;
}

__device__ __forceinline__ float eps_of(long bits) { return __int_as_float((int)bits); }

// r[j] = round(sum of srcs[q][j] + res[j]) over this row, j in packs (VEC) or elements; returns
// this thread's share of the sum of squares of the rounded r.
template <typename T, bool VEC>
__device__ __forceinline__ float add_row(const T* const* srcs, int world, const T* res, T* r, long hidden) {
  const int N = Pack<T>::N;
  float ss = 0.f;
  long j = 0;
  if (VEC) {
    const long vhi = hidden / N * N;
    for (j = (long)threadIdx.x * N; j < vhi; j += (long)blockDim.x * N) {
      PackSum<T> acc;
      for (int q = 0; q < world; ++q) acc.add(__ldcg(reinterpret_cast<const uint4*>(srcs[q] + j)));
      acc.add(*reinterpret_cast<const uint4*>(res + j));
      const uint4 o = acc.packed();
      *reinterpret_cast<uint4*>(r + j) = o;
      const T* oe = reinterpret_cast<const T*>(&o);
#pragma unroll
      for (int k = 0; k < N; ++k) ss += to_f(oe[k]) * to_f(oe[k]);
    }
    j = vhi;
  }
  for (long i = j + threadIdx.x; i < hidden; i += blockDim.x) {
    float acc = 0.f;
    for (int q = 0; q < world; ++q) acc += to_f(__ldcg(srcs[q] + i));
    const T o = from_f<T>(acc + to_f(res[i]));
    r[i] = o;
    ss += to_f(o) * to_f(o);
  }
  return ss;
}

// y[j] = round(r[j] * inv * w[j]) over this row. Reads r as written by this block: after a
// __syncthreads (block_sum's) that makes every thread's stores of r visible to the block.
template <typename T, bool VEC>
__device__ __forceinline__ void scale_row(const T* r, const T* w, T* y, long hidden, float inv) {
  const int N = Pack<T>::N;
  long j = 0;
  if (VEC) {
    const long vhi = hidden / N * N;
    for (j = (long)threadIdx.x * N; j < vhi; j += (long)blockDim.x * N) {
      const uint4 rv = *reinterpret_cast<const uint4*>(r + j), wv = *reinterpret_cast<const uint4*>(w + j);
      const T* re = reinterpret_cast<const T*>(&rv);
      const T* we = reinterpret_cast<const T*>(&wv);
      uint4 o;
      T* oe = reinterpret_cast<T*>(&o);
#pragma unroll
      for (int k = 0; k < N; ++k) oe[k] = from_f<T>(to_f(re[k]) * inv * to_f(we[k]));
      *reinterpret_cast<uint4*>(y + j) = o;
    }
    j = vhi;
  }
  for (long i = j + threadIdx.x; i < hidden; i += blockDim.x) y[i] = from_f<T>(to_f(r[i]) * inv * to_f(w[i]));
}

// Slots: rank q's rows of x land in my set at q * slot elements (slot >= rows * hidden).
template <typename T, bool VEC>
__device__ void ar_rmsnorm(const Ctx& c, const T* x, const T* res, const T* w, T* y, T* r, long rows, long hidden,
                           float eps, long slot) {
  u32 e;
  if (!begin(c, &e)) return;
  const int me = c.rank, world = c.world;
  for (long row = blockIdx.x; row < rows; row += gridDim.x)
    for (int k = 1; k < world; ++k) {
      const int p = (me + k) % world;
      copy_range<T, VEC>(slots_of<T>(c, p, e) + me * slot + row * hidden, x + row * hidden, 0, hidden);
    }
  if (!barrier(c.flags, me, world, STAGE_READY, e, c.timeout_ns, c.err, c.err_dev)) return;
  const T* mine = slots_of<T>(c, me, e);
  for (long row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* srcs[MAX_RANKS];
    for (int q = 0; q < world; ++q) srcs[q] = (q == me ? x : mine + q * slot) + row * hidden;
    const long o = row * hidden;
    const float ss = block_sum(add_row<T, VEC>(srcs, world, res + o, r + o, hidden));
    scale_row<T, VEC>(r + o, w, y + o, hidden, rsqrtf(ss / (float)hidden + eps));
  }
  end(c);
}

// Low-latency words: rank q's words of x sit in my set of words at q * slot_words; a row is
// hidden * sizeof(T) / 4 words (whole words: the caller checks).
template <typename T>
__device__ void ar_rmsnorm_ll(const Ctx& c, const T* x, const T* res, const T* w, T* y, T* r, long rows,
                              long hidden, float eps, long slot_words) {
  u32 e;
  if (!begin(c, &e)) return;
  const int me = c.rank, world = c.world;
  const int per = 4 / (int)sizeof(T);  // elements per word
  const long W = hidden / per;
  const u32* xw = reinterpret_cast<const u32*>(x);
  for (long row = blockIdx.x; row < rows; row += gridDim.x)
    for (long i = threadIdx.x; i < W; i += blockDim.x) {
      const u32 d = xw[row * W + i];
      for (int k = 1; k < world; ++k) st_ll(ll_slots(c, (me + k) % world, e) + me * slot_words + row * W + i, d, e);
    }
  const u64* mine = ll_slots(c, me, e);
  for (long row = blockIdx.x; row < rows; row += gridDim.x) {
    int failed = 0;
    float ss = 0.f;
    for (long i = threadIdx.x; i < W && !failed; i += blockDim.x) {
      float acc[2] = {0.f, 0.f};
      for (int q = 0; q < world; ++q) {
        u32 d;
        if (q == me) d = xw[row * W + i];
        else if (!ld_ll(c, mine + q * slot_words + row * W + i, e, q, &d)) { failed = 1; break; }
        const T* xe = reinterpret_cast<const T*>(&d);
        for (int k = 0; k < per; ++k) acc[k] += to_f(xe[k]);
      }
      if (failed) break;
      for (int k = 0; k < per; ++k) {
        const long j = row * hidden + i * per + k;
        const T o = from_f<T>(acc[k] + to_f(res[j]));
        r[j] = o;
        ss += to_f(o) * to_f(o);
      }
    }
    if (__syncthreads_or(failed)) return;  // recorded by ld_ll; later launches see the error
    const float total = block_sum(ss);
    scale_row<T, false>(r + row * hidden, w, y + row * hidden, hidden, rsqrtf(total / (float)hidden + eps));
  }
  end(c);
}

// One rank: r = x + residual, then the norm (the context is not read).
template <typename T, bool VEC>
__device__ void add_rmsnorm(const T* x, const T* res, const T* w, T* y, T* r, long rows, long hidden, float eps) {
  for (long row = blockIdx.x; row < rows; row += gridDim.x) {
    const long o = row * hidden;
    const T* srcs[1] = {x + o};
    const float ss = block_sum(add_row<T, VEC>(srcs, 1, res + o, r + o, hidden));
    scale_row<T, VEC>(r + o, w, y + o, hidden, rsqrtf(ss / (float)hidden + eps));
  }
}

#define NORM_ARGS(T) const Ctx c, const T* x, const T* res, const T* w, T* y, T* r, long rows, long hidden, long eps, long s
#define INSTANTIATE_NORM(T, TAG)                                                                          \
  extern "C" __global__ void __launch_bounds__(512) ar_rmsnorm_##TAG##_vec(NORM_ARGS(T)) {                  \
    ar_rmsnorm<T, true>(c, x, res, w, y, r, rows, hidden, eps_of(eps), s);                               \
  }                                                                                                      \
  extern "C" __global__ void __launch_bounds__(512) ar_rmsnorm_##TAG##_scalar(NORM_ARGS(T)) {               \
    ar_rmsnorm<T, false>(c, x, res, w, y, r, rows, hidden, eps_of(eps), s);                              \
  }                                                                                                      \
  extern "C" __global__ void __launch_bounds__(512) ar_rmsnorm_ll_##TAG##_vec(NORM_ARGS(T)) {               \
    ar_rmsnorm_ll<T>(c, x, res, w, y, r, rows, hidden, eps_of(eps), s);                                  \
  }                                                                                                      \
  extern "C" __global__ void __launch_bounds__(512) add_rmsnorm_##TAG##_vec(NORM_ARGS(T)) {                 \
    add_rmsnorm<T, true>(x, res, w, y, r, rows, hidden, eps_of(eps));                                    \
  }                                                                                                      \
  extern "C" __global__ void __launch_bounds__(512) add_rmsnorm_##TAG##_scalar(NORM_ARGS(T)) {              \
    add_rmsnorm<T, false>(x, res, w, y, r, rows, hidden, eps_of(eps));                                   \
  }

INSTANTIATE_NORM(float, f32)
INSTANTIATE_NORM(__half, f16)
INSTANTIATE_NORM(__nv_bfloat16, bf16)
