// Matrix products for the few rows of a decode step on an x86 CPU: y (B, N) = x (B, K) @ W.T + bias + res, with W
// in bf16, int8 with a scale per row, or int4 in 32-value blocks with a scale and zero per group. A weight is read
// once, as one stream, in the tiled order pack() lays it out in, and turned into floats (bf16 pairs with
// AVX512-BF16) in registers, where it meets every row of x: the arithmetic is the float model's, with the
// weights' values rounded, and every row's result is the same alone as in a batch.
// Compiled on the machine that runs it (native.py), with -march=native; OpenMP splits the tiles over threads.
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "these kernels need AVX2, FMA and F16C; elsewhere torch's own kernels run"
#endif

enum { BF16 = 0, INT8 = 1, INT4 = 2 };
enum { R = 4, CHUNK = 32, PAIR = 64 };  // weight rows per tile, values per row of a tile's chunk; int4: two chunks
enum { PARALLEL_WORK = 1 << 17 };     // multiply-adds from which a product or the attention is split over threads

// One packed weight, laid out by tiles of R rows (N padded to a multiple of R with zero rows): tile t holds, for
// each chunk c of 32 inputs, rows 4t..4t+3's values there, one after another. int4 goes by pairs of chunks (64
// inputs): 32 bytes a row, input j of the pair's first 32 in byte j's low nibble and input j of its next 32 in
// the high one (native.int4_nibbles); its scales and zeros fp16, (N / R, K / group, R). The same fields in
// native.py.
struct Linear {
    const void* w;
    const float* scale;      // int8: (N padded,) float32
    const uint16_t* scale4;  // int4: fp16 scales, as above
    const uint16_t* zero4;   // int4: fp16 zeros; w = q * scale + zero
    const float* bias;       // (N,) float32, or null
    int64_t kind, N, K, group;
};

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 64);  // NaN stays NaN
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);               // round to nearest even
}

