// Reference attention. Prefill runs per head as two GEMMs over blocks of query rows (the
// scores of one block are the only scratch); decode walks an explicit row list per KV head, and
// a batch of decode queries shares one parallel loop.
#include <cblas.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/parallel_for.h"
#include "kernels/cpu/row_gemm.h"
#include "kernels/cpu/serial_blas.h"
#include "kernels/cpu/simd.h"

namespace infinigen::cpu {
namespace {

// Query rows per block in AttentionCausal: bounds the score scratch to kQueryBlock × context.
constexpr int64_t kQueryBlock = 128;

// Per-thread scratch that only grows, so steady-state calls allocate nothing.
float* Scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// Rows per decode task (see AttentionDecode).
constexpr int64_t kDecodeChunk = 256;
inline void Prefetch(const void* row, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(row) + b);
}

// 8 elements of a K/V row as float32 (bfloat16 widened exactly), and one element.
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const uint16_t* p) { return WidenBf16x8(p); }
inline float At(const float* p, int i) { return p[i]; }
inline float At(const uint16_t* p, int i) { return Bf16ToFloat(p[i]); }

// p[j] = s[j] * scale for j < n; returns their maximum (-inf when n is 0). A maximum is the
// same whatever order the values are compared in.
inline float ScaleAndMax(const float* s, float scale, float* p, int64_t n) {
  const __m256 sv = _mm256_set1_ps(scale);
  __m256 mv = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + j), sv);
    _mm256_storeu_ps(p + j, x);
    mv = _mm256_max_ps(mv, x);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  float m = -INFINITY;
  for (float l : lanes) m = std::max(m, l);
  for (; j < n; ++j) m = std::max(m, p[j] = s[j] * scale);
  return m;
}

// p[j] = exp(p[j] - m) for j < n (every p[j] <= m), and their sum in double: lane l of two
// 4-lane accumulators takes j = 8t + l (l < 4 into the first), the accumulators are added
// lane-wise and their lanes summed in order; the last n % 8 go through the same exp (padded)
// and into the total in j order. The same numbers for the same scores whatever the caller.
inline double ExpAndSum(float* p, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), mv));
    _mm256_storeu_ps(p + j, e);
    acc0 = _mm256_add_pd(acc0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    acc1 = _mm256_add_pd(acc1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(acc0, acc1));
  double sum = ((lanes[0] + lanes[1]) + lanes[2]) + lanes[3];
  if (j < n) {
    alignas(32) float tail[8];
    for (int64_t t = 0; t < 8; ++t) tail[t] = j + t < n ? p[j + t] : m;
    _mm256_store_ps(tail, Exp8(_mm256_sub_ps(_mm256_load_ps(tail), mv)));
    for (int64_t t = 0; j + t < n; ++t) {
      p[j + t] = tail[t];
      sum += tail[t];
    }
  }
  return sum;
}

}  // namespace

void AttentionCausal(const float* q, int64_t q_stride, int64_t num_q, int64_t q_start, KvRows k,
                     KvRows v, int num_heads, int num_kv_heads, int head_dim, float scale,
                     float* out, int64_t out_stride) {
  const int group = num_heads / num_kv_heads;
  const int64_t blocks = (num_q + kQueryBlock - 1) / kQueryBlock;
  // Tasks (head, query block) on the team, each with single-threaded OpenBLAS (SerialBlas);
  // later blocks see more keys, so each thread takes the next task when it is done.
  ParallelForDynamic(num_heads * blocks, num_q * (q_start + num_q) > (1 << 15), [&](int64_t t) {
    const int h = static_cast<int>(t / blocks);
    const int64_t b0 = t % blocks * kQueryBlock;
    const int g = h / group;
    const float* kh = static_cast<const float*>(k.data) + g * k.head_stride;
    const float* vh = static_cast<const float*>(v.data) + g * v.head_stride;
    const int64_t rows = std::min(kQueryBlock, num_q - b0);
    const int64_t ctx = q_start + b0 + rows;  // keys visible to the block's last row
    float* s = Scratch(rows * ctx);
    SerialBlas();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, ctx, head_dim, scale,
                q + b0 * q_stride + h * head_dim, q_stride, kh, k.row_stride, 0.0f, s, ctx);
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = s + r * ctx;
      const int64_t visible = q_start + b0 + r + 1;
      std::fill(sr + visible, sr + ctx, 0.0f);
      Softmax(sr, visible);
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, head_dim, ctx, 1.0f, s, ctx, vh,
                v.row_stride, 0.0f, out + b0 * out_stride + h * head_dim, out_stride);
  });
}

