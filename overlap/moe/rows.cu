// The MoE row kernels of overlap/moe/ (peer_kernels.py, peer_rows.py, pipeline.py): indexed row copies and weighted row sums between
// the ranks' slot buffers, and the routing laid out on the device.
//
// Compiled after collectives/peer/peer.cuh (collectives/peer/_launch.py: the two texts
// concatenated, one module of their own), whose context (`struct Ctx`) and packs they use; the
// host asks for them with PeerMemory.kernel(..., source=<this file>).

// ---- rows: indexed row copies and weighted row sums between ranks' slot buffers ----------------
//
// For expert-parallel dispatch and combine (overlap/moe/ (peer_kernels.py, peer_rows.py, pipeline.py)). A row is `row` elements; one
// warp handles one item at a time (warp w of the grid takes items w, w + warps, ...), its lanes
// striding over the row's 16-byte packs. None of these kernels waits: the caller orders them
// between ce_fence barriers, and they do nothing once a wait has failed (err_dev set).
//
//   rows_gather  (dispatch): item i reads row src[2i+1] of rank src[2i]'s slot buffer (rows from
//                `off` bytes in) once and writes it to rows dst[ptr[i] .. ptr[i+1]) of `out`: a
//                token bound for several experts of one rank crosses the link once.
//   rows_partial (combine, on the experts' rank): item i writes, into this rank's slot buffer at
//                row item[2i+1] (rows from `p_off` bytes in), the sum over its entries e of
//                weight x rows[ent[2e]], the weight being float ent[2e+1] of rank item[2i]'s
//                slot buffer at `w_off` bytes: one partial row per (token, rank) crosses back.
//   rows_sum     (combine, on the tokens' rank): out[i] = sum over entries e of row ent[2e+1] of
//                rank ent[2e]'s slot buffer (from `p_off`), in entry order; zeros if none.
// Sums are taken in fp32 and rounded once.

#define WARP 32
#define ROWS_UNROLL 4

__device__ __forceinline__ long warp_id() { return ((long)blockIdx.x * blockDim.x + threadIdx.x) / WARP; }
__device__ __forceinline__ long n_warps() { return (long)gridDim.x * blockDim.x / WARP; }

template <typename T, bool VEC>
__device__ void rows_gather(const Ctx& c, const long* src, const long* ptr, const long* dst, T* out, long n,
                            long row, long off) {
  if (*(volatile int*)c.err_dev) return;
  const int lane = threadIdx.x % WARP;
  for (long i = warp_id(); i < n; i += n_warps()) {
    const T* s = reinterpret_cast<const T*>(c.slots.p[src[2 * i]] + off) + src[2 * i + 1] * row;
    const long a = ptr[i], b = ptr[i + 1];
    if (VEC) {
      const long packs = row / Pack<T>::N;
      const uint4* sv = reinterpret_cast<const uint4*>(s);
      for (long v = lane; v < packs; v += ROWS_UNROLL * WARP) {
        uint4 x[ROWS_UNROLL];
#pragma unroll
        for (int u = 0; u < ROWS_UNROLL; ++u)
          if (v + u * WARP < packs) x[u] = __ldcg(sv + v + u * WARP);
        for (long d = a; d < b; ++d) {
          uint4* o = reinterpret_cast<uint4*>(out + dst[d] * row);
#pragma unroll
          for (int u = 0; u < ROWS_UNROLL; ++u)
            if (v + u * WARP < packs) o[v + u * WARP] = x[u];
        }
      }
    } else {
      for (long j = lane; j < row; j += WARP) {
        const T x = s[j];
        for (long d = a; d < b; ++d) out[dst[d] * row + j] = x;
      }
    }
  }
}

template <typename T, bool VEC>
__device__ void rows_partial(const Ctx& c, const long* item, const long* ptr, const long* ent, const T* rows, long n,
                             long row, long p_off, long w_off) {
  if (*(volatile int*)c.err_dev) return;
  const int lane = threadIdx.x % WARP;
  const int N = Pack<T>::N;
  for (long i = warp_id(); i < n; i += n_warps()) {
    const float* wts = reinterpret_cast<const float*>(c.slots.p[item[2 * i]] + w_off);
    T* o = reinterpret_cast<T*>(c.slots.p[c.rank] + p_off) + item[2 * i + 1] * row;
    const long a = ptr[i], b = ptr[i + 1];
    // one lane per entry loads its weight (from the tokens' rank) once; each is then broadcast
    const long cnt = b - a;
    const float wl = lane < cnt ? __ldcg(wts + ent[2 * (a + lane) + 1]) : 0.f;
    if (VEC) {
      const long packs = row / N;
      for (long v0 = 0; v0 < packs; v0 += WARP) {  // every lane runs every round (the shuffles)
        const long v = v0 + lane;
        const bool live = v < packs;
        PackSum<T> acc;
        for (long e = 0; e < cnt; ++e) {
          // more entries than lanes (more than 32 local experts for one token): read directly
          const float we = cnt <= WARP ? __shfl_sync(0xffffffffu, wl, (int)e) : __ldcg(wts + ent[2 * (a + e) + 1]);
          if (live) acc.add(__ldg(reinterpret_cast<const uint4*>(rows + ent[2 * (a + e)] * row) + v), we);
        }
        if (live) __stcg(reinterpret_cast<uint4*>(o) + v, acc.packed());
      }
    } else {
      for (long j = lane; j < row; j += WARP) {
        float acc = 0.f;
        for (long e = a; e < b; ++e) acc += __ldcg(wts + ent[2 * e + 1]) * to_f(rows[ent[2 * e] * row + j]);
        o[j] = from_f<T>(acc);
      }
    }
  }
}