// ---- 16 floats: one AVX-512 register, or two AVX2 ones --------------------------------------------------------
#ifdef __AVX512F__
#define NB_MAX 4  // rows of x per pass: R * NB_MAX accumulators in 32 registers
struct vf {
    __m512 v;
};
static inline vf zeros() { return {_mm512_setzero_ps()}; }
static inline vf set1(float s) { return {_mm512_set1_ps(s)}; }
static inline vf loadf(const float* p) { return {_mm512_loadu_ps(p)}; }
static inline vf fma(vf a, vf b, vf c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
static inline float hsum(vf a) { return _mm512_reduce_add_ps(a.v); }
static inline vf bf16s(const uint16_t* p) {
    __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(u, 16))};
}
static inline vf int8s(const int8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)))};
}
#else
#define NB_MAX 2  // 16 registers
struct vf {
    __m256 a, b;
};
static inline vf zeros() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline vf set1(float s) { return {_mm256_set1_ps(s), _mm256_set1_ps(s)}; }
static inline vf loadf(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline vf fma(vf x, vf y, vf c) { return {_mm256_fmadd_ps(x.a, y.a, c.a), _mm256_fmadd_ps(x.b, y.b, c.b)}; }
static inline float hsum(vf x) {
    __m256 s = _mm256_add_ps(x.a, x.b);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
static inline __m256 bf16x8(const uint16_t* p) {
    __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
static inline vf bf16s(const uint16_t* p) { return {bf16x8(p), bf16x8(p + 8)}; }
static inline __m256 int8x8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
static inline vf int8s(const int8_t* p) { return {int8x8(p), int8x8(p + 8)}; }
#endif

// One chunk of R rows of a bf16 or int8 weight as floats, w[r][0] its first 16 values and w[r][1] the next 16
static inline void chunk(const Linear& L, int64_t tile, int64_t c, vf w[R][2]) {
    const int64_t at = (tile * (L.K / CHUNK) + c) * R;  // the chunk's first row, in rows of 32 values
    for (int r = 0; r < R; r++) {
        if (L.kind == BF16) {
            const uint16_t* p = (const uint16_t*)L.w + (at + r) * CHUNK;
            w[r][0] = bf16s(p), w[r][1] = bf16s(p + 16);
        } else {
            const int8_t* p = (const int8_t*)L.w + (at + r) * CHUNK;
            w[r][0] = int8s(p), w[r][1] = int8s(p + 16);
        }
    }
}

// dots[b][r] = x[b] . w[tile rows r] for NB rows of x from b0: x float32 (xf) or, with AVX512-BF16, bf16 (xh)
template <int NB>
static void tile_dots(const Linear& L, int64_t tile, const float* xf, const uint16_t* xh, int64_t b0,
                      float dots[][R]) {
    const int64_t K = L.K, chunks = K / CHUNK;
#ifdef __AVX512BF16__
    if (xh) {
        __m512 acc[NB][R];
        for (int b = 0; b < NB; b++)
            for (int r = 0; r < R; r++) acc[b][r] = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; c++) {
            __m512bh w[R];
            if (L.kind == BF16) {
                const uint16_t* p = (const uint16_t*)L.w + (tile * chunks + c) * R * CHUNK;
                for (int r = 0; r < R; r++) w[r] = (__m512bh)_mm512_loadu_si512(p + r * CHUNK);
            } else {
                vf f[R][2];
                chunk(L, tile, c, f);
                for (int r = 0; r < R; r++) w[r] = _mm512_cvtne2ps_pbh(f[r][1].v, f[r][0].v);
            }
            for (int b = 0; b < NB; b++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(xh + (b0 + b) * K + c * CHUNK);
                for (int r = 0; r < R; r++) acc[b][r] = _mm512_dpbf16_ps(acc[b][r], xv, w[r]);
            }
        }
        for (int b = 0; b < NB; b++)
            for (int r = 0; r < R; r++) dots[b][r] = _mm512_reduce_add_ps(acc[b][r]);
        return;
    }
#endif
    vf acc[NB][R];
    for (int b = 0; b < NB; b++)
        for (int r = 0; r < R; r++) acc[b][r] = zeros();
    for (int64_t c = 0; c < chunks; c++) {
        vf w[R][2];
        chunk(L, tile, c, w);
        for (int b = 0; b < NB; b++) {
            const float* xp = xf + (b0 + b) * K + c * CHUNK;
            const vf x0 = loadf(xp), x1 = loadf(xp + 16);
            for (int r = 0; r < R; r++) acc[b][r] = fma(w[r][1], x1, fma(w[r][0], x0, acc[b][r]));
        }
    }
    for (int b = 0; b < NB; b++)
        for (int r = 0; r < R; r++) dots[b][r] = hsum(acc[b][r]);
}

// int4 against x rounded to int8 in blocks of 32, each with a scale d (x ~ q * d) and its exact sum: the
// nibbles' integer dot products with a block of x (vpdpbusd, or vpmaddubsw where VNNI is missing) scaled once per
// block, the zeros times the block's sum. Nibble unpacking is the costly part of int4 in floats; here it is two
// byte operations per 32 values.
struct Quantized {
    const int8_t* q;    // (B, K)
    const float* d;     // (B, K / 32)
    const float* sum;   // (B, K / 32)
};

static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else  // u is a nibble here: the pairs' int16 sums cannot saturate
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float hsum8(__m256 s) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

template <int NB>
static void tile_dots_int4(const Linear& L, int64_t tile, const Quantized& x, int64_t b0, float dots[][R]) {
    const int64_t K = L.K, pairs = K / PAIR, blocks = K / CHUNK, G = K / L.group;
    const uint8_t* w = (const uint8_t*)L.w + tile * pairs * R * CHUNK;
    const __m256i low = _mm256_set1_epi8(15);
    __m256i lane[R];
    for (int r = 0; r < R; r++) lane[r] = _mm256_set1_epi32(r);
    __m256 acc[NB][R];
    __m128 zacc[NB];  // the zeros times the blocks' sums, one lane a row of the tile
    for (int b = 0; b < NB; b++) {
        zacc[b] = _mm_setzero_ps();
        for (int r = 0; r < R; r++) acc[b][r] = _mm256_setzero_ps();
    }
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t ga = 2 * p * CHUNK / L.group, gb = (2 * p + 1) * CHUNK / L.group;
        const uint16_t *sa = L.scale4 + (tile * G + ga) * R, *sb = L.scale4 + (tile * G + gb) * R;
        const __m128 SA = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)sa));  // the tile's 4 rows' scales
        const __m128 SB = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)sb));
        const __m128 ZA = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(L.zero4 + (tile * G + ga) * R)));
        const __m128 ZB = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(L.zero4 + (tile * G + gb) * R)));
        __m256i lo[R], hi[R];
        for (int r = 0; r < R; r++) {  // 32 bytes: block a's values in the low nibbles, block b's in the high
            const __m256i v = _mm256_loadu_si256((const __m256i*)(w + (p * R + r) * CHUNK));
            lo[r] = _mm256_and_si256(v, low);
            hi[r] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        for (int b = 0; b < NB; b++) {
            const int64_t row = b0 + b, blk = row * blocks + 2 * p;
            const __m256i xa = _mm256_loadu_si256((const __m256i*)(x.q + row * K + p * PAIR));
            const __m256i xb = _mm256_loadu_si256((const __m256i*)(x.q + row * K + p * PAIR + CHUNK));
            const __m256 CA = _mm256_castps128_ps256(_mm_mul_ps(SA, _mm_broadcast_ss(x.d + blk)));
            const __m256 CB = _mm256_castps128_ps256(_mm_mul_ps(SB, _mm_broadcast_ss(x.d + blk + 1)));
            zacc[b] = _mm_fmadd_ps(ZA, _mm_broadcast_ss(x.sum + blk), zacc[b]);
            zacc[b] = _mm_fmadd_ps(ZB, _mm_broadcast_ss(x.sum + blk + 1), zacc[b]);
            for (int r = 0; r < R; r++) {
                const __m256 pa = _mm256_cvtepi32_ps(dot_u8s8(lo[r], xa));
                const __m256 pb = _mm256_cvtepi32_ps(dot_u8s8(hi[r], xb));
                acc[b][r] = _mm256_fmadd_ps(pa, _mm256_permutevar8x32_ps(CA, lane[r]), acc[b][r]);
                acc[b][r] = _mm256_fmadd_ps(pb, _mm256_permutevar8x32_ps(CB, lane[r]), acc[b][r]);
            }
        }
    }
    for (int b = 0; b < NB; b++) {
        float z[4];
        _mm_storeu_ps(z, zacc[b]);
        for (int r = 0; r < R; r++) dots[b][r] = hsum8(acc[b][r]) + z[r];
    }
}