namespace {

// y += a * x over n floats with explicit 8-lane FMAs: the same arithmetic whatever the
// pointers' alignment (a compiler's alignment peeling would round the first elements
// differently on different buffers, and a decode step and a prefill row must agree bit for bit).
template <typename T>
inline void Axpy(float a, const T* x, float* y, int n) {
  const __m256 av = _mm256_set1_ps(a);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, Load8(x + i), _mm256_loadu_ps(y + i)));
  }
  for (; i < n; ++i) y[i] = std::fma(a, At(x, i), y[i]);
}

// outs[r] = sum over j < n of ps[r][j] * rows[j] for r < R (n rows of `width` floats), each
// element accumulated in j order by FMA from zero, as Axpy would: R rows x 32 floats at a time
// in registers (each V row loaded once for the R outputs). T: float, or uint16_t for bfloat16.
template <int R, typename T>
void WeightedRowsTile(const float* const* ps, const T* const* rows, int64_t n, int width,
                      float* const* outs) {
  int d0 = 0;
  for (; d0 + 32 <= width; d0 += 32) {
    __m256 acc[R][4];
    for (int r = 0; r < R; ++r) {
      for (int t = 0; t < 4; ++t) acc[r][t] = _mm256_setzero_ps();
    }
    for (int64_t j = 0; j < n; ++j) {
      const T* v = rows[j] + d0;
      const __m256 v0 = Load8(v), v1 = Load8(v + 8);
      const __m256 v2 = Load8(v + 16), v3 = Load8(v + 24);
      for (int r = 0; r < R; ++r) {
        const __m256 pj = _mm256_set1_ps(ps[r][j]);
        acc[r][0] = _mm256_fmadd_ps(pj, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(pj, v1, acc[r][1]);
        acc[r][2] = _mm256_fmadd_ps(pj, v2, acc[r][2]);
        acc[r][3] = _mm256_fmadd_ps(pj, v3, acc[r][3]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int t = 0; t < 4; ++t) _mm256_storeu_ps(outs[r] + d0 + 8 * t, acc[r][t]);
    }
  }
  if (d0 == width) return;
  for (int r = 0; r < R; ++r) {
    std::fill(outs[r] + d0, outs[r] + width, 0.0f);
    for (int64_t j = 0; j < n; ++j) Axpy(ps[r][j], rows[j] + d0, outs[r] + d0, width - d0);
  }
}

// GCC 12's AVX-512 headers build some results from _mm512_undefined_* values, which it then
// reports as uninitialized where they are inlined (GCC bug 105593, fixed in GCC 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// 16 elements of a K/V row as float32, as two Load8 make them.
IG_AVX512 inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
IG_AVX512 inline __m512 Load16(const uint16_t* p) { return WidenBf16x16(p); }

// WeightedRowsTile with 16-lane registers (width a multiple of 32): every element is the same
// FMA chain over j (lanes do not meet), so the same numbers.
template <int R, typename T>
IG_AVX512 void WeightedRowsTile16(const float* const* ps, const T* const* rows, int64_t n,
                                  int width, float* const* outs) {
  for (int d0 = 0; d0 < width; d0 += 32) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const T* v = rows[j] + d0;
      const __m512 v0 = Load16(v), v1 = Load16(v + 16);
      for (int r = 0; r < R; ++r) {
        const __m512 pj = _mm512_set1_ps(ps[r][j]);
        acc[r][0] = _mm512_fmadd_ps(pj, v0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(pj, v1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(outs[r] + d0, acc[r][0]);
      _mm512_storeu_ps(outs[r] + d0 + 16, acc[r][1]);
    }
  }
}
#pragma GCC diagnostic pop

// The weighted rows of several outputs that see the same n rows, up to six (AVX-512) or three
// at a time.
template <typename T>
void WeightedRows(const float* const* ps, int count, const T* const* rows, int64_t n, int width,
                  float* const* outs) {
  int r = 0;
  if (ActiveIsa() == Isa::kAvx512 && width % 32 == 0) {
    for (; r + 6 <= count; r += 6) WeightedRowsTile16<6>(ps + r, rows, n, width, outs + r);
    for (; r + 3 <= count; r += 3) WeightedRowsTile16<3>(ps + r, rows, n, width, outs + r);
    for (; r < count; ++r) WeightedRowsTile16<1>(ps + r, rows, n, width, outs + r);
    return;
  }
  for (; r + 3 <= count; r += 3) WeightedRowsTile<3>(ps + r, rows, n, width, outs + r);
  if (count - r == 2) WeightedRowsTile<2>(ps + r, rows, n, width, outs + r);
  if (count - r == 1) WeightedRowsTile<1>(ps + r, rows, n, width, outs + r);
}

// Where one (query row, query head) of a chunk puts its partial results: the chunk's
// probabilities before normalization (exp(score - chunk max)) for rows j0 .., the chunk's max
// score and sum of exponentials, and its unnormalized output [head_dim].
struct ChunkPartial {
  float* p;
  float* max;
  float* sum;
  float* out;
};

// The partials of chunk rows [j0, j1) of KV head g (listed by idx when not null) for nq query
// rows q0 + i * q_stride of the group's heads: query row i sees rows [j0, ends[i]) (ends[i] <=
// j1), its head h0 + hh writes partials[i * group + hh]. Scores are the fixed-order dot products
// of row_gemm.h (each K row read once per block of queries), the weighted V rows summed in row
// order. Decode calls this with one query row and prefill with a block of them: the same code,
// so the same numbers for a query whichever it is (never inlined: a caller's constants must not
// let the compiler compile its copy differently).
__attribute__((noinline)) void ChunkPartials(const float* q0, int64_t q_stride, const int64_t* ends,
                                             int nq, KvRows k, KvRows v, const int32_t* idx, int g,
                                             int group, int64_t j0, int64_t j1, int head_dim,
                                             float scale, const ChunkPartial* partials) {
  const int h0 = g * group;
  const int64_t n = j1 - j0;
  thread_local std::vector<const void*> k_rows, v_rows;
  thread_local std::vector<float> scores;  // [nq * group, kDecodeChunk]
  k_rows.resize(kDecodeChunk);
  v_rows.resize(kDecodeChunk);
  scores.resize(static_cast<size_t>(nq) * group * kDecodeChunk);
  for (int64_t j = 0; j < n; ++j) {
    k_rows[j] = k.Row(g, idx != nullptr ? idx[j0 + j] : j0 + j);
    v_rows[j] = v.Row(g, idx != nullptr ? idx[j0 + j] : j0 + j);
    // Ask for all of the chunk's rows at once, so that their misses overlap; a chunk fits in L2.
    // Rows listed by index or by a table are scattered (hardware prefetchers do not follow
    // indices), and even rows packed one after another arrive sooner so: the hardware's
    // streamer starts again at every 4 KiB page (dense decode at depth 8000 over packed bf16
    // K/V, `infinigen bench --depth 8000`: 26.0-26.2 -> 21.5-21.6 ms a token).
    Prefetch(k_rows[j], head_dim * (k.bf16 ? 2 : 4));
    Prefetch(v_rows[j], head_dim * (v.bf16 ? 2 : 4));
  }
  // Scores of m query rows (row stride ldq) against the chunk's K rows into y (row stride ldy).
  auto scores_of = [&](const float* q, int64_t ldq, float* y, int64_t ldy, int64_t m) {
    if (k.bf16) {
      GemmRowsBf16Table(q, ldq, reinterpret_cast<const uint16_t* const*>(k_rows.data()), nullptr, y,
                        ldy, m, n, head_dim, false);
    } else {
      GemmRowsF32Table(q, ldq, reinterpret_cast<const float* const*>(k_rows.data()), nullptr, y,
                       ldy, m, n, head_dim, false);
    }
  };
  if (nq == 1) {  // the group's heads are the rows: each K row read once per two heads
    scores_of(q0 + h0 * head_dim, head_dim, scores.data(), kDecodeChunk, group);
  } else {  // a block of queries per head: each K row read once per two queries
    for (int hh = 0; hh < group; ++hh) {
      scores_of(q0 + (h0 + hh) * head_dim, q_stride, scores.data() + hh * kDecodeChunk,
                group * kDecodeChunk, nq);
    }
  }
  for (int i = 0; i < nq; ++i) {
    const int64_t seen = ends[i] - j0;
    for (int hh = 0; hh < group; ++hh) {
      const ChunkPartial& cp = partials[i * group + hh];
      const float* s = scores.data() + (static_cast<int64_t>(i) * group + hh) * kDecodeChunk;
      const float m = ScaleAndMax(s, scale, cp.p, seen);
      double sum = 0.0;
      if (m == -INFINITY) {
        std::fill(cp.p, cp.p + seen, 0.0f);
      } else {
        sum = ExpAndSum(cp.p, seen, m);
      }
      *cp.max = m;
      *cp.sum = static_cast<float>(sum);
    }
  }
  // The weighted V rows: the group's heads of one query see the same rows.
  thread_local std::vector<const float*> ps;
  thread_local std::vector<float*> outs;
  ps.resize(group);
  outs.resize(group);
  for (int i = 0; i < nq; ++i) {
    for (int hh = 0; hh < group; ++hh) {
      ps[hh] = partials[i * group + hh].p;
      outs[hh] = partials[i * group + hh].out;
    }
    if (v.bf16) {
      WeightedRows(ps.data(), group, reinterpret_cast<const uint16_t* const*>(v_rows.data()),
                   ends[i] - j0, head_dim, outs.data());
    } else {
      WeightedRows(ps.data(), group, reinterpret_cast<const float* const*>(v_rows.data()),
                   ends[i] - j0, head_dim, outs.data());
    }
  }
}

// One query head's output from its chunks' partials (max [chunks], sum [chunks], out [chunks,
// head_dim]): each chunk rescaled by exp(chunk max - max) over the total. Writes each chunk's
// weight to `weights` when not null. False when every score was -inf (nothing written). Never
// inlined, for the same reason as ChunkPartials.
__attribute__((noinline)) bool MergeChunks(const float* max, const float* sum, const float* out,
                                           int64_t chunks, int head_dim, float* oh,
                                           float* weights) {
  float max_v = -INFINITY;
  for (int64_t c = 0; c < chunks; ++c) max_v = std::max(max_v, max[c]);
  if (max_v == -INFINITY) return false;
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    total += static_cast<double>(sum[c]) * std::exp(max[c] - max_v);
  }
  std::fill(oh, oh + head_dim, 0.0f);
  for (int64_t c = 0; c < chunks; ++c) {
    const float w = static_cast<float>(std::exp(max[c] - max_v) / total);
    Axpy(w, out + c * head_dim, oh, head_dim);
    if (weights != nullptr) weights[c] = w;
  }
  return true;
}

// Query rows per block of the blocked causal attention (their chunk partials share the K/V
// reads).
constexpr int kCausalBlock = 16;

}  // namespace

void AttentionCausalRows(const float* q, int64_t q_stride, int64_t num_q, int64_t q_start, KvRows k,
                         KvRows v, int num_heads, int num_kv_heads, int head_dim, float scale,
                         float* out, int64_t out_stride) {
  // Each query row computed exactly as a decode step computes it (ChunkPartials over the
  // 256-row chunks of the rows it sees, then MergeChunks), blocks of query rows sharing each
  // chunk's K/V reads; tasks (query block, KV head) in parallel.
  const int group = num_heads / num_kv_heads;
  const int64_t blocks = (num_q + kCausalBlock - 1) / kCausalBlock;
  ParallelForDynamic(blocks * num_kv_heads, num_q > 1, [&](int64_t t) {
    const int64_t b0 = t / num_kv_heads * kCausalBlock;
    const int g = static_cast<int>(t % num_kv_heads);
    const int nq = static_cast<int>(std::min<int64_t>(kCausalBlock, num_q - b0));
    const int64_t last = q_start + b0 + nq;  // rows the block's last query sees
    const int64_t chunks = (last + kDecodeChunk - 1) / kDecodeChunk;
    // Scratch: per (query, head) the probabilities of one chunk, and per (query, head, chunk)
    // max, sum and output.
    const int64_t per = static_cast<int64_t>(nq) * group;
    float* scratch = Scratch(per * (kDecodeChunk + chunks * (2 + head_dim)));
    float* probs = scratch;
    float* maxs = probs + per * kDecodeChunk;
    float* sums = maxs + per * chunks;
    float* outs = sums + per * chunks;
    const float* qs[kCausalBlock];
    int64_t ends[kCausalBlock];
    thread_local std::vector<ChunkPartial> partials;
    partials.resize(static_cast<size_t>(per));
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t j0 = c * kDecodeChunk, j1 = std::min(last, j0 + kDecodeChunk);
      int m = 0;  // the block's queries that see rows of this chunk, in order
      for (int i = 0; i < nq; ++i) {
        const int64_t visible = q_start + b0 + i + 1;
        if (visible <= j0) continue;
        qs[m] = q + (b0 + i) * q_stride;
        ends[m] = std::min(visible, j0 + kDecodeChunk);
        for (int hh = 0; hh < group; ++hh) {
          const int64_t at = (static_cast<int64_t>(i) * group + hh);
          partials[m * group + hh] = {probs + at * kDecodeChunk, maxs + at * chunks + c,
                                      sums + at * chunks + c, outs + (at * chunks + c) * head_dim};
        }
        ++m;
      }
      if (m > 0) {
        ChunkPartials(qs[0], q_stride, ends, m, k, v, nullptr, g, group, j0, j1, head_dim, scale,
                      partials.data());
      }
    }
    for (int i = 0; i < nq; ++i) {
      const int64_t visible = q_start + b0 + i + 1;
      const int64_t own = (visible + kDecodeChunk - 1) / kDecodeChunk;  // its chunks
      for (int hh = 0; hh < group; ++hh) {
        const int64_t at = static_cast<int64_t>(i) * group + hh;
        float* oh = out + (b0 + i) * out_stride + (g * group + hh) * head_dim;
        if (!MergeChunks(maxs + at * chunks, sums + at * chunks, outs + at * chunks * head_dim, own,
                         head_dim, oh, nullptr)) {
          std::fill(oh, oh + head_dim, 0.0f);  // -inf everywhere cannot happen: q.k is finite
        }
      }
    }
  });
}

