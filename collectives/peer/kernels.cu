// The collectives' kernels over peer memory (see collectives/peer/__init__.py): one shot, the
// low-latency words, two shot, reduce-scatter, all-gather and the copy-engine path.
//
// Compiled after peer.cuh (collectives/peer/_launch.py), whose note describes the protocol every
// call follows and whose context, flags, barrier and packs these kernels use.

// All-reduce, one shot: push the whole input into every peer's slot `rank`; reduce all slots.
// Slots are `slot` elements apart.
template <typename T, bool VEC>
__device__ void one_shot(const Ctx& c, const T* in, T* out, long n, long slot) {
  u32 e;
  if (!begin(c, &e)) return;
  long lo, hi;
  share<T>(n, n, &lo, &hi);
  for (int d = 1; d < c.world; ++d) {
    const int p = (c.rank + d) % c.world;
    copy_range<T, VEC>(slots_of<T>(c, p, e) + c.rank * slot, in, lo, hi);
  }
  if (!barrier(c.flags, c.rank, c.world, STAGE_READY, e, c.timeout_ns, c.err, c.err_dev)) return;
  const T* mine = slots_of<T>(c, c.rank, e);
  const T* srcs[MAX_RANKS];
  for (int q = 0; q < c.world; ++q) srcs[q] = q == c.rank ? in : mine + q * slot;
  reduce_range<T, VEC>(out, srcs, c.world, nullptr, 0, lo, hi);
  end(c);
}

// ---- low-latency words (their store, load and area: peer.cuh) ----------------------------------

// Word i of a `bytes`-long message (4-byte aligned; the last word may hold 2 bytes).
__device__ __forceinline__ u32 word_of(const void* src, long i, long bytes) {
  if (4 * i + 4 <= bytes) return reinterpret_cast<const u32*>(src)[i];
  return reinterpret_cast<const unsigned short*>(src)[2 * i];
}

__device__ __forceinline__ void put_word(void* dst, long i, long bytes, u32 v) {
  if (4 * i + 4 <= bytes) reinterpret_cast<u32*>(dst)[i] = v;
  else reinterpret_cast<unsigned short*>(dst)[2 * i] = (unsigned short)v;
}

// out's word i = the sum over ranks, in rank order, of word i: mine from `own`, each peer q's
// from my slots (`stride` words apart) once it carries `e`. False on timeout.
template <typename T>
__device__ __forceinline__ bool sum_word(const Ctx& c, const void* own, const u64* mine, long stride, long i,
                                         long bytes, u32 e, void* out) {
  const int per = 4 / (int)sizeof(T);  // elements per word
  float acc[2] = {0.f, 0.f};
  for (int q = 0; q < c.world; ++q) {
    u32 d;
    if (q == c.rank) d = word_of(own, i, bytes);
    else if (!ld_ll(c, mine + q * stride + i, e, q, &d)) return false;
    const T* x = reinterpret_cast<const T*>(&d);
    for (int k = 0; k < per; ++k) acc[k] += to_f(x[k]);
  }
  u32 o = 0;
  T* oe = reinterpret_cast<T*>(&o);
  for (int k = 0; k < per; ++k) oe[k] = from_f<T>(acc[k]);
  put_word(out, i, bytes, o);
  return true;
}

// Sums in low-latency words, for the one-shot all-reduce (stride 0: every peer gets the whole
// input) and the reduce-scatter (`in` holds world shards of n elements, `stride` apart, and
// peer p gets shard p): push each word into the peer's slot `rank` (slots `slot_words` words
// apart); sum my part's words over the ranks, in rank order, into `out`. `in` and `out` are
// 4-byte aligned; a thread handles the same words in both loops, so in-place calls are safe.
template <typename T>
__device__ void sum_ll(const Ctx& c, const T* in, T* out, long n, long stride, long slot_words) {
  u32 e;
  if (!begin(c, &e)) return;
  const int r = c.rank, w = c.world;
  const long bytes = n * (long)sizeof(T), words = (bytes + 3) / 4;
  const long tid = (long)blockIdx.x * blockDim.x + threadIdx.x, nt = (long)gridDim.x * blockDim.x;
  for (long i = tid; i < words; i += nt)
    for (int k = 1; k < w; ++k) {
      const int p = (r + k) % w;
      st_ll(ll_slots(c, p, e) + r * slot_words + i, word_of(in + p * stride, i, bytes), e);
    }
  const u64* mine = ll_slots(c, r, e);
  for (long i = tid; i < words; i += nt)
    if (!sum_word<T>(c, in + r * stride, mine, slot_words, i, bytes, e, out)) return;
  end(c);
}