// x's rows rounded to int8 in blocks of 32 (round to nearest, scale max |x| / 127), into one allocation (*own,
// null where there is no memory)
static Quantized quantize_rows(const void* x, int64_t B, int64_t K, int bf16, void** own) {
    const int64_t n = B * K, blocks = n / CHUNK;
    char* mem = (char*)malloc(n + 8 * blocks);
    *own = mem;
    if (!mem) return {nullptr, nullptr, nullptr};
    int8_t* q = (int8_t*)mem;
    float *d = (float*)(mem + n), *sum = d + blocks;
    for (int64_t j = 0; j < blocks; j++) {
        float v[CHUNK], amax = 0.f, s = 0.f;
        for (int i = 0; i < CHUNK; i++) {
            const int64_t at = j * CHUNK + i;
            v[i] = bf16 ? from_bf16(((const uint16_t*)x)[at]) : ((const float*)x)[at];
            amax = fmaxf(amax, fabsf(v[i]));
            s += v[i];
        }
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        for (int i = 0; i < CHUNK; i++) q[j * CHUNK + i] = (int8_t)nearbyintf(v[i] * inv);
        d[j] = amax / 127.f, sum[j] = s;
    }
    return {q, d, sum};
}

// where y's rows go: y (B, N) float32 or bf16, with res (B, N) in y's dtype added (it may be y itself)
struct Out {
    void* y;
    const void* res;
    int bf16;
};