namespace {

// One decode query's scratch (DecodeScratchFloats of it, from `at`): probabilities [heads, rows]
// (exp(score - chunk max)), and per (query head, chunk) the max, the sum and the output
// [head_dim]; chunk weights [heads, chunks].
struct DecodeLayout {
  int64_t chunks = 0;
  float* scores = nullptr;
  float* chunk_max = nullptr;
  float* chunk_sum = nullptr;
  float* chunk_out = nullptr;
  float* chunk_weight = nullptr;
};

int64_t DecodeChunks(int64_t num_rows) { return (num_rows + kDecodeChunk - 1) / kDecodeChunk; }

size_t DecodeScratchFloats(int64_t num_rows, int num_heads, int head_dim) {
  const int64_t chunks = DecodeChunks(num_rows);
  return static_cast<size_t>(num_heads) *
         (num_rows + chunks * (3 + static_cast<int64_t>(head_dim)));
}

DecodeLayout LayOut(float* at, int64_t num_rows, int num_heads, int head_dim) {
  DecodeLayout l;
  l.chunks = DecodeChunks(num_rows);
  l.scores = at;
  l.chunk_max = l.scores + static_cast<int64_t>(num_heads) * num_rows;
  l.chunk_sum = l.chunk_max + num_heads * l.chunks;
  l.chunk_out = l.chunk_sum + num_heads * l.chunks;
  l.chunk_weight = l.chunk_out + num_heads * l.chunks * head_dim;
  return l;
}

// Task t of a decode query: KV head t / chunks, chunk t % chunks.
void DecodeTask(const DecodeQuery& d, const DecodeLayout& l, int64_t t, int num_heads,
                int num_kv_heads, int head_dim, float scale) {
  const int group = num_heads / num_kv_heads;
  const int g = static_cast<int>(t / l.chunks);
  const int64_t c = t % l.chunks;
  const int64_t j0 = c * kDecodeChunk, j1 = std::min(d.num_rows, j0 + kDecodeChunk);
  const int32_t* idx = d.indices != nullptr ? d.indices + g * d.num_rows : nullptr;
  thread_local std::vector<ChunkPartial> partials;
  partials.resize(static_cast<size_t>(group));
  for (int hh = 0; hh < group; ++hh) {
    const int h = g * group + hh;
    partials[hh] = {l.scores + h * d.num_rows + j0, l.chunk_max + h * l.chunks + c,
                    l.chunk_sum + h * l.chunks + c, l.chunk_out + (h * l.chunks + c) * head_dim};
  }
  ChunkPartials(d.q, 0, &j1, 1, d.k, d.v, idx, g, group, j0, j1, head_dim, scale, partials.data());
}

// Query head h's output from its chunks; false when every score was -inf (the output is then
// the rows' uniform average, the only finite answer). Never inlined: AttentionDecode and
// AttentionDecodeBatch run this one copy.
__attribute__((noinline)) bool MergeHead(const DecodeQuery& d, const DecodeLayout& l, int h,
                                         int group, int head_dim) {
  float* oh = d.out + h * head_dim;
  if (MergeChunks(l.chunk_max + h * l.chunks, l.chunk_sum + h * l.chunks,
                  l.chunk_out + h * l.chunks * head_dim, l.chunks, head_dim, oh,
                  l.chunk_weight + h * l.chunks)) {
    return true;
  }
  std::fill(oh, oh + head_dim, 0.0f);
  const int32_t* idx = d.indices != nullptr ? d.indices + (h / group) * d.num_rows : nullptr;
  for (int64_t j = 0; j < d.num_rows; ++j) {
    const void* vr = d.v.Row(h / group, idx != nullptr ? idx[j] : j);
    for (int i = 0; i < head_dim; ++i) {
      oh[i] += (d.v.bf16 ? At(static_cast<const uint16_t*>(vr), i)
                         : At(static_cast<const float*>(vr), i)) /
               d.num_rows;
    }
  }
  return false;
}

// Tasks run in parallel above this much work (rows x heads x head_dim): below it the team's
// hand-off costs more than it saves.
constexpr int64_t kParallelDecodeWork = int64_t{1} << 16;

}  // namespace