// All-gather in low-latency words: `in` has m elements; `out` gets world shards of m, `stride`
// apart. Push my words into every peer's slot `rank`; copy mine and the peers' words out.
template <typename T>
__device__ void all_gather_ll(const Ctx& c, const T* in, T* out, long m, long stride) {
  u32 e;
  if (!begin(c, &e)) return;
  const int r = c.rank, w = c.world;
  const long bytes = m * (long)sizeof(T), words = (bytes + 3) / 4;
  const long tid = (long)blockIdx.x * blockDim.x + threadIdx.x, nt = (long)gridDim.x * blockDim.x;
  for (long i = tid; i < words; i += nt) {
    const u32 d = word_of(in, i, bytes);
    for (int k = 1; k < w; ++k) st_ll(ll_slots(c, (r + k) % w, e) + r * words + i, d, e);
    put_word(out + r * stride, i, bytes, d);
  }
  const u64* mine = ll_slots(c, r, e);
  for (long i = tid; i < words; i += nt)
    for (int k = 1; k < w; ++k) {
      const int q = (r + k) % w;
      u32 d;
      if (!ld_ll(c, mine + q * words + i, e, q, &d)) return;
      put_word(out + q * stride, i, bytes, d);
    }
  end(c);
}

// All-reduce, two shots: shard s is [s*S, s*S + len_s). Push shard p of the input into p's
// reduce slot `rank`; reduce my shard, write it to `out` and push it into every peer's gather
// slot `rank`; copy the peers' reduced shards out of my gather slots.
// Reduce slot q at q*S, gather slot q at (world + q)*S.
template <typename T, bool VEC>
__device__ void two_shot(const Ctx& c, const T* in, T* out, long n, long S) {
  u32 e;
  if (!begin(c, &e)) return;
  const int r = c.rank, w = c.world;
  T* mine = slots_of<T>(c, r, e);
  auto len_of = [&](int s) { return max(0L, min(S, n - s * S)); };
  long lo, hi;
  for (int d = 1; d < w; ++d) {
    const int p = (r + d) % w;
    share<T>(S, len_of(p), &lo, &hi);
    copy_range<T, VEC>(slots_of<T>(c, p, e) + r * S, in + p * S, lo, hi);
  }
  if (!barrier(c.flags, r, w, STAGE_READY, e, c.timeout_ns, c.err, c.err_dev)) return;
  share<T>(S, len_of(r), &lo, &hi);
  const T* srcs[MAX_RANKS];
  T* also[MAX_RANKS];
  int n_also = 0;
  for (int q = 0; q < w; ++q) srcs[q] = q == r ? in + r * S : mine + q * S;
  for (int d = 1; d < w; ++d) also[n_also++] = slots_of<T>(c, (r + d) % w, e) + (w + r) * S;
  reduce_range<T, VEC>(out + r * S, srcs, w, also, n_also, lo, hi);
  if (!barrier(c.flags, r, w, STAGE_REDUCED, e, c.timeout_ns, c.err, c.err_dev)) return;
  for (int d = 1; d < w; ++d) {
    const int p = (r + d) % w;
    share<T>(S, len_of(p), &lo, &hi);
    copy_range<T, VEC>(out + p * S, mine + (w + p) * S, lo, hi);
  }
  end(c);
}

// This block's share [lo, hi) of `src(p)` pushed into every peer p's slot `rank` (slots m apart).
template <typename T, bool VEC, typename Src>
__device__ __forceinline__ void push_shards(const Ctx& c, u32 e, long m, long lo, long hi, Src src) {
  for (int d = 1; d < c.world; ++d) {
    const int p = (c.rank + d) % c.world;
    copy_range<T, VEC>(slots_of<T>(c, p, e) + c.rank * m, src(p), lo, hi);
  }
}