static void store(const Linear& L, int64_t tile, const float dots[][R], int64_t b0, int nb, const Out& o) {
    for (int b = 0; b < nb; b++)
        for (int r = 0; r < R; r++) {
            const int64_t n = tile * R + r, i = (b0 + b) * L.N + n;
            if (n >= L.N) break;  // a padding row
            float v = dots[b][r];
            if (L.kind == INT8) v *= L.scale[n];
            if (L.bias) v += L.bias[n];
            if (o.bf16) {
                if (o.res) v += from_bf16(((const uint16_t*)o.res)[i]);
                ((uint16_t*)o.y)[i] = to_bf16(v);
            } else {
                if (o.res) v += ((const float*)o.res)[i];
                ((float*)o.y)[i] = v;
            }
        }
}

static void tile_rows(const Linear& L, int64_t tile, const float* xf, const uint16_t* xh, const Quantized& xq,
                      int64_t B, const Out& o) {
    float dots[NB_MAX][R];
    for (int64_t b = 0; b < B; b += NB_MAX) {  // the tile's weights stay in L1 between these passes
        const int nb = (int)(B - b < NB_MAX ? B - b : NB_MAX);
        if (L.kind == INT4) {
            switch (nb) {
#if NB_MAX == 4
                case 4: tile_dots_int4<4>(L, tile, xq, b, dots); break;
                case 3: tile_dots_int4<3>(L, tile, xq, b, dots); break;
#endif
                case 2: tile_dots_int4<2>(L, tile, xq, b, dots); break;
                default: tile_dots_int4<1>(L, tile, xq, b, dots); break;
            }
        } else {
            switch (nb) {
#if NB_MAX == 4
                case 4: tile_dots<4>(L, tile, xf, xh, b, dots); break;
                case 3: tile_dots<3>(L, tile, xf, xh, b, dots); break;
#endif
                case 2: tile_dots<2>(L, tile, xf, xh, b, dots); break;
                default: tile_dots<1>(L, tile, xf, xh, b, dots); break;
            }
        }
        store(L, tile, dots, b, nb, o);
    }
}

static bool takes(const Linear& L) {
    if (L.N < 1 || L.K < 1 || L.K % CHUNK || (L.kind != BF16 && L.kind != INT8 && L.kind != INT4)) return false;
    return L.kind != INT4 || (L.K % PAIR == 0 && L.group > 0 && L.group % CHUNK == 0 && L.K % L.group == 0);
}

// y = x @ W.T + bias + res for x (B, K) float32, or bf16 where x_bf16; 0, or 2 where memory ran out
static int linear(const Linear& L, int64_t B, const void* x, int x_bf16, const Out& o, int threads) {
    const int64_t K = L.K;
    const float* xf = nullptr;
    const uint16_t* xh = nullptr;
    void* own = nullptr;
    Quantized xq = {nullptr, nullptr, nullptr};
    if (L.kind == INT4) {
        xq = quantize_rows(x, B, K, x_bf16, &own);
        if (!own) return 2;
    } else {
#ifdef __AVX512BF16__
        if (x_bf16) xh = (const uint16_t*)x;  // bf16 pairs straight into vdpbf16ps
#endif
        if (!xh && x_bf16) {  // the rows in float32 once, for every tile
            float* f = (float*)malloc(sizeof(float) * B * K);
            if (!f) return 2;
            for (int64_t i = 0; i < B * K; i++) f[i] = from_bf16(((const uint16_t*)x)[i]);
            own = f, xf = f;
        } else if (!xh) {
            xf = (const float*)x;
        }
    }
    const int64_t tiles = (L.N + R - 1) / R;
    // threads only for a weight worth it: waking them costs more than a small product, and on busy cores
    // OpenMP's barriers make it far more
    const bool split = threads > 1 && L.N * L.K >= PARALLEL_WORK;
#pragma omp parallel for schedule(static) num_threads(threads) if (split)
    for (int64_t t = 0; t < tiles; t++) tile_rows(L, t, xf, xh, xq, B, o);
    free(own);
    return 0;
}

