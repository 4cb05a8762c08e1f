// What every peer-memory kernel module shares: the types, the flags and the bounded barrier,
// element packs, the context (`struct Ctx`), a call's begin and end, and the low-latency words.
//
// collectives/peer/_launch.py compiles this text in front of each source, the two concatenated
// (it is not #included): collectives/peer/kernels.cu (the collectives), and a source of code
// outside collectives/peer that ships its own kernels against the same context
// (overlap/moe/rows.cu, the MoE row kernels; overlap/norm.cu, the fused all-reduce + RMSNorm).
// Each source is one compiled module.
//
// The protocol (see collectives/peer/__init__.py). Every rank owns one IPC buffer of slots, where
// peers push data, in two halves ("sets"), and one flag area; both are mapped into every other
// rank. A call is one kernel launch with the same grid on every rank; block b of rank r only ever
// waits for block b of its peers, so blocks never wait on each other inside one GPU.
//
//   rank r, block b                              rank p, block b
//   push my data into p's set (e % 2)  --------> (lands in p's slot r)
//   fence.sys; flag[p][b][stage][r] = e -------> p waits until its flag[b][stage][r] >= e
//   wait until my flag[b][stage][p] >= e <------ p signals the same way
//   reduce / copy out of my own set (e % 2)
//
// `e` is the call's number, kept in device memory (calls[0], advanced by the last block to finish
// a call), so that every block of a call agrees on it and CUDA graphs replay correctly (nothing is
// baked into the graph). Flags only grow; a wait compares with wrap-around arithmetic.
//
// Why two sets and no "done" barrier: when a rank starts call e, each peer has finished call
// e - 2 entirely (the peer signalled in call e - 1, and a kernel starts only after the stream's
// previous kernel has ended), so nobody still reads the set that call e writes. Call e - 1 used
// the other set.
//
// Every wait is bounded by `timeout_ns` of %globaltimer: on expiry the block records (stage,
// block, peer) in the host-mapped error word and returns; later launches see the error and
// return at once, and the host raises.
//
// Data written by a peer is read with ld.global.cg (L2, never a stale L1 line); data pushed into
// a peer's memory is written with st.global.cg.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define MAX_RANKS 8
#define MAX_BLOCKS 128
#define N_STAGES 2
#define STAGE_READY 0
#define STAGE_REDUCED 1

struct Ptrs {
  char* p[MAX_RANKS];
};

typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u32 ld_acquire_sys(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(u32* p, u32 v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys(u32* p, u32 v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ u64 global_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ u32* flag_at(char* base, int block, int stage, int src) {
  return reinterpret_cast<u32*>(base) + (block * N_STAGES + stage) * MAX_RANKS + src;
}

// err[0]: 0 while healthy, else 1 (timeout); err[1..3]: stage, block, the peer waited for.
// `err` is host-mapped (the host reads it without synchronising); `err_dev` is the device copy
// that later launches check.
__device__ void report_timeout(volatile int* err, volatile int* err_dev, int stage, int peer) {
  if (atomicCAS(const_cast<int*>(err_dev), 0, 1) == 0) {
    err[1] = stage;
    err[2] = blockIdx.x;
    err[3] = peer;
    __threadfence_system();
    err[0] = 1;
    __threadfence_system();
  }
}

// Block-wide: signal `stage` with epoch `e` to every peer, then wait for theirs.
// Returns false (on every thread of the block) when a wait timed out.
__device__ bool barrier(const Ptrs& flags, int rank, int world, int stage, u32 e, u64 timeout_ns,
                        volatile int* err, volatile int* err_dev) {
  int failed = 0;
  __syncthreads();  // every thread's pushes are issued before the flag
  const int t = threadIdx.x;
  if (t < world && t != rank) {
    __threadfence_system();  // the block's pushes (ordered before by the barrier) before the flag
    st_relaxed_sys(flag_at(flags.p[t], blockIdx.x, stage, rank), e);
    const u32* mine = flag_at(flags.p[rank], blockIdx.x, stage, t);
    const u64 start = global_ns();
    while ((int)(ld_acquire_sys(mine) - e) < 0) {
      if (global_ns() - start > timeout_ns) {
        report_timeout(err, err_dev, stage, t);
        failed = 1;
        break;
      }
    }
  }
  return __syncthreads_or(failed) == 0;  // a barrier too: no shared flag to reset between calls
}

// ---- element packs: 16 bytes moved at a time, reduced in fp32 ----------------------------------

template <typename T> struct Pack;
template <> struct Pack<float> { static const int N = 4; };
template <> struct Pack<__half> { static const int N = 8; };
template <> struct Pack<__nv_bfloat16> { static const int N = 8; };

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// One pack's elements summed in fp32 (weights optional), then rounded once: the reducing kernels'
// inner step. A weight of 1 adds exactly (1 * x is x, fused or not).
template <typename T> struct PackSum {
  float v[8];
  __device__ __forceinline__ PackSum() {
#pragma unroll
    for (int k = 0; k < Pack<T>::N; ++k) v[k] = 0.f;
  }
  __device__ __forceinline__ void add(const uint4& x, float w = 1.f) {
    const T* e = reinterpret_cast<const T*>(&x);
#pragma unroll
    for (int k = 0; k < Pack<T>::N; ++k) v[k] += w * to_f(e[k]);
  }
  __device__ __forceinline__ uint4 packed() const {
    uint4 r;
    T* re = reinterpret_cast<T*>(&r);
#pragma unroll
    for (int k = 0; k < Pack<T>::N; ++k) re[k] = from_f<T>(v[k]);
    return r;
  }
};

// Copy [lo, hi) elements src -> dst; `cg` reads/writes bypass L1 (peer-visible data). Four packs
// per thread are loaded before any is stored, so that enough bytes are in flight to fill NVLink.
template <typename T, bool VEC>
__device__ __forceinline__ void copy_range(T* dst, const T* src, long lo, long hi) {
  const int N = Pack<T>::N;
  long i = lo;
  if (VEC) {
    const long vhi = lo + (hi - lo) / N * N;
    const long step = (long)blockDim.x * N;
    i = lo + (long)threadIdx.x * N;
    for (; i + 3 * step < vhi; i += 4 * step) {
      const uint4 a = __ldcg(reinterpret_cast<const uint4*>(src + i));
      const uint4 b = __ldcg(reinterpret_cast<const uint4*>(src + i + step));
      const uint4 c = __ldcg(reinterpret_cast<const uint4*>(src + i + 2 * step));
      const uint4 d = __ldcg(reinterpret_cast<const uint4*>(src + i + 3 * step));
      __stcg(reinterpret_cast<uint4*>(dst + i), a);
      __stcg(reinterpret_cast<uint4*>(dst + i + step), b);
      __stcg(reinterpret_cast<uint4*>(dst + i + 2 * step), c);
      __stcg(reinterpret_cast<uint4*>(dst + i + 3 * step), d);
    }
    for (; i < vhi; i += step)
      __stcg(reinterpret_cast<uint4*>(dst + i), __ldcg(reinterpret_cast<const uint4*>(src + i)));
    i = vhi;
  }
  for (long j = i + threadIdx.x; j < hi; j += blockDim.x) dst[j] = src[j];
}

// out[i] = sum over q of srcs[q][i] (q in rank order, so every rank computes the same bits),
// also written to each of `also` (pushed results), for i in [lo, hi).
template <typename T, bool VEC>
__device__ __forceinline__ void reduce_range(T* out, const T* const* srcs, int world, T* const* also, int n_also,
                                             long lo, long hi) {
  const int N = Pack<T>::N;
  long i = lo;
  if (VEC) {
    const long vhi = lo + (hi - lo) / N * N;
    for (i = lo + (long)threadIdx.x * N; i < vhi; i += (long)blockDim.x * N) {
      PackSum<T> acc;
      for (int q = 0; q < world; ++q) acc.add(__ldcg(reinterpret_cast<const uint4*>(srcs[q] + i)));
      const uint4 o = acc.packed();
      *reinterpret_cast<uint4*>(out + i) = o;
      for (int a = 0; a < n_also; ++a) __stcg(reinterpret_cast<uint4*>(also[a] + i), o);
    }
    i = vhi;
  }
  for (long j = i + threadIdx.x; j < hi; j += blockDim.x) {
    float acc = to_f(srcs[0][j]);
    for (int q = 1; q < world; ++q) acc += to_f(srcs[q][j]);
    const T r = from_f<T>(acc);
    out[j] = r;
    for (int a = 0; a < n_also; ++a) also[a][j] = r;
  }
}

// This block's share [lo, hi) of a range of `len` elements; shares are whole packs, and the same
// on every rank and for every shard of one call (they depend on `span`, the longest shard).
template <typename T>
__device__ __forceinline__ void share(long span, long len, long* lo, long* hi) {
  const int N = Pack<T>::N;
  long per = (span + gridDim.x - 1) / gridDim.x;
  per = (per + N - 1) / N * N;
  *lo = min(len, per * (long)blockIdx.x);
  *hi = min(len, *lo + per);
}

struct Ctx {
  Ptrs slots;     // every rank's slot buffer (two sets of `set_bytes`)
  Ptrs flags;     // every rank's flag area (block flags, then copy-engine flags)
  u32* calls;     // this rank's [call number, blocks finished in this call, reduce blocks finished,
                  //  copy-engine sections opened, closed]
  int* err;       // host-mapped [failed, stage, block, peer, sections opened, closed, -, -]
  int* err_dev;   // device error word
  int rank;
  int world;
  u64 timeout_ns;
  u64 set_bytes;     // bytes of one set of slots
  u64 ll_off;        // the low-latency words' area in every rank's flag allocation (two sets)
  u64 ll_set_bytes;  // bytes of one set of it
};

// The call's number; false (on every thread) if an earlier call failed.
__device__ __forceinline__ bool begin(const Ctx& c, u32* e) {
  __shared__ u32 epoch;
  __shared__ int healthy;
  if (threadIdx.x == 0) {
    epoch = *(volatile u32*)c.calls + 1;
    healthy = *(volatile int*)c.err_dev == 0;
  }
  __syncthreads();
  *e = epoch;
  return healthy != 0;
}

// The last block to finish advances the call number (every block read it in begin()).
__device__ __forceinline__ void end(const Ctx& c) {
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(c.calls + 1, 1u) == gridDim.x - 1) {
      c.calls[1] = 0;
      c.calls[0] += 1;
      __threadfence();
    }
  }
}

// Rank q's set of slots for call e.
template <typename T>
__device__ __forceinline__ T* slots_of(const Ctx& c, int q, u32 e) {
  return reinterpret_cast<T*>(c.slots.p[q] + (e & 1u) * c.set_bytes);
}

// ---- the copy-engine flags: after the block flags in every rank's flag area ---------------------
//
// Ring slot, stage and source rank, as collectives/peer/_layout.py lays them out on the host; what
// they mean is kernels.cu's ("copy-engine path").

#define CE_RING 16
#define CE_STAGES 3
#define CE_PUSHED 0
#define CE_REDUCED 1
#define CE_PULLED 2
#define BLOCK_FLAG_WORDS (MAX_BLOCKS * N_STAGES * MAX_RANKS)

__device__ __forceinline__ u32* ce_flag(char* base, int slot, int stage, int src) {
  return reinterpret_cast<u32*>(base) + BLOCK_FLAG_WORDS + (slot * CE_STAGES + stage) * MAX_RANKS + src;
}

// ---- low-latency words: 4 bytes of data and the call's number in one 8-byte store -------------
//
// For small messages the flag round trip of `barrier` (a system fence, a flag, a wait) is most of
// a call. Here every 4 data bytes travel with the call's number e in one 8-byte store (single-copy
// atomic), and the reader spins on each word until it carries e: no fence, no separate flag.
// The words have an area of their own (after the flags, two sets as for the slots), which no
// other path writes: words of call e - 2 in the same set carry e - 2 and are never taken for
// e's, while raw data there (a slot buffer's) could carry any number. Each wait is bounded like
// a barrier's (stage 2).

#define STAGE_LL 2

__device__ __forceinline__ void st_ll(u64* p, u32 data, u32 e) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(((u64)e << 32) | data) : "memory");
}

__device__ __forceinline__ u64 ld_relaxed_sys64(const u64* p) {
  u64 v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Rank q's set of low-latency words for call e.
__device__ __forceinline__ u64* ll_slots(const Ctx& c, int q, u32 e) {
  return reinterpret_cast<u64*>(c.flags.p[q] + c.ll_off + (e & 1u) * c.ll_set_bytes);
}

// The data of word `p` once it carries `e`; false (recorded) on timeout.
__device__ __forceinline__ bool ld_ll(const Ctx& c, const u64* p, u32 e, int peer, u32* data) {
  u64 v = ld_relaxed_sys64(p);
  if ((u32)(v >> 32) != e) {
    const u64 start = global_ns();
    do {
      if (global_ns() - start > c.timeout_ns) {
        report_timeout(c.err, c.err_dev, STAGE_LL, peer);
        return false;
      }
      v = ld_relaxed_sys64(p);
    } while ((u32)(v >> 32) != e);
  }
  *data = (u32)v;
  return true;
}