// Reduce-scatter: `in` holds world shards of m elements, `in_stride` apart; rank r's result
// (m elements) goes to `out`. Push shard p into p's slot `rank` (slots m apart); reduce.
template <typename T, bool VEC>
__device__ void reduce_scatter(const Ctx& c, const T* in, T* out, long m, long in_stride) {
  u32 e;
  if (!begin(c, &e)) return;
  const int r = c.rank, w = c.world;
  long lo, hi;
  share<T>(m, m, &lo, &hi);
  push_shards<T, VEC>(c, e, m, lo, hi, [&](int p) { return in + p * in_stride; });
  if (!barrier(c.flags, r, w, STAGE_READY, e, c.timeout_ns, c.err, c.err_dev)) return;
  const T* mine = slots_of<T>(c, r, e);
  const T* srcs[MAX_RANKS];
  for (int q = 0; q < w; ++q) srcs[q] = q == r ? in + r * in_stride : mine + q * m;
  reduce_range<T, VEC>(out, srcs, w, nullptr, 0, lo, hi);
  end(c);
}

// All-gather: `in` has m elements; `out` gets world shards of m, `out_stride` apart. Push into
// every peer's slot `rank` (slots m apart); copy mine and the peers' slots out.
template <typename T, bool VEC>
__device__ void all_gather(const Ctx& c, const T* in, T* out, long m, long out_stride) {
  u32 e;
  if (!begin(c, &e)) return;
  const int r = c.rank, w = c.world;
  long lo, hi;
  share<T>(m, m, &lo, &hi);
  push_shards<T, VEC>(c, e, m, lo, hi, [&](int) { return in; });
  copy_range<T, VEC>(out + r * out_stride, in, lo, hi);
  if (!barrier(c.flags, r, w, STAGE_READY, e, c.timeout_ns, c.err, c.err_dev)) return;
  const T* mine = slots_of<T>(c, r, e);
  for (int d = 1; d < w; ++d) {
    const int p = (r + d) % w;
    copy_range<T, VEC>(out + p * out_stride, mine + p * m, lo, hi);
  }
  end(c);
}

// Entry points: the context is passed by value (it sits in the launch's parameter bank, no
// memory load before the first push), then four plain arguments.
// ---- copy-engine path -------------------------------------------------------------------------
//
// Large all-reduces move their bytes with cudaMemcpyAsync (the copy engines, no SMs) and use SMs
// only to reduce. A call is bracketed by two barrier calls (ce_fence: open, then clear and close)
// and split into chunks that cycle through `R` ring slots of each rank's slot buffer:
//
//   copy stream:    push chunk j's shards into the peers' ring slot j%R  ->  flag PUSHED
//   compute stream: ce_reduce(j): wait PUSHED(j) [and PULLED(j-R)], reduce my shard into `out`
//                   and into my ring slot's result area  ->  flag REDUCED (last block)
//   copy stream:    wait REDUCED(j); pull each peer's reduced shard into `out`  ->  flag PULLED
//
// Copy-engine flags hold the use count of their ring slot within the call (j / R + 1), which the
// host knows, so the copy streams signal and wait with stream memory operations (no kernel beside
// the compute stream's; the host's section watchdog bounds those waits) and CUDA graphs replay the
// same values; the closing ce_fence clears this rank's copy-engine flags once every peer has
// finished.

// Threads t < world, t != rank, wait until my copy-engine flag (slot, stage, t) >= v.
__device__ bool ce_wait_all(const Ctx& c, int slot, int stage, u32 v, int only = -1) {
  int failed = 0;
  const int t = threadIdx.x;
  if (t < c.world && t != c.rank && (only < 0 || t == only)) {
    const u32* f = ce_flag(c.flags.p[c.rank], slot, stage, t);
    const u64 start = global_ns();
    while ((int)(ld_acquire_sys(f) - v) < 0) {
      if (global_ns() - start > c.timeout_ns) {
        report_timeout(c.err, c.err_dev, 10 + stage, t);
        failed = 1;
        break;
      }
    }
  }
  return __syncthreads_or(failed) == 0;
}