// ---- a whole decode step of a pre-norm block ---------------------------------------------------------------
// RMSNorm, the fused q, k, v projection, RoPE (half-split pairs), the new key and value into the cache,
// grouped-query attention over each row's keys up to its position, the output projection and its residual add;
// RMSNorm, SwiGLU's fused gate and up projection, the down projection and its residual add. The residual stream
// stays in the model's dtype between the sub-blocks, as in the model's own forward; the rest is float32.

struct Block {
    Linear qkv, proj, fc, down;  // attn.c_attn, attn.c_proj, mlp.c_fc (gate half, then up half), mlp.c_proj
    const float* ln1;            // RMSNorm gains (C,), float32
    const float* ln2;
    float eps1, eps2;
    int64_t C, nh, nkv, hs, H, S;  // S: the cache's positions per row
    const float* cos;              // RoPE (S, hs) float32: cos, and sin with its first half negated
    const float* sin;
    const float* q_norm;           // QK-norm's gains (hs,) float32, before RoPE (Qwen3, OLMo 2), or null
    const float* k_norm;
    float eps_q, eps_k;
};

static inline float value(const void* p, int64_t i, int bf16) {
    return bf16 ? from_bf16(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}
static inline void put(void* p, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t*)p)[i] = to_bf16(v);
    else ((float*)p)[i] = v;
}

static void rms_norm(const void* x, const float* g, float eps, int64_t B, int64_t C, void* out, int bf16) {
    for (int64_t b = 0; b < B; b++) {
        float ss = 0.f;
        for (int64_t c = 0; c < C; c++) {
            const float v = value(x, b * C + c, bf16);
            ss += v * v;
        }
        const float inv = 1.f / sqrtf(ss / C + eps);
        for (int64_t c = 0; c < C; c++) put(out, b * C + c, value(x, b * C + c, bf16) * inv * g[c], bf16);
    }
}

static inline vf cache_row(const void* p, int64_t i, int bf16) {
    return bf16 ? bf16s((const uint16_t*)p + i) : loadf((const float*)p + i);
}

// one row's query heads of one key/value head over its n keys: out (group, hs) float32
static void attend(const Block& L, const float* q, const void* kc, const void* vc, int64_t n, int kv_bf16,
                   float* scores, float* out) {
    const int64_t hs = L.hs, group = L.nh / L.nkv;
    const float scale = 1.f / sqrtf((float)hs);
    for (int64_t g = 0; g < group; g++) {
        const float* qg = q + g * hs;
        float m = -INFINITY;
        for (int64_t j = 0; j < n; j++) {
            vf acc = zeros();
            for (int64_t d = 0; d < hs; d += 16) acc = fma(loadf(qg + d), cache_row(kc, j * hs + d, kv_bf16), acc);
            scores[j] = hsum(acc) * scale;
            m = fmaxf(m, scores[j]);
        }
        float total = 0.f;
        for (int64_t j = 0; j < n; j++) total += (scores[j] = expf(scores[j] - m));
        float* o = out + g * hs;
        for (int64_t d = 0; d < hs; d += 16) {
            vf acc = zeros();
            for (int64_t j = 0; j < n; j++) acc = fma(set1(scores[j]), cache_row(vc, j * hs + d, kv_bf16), acc);
            const vf t = fma(acc, set1(1.f / total), zeros());
            float tmp[16];
#ifdef __AVX512F__
            _mm512_storeu_ps(tmp, t.v);
#else
            _mm256_storeu_ps(tmp, t.a), _mm256_storeu_ps(tmp + 8, t.b);
#endif
            memcpy(o + d, tmp, sizeof tmp);
        }
    }
}