template <typename T, bool VEC>
__device__ void rows_sum(const Ctx& c, const long* ptr, const long* ent, T* out, long n, long row, long p_off) {
  if (*(volatile int*)c.err_dev) return;
  const int lane = threadIdx.x % WARP;
  const int N = Pack<T>::N;
  for (long i = warp_id(); i < n; i += n_warps()) {
    const long a = ptr[i], b = ptr[i + 1];
    T* o = out + i * row;
    if (VEC) {
      const long packs = row / N;
      for (long v = lane; v < packs; v += WARP) {
        PackSum<T> acc;
        for (long e = a; e < b; ++e) {
          const T* s = reinterpret_cast<const T*>(c.slots.p[ent[2 * e]] + p_off) + ent[2 * e + 1] * row;
          acc.add(__ldcg(reinterpret_cast<const uint4*>(s) + v));
        }
        reinterpret_cast<uint4*>(o)[v] = acc.packed();
      }
    } else {
      for (long j = lane; j < row; j += WARP) {
        float acc = 0.f;
        for (long e = a; e < b; ++e)
          acc += to_f((reinterpret_cast<const T*>(c.slots.p[ent[2 * e]] + p_off) + ent[2 * e + 1] * row)[j]);
        o[j] = from_f<T>(acc);
      }
    }
  }
}

#define INSTANTIATE_ROWS(T, TAG, VEC, KIND)                                                             \
  extern "C" __global__ void __launch_bounds__(512) rows_gather_##TAG##_##KIND(                         \
      const Ctx c, const long* src, const long* ptr, const long* dst, T* out, long n, long row, long off) { \
    rows_gather<T, VEC>(c, src, ptr, dst, out, n, row, off);                                            \
  }                                                                                                     \
  extern "C" __global__ void __launch_bounds__(512) rows_partial_##TAG##_##KIND(                        \
      const Ctx c, const long* item, const long* ptr, const long* ent, const T* rows, long n, long row,  \
      long p_off, long w_off) {                                                                         \
    rows_partial<T, VEC>(c, item, ptr, ent, rows, n, row, p_off, w_off);                                \
  }                                                                                                     \
  extern "C" __global__ void __launch_bounds__(512) rows_sum_##TAG##_##KIND(                            \
      const Ctx c, const long* ptr, const long* ent, T* out, long n, long row, long p_off) {             \
    rows_sum<T, VEC>(c, ptr, ent, out, n, row, p_off);                                                  \
  }

INSTANTIATE_ROWS(float, f32, true, vec)
INSTANTIATE_ROWS(float, f32, false, scalar)
INSTANTIATE_ROWS(__half, f16, true, vec)
INSTANTIATE_ROWS(__half, f16, false, scalar)
INSTANTIATE_ROWS(__nv_bfloat16, bf16, true, vec)
INSTANTIATE_ROWS(__nv_bfloat16, bf16, false, scalar)

// ---- rows, laid out on the device (dropless dispatch and combine without a host plan) ----------
//
// The same three moves as above, but the routing never visits the host: each rank copies its
// token count and expert ids (int32 [tokens, k]) into its own slot buffer at `i_off` (header of
// IDS_HEADER ints, then the ids), and after a barrier
//
//   rows_ids     copies every rank's ids into ids_all [W][t_max][k] here, with their token
//                counts, counts this rank's pairs bound for each rank (send), and counts each
//                tile of a source's tokens' pairs per local expert (a scratch table);
//   rows_layout  R[s][t][e] = the rank of token t among s's tokens that chose local expert e
//                (or -1), a block per (s, e, tile) starting from the tiles before it;
//                cnt[s][e] = their number.
//                info = [cnt (W * e_loc), tokens (W), send (W), bad range, bad repeat, then
//                from totals_at() each local expert's rows from all sources as int64]: the two
//                error words hold 1 + a rank whose ids are out of range, resp. repeat an expert
//                (else 0). info starts zeroed (rows_post does it, or the pipelined section).
//   recv_x row of (s, t, e) = base[e][s] + R[s][t][e], base being the exclusive prefix sum of
//   cnt in (local expert, source) order: recv_x is grouped by local expert, then source, then
//   token, as over the all-to-all. Each kernel below works this out per token from ids_all, R
//   and info; a warp handles one (source, token) at a time, and tokens without a pair here are
//   skipped at once.
//
// `ke` packs the layout: k (bits 0-7), the local expert count (bits 8-23), a source filter
// (bits 24-30: s + 1 where a kernel that takes one is to handle source s's tokens only; 0: all
// sources), the order of a compact layout (bit 31, below) and `cap` (bits 32-63). cap = 0:
// recv_x is compact (the row of (s, t, e) is base[e][s] + R[s][t][e], base the exclusive prefix
// sum of cnt in (local expert, source) order; with bit 31, in (source, local expert) order
// instead, this rank's own source first, then rank + 1, ...: each source's rows together,
// grouped by expert); cap > 0: recv_x is padded,
// [e_loc][cap] rows, the row of (s, t, e) being e * cap + (the rows of e from sources before s)
// + R[s][t][e], and nothing on the host needs the counts.