// A one-block barrier of every rank. `mode` bits: 1, zero this rank's copy-engine flags afterwards
// (every peer has signalled its last one before arriving here); 2, it opens a copy-engine section;
// 4, it closes one. Sections opened and closed are counted here and shown to the host's watchdog
// (err[4], err[5]), which bounds the sections' stream waits (collectives/peer/_watchdog.py);
// graph replays count too. A plain barrier (no 2 or 4) is no section boundary.
extern "C" __global__ void ce_fence(const Ctx c, long mode) {
  u32 e;
  if (!begin(c, &e)) return;
  if (!barrier(c.flags, c.rank, c.world, STAGE_READY, e, c.timeout_ns, c.err, c.err_dev)) return;
  if (mode & 1) {
    u32* f = ce_flag(c.flags.p[c.rank], 0, 0, 0);
    for (int i = threadIdx.x; i < CE_RING * CE_STAGES * MAX_RANKS; i += blockDim.x) f[i] = 0;
    __threadfence_system();
  }
  if (threadIdx.x == 0 && (mode & 6)) {
    const int k = (mode & 4) ? 1 : 0;
    const u32 n = c.calls[3 + k] + 1;
    c.calls[3 + k] = n;
    reinterpret_cast<volatile int*>(c.err)[4 + k] = (int)n;
  }
  end(c);
}

// One block: wait until every peer's flag (slot, stage) >= v (a compute stream's bounded wait;
// the copy streams wait with stream memory operations instead).
extern "C" __global__ void ce_wait(const Ctx c, long slot, long stage, long v) {
  if (*(volatile int*)c.err_dev) return;
  ce_wait_all(c, (int)slot, (int)stage, (u32)v);
}

// The same for one peer's flag: source rank q's.
extern "C" __global__ void ce_wait_from(const Ctx c, long slot, long stage, long v, long q) {
  if (*(volatile int*)c.err_dev) return;
  ce_wait_all(c, (int)slot, (int)stage, (u32)v, (int)q);
}

// The last block of a copy-engine reduction to finish tells every peer that ring slot s's use u
// is reduced (REDUCED = u + 1).
__device__ __forceinline__ void signal_reduced(const Ctx& c, int s, u32 u) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    if (atomicAdd(c.calls + 2, 1u) == gridDim.x - 1) {
      c.calls[2] = 0;
      __threadfence_system();
      for (int d = 1; d < c.world; ++d)
        st_release_sys(ce_flag(c.flags.p[(c.rank + d) % c.world], s, CE_REDUCED, c.rank), u + 1);
    }
  }
}

// Reduce chunk j (ring slot s = j % R, use u = j / R). `in`/`out` point at the chunk; shard q is
// [q*S, q*S + len_q) of its `nj` elements; my ring slot starts `slot_off` elements into my slot
// buffer: the peers' pushes at slot_off + q*S_max, my result at slot_off + world*S_max.
template <typename T, bool VEC>
__device__ void ce_reduce(const Ctx& c, const T* in, T* out, long slot_off, long S, long nj, long j, long R,
                          long S_max) {
  if (*(volatile int*)c.err_dev) return;
  const int r = c.rank, w = c.world;
  const int s = (int)(j % R);
  const u32 u = (u32)(j / R);
  if (!ce_wait_all(c, s, CE_PUSHED, u + 1)) return;
  if (u > 0 && !ce_wait_all(c, s, CE_PULLED, u)) return;  // the peers have pulled this slot's last result
  T* mine = reinterpret_cast<T*>(c.slots.p[r]) + slot_off;
  const long len = max(0L, min(S, nj - r * S));
  long lo, hi;
  share<T>(S, len, &lo, &hi);
  const T* srcs[MAX_RANKS];
  for (int q = 0; q < w; ++q) srcs[q] = q == r ? in + r * S : mine + q * S_max;
  T* res = mine + w * S_max;
  T* also[1] = {out + r * S};
  reduce_range<T, VEC>(res, srcs, w, also, 1, lo, hi);
  signal_reduced(c, s, u);
}

// Reduce-scatter by copy engines, chunk j (ring slot s = j % R, use u = j / R): the peers have
// pushed their part of my shard's chunk (`nj` elements) into my ring slot, source q's at
// slot_off + q*C; out = the sum over ranks (mine from `in`). No result area: nobody pulls; the
// last block tells the peers that the slot is free again (REDUCED), which their next push of
// this slot waits for.
template <typename T, bool VEC>
__device__ void ce_reduce_rs(const Ctx& c, const T* in, T* out, long slot_off, long C, long nj, long j, long R) {
  if (*(volatile int*)c.err_dev) return;
  const int r = c.rank, w = c.world;
  const int s = (int)(j % R);
  const u32 u = (u32)(j / R);
  if (!ce_wait_all(c, s, CE_PUSHED, u + 1)) return;
  const T* mine = reinterpret_cast<const T*>(c.slots.p[r]) + slot_off;
  long lo, hi;
  share<T>(nj, nj, &lo, &hi);
  const T* srcs[MAX_RANKS];
  for (int q = 0; q < w; ++q) srcs[q] = q == r ? in : mine + q * C;
  reduce_range<T, VEC>(out, srcs, w, nullptr, 0, lo, hi);
  signal_reduced(c, s, u);
}