static void rope(float* x, const float* cos, const float* sin, int64_t hs) {
    const int64_t half = hs / 2;
    float t[512];
    memcpy(t, x, sizeof(float) * hs);
    for (int64_t i = 0; i < hs; i++) x[i] = t[i] * cos[i] + t[i < half ? i + half : i - half] * sin[i];
}

// the profile clock: seconds spent in ng_decode by part (products, attention, all of it), added to the caller's
// timers[0..2] where it passes them: each caller its own, so that steps decoding at once do not share one
static inline double now() {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static int timed_linear(const Linear& L, int64_t B, const void* x, int x_bf16, const Out& o, int threads,
                        double* timers) {
    const double t0 = timers ? now() : 0;
    const int rc = linear(L, B, x, x_bf16, o, threads);
    if (timers) timers[0] += now() - t0;
    return rc;
}

static int block_step(const Block& L, int64_t B, void* x, const int64_t* pos, const int64_t* rows, void* kc,
                      void* vc, int bf16, int kv_bf16, int threads, char* scratch, double* timers) {
    const int64_t C = L.C, nh = L.nh, nkv = L.nkv, hs = L.hs, H = L.H, S = L.S, width = (nh + 2 * nkv) * hs;
    void* xn = scratch;                                                // (B, C) model dtype
    float* qkv = (float*)(scratch + B * C * 4);                        // (B, width)
    float* att = qkv + B * width;                                      // (B, nh * hs) float32
    void* atto = att + B * nh * hs;                                    // (B, nh * hs) model dtype
    float* gu = (float*)((char*)atto + B * nh * hs * 4);               // (B, 2H)
    void* h = gu + B * 2 * H;                                          // (B, H) model dtype
    float* scores = (float*)((char*)h + B * H * 4);                    // (threads, S)
    rms_norm(x, L.ln1, L.eps1, B, C, xn, bf16);
    if (timed_linear(L.qkv, B, xn, bf16, {qkv, nullptr, 0}, threads, timers)) return 2;
    for (int64_t b = 0; b < B; b++) {
        float* row = qkv + b * width;
        const float *c = L.cos + pos[b] * hs, *s = L.sin + pos[b] * hs;
        if (L.q_norm) {  // QK-norm: each query and key head's hs values RMS-normed with the shared gains
            for (int64_t head = 0; head < nh; head++) rms_norm(row + head * hs, L.q_norm, L.eps_q, 1, hs, row + head * hs, 0);
            for (int64_t head = nh; head < nh + nkv; head++)
                rms_norm(row + head * hs, L.k_norm, L.eps_k, 1, hs, row + head * hs, 0);
        }
        for (int64_t head = 0; head < nh + nkv; head++) rope(row + head * hs, c, s, hs);
        for (int64_t kh = 0; kh < nkv; kh++) {  // the new key and value into the cache
            const int64_t at = ((rows[b] * nkv + kh) * S + pos[b]) * hs;
            for (int64_t d = 0; d < hs; d++) {
                put(kc, at + d, row[(nh + kh) * hs + d], kv_bf16);
                put(vc, at + d, row[(nh + nkv + kh) * hs + d], kv_bf16);
            }
        }
    }
    const double t0 = timers ? now() : 0;
    int64_t keys = 0;  // the attention's work: every row's held keys times the heads' widths
    for (int64_t b = 0; b < B; b++) keys += pos[b] + 1;
    const bool split = threads > 1 && B * nkv > 1 && keys * nh * hs >= PARALLEL_WORK;
#pragma omp parallel for schedule(static) num_threads(threads) if (split)
    for (int64_t t = 0; t < B * nkv; t++) {
        const int64_t b = t / nkv, kh = t % nkv, group = nh / nkv;
#ifdef _OPENMP
        float* sc = scores + omp_get_thread_num() * S;
#else
        float* sc = scores;
#endif
        const int64_t at = (rows[b] * nkv + kh) * S * hs;
        attend(L, qkv + b * width + kh * group * hs, (const char*)kc + at * (kv_bf16 ? 2 : 4),
               (const char*)vc + at * (kv_bf16 ? 2 : 4), pos[b] + 1, kv_bf16, sc, att + (b * nh + kh * group) * hs);
    }
    if (timers) timers[1] += now() - t0;
    for (int64_t i = 0; i < B * nh * hs; i++) put(atto, i, att[i], bf16);
    if (timed_linear(L.proj, B, atto, bf16, {x, x, bf16}, threads, timers)) return 2;
    rms_norm(x, L.ln2, L.eps2, B, C, xn, bf16);
    if (timed_linear(L.fc, B, xn, bf16, {gu, nullptr, 0}, threads, timers)) return 2;
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < H; i++) {
            const float g = gu[b * 2 * H + i], u = gu[b * 2 * H + H + i];
            put(h, b * H + i, g / (1.f + expf(-g)) * u, bf16);
        }
    return timed_linear(L.down, B, h, bf16, {x, x, bf16}, threads, timers);
}