__device__ __forceinline__ int geo_k(long ke) { return (int)(ke & 0xff); }
__device__ __forceinline__ int geo_eloc(long ke) { return (int)((ke >> 8) & 0xffff); }
__device__ __forceinline__ int geo_src(long ke) { return (int)((ke >> 24) & 0x7f) - 1; }
__device__ __forceinline__ bool geo_by_source(long ke) { return ((ke >> 31) & 1) && !(ke >> 32); }  // compact only
__device__ __forceinline__ long geo_cap(long ke) { return ke >> 32; }

#define IDS_HEADER 16
#define MAX_BASE 4096

__device__ __forceinline__ int scan_block(int flag, int* warp_sums, int* total) {
  // exclusive prefix count of `flag` over the block (512 threads), and the block's total
  const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP, nw = blockDim.x / WARP;
  const unsigned ballot = __ballot_sync(0xffffffffu, flag);
  const int in_warp = __popc(ballot & ((1u << lane) - 1u));
  if (lane == 0) warp_sums[wid] = __popc(ballot);
  __syncthreads();
  if (threadIdx.x == 0) {
    int run = 0;
    for (int i = 0; i < nw; ++i) {
      const int v = warp_sums[i];
      warp_sums[i] = run;
      run += v;
    }
    *total = run;
  }
  __syncthreads();
  const int r = warp_sums[wid] + in_warp;
  __syncthreads();  // warp_sums is reused by the next tile
  return r;
}

// rows_ids and rows_layout take a source's tokens LAYOUT_TILE at a time, one per thread.
#define LAYOUT_TILE 512
__host__ __device__ __forceinline__ long layout_tiles(long t_max) { return (t_max + LAYOUT_TILE - 1) / LAYOUT_TILE; }

// Before a dispatch's barrier, this rank's own slot buffer gets its rows (X: `x_bytes` from
// `x`, at x_off) and its routing at i_off (the token count T, then the `n_ids` int64 ids as
// int32), and `info` (`n_info` ints, this rank's) is zeroed: one launch for what would be four
// small copies. Grid-stride; 16-byte packs where both row pointers allow.
extern "C" __global__ void __launch_bounds__(512) rows_post(const Ctx c, long x_off, long i_off, const char* x,
                                                            long x_bytes, const long* ids, long n_ids, long T,
                                                            int* info, long n_info) {
  if (*(volatile int*)c.err_dev) return;
  char* dst = c.slots.p[c.rank] + x_off;
  const long tid = (long)blockIdx.x * blockDim.x + threadIdx.x, nt = (long)gridDim.x * blockDim.x;
  long done = 0;
  if (((reinterpret_cast<unsigned long>(x) | reinterpret_cast<unsigned long>(dst)) & 15) == 0) {
    const long packs = x_bytes / 16;
    const uint4* xs = reinterpret_cast<const uint4*>(x);
    uint4* ds = reinterpret_cast<uint4*>(dst);
    for (long i = tid; i < packs; i += nt) ds[i] = __ldg(xs + i);
    done = packs * 16;
  }
  for (long i = done + tid; i < x_bytes; i += nt) dst[i] = x[i];
  int* head = reinterpret_cast<int*>(c.slots.p[c.rank] + i_off);
  for (long i = tid; i < n_ids; i += nt) head[IDS_HEADER + i] = (int)ids[i];
  if (tid == 0) head[0] = (int)T;
  for (long i = tid; i < n_info; i += nt) info[i] = 0;
}

// Where info's per-expert totals (int64) start, in ints: after the counts, tokens, sends and the
// two error words, rounded up to 8 bytes.
__device__ __forceinline__ int totals_at(int W, int e_loc) { return (W * e_loc + 2 * W + 2 + 1) / 2 * 2; }