#define INSTANTIATE(NAME, T, TAG)                                                                  \
  extern "C" __global__ void __launch_bounds__(512)                                               \
      NAME##_##TAG##_vec(const Ctx c, const T* in, T* out, long a, long b) {                       \
    NAME<T, true>(c, in, out, a, b);                                                              \
  }                                                                                               \
  extern "C" __global__ void __launch_bounds__(512)                                               \
      NAME##_##TAG##_scalar(const Ctx c, const T* in, T* out, long a, long b) {                    \
    NAME<T, false>(c, in, out, a, b);                                                             \
  }

#define ALL_DTYPES(NAME)                  \
  INSTANTIATE(NAME, float, f32)           \
  INSTANTIATE(NAME, __half, f16)          \
  INSTANTIATE(NAME, __nv_bfloat16, bf16)

ALL_DTYPES(one_shot)

#define INSTANTIATE_LL(T, TAG)                                                                         \
  extern "C" __global__ void __launch_bounds__(512)                                                   \
      one_shot_ll_##TAG##_vec(const Ctx c, const T* in, T* out, long n, long slot_words) {              \
    sum_ll<T>(c, in, out, n, 0, slot_words);                                                          \
  }                                                                                                   \
  extern "C" __global__ void __launch_bounds__(512)                                                   \
      reduce_scatter_ll_##TAG##_vec(const Ctx c, const T* in, T* out, long m, long stride) {           \
    sum_ll<T>(c, in, out, m, stride, (m * (long)sizeof(T) + 3) / 4);                                  \
  }                                                                                                   \
  extern "C" __global__ void __launch_bounds__(512)                                                   \
      all_gather_ll_##TAG##_vec(const Ctx c, const T* in, T* out, long m, long stride) {               \
    all_gather_ll<T>(c, in, out, m, stride);                                                          \
  }

INSTANTIATE_LL(float, f32)
INSTANTIATE_LL(__half, f16)
INSTANTIATE_LL(__nv_bfloat16, bf16)
ALL_DTYPES(two_shot)
ALL_DTYPES(reduce_scatter)
ALL_DTYPES(all_gather)

#define INSTANTIATE_CE(T, TAG)                                                                       \
  extern "C" __global__ void __launch_bounds__(512) ce_reduce_##TAG##_vec(                          \
      const Ctx c, const T* in, T* out, long slot_off, long S, long nj, long j, long R, long S_max) { \
    ce_reduce<T, true>(c, in, out, slot_off, S, nj, j, R, S_max);                                   \
  }                                                                                                 \
  extern "C" __global__ void __launch_bounds__(512) ce_reduce_##TAG##_scalar(                       \
      const Ctx c, const T* in, T* out, long slot_off, long S, long nj, long j, long R, long S_max) { \
    ce_reduce<T, false>(c, in, out, slot_off, S, nj, j, R, S_max);                                  \
  }

#define INSTANTIATE_CE_RS(T, TAG)                                                                    \
  extern "C" __global__ void __launch_bounds__(512) ce_reduce_rs_##TAG##_vec(                       \
      const Ctx c, const T* in, T* out, long slot_off, long C, long nj, long j, long R) {           \
    ce_reduce_rs<T, true>(c, in, out, slot_off, C, nj, j, R);                                      \
  }                                                                                                 \
  extern "C" __global__ void __launch_bounds__(512) ce_reduce_rs_##TAG##_scalar(                    \
      const Ctx c, const T* in, T* out, long slot_off, long C, long nj, long j, long R) {           \
    ce_reduce_rs<T, false>(c, in, out, slot_off, C, nj, j, R);                                     \
  }

INSTANTIATE_CE_RS(float, f32)
INSTANTIATE_CE_RS(__half, f16)
INSTANTIATE_CE_RS(__nv_bfloat16, bf16)

INSTANTIATE_CE(float, f32)
INSTANTIATE_CE(__half, f16)
INSTANTIATE_CE(__nv_bfloat16, bf16)