// The layout of every struct shared with Python (native.py's ctypes mirrors): one row per field, and one with
// an empty field name for the struct's whole size. Loading checks each against the mirror.
struct Field {
    const char *type, *name;
    int64_t offset, size;
};
#define FIELD(T, f) {#T, #f, (int64_t)offsetof(T, f), (int64_t)sizeof(((T*)nullptr)->f)}
static const Field layout[] = {
    {"Linear", "", 0, sizeof(Linear)},
    FIELD(Linear, w), FIELD(Linear, scale), FIELD(Linear, scale4), FIELD(Linear, zero4), FIELD(Linear, bias),
    FIELD(Linear, kind), FIELD(Linear, N), FIELD(Linear, K), FIELD(Linear, group),
    {"Block", "", 0, sizeof(Block)},
    FIELD(Block, qkv), FIELD(Block, proj), FIELD(Block, fc), FIELD(Block, down), FIELD(Block, ln1),
    FIELD(Block, ln2), FIELD(Block, eps1), FIELD(Block, eps2), FIELD(Block, C), FIELD(Block, nh),
    FIELD(Block, nkv), FIELD(Block, hs), FIELD(Block, H), FIELD(Block, S), FIELD(Block, cos), FIELD(Block, sin),
    FIELD(Block, q_norm), FIELD(Block, k_norm), FIELD(Block, eps_q), FIELD(Block, eps_k),
};
#undef FIELD