// Block (q, tile): rank q's ids of tokens [tile * LAYOUT_TILE, + LAYOUT_TILE), one token per
// thread, copied into ids_all[q] and checked (range; no expert twice in a token), and the tile's
// pairs counted per local expert of this rank: tiles[(q * n_tiles + tile) * e_loc + e], for
// rows_layout. Tile 0 records q's token count; this rank's own tiles add its pairs bound for each
// rank to `send` (info starts zeroed). Grid: W * n_tiles, n_tiles = layout_tiles(t_max).
extern "C" __global__ void __launch_bounds__(512) rows_ids(const Ctx c, long i_off, long t_max, long ke, int* info,
                                                           int* ids_all, int* tiles) {
  if (*(volatile int*)c.err_dev) return;
  const int k = geo_k(ke), e_loc = geo_eloc(ke), W = c.world, E = W * e_loc;
  const long n_tiles = layout_tiles(t_max);
  const int q = (int)(blockIdx.x / n_tiles), tile = (int)(blockIdx.x % n_tiles);
  __shared__ int cnt[MAX_BASE];
  __shared__ int send[MAX_RANKS];
  for (int e = threadIdx.x; e < e_loc; e += blockDim.x) cnt[e] = 0;
  if (threadIdx.x < MAX_RANKS) send[threadIdx.x] = 0;
  __syncthreads();
  const int* head = reinterpret_cast<const int*>(c.slots.p[q] + i_off);
  const long n = __ldcg(head), t = (long)tile * LAYOUT_TILE + threadIdx.x;
  const bool own = q == c.rank;
  if (t < n) {
    const int* src = head + IDS_HEADER + t * k;
    int* dst = ids_all + ((long)q * t_max + t) * k;
    bool bad_range = false, repeat = false;
    for (int j = 0; j < k; ++j) {
      const int v = __ldcg(src + j);
      dst[j] = v;
      if (v < 0 || v >= E) {
        bad_range = true;
        continue;
      }
      for (int i = 0; i < j; ++i) repeat |= dst[i] == v;
      if (v / e_loc == c.rank) atomicAdd(&cnt[v - c.rank * e_loc], 1);
      if (own) atomicAdd(&send[v / e_loc], 1);
    }
    if (bad_range) atomicCAS(info + E + 2 * W, 0, q + 1);
    if (repeat) atomicCAS(info + E + 2 * W + 1, 0, q + 1);
  }
  __syncthreads();
  int* mine = tiles + ((long)q * n_tiles + tile) * e_loc;
  for (int e = threadIdx.x; e < e_loc; e += blockDim.x) mine[e] = cnt[e];
  if (own && threadIdx.x < W && send[threadIdx.x]) atomicAdd(info + E + W + threadIdx.x, send[threadIdx.x]);
  if (tile == 0 && threadIdx.x == 0) info[E + q] = (int)n;
}

// Block (s, e, tile) ranks source s's tokens of one tile (rows_ids' tiles) that chose this rank's
// local expert e, after those of the tiles before it (from rows_ids' counts): R[s][t][e]; the
// last tile holding tokens of s (tile 0 if none) writes cnt[s][e] and adds it to e's total.
// Grid: W * e_loc * layout_tiles(t_max); a block per tile, so that a prefill's thousands of
// tokens are ranked by hundreds of blocks instead of each block walking all of a source's. (One
// H200, 8192 tokens of top-8 over 16 local experts, a scratch profile of 2026-12-01, not kept:
// rows_layout 72 -> 5 us and rows_ids 30 -> 7 us against a block per (s, e) walking every tile.)
extern "C" __global__ void __launch_bounds__(512) rows_layout(const Ctx c, long t_max, long ke, int* R, int* info,
                                                              const int* ids_all, const int* tiles) {
  if (*(volatile int*)c.err_dev) return;
  const int k = geo_k(ke), e_loc = geo_eloc(ke), W = c.world;
  const long n_tiles = layout_tiles(t_max);
  const int tile = (int)(blockIdx.x % n_tiles), se = (int)(blockIdx.x / n_tiles);
  const int s = se / e_loc, e = se % e_loc, target = c.rank * e_loc + e;
  const int n = info[W * e_loc + s];
  const int last = max(0, (n + LAYOUT_TILE - 1) / LAYOUT_TILE - 1);
  if (tile > last) return;
  __shared__ int warp_sums[32];
  __shared__ int total;
  __shared__ int before;
  if (threadIdx.x < WARP) {  // this expert's pairs in s's earlier tiles
    int acc = 0;
    for (int i = threadIdx.x; i < tile; i += WARP) acc += tiles[((long)s * n_tiles + i) * e_loc + e];
    for (int o = WARP / 2; o > 0; o /= 2) acc += __shfl_down_sync(0xffffffffu, acc, o);
    if (threadIdx.x == 0) before = acc;
  }
  const long t = (long)tile * LAYOUT_TILE + threadIdx.x;
  int flag = 0;
  if (t < n) {
    const int* mine = ids_all + ((long)s * t_max + t) * k;
    for (int j = 0; j < k; ++j) flag |= mine[j] == target;
  }
  const int r = scan_block(flag, warp_sums, &total);  // its barriers also publish `before`
  if (t < n) R[((long)s * t_max + t) * e_loc + e] = flag ? before + r : -1;
  if (tile == last && threadIdx.x == 0) {
    const int run = before + total;
    info[s * e_loc + e] = run;
    // and local expert e's rows from every source, as int64 after the error words (8-byte aligned)
    atomicAdd(reinterpret_cast<unsigned long long*>(info + totals_at(W, e_loc)) + e, (unsigned long long)run);
  }
}