// Decode attention, split like flash-decoding: the rows of each KV head are cut into chunks of
// kDecodeChunk, and one task per (KV head, chunk) reads each K and V row once for every query
// head of the group (a row read per query head made the dense case read K and V group times),
// keeping per query head the chunk's max score, its sum of exponentials and its unnormalized
// output; the chunks are then merged exactly (each rescaled by exp(chunk max - max)). Tasks run
// in parallel, so a few KV heads over many rows still use every core.
void AttentionDecode(const float* q, KvRows k, KvRows v, const int32_t* indices, int64_t num_rows,
                     int num_heads, int num_kv_heads, int head_dim, float scale, float* out,
                     float* weights_out) {
  const int group = num_heads / num_kv_heads;
  if (num_rows <= 0) {
    std::fill(out, out + static_cast<int64_t>(num_heads) * head_dim, 0.0f);
    return;
  }
  const DecodeQuery d{q, k, v, indices, num_rows, out};
  const DecodeLayout l = LayOut(Scratch(DecodeScratchFloats(num_rows, num_heads, head_dim)),
                                num_rows, num_heads, head_dim);
  ParallelFor(l.chunks * num_kv_heads, num_rows * num_heads * head_dim > kParallelDecodeWork,
              [&](int64_t t) { DecodeTask(d, l, t, num_heads, num_kv_heads, head_dim, scale); });
  for (int h = 0; h < num_heads; ++h) {
    if (!MergeHead(d, l, h, group, head_dim)) {
      if (weights_out != nullptr)
        std::fill_n(weights_out + h * num_rows, num_rows, 1.0f / num_rows);
      continue;
    }
    if (weights_out == nullptr) continue;
    const float* s = l.scores + h * num_rows;
    for (int64_t c = 0; c < l.chunks; ++c) {
      const int64_t j0 = c * kDecodeChunk, j1 = std::min(num_rows, j0 + kDecodeChunk);
      for (int64_t j = j0; j < j1; ++j)
        weights_out[h * num_rows + j] = s[j] * l.chunk_weight[h * l.chunks + c];
    }
  }
}