extern "C" {

// What the build was compiled for (shown by `nanogpt info` and the benchmarks)
const char* ng_isa() {
#if defined(__AVX512BF16__)
    return "AVX-512 BF16";
#elif defined(__AVX512F__)
    return "AVX-512";
#else
    return "AVX2";
#endif
}

int ng_tile_rows() { return R; }

// Row i of the shared structs' layout (type, field, offset and size in bytes): 1, or 0 past the last row
int ng_layout(int64_t i, const char** type, const char** name, int64_t* offset, int64_t* size) {
    if (i < 0 || i >= (int64_t)(sizeof layout / sizeof layout[0])) return 0;
    *type = layout[i].type, *name = layout[i].name, *offset = layout[i].offset, *size = layout[i].size;
    return 1;
}

// y (B, N) = x (B, K) @ W.T (+ bias) (+ res): x, res and y float32, or bf16 where bf16 != 0, each contiguous.
// Returns 0, 1 for a shape the kernels do not take (K not a multiple of 32; int4: of 64, and groups of 32), or 2
// where memory ran out.
int ng_linear(const Linear* L, int64_t B, const void* x, const void* res, void* y, int bf16, int threads) {
    if (!takes(*L) || B < 1 || threads < 1) return 1;
    return linear(*L, B, x, bf16, {y, res, bf16}, threads);
}

static int decode_rows(const Block* blocks, int64_t n_layer, int64_t B, void* x, const int64_t* pos,
                       const int64_t* rows, int64_t cache_rows, void* const* ks, void* const* vs, int bf16, int kv_bf16,
                       int threads, double* timers) {
    for (int64_t b = 0; b < B; b++)
        if (rows[b] < 0 || rows[b] >= cache_rows) return 3;
    for (int64_t l = 0; l < n_layer; l++) {
        const Block& L = blocks[l];
        if (!takes(L.qkv) || !takes(L.proj) || !takes(L.fc) || !takes(L.down) || L.hs % 16 || L.hs > 512) return 1;
        const int64_t width = (L.nh + 2 * L.nkv) * L.hs;  // the products' shapes the scratch is sized for
        if (L.nkv <= 0 || L.nh % L.nkv || L.qkv.K != L.C || L.qkv.N != width || L.proj.K != L.nh * L.hs ||
            L.proj.N != L.C || L.fc.K != L.C || L.fc.N != 2 * L.H || L.down.K != L.H || L.down.N != L.C)
            return 1;
        if (L.C != blocks[0].C || L.H != blocks[0].H || L.S != blocks[0].S || width != (blocks[0].nh + 2 * blocks[0].nkv) * blocks[0].hs ||
            L.nh * L.hs != blocks[0].nh * blocks[0].hs)
            return 1;
        for (int64_t b = 0; b < B; b++)
            if (pos[b] < 0 || pos[b] >= L.S) return 3;
    }
    const Block& f = blocks[0];
    const int64_t width = (f.nh + 2 * f.nkv) * f.hs, heads = f.nh * f.hs;
    const int64_t n = B * (4 * f.C + 4 * width + 8 * heads + 8 * f.H + 4 * f.H) + 4 * (threads + 1) * f.S;
    const double t0 = timers ? now() : 0;
    char* scratch = (char*)malloc(n);
    if (!scratch) return 2;
    int rc = 0;
    for (int64_t l = 0; l < n_layer && rc == 0; l++)
        rc = block_step(blocks[l], B, x, pos, rows, ks[l], vs[l], bf16, kv_bf16, threads, scratch, timers);
    free(scratch);
    if (timers) timers[2] += now() - t0;
    return rc;
}

// One decode step of n_layer blocks for B rows, each one new token at its position pos[b]: x (B, C), the
// residual stream in the model's dtype (bf16 where bf16), in and out; ks[l] and vs[l] the layer's cache
// (cache_rows, nkv, S, hs), bf16 where kv_bf16; rows[b] the cache row of x's row b (null: row b), several x rows
// may share one: each layer writes every row's key and value before any row attends, so rows of one cache row at
// positions p, p + 1, ... are one sequence's next tokens, each seeing those before it (a speculative check);
// timers: the caller's profile clock (3 doubles, see now()) or null. Returns 0, 1 for a shape the kernels do not
// take, 2 where memory ran out, 3 for a position or row outside the cache.
int ng_decode(const Block* blocks, int64_t n_layer, int64_t B, void* x, const int64_t* pos, const int64_t* rows,
              int64_t cache_rows, void* const* ks, void* const* vs, int bf16, int kv_bf16, int threads,
              double* timers) {
    if (n_layer < 1 || B < 1 || threads < 1) return 1;
    int64_t* own = nullptr;
    if (!rows) {  // row b of x is row b of the cache
        own = (int64_t*)malloc(B * sizeof(int64_t));
        if (!own) return 2;
        for (int64_t b = 0; b < B; b++) own[b] = b;
        rows = own;
    }
    const int rc = decode_rows(blocks, n_layer, B, x, pos, rows, cache_rows, ks, vs, bf16, kv_bf16, threads, timers);
    free(own);
    return rc;
}
}