// base[e * W + s] (`by_source`: base[((s - rank) mod W) * e_loc + e]): the first recv_x row of
// (local expert e, source s), in shared memory (`cap`, `by_source`: see the layout above). Every
// thread loads some of the counts, then the block scans them (one thread walking W * e_loc
// counts in global memory costs ~10 us of load latency per block, most of a decode-sized gather).
__device__ __forceinline__ void load_base(const int* info, int W, int e_loc, long cap, int* base,
                                          bool by_source = false, int rank = 0) {
  __shared__ int warp_sums[32];
  const int n = W * e_loc, lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    base[i] = __ldcg(info + (by_source && !cap ? ((rank + i / e_loc) % W) * e_loc + i % e_loc
                                               : (i % W) * e_loc + i / W));
  __syncthreads();
  if (cap) {  // padded: expert e's rows start at e * cap, its sources' in rank order
    for (int e = threadIdx.x; e < e_loc; e += blockDim.x) {
      int run = (int)(e * cap);
      for (int q = 0; q < W; ++q) {
        const int v = base[e * W + q];
        base[e * W + q] = run;
        run += v;
      }
    }
    __syncthreads();
    return;
  }
  // compact: an exclusive prefix sum over all n, each thread over its own run of entries
  const int per = (n + blockDim.x - 1) / blockDim.x, lo = min(n, (int)threadIdx.x * per), hi = min(n, lo + per);
  int mine = 0;
  for (int i = lo; i < hi; ++i) mine += base[i];
  int incl = mine;  // inclusive scan of the threads' sums: within the warp, then over the warps
  for (int o = 1; o < WARP; o *= 2) {
    const int v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == WARP - 1) warp_sums[wid] = incl;
  __syncthreads();
  if (wid == 0) {
    const int nw = blockDim.x / WARP;
    int v = lane < nw ? warp_sums[lane] : 0;
    for (int o = 1; o < WARP; o *= 2) {
      const int u = __shfl_up_sync(0xffffffffu, v, o);
      if (lane >= o) v += u;
    }
    if (lane < nw) warp_sums[lane] = v;  // inclusive over the warps
  }
  __syncthreads();
  int run = incl - mine + (wid ? warp_sums[wid - 1] : 0);
  for (int i = lo; i < hi; ++i) {
    const int v = base[i];
    base[i] = run;
    run += v;
  }
  __syncthreads();
}

// Row slices: with few items (decode-sized batches), the warps of the grid share each item's row
// instead of leaving most SMs idle: slice p of S covers units [lo, hi) (whole warps' worth each),
// S being how many warps the grid has per item, at most one per WARP units.
__device__ __forceinline__ int row_slices(long items, long units) {
  const long by_grid = items ? n_warps() / items : 1, by_row = units / WARP;
  return (int)max(1L, min(by_grid, by_row));
}

__device__ __forceinline__ void slice_range(long units, int S, int p, long* lo, long* hi) {
  const long per = ((units + S - 1) / S + WARP - 1) / WARP * WARP;
  *lo = min(units, per * p);
  *hi = min(units, *lo + per);
}

// The recv_x rows of (s, t) on this rank: lane j < k holds its pair's row, or -1; returns the
// ballot of lanes that hold one.
__device__ __forceinline__ unsigned my_rows(const Ctx& c, const int* ids_all, const int* R, const int* base, int s,
                                            long t, long t_max, int k, int e_loc, int* row_of_lane,
                                            bool by_source = false) {
  const int lane = threadIdx.x % WARP;
  int d = -1;
  if (lane < k) {
    const int e = ids_all[((long)s * t_max + t) * k + lane] - c.rank * e_loc;
    if (e >= 0 && e < e_loc)
      d = base[by_source ? ((s - c.rank + c.world) % c.world) * e_loc + e : e * c.world + s] +
          R[((long)s * t_max + t) * e_loc + e];
  }
  *row_of_lane = d;
  return __ballot_sync(0xffffffffu, d >= 0);
}

template <typename T, bool VEC>
__device__ void rows_gather_dense(const Ctx& c, long x_off, const int* R, const int* info, const int* ids_all, T* out,
                                  long t_max, long row, long ke) {
  if (*(volatile int*)c.err_dev) return;
  const int k = geo_k(ke), e_loc = geo_eloc(ke), W = c.world;
  __shared__ int base[MAX_BASE];
  __shared__ int dst[16][WARP];  // each warp's destination rows (512 threads: 16 warps)
  load_base(info, W, e_loc, geo_cap(ke), base, geo_by_source(ke), c.rank);
  const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
  const long units = VEC ? row / Pack<T>::N : row, items = W * t_max;
  const int S = row_slices(items, units);
  for (long it = warp_id(); it < items * S; it += n_warps()) {
    const long g = it / S;
    const int s = (int)(g / t_max);
    const long t = g % t_max;
    if (t >= info[W * e_loc + s]) continue;
    int d;
    const unsigned mask = my_rows(c, ids_all, R, base, s, t, t_max, k, e_loc, &d, geo_by_source(ke));
    if (!mask) continue;
    long lo, hi;
    slice_range(units, S, (int)(it % S), &lo, &hi);
    dst[wid][lane] = d;
    __syncwarp();
    const T* src = reinterpret_cast<const T*>(c.slots.p[s] + x_off) + t * row;
    if (VEC) {
      const uint4* sv = reinterpret_cast<const uint4*>(src);
      for (long v = lo + lane; v < hi; v += ROWS_UNROLL * WARP) {
        uint4 x[ROWS_UNROLL];
#pragma unroll
        for (int u = 0; u < ROWS_UNROLL; ++u)
          if (v + u * WARP < hi) x[u] = __ldcg(sv + v + u * WARP);
        for (unsigned m = mask; m; m &= m - 1) {
          uint4* o = reinterpret_cast<uint4*>(out + (long)dst[wid][__ffs(m) - 1] * row);
#pragma unroll
          for (int u = 0; u < ROWS_UNROLL; ++u)
            if (v + u * WARP < hi) o[v + u * WARP] = x[u];
        }
      }
    } else {
      for (long j = lo + lane; j < hi; j += WARP) {
        const T x = src[j];
        for (unsigned m = mask; m; m &= m - 1) out[(long)dst[wid][__ffs(m) - 1] * row + j] = x;
      }
    }
    __syncwarp();  // every lane has read dst[wid] before the next token writes it
  }
}