void AttentionDecodeBatch(std::span<const DecodeQuery> items, int num_heads, int num_kv_heads,
                          int head_dim, float scale) {
  const int group = num_heads / num_kv_heads;
  // Each query's layout in one scratch, and its first task among the batch's.
  thread_local std::vector<DecodeLayout> layouts;
  thread_local std::vector<int64_t> first_task;
  layouts.resize(items.size());
  first_task.resize(items.size() + 1);
  size_t floats = 0;
  int64_t work = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    floats += DecodeScratchFloats(std::max<int64_t>(items[i].num_rows, 0), num_heads, head_dim);
    work += std::max<int64_t>(items[i].num_rows, 0) * num_heads * head_dim;
  }
  float* scratch = Scratch(floats);
  first_task[0] = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const int64_t rows = std::max<int64_t>(items[i].num_rows, 0);
    layouts[i] = LayOut(scratch, rows, num_heads, head_dim);
    scratch += DecodeScratchFloats(rows, num_heads, head_dim);
    first_task[i + 1] = first_task[i] + layouts[i].chunks * num_kv_heads;
    if (rows == 0) std::fill(items[i].out, items[i].out + int64_t{num_heads} * head_dim, 0.0f);
  }
  // Every query's tasks in one parallel loop (not one a query: a barrier each, and a few tasks
  // each, unevenly shared, at short contexts), then every query head's merge in another.
  // (The team's threads see the caller's thread_local vectors through these pointers only.)
  const int64_t* first = first_task.data();
  const int64_t* first_end = first + first_task.size();
  const DecodeLayout* layout = layouts.data();
  const bool parallel = work > kParallelDecodeWork;
  ParallelForStealing(*(first_end - 1), parallel, [&](int64_t t) {
    const int64_t i = std::upper_bound(first, first_end, t) - first - 1;
    DecodeTask(items[i], layout[i], t - first[i], num_heads, num_kv_heads, head_dim, scale);
  });
  ParallelFor(static_cast<int64_t>(items.size()) * num_heads, parallel && items.size() > 1,
              [&](int64_t m) {
                const int64_t i = m / num_heads;
                if (items[i].num_rows > 0) {
                  MergeHead(items[i], layout[i], static_cast<int>(m % num_heads), group, head_dim);
                }
              });
}

}  // namespace infinigen::cpu