// Expert side: P (this rank's slot buffer at p_off) row s * t_max + t = sum over (s, t)'s pairs
// here of weight x rows[its recv_x row], the weight read from rank s's slot buffer at w_off (with
// a source filter in `ke`, for that source's tokens only).
template <typename T, bool VEC>
__device__ void rows_partial_dense(const Ctx& c, long p_off, long w_off, const int* R, const int* info,
                                   const int* ids_all, const T* rows, long t_max, long row, long ke) {
  if (*(volatile int*)c.err_dev) return;
  const int k = geo_k(ke), e_loc = geo_eloc(ke), W = c.world;
  const int N = Pack<T>::N;
  __shared__ int base[MAX_BASE];
  __shared__ int dst[16][WARP];
  __shared__ float wt[16][WARP];
  load_base(info, W, e_loc, geo_cap(ke), base, geo_by_source(ke), c.rank);
  const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
  const int only = geo_src(ke);  // >= 0: source `only`'s tokens alone
  const long first = only >= 0 ? only * t_max : 0;
  const long units = VEC ? row / N : row, items = only >= 0 ? t_max : W * t_max;
  const int S = row_slices(items, units);
  for (long it = warp_id(); it < items * S; it += n_warps()) {
    const long g = first + it / S;
    const int s = (int)(g / t_max);
    const long t = g % t_max;
    if (t >= info[W * e_loc + s]) continue;
    int d;
    const unsigned mask = my_rows(c, ids_all, R, base, s, t, t_max, k, e_loc, &d, geo_by_source(ke));
    if (!mask) continue;
    long lo, hi;
    slice_range(units, S, (int)(it % S), &lo, &hi);
    dst[wid][lane] = d;
    wt[wid][lane] = d >= 0 ? __ldcg(reinterpret_cast<const float*>(c.slots.p[s] + w_off) + t * k + lane) : 0.f;
    __syncwarp();
    T* o = reinterpret_cast<T*>(c.slots.p[c.rank] + p_off) + g * row;
    if (VEC) {
      for (long v = lo + lane; v < hi; v += WARP) {
        PackSum<T> acc;
        for (unsigned m = mask; m; m &= m - 1) {
          const int j = __ffs(m) - 1;
          acc.add(__ldg(reinterpret_cast<const uint4*>(rows + (long)dst[wid][j] * row) + v), wt[wid][j]);
        }
        __stcg(reinterpret_cast<uint4*>(o) + v, acc.packed());
      }
    } else {
      for (long jj = lo + lane; jj < hi; jj += WARP) {
        float acc = 0.f;
        for (unsigned m = mask; m; m &= m - 1) {
          const int j = __ffs(m) - 1;
          acc += wt[wid][j] * to_f(rows[(long)dst[wid][j] * row + jj]);
        }
        o[jj] = from_f<T>(acc);
      }
    }
    __syncwarp();
  }
}

// Token side: out[t] = sum, over the ranks q (ascending) holding one of t's experts, of rank q's
// P row (this rank) * t_max + t.
template <typename T, bool VEC>
__device__ void rows_sum_dense(const Ctx& c, long p_off, const int* ids_all, T* out, long t_max, long row, long ke,
                               long n) {
  if (*(volatile int*)c.err_dev) return;
  const int k = geo_k(ke), e_loc = geo_eloc(ke);
  const int N = Pack<T>::N;
  const int lane = threadIdx.x % WARP;
  const long units = VEC ? row / N : row;
  const int S = row_slices(n, units);
  for (long it = warp_id(); it < n * S; it += n_warps()) {
    const long t = it / S;
    long lo, hi;
    slice_range(units, S, (int)(it % S), &lo, &hi);
    const int q_lane = lane < k ? ids_all[((long)c.rank * t_max + t) * k + lane] / e_loc : -1;
    unsigned ranks = 0;
    for (int q = 0; q < c.world; ++q)
      if (__any_sync(0xffffffffu, q_lane == q)) ranks |= 1u << q;
    const long prow = (long)c.rank * t_max + t;
    T* o = out + t * row;
    if (VEC) {
      for (long v = lo + lane; v < hi; v += WARP) {
        PackSum<T> acc;
        for (unsigned m = ranks; m; m &= m - 1) {
          const T* src = reinterpret_cast<const T*>(c.slots.p[__ffs(m) - 1] + p_off) + prow * row;
          acc.add(__ldcg(reinterpret_cast<const uint4*>(src) + v));
        }
        reinterpret_cast<uint4*>(o)[v] = acc.packed();
      }
    } else {
      for (long j = lo + lane; j < hi; j += WARP) {
        float acc = 0.f;
        for (unsigned m = ranks; m; m &= m - 1)
          acc += to_f((reinterpret_cast<const T*>(c.slots.p[__ffs(m) - 1] + p_off) + prow * row)[j]);
        o[j] = from_f<T>(acc);
      }
    }
  }
}

// Combine's backward, expert side: for each (s, t) with pairs here, read the output gradient
// g = rank s's X row t once and, for each of its pairs j here, write grad_rows[its row] =
// weight_j x g (the weight from rank s's W) and, when `dots` is set, D (this rank's slot buffer
// at d_off, float [W][t_max][k]) at (s, t, j) = <g, rows[its row]> (the weight's gradient).
template <typename T, bool VEC>
__device__ void rows_grad_dense(const Ctx& c, long x_off, long w_off, long d_off, const int* R, const int* info,
                                const int* ids_all, const T* rows, T* grad_rows, long t_max, long row, long ke,
                                long dots) {
  if (*(volatile int*)c.err_dev) return;
  const int k = geo_k(ke), e_loc = geo_eloc(ke), W = c.world;
  const int N = Pack<T>::N;
  __shared__ int base[MAX_BASE];
  __shared__ int dst[16][WARP];
  __shared__ float wt[16][WARP];
  load_base(info, W, e_loc, geo_cap(ke), base, geo_by_source(ke), c.rank);
  const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
  float* D = reinterpret_cast<float*>(c.slots.p[c.rank] + d_off);
  for (long g = warp_id(); g < W * t_max; g += n_warps()) {
    const int s = (int)(g / t_max);
    const long t = g % t_max;
    if (t >= info[W * e_loc + s]) continue;
    int d;
    const unsigned mask = my_rows(c, ids_all, R, base, s, t, t_max, k, e_loc, &d, geo_by_source(ke));
    if (!mask) continue;
    dst[wid][lane] = d;
    wt[wid][lane] = d >= 0 ? __ldcg(reinterpret_cast<const float*>(c.slots.p[s] + w_off) + t * k + lane) : 0.f;
    __syncwarp();
    const T* gsrc = reinterpret_cast<const T*>(c.slots.p[s] + x_off) + t * row;
    float part[WARP];  // this lane's share of each pair's dot product (pair j in slot j)
#pragma unroll
    for (int j = 0; j < WARP; ++j) part[j] = 0.f;
    if (VEC) {
      const long packs = row / N;
      for (long v = lane; v < packs; v += WARP) {
        const uint4 gv = __ldcg(reinterpret_cast<const uint4*>(gsrc) + v);
        const T* ge = reinterpret_cast<const T*>(&gv);
#pragma unroll
        for (int j = 0; j < WARP; ++j) {
          if (!((mask >> j) & 1u)) continue;
          const long r = (long)dst[wid][j] * row;
          uint4 o;
          T* oe = reinterpret_cast<T*>(&o);
#pragma unroll
          for (int q = 0; q < N; ++q) oe[q] = from_f<T>(wt[wid][j] * to_f(ge[q]));
          reinterpret_cast<uint4*>(grad_rows + r)[v] = o;
          if (dots) {
            const uint4 xv = __ldg(reinterpret_cast<const uint4*>(rows + r) + v);
            const T* xe = reinterpret_cast<const T*>(&xv);
#pragma unroll
            for (int q = 0; q < N; ++q) part[j] += to_f(ge[q]) * to_f(xe[q]);
          }
        }
      }
    } else {
      for (long jj = lane; jj < row; jj += WARP) {
        const float gf = to_f(gsrc[jj]);
#pragma unroll
        for (int j = 0; j < WARP; ++j) {
          if (!((mask >> j) & 1u)) continue;
          const long r = (long)dst[wid][j] * row;
          grad_rows[r + jj] = from_f<T>(wt[wid][j] * gf);
          if (dots) part[j] += gf * to_f(rows[r + jj]);
        }
      }
    }
    if (dots) {
#pragma unroll
      for (int j = 0; j < WARP; ++j) {
        if (!((mask >> j) & 1u)) continue;  // the same on every lane: no lane skips a shuffle
        float v = part[j];
        for (int o = WARP / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) __stcg(D + ((long)s * t_max + t) * k + j, v);
      }
    }
    __syncwarp();
  }
}

// The source of every recv_x row: index[d] = s * t_max + t for each pair (s, t, e) here, d its
// recv_x row; one warp per (s, t). A kernel that reads every rank's tokens from one table (rank
// s's at row s * t_max) reads recv_x's rows through it. With `seg` (the compact layout by source,
// W >= 2), block 0 also writes the segments of each (source s, local expert e), as int32
// [4][W][e_loc]: the first row, the rows, the end within s's rows (inclusive sum over e), and the
// first row counted after this rank's own rows (its own source comes first).
extern "C" __global__ void __launch_bounds__(512) rows_index_dense(const Ctx c, const int* R, const int* info,
                                                                   const int* ids_all, int* index, long t_max, long ke,
                                                                   int* seg) {
  if (*(volatile int*)c.err_dev) return;
  const int k = geo_k(ke), e_loc = geo_eloc(ke), W = c.world;
  __shared__ int base[MAX_BASE];
  load_base(info, W, e_loc, geo_cap(ke), base, geo_by_source(ke), c.rank);
  if (seg && blockIdx.x == 0) {
    const int n = W * e_loc, own = W > 1 ? base[e_loc] : 0;  // the layout's second source starts after the own rows
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const int at = base[((i / e_loc - c.rank + W) % W) * e_loc + i % e_loc];
      seg[i] = at;
      seg[n + i] = __ldcg(info + i);
      seg[3 * n + i] = at - own;
    }
    if (threadIdx.x < W) {
      int run = 0;
      for (int e = 0; e < e_loc; ++e) {
        run += __ldcg(info + threadIdx.x * e_loc + e);
        seg[2 * n + threadIdx.x * e_loc + e] = run;
      }
    }
  }
  const int lane = threadIdx.x % WARP;
  for (long g = warp_id(); g < W * t_max; g += n_warps()) {
    const int s = (int)(g / t_max);
    const long t = g % t_max;
    if (t >= info[W * e_loc + s]) continue;
    int d;
    my_rows(c, ids_all, R, base, s, t, t_max, k, e_loc, &d, geo_by_source(ke));
    if (d >= 0) index[d] = (int)g;
  }
}

// Combine's backward, token side: gw[t][j] = D of the rank holding pair j's expert at (this
// rank, t, j); one thread per pair.
extern "C" __global__ void __launch_bounds__(512) rows_dots_dense(const Ctx c, long d_off, const int* ids_all,
                                                                  float* gw, long t_max, long ke, long n) {
  if (*(volatile int*)c.err_dev) return;
  const int k = geo_k(ke), e_loc = geo_eloc(ke);
  for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n * k; i += (long)gridDim.x * blockDim.x) {
    const long t = i / k;
    const int j = (int)(i % k);
    const int q = ids_all[((long)c.rank * t_max + t) * k + j] / e_loc;
    gw[i] = __ldcg(reinterpret_cast<const float*>(c.slots.p[q] + d_off) + ((long)c.rank * t_max + t) * k + j);
  }
}

#define INSTANTIATE_DENSE(T, TAG, VEC, KIND)                                                            \
  extern "C" __global__ void __launch_bounds__(512) rows_gather_dense_##TAG##_##KIND(                   \
      const Ctx c, long x_off, const int* R, const int* info, const int* ids_all, T* out, long t_max,   \
      long row, long ke) {                                                                              \
    rows_gather_dense<T, VEC>(c, x_off, R, info, ids_all, out, t_max, row, ke);                         \
  }                                                                                                     \
  extern "C" __global__ void __launch_bounds__(512) rows_partial_dense_##TAG##_##KIND(                  \
      const Ctx c, long p_off, long w_off, const int* R, const int* info, const int* ids_all,          \
      const T* rows, long t_max, long row, long ke) {                                                   \
    rows_partial_dense<T, VEC>(c, p_off, w_off, R, info, ids_all, rows, t_max, row, ke);                \
  }                                                                                                     \
  extern "C" __global__ void __launch_bounds__(512) rows_sum_dense_##TAG##_##KIND(                      \
      const Ctx c, long p_off, const int* ids_all, T* out, long t_max, long row, long ke, long n) {     \
    rows_sum_dense<T, VEC>(c, p_off, ids_all, out, t_max, row, ke, n);                                  \
  }                                                                                                     \
  extern "C" __global__ void __launch_bounds__(512) rows_grad_dense_##TAG##_##KIND(                     \
      const Ctx c, long x_off, long w_off, long d_off, const int* R, const int* info, const int* ids_all, \
      const T* rows, T* grad_rows, long t_max, long row, long ke, long dots) {                          \
    rows_grad_dense<T, VEC>(c, x_off, w_off, d_off, R, info, ids_all, rows, grad_rows, t_max, row, ke, dots); \
  }

INSTANTIATE_DENSE(float, f32, true, vec)
INSTANTIATE_DENSE(float, f32, false, scalar)
INSTANTIATE_DENSE(__half, f16, true, vec)
INSTANTIATE_DENSE(__half, f16, false, scalar)
INSTANTIATE_DENSE(__nv_bfloat16, bf16, true, vec)
INSTANTIATE_DENSE(__nv_bfloat16, bf16, false, scalar)
