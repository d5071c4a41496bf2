// Matrix products for the few rows of a decode step on an x86 CPU: y (B, N) = x (B, K) @ W.T + bias + res, with W
// in bf16, int8 with a scale per row, or int4 in 32-value blocks with a scale and zero per group. A weight is read
// once, as one stream, in the tiled order pack() lays it out in, where it meets every row of x in registers: bf16
// in bf16 pairs (AVX512-BF16) or floats, int8 and int4 in integer dot products against x's rows rounded to int8
// in blocks of 32, as llama.cpp's q8_0 and q4_0 do. Every row's result is the same alone as in a batch.
// Compiled on the machine that runs it (native.py), with -march=native; a small pool of threads (pool::run) splits
// the tiles and the attention's heads over threads.
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "these kernels need AVX2, FMA and F16C; elsewhere torch's own kernels run"
#endif

enum { BF16 = 0, INT8 = 1, INT4 = 2 };
enum { R = 4, CHUNK = 32, PAIR = 64 };  // weight rows per tile, values per row of a tile's chunk; int4's K: 64s
enum { R4 = 16 };                       // int4's and int8's rows per tile: one a 32-bit lane of 512 bits
enum { PARALLEL_WORK = 1 << 17 };     // multiply-adds from which a product or the attention is split over threads

// One packed weight, laid out by tiles of R rows (N padded to a multiple of R with zero rows): tile t holds, for
// each chunk c of 32 inputs, rows 4t..4t+3's values there, one after another. int4 goes by tiles of R4 = 16 rows
// (N padded to a multiple of 16) with a row in each 32-bit lane of a 512-bit register: for each block c of 32
// inputs, four runs j of 64 bytes, 4 bytes a row, byte m of row i holding input 32c + 8j + m in its low nibble
// and input 32c + 8j + 4 + m in its high one (native.int4_tiles); its scales and zeros fp16, (N / R4, K / group,
// R4). int8 goes by the same tiles of R4 rows, eight runs j of 64 bytes a block, byte m of row i holding input
// 32c + 4j + m (native.int8_tiles). The same fields in native.py.
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
#endif

// One chunk of R rows of a bf16 weight as floats, w[r][0] its first 16 values and w[r][1] the next 16
static inline void chunk(const Linear& L, int64_t tile, int64_t c, vf w[R][2]) {
    const int64_t at = (tile * (L.K / CHUNK) + c) * R;  // the chunk's first row, in rows of 32 values
    for (int r = 0; r < R; r++) {
        const uint16_t* p = (const uint16_t*)L.w + (at + r) * CHUNK;
        w[r][0] = bf16s(p), w[r][1] = bf16s(p + 16);
    }
}

// dots[b][r] = x[b] . w[tile rows r] of a bf16 weight for NB rows of x from b0: x float32 (xf) or, with
// AVX512-BF16, bf16 (xh)
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
            const uint16_t* p = (const uint16_t*)L.w + (tile * chunks + c) * R * CHUNK;
            for (int r = 0; r < R; r++) w[r] = (__m512bh)_mm512_loadu_si512(p + r * CHUNK);
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

// int4 against x rounded to int8 in blocks of 32, each with a scale d (x ~ q * d) and its exact sum. A tile's 16
// rows sit in the 16 lanes of one register, 4 bytes (8 nibbles) a lane: VNNI's vpdpbusd multiplies each lane's 4
// nibbles by the same 4 bytes of x (broadcast) and adds them into that lane, so that after 8 of them a lane holds
// its row's integer dot product with the block, with no horizontal sums. Each block then takes one conversion and
// two multiply-adds for all 16 rows: its scales times d, its zeros times the block's sum. The unpacked nibbles stay
// in registers for every row of x (up to NB4_MAX), so that a weight is read once for a batch of 8.
struct Quantized {
    const int8_t* q;      // (B, K)
    const float* d;       // (B, K / 32)
    const float* sum;     // (B, K / 32): x's own sum
    const int32_t* isum;  // (B, K / 32): q's sum
};

#ifdef __AVX512F__
#define NB4_MAX 8  // 8 registers of nibbles, 2 of scales and zeros, 2 accumulators a row of x: 28 of 32
struct vi {
    __m512i v;
};
static inline vi load64(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
static inline vi low4(vi a) { return {_mm512_and_si512(a.v, _mm512_set1_epi8(15))}; }
static inline vi high4(vi a) { return {_mm512_and_si512(_mm512_srli_epi16(a.v, 4), _mm512_set1_epi8(15))}; }
static inline vi izeros() { return {_mm512_setzero_si512()}; }
static inline vi iadd(vi a, vi b) { return {_mm512_add_epi32(a.v, b.v)}; }
// acc + the sums of 4 products of u's bytes (0..15) with s's 4 bytes, in each 32-bit lane
static inline vi dot4(vi acc, vi u, const int8_t* s) {
    int32_t four;
    memcpy(&four, s, 4);
#ifdef __AVX512VNNI__
    return {_mm512_dpbusd_epi32(acc.v, u.v, _mm512_set1_epi32(four))};
#else  // u is a nibble: the pairs' int16 sums cannot saturate
    const __m512i p = _mm512_maddubs_epi16(u.v, _mm512_set1_epi32(four));
    return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(p, _mm512_set1_epi16(1)))};
#endif
}
#ifdef __AVX512VNNI__
#define VNNI8 1
#endif
static inline vi iset1(int32_t v) { return {_mm512_set1_epi32(v)}; }
static inline vi iflip(vi a) { return {_mm512_xor_si512(a.v, _mm512_set1_epi8(-128))}; }
// acc + the sums of 4 products of w's bytes with s's 4 bytes in each 32-bit lane, w from prep8 (below)
static inline vi dot8(vi acc, vi w, const int8_t* s) {
    int32_t four;
    memcpy(&four, s, 4);
    const __m512i x = _mm512_set1_epi32(four);
#ifdef VNNI8
    return {_mm512_dpbusd_epi32(acc.v, w.v, x)};
#else
    const __m512i signed_x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w.v), _mm512_setzero_si512(), x);
    const __m512i p = _mm512_maddubs_epi16(_mm512_abs_epi8(w.v), signed_x);
    return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(p, _mm512_set1_epi16(1)))};
#endif
}
static inline vf tofloat(vi a) { return {_mm512_cvtepi32_ps(a.v)}; }
static inline vf halfs(const uint16_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p))}; }
static inline vf mul(vf a, vf b) { return {_mm512_mul_ps(a.v, b.v)}; }
static inline void storef(float* p, vf a) { _mm512_storeu_ps(p, a.v); }
#else
#define NB4_MAX 2
struct vi {
    __m256i a, b;
};
static inline vi load64(const uint8_t* p) {
    return {_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)(p + 32))};
}
static inline vi low4(vi x) {
    const __m256i m = _mm256_set1_epi8(15);
    return {_mm256_and_si256(x.a, m), _mm256_and_si256(x.b, m)};
}
static inline vi high4(vi x) {
    const __m256i m = _mm256_set1_epi8(15);
    return {_mm256_and_si256(_mm256_srli_epi16(x.a, 4), m), _mm256_and_si256(_mm256_srli_epi16(x.b, 4), m)};
}
static inline vi izeros() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline vi iadd(vi x, vi y) { return {_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)}; }
static inline __m256i dot4x8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else  // u is a nibble: the pairs' int16 sums cannot saturate
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
static inline vi dot4(vi acc, vi u, const int8_t* s) {
    int32_t four;
    memcpy(&four, s, 4);
    const __m256i x = _mm256_set1_epi32(four);
    return {dot4x8(acc.a, u.a, x), dot4x8(acc.b, u.b, x)};
}
// int8 weights, as the AVX-512 ones above
static inline __m256i dot8x8(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, w, x);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
    const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
}
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
#define VNNI8 1
#endif
static inline vi iset1(int32_t v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
static inline vi iflip(vi w) {
    const __m256i flip = _mm256_set1_epi8(-128);
    return {_mm256_xor_si256(w.a, flip), _mm256_xor_si256(w.b, flip)};
}
static inline vi dot8(vi acc, vi w, const int8_t* s) {
    int32_t four;
    memcpy(&four, s, 4);
    const __m256i x = _mm256_set1_epi32(four);
    return {dot8x8(acc.a, w.a, x), dot8x8(acc.b, w.b, x)};
}
static inline vf tofloat(vi x) { return {_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
static inline vf halfs(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)))};
}
static inline vf mul(vf x, vf y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
static inline void storef(float* p, vf x) { _mm256_storeu_ps(p, x.a), _mm256_storeu_ps(p + 8, x.b); }
#endif

// int8 weights: a run of 64 signed bytes made ready for dot8 once, then used for every row of x. VNNI's vpdpbusd
// multiplies unsigned bytes by signed ones, so the weights go in as q + 128 (the sign bit flipped) and the 128
// times the block's sum of x's bytes comes off (start8); without VNNI, |q| meets x with q's sign (the pairs'
// int16 sums, at most 2 x 127 x 127, cannot saturate).
static inline vi prep8(vi w) {
#ifdef VNNI8
    return iflip(w);
#else
    return w;
#endif
}
static inline vi start8(int32_t isum) {
#ifdef VNNI8
    return iset1(-128 * isum);
#else
    (void)isum;
    return izeros();
#endif
}

// dots[b][r] = x[b] . w[tile rows r] for NB rows of x from b0
template <int NB>
static void tile_dots_int4(const Linear& L, int64_t tile, const Quantized& x, int64_t b0, float dots[][R4]) {
    const int64_t K = L.K, blocks = K / CHUNK, G = K / L.group, per_group = L.group / CHUNK;
    const uint8_t* w = (const uint8_t*)L.w + tile * blocks * 4 * 64;
    const uint16_t *scales = L.scale4 + tile * G * R4, *zeros4 = L.zero4 + tile * G * R4;
    vf acc[NB];
    for (int b = 0; b < NB; b++) acc[b] = zeros();
    for (int64_t g = 0; g < G; g++) {
        const vf S = halfs(scales + g * R4), Z = halfs(zeros4 + g * R4);  // the 16 rows' scales and zeros
        for (int64_t c = g * per_group; c < (g + 1) * per_group; c++) {
            vi lo[4], hi[4];
            // the block 8 ahead (2 KiB, into the next tile at a tile's end) asked for now: with a block's
            // arithmetic between its loads, the hardware's prefetch alone kept too few reads in flight (the 135M
            // shape's step at batch 1, 1 thread: 7.6 against 5.8-7.0 ms; batch 8: 17.5-20.5 against 13.3-17.4)
            for (int j = 0; j < 4; j++) _mm_prefetch((const char*)(w + ((c + 8) * 4 + j) * 64), _MM_HINT_T0);
            for (int j = 0; j < 4; j++) {
                const vi v = load64(w + (c * 4 + j) * 64);
                lo[j] = low4(v), hi[j] = high4(v);
            }
            for (int b = 0; b < NB; b++) {
                const int64_t row = b0 + b, blk = row * blocks + c;
                const int8_t* xq = x.q + row * K + c * CHUNK;
                vi s0 = izeros(), s1 = izeros();  // two chains, for the adds' latency
                s0 = dot4(s0, lo[0], xq), s1 = dot4(s1, hi[0], xq + 4);
                s0 = dot4(s0, lo[1], xq + 8), s1 = dot4(s1, hi[1], xq + 12);
                s0 = dot4(s0, lo[2], xq + 16), s1 = dot4(s1, hi[2], xq + 20);
                s0 = dot4(s0, lo[3], xq + 24), s1 = dot4(s1, hi[3], xq + 28);
                acc[b] = fma(tofloat(iadd(s0, s1)), mul(S, set1(x.d[blk])), acc[b]);
                acc[b] = fma(Z, set1(x.sum[blk]), acc[b]);
            }
        }
    }
    for (int b = 0; b < NB; b++) storef(dots[b], acc[b]);
}

// dots[b][r] = x[b] . q[tile rows r] of an int8 weight (its scale per row left to store) for NB rows of x from b0:
// per block of 32 inputs, 8 integer dot products give each of the 16 rows' sums in its lane, then one conversion
// and one multiply-add by the block's d serve the 16 rows
template <int NB>
static void tile_dots_int8(const Linear& L, int64_t tile, const Quantized& x, int64_t b0, float dots[][R4]) {
    const int64_t K = L.K, blocks = K / CHUNK;
    const uint8_t* w = (const uint8_t*)L.w + tile * blocks * 8 * 64;
    vf acc[NB];
    for (int b = 0; b < NB; b++) acc[b] = zeros();
    for (int64_t c = 0; c < blocks; c++) {
        vi u[8];
        // 4 blocks (2 KiB) ahead, as int4's 8: a block of int8 is twice its bytes
        for (int j = 0; j < 8; j++) _mm_prefetch((const char*)(w + ((c + 4) * 8 + j) * 64), _MM_HINT_T0);
        for (int j = 0; j < 8; j++) u[j] = prep8(load64(w + (c * 8 + j) * 64));
        for (int b = 0; b < NB; b++) {
            const int64_t row = b0 + b, blk = row * blocks + c;
            const int8_t* xq = x.q + row * K + c * CHUNK;
            vi s0 = start8(x.isum[blk]), s1 = izeros();  // two chains, for the adds' latency
            s0 = dot8(s0, u[0], xq), s1 = dot8(s1, u[1], xq + 4);
            s0 = dot8(s0, u[2], xq + 8), s1 = dot8(s1, u[3], xq + 12);
            s0 = dot8(s0, u[4], xq + 16), s1 = dot8(s1, u[5], xq + 20);
            s0 = dot8(s0, u[6], xq + 24), s1 = dot8(s1, u[7], xq + 28);
            acc[b] = fma(tofloat(iadd(s0, s1)), set1(x.d[blk]), acc[b]);
        }
    }
    for (int b = 0; b < NB; b++) storef(dots[b], acc[b]);
}

template <int NB>
static void tile_dots_q(const Linear& L, int64_t tile, const Quantized& x, int64_t b0, float dots[][R4]) {
    if (L.kind == INT4) tile_dots_int4<NB>(L, tile, x, b0, dots);
    else tile_dots_int8<NB>(L, tile, x, b0, dots);
}

// A block holding a NaN or an infinity: no integers (their conversion is undefined), and NaN for its scale and
// sum, so that every product it enters comes out NaN, as a float product's would, not finite and wrong
static inline void not_finite(int8_t* q, float* d, float* sum, int32_t* isum) {
    memset(q, 0, CHUNK);
    *d = *sum = NAN, *isum = 0;
}

// x's rows rounded to int8 in blocks of 32 (round to nearest, scale max |x| / 127), into one allocation (*own,
// null where there is no memory)
static Quantized quantize_rows(const void* x, int64_t B, int64_t K, int bf16, void** own) {
    const int64_t n = B * K, blocks = n / CHUNK;
    char* mem = (char*)malloc(n + 12 * blocks);
    *own = mem;
    if (!mem) return {nullptr, nullptr, nullptr, nullptr};
    int8_t* q = (int8_t*)mem;
    float *d = (float*)(mem + n), *sum = d + blocks;
    int32_t* isum = (int32_t*)(sum + blocks);
#ifdef __AVX512F__
    // 32 values in two registers: at batch 1 the scalar loop below took ~8 % of an int4 step
    for (int64_t j = 0; j < blocks; j++) {
        __m512 v0, v1;
        if (bf16) {
            const uint16_t* p = (const uint16_t*)x + j * CHUNK;
            v0 = bf16s(p).v, v1 = bf16s(p + 16).v;
        } else {
            v0 = _mm512_loadu_ps((const float*)x + j * CHUNK), v1 = _mm512_loadu_ps((const float*)x + j * CHUNK + 16);
        }
        sum[j] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
        if (!isfinite(sum[j])) {
            not_finite(q + j * CHUNK, d + j, sum + j, isum + j);
            continue;
        }
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        // cvtps rounds to nearest even, as nearbyintf does; |v * inv| <= 127 fits a byte
        const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
        _mm_storeu_si128((__m128i*)(q + j * CHUNK), _mm512_cvtsepi32_epi8(i0));
        _mm_storeu_si128((__m128i*)(q + j * CHUNK + 16), _mm512_cvtsepi32_epi8(i1));
        d[j] = amax / 127.f, isum[j] = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
    }
    return {q, d, sum, isum};
#endif
    for (int64_t j = 0; j < blocks; j++) {
        float v[CHUNK], amax = 0.f, s = 0.f;
        for (int i = 0; i < CHUNK; i++) {
            const int64_t at = j * CHUNK + i;
            v[i] = bf16 ? from_bf16(((const uint16_t*)x)[at]) : ((const float*)x)[at];
            amax = fmaxf(amax, fabsf(v[i]));
            s += v[i];
        }
        if (!isfinite(s)) {
            not_finite(q + j * CHUNK, d + j, sum + j, isum + j);
            continue;
        }
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        int32_t is = 0;
        for (int i = 0; i < CHUNK; i++) is += q[j * CHUNK + i] = (int8_t)nearbyintf(v[i] * inv);
        d[j] = amax / 127.f, sum[j] = s, isum[j] = is;
    }
    return {q, d, sum, isum};
}

// where y's rows go: y (B, N) float32 or bf16, with res (B, N) in y's dtype added (it may be y itself)
struct Out {
    void* y;
    const void* res;
    int bf16;
};

// rows n0..n0 + rows - 1 of y for nb rows of x from b0, from dots (nb, stride)
static void store(const Linear& L, int64_t n0, int rows, const float* dots, int stride, int64_t b0, int nb,
                  const Out& o) {
    for (int b = 0; b < nb; b++)
        for (int r = 0; r < rows; r++) {
            const int64_t n = n0 + r, i = (b0 + b) * L.N + n;
            if (n >= L.N) break;  // a padding row
            float v = dots[b * stride + r];
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

static void tile_rows(const Linear& L, int64_t tile, const float* xf, const uint16_t* xh, int64_t B, const Out& o) {
    float dots[NB_MAX][R];
    for (int64_t b = 0; b < B; b += NB_MAX) {  // the tile's weights stay in L1 between these passes
        const int nb = (int)(B - b < NB_MAX ? B - b : NB_MAX);
        switch (nb) {
#if NB_MAX == 4
            case 4: tile_dots<4>(L, tile, xf, xh, b, dots); break;
            case 3: tile_dots<3>(L, tile, xf, xh, b, dots); break;
#endif
            case 2: tile_dots<2>(L, tile, xf, xh, b, dots); break;
            default: tile_dots<1>(L, tile, xf, xh, b, dots); break;
        }
        store(L, tile * R, R, dots[0], R, b, nb, o);
    }
}

static void tile_rows_q(const Linear& L, int64_t tile, const Quantized& xq, int64_t B, const Out& o) {
    float dots[NB4_MAX][R4];
    for (int64_t b = 0; b < B; b += NB4_MAX) {
        const int nb = (int)(B - b < NB4_MAX ? B - b : NB4_MAX);
        switch (nb) {
#if NB4_MAX == 8
            case 8: tile_dots_q<8>(L, tile, xq, b, dots); break;
            case 7: tile_dots_q<7>(L, tile, xq, b, dots); break;
            case 6: tile_dots_q<6>(L, tile, xq, b, dots); break;
            case 5: tile_dots_q<5>(L, tile, xq, b, dots); break;
            case 4: tile_dots_q<4>(L, tile, xq, b, dots); break;
            case 3: tile_dots_q<3>(L, tile, xq, b, dots); break;
#endif
            case 2: tile_dots_q<2>(L, tile, xq, b, dots); break;
            default: tile_dots_q<1>(L, tile, xq, b, dots); break;
        }
        store(L, tile * R4, R4, dots[0], R4, b, nb, o);
    }
}

static bool takes(const Linear& L) {
    if (L.N < 1 || L.K < 1 || L.K % CHUNK || (L.kind != BF16 && L.kind != INT8 && L.kind != INT4)) return false;
    return L.kind != INT4 || (L.K % PAIR == 0 && L.group > 0 && L.group % CHUNK == 0 && L.K % L.group == 0);
}

// ---- threads without a barrier that a busy core holds up ------------------------------------------------------
// A job is n items, which the caller and the pool's workers claim one at a time from a shared counter. The caller
// waits only for items a worker has claimed: where another process holds the other core, a worker that has not
// woken claims nothing and the caller does the whole job alone, at one thread's speed. OpenMP's join barrier
// waited for it instead, a scheduler's time slice a product: decode at 2 threads on a loaded 2-core machine took
// 35x as long as at 1 (benchmarks/README.md). Workers spin a while between jobs (a decode step's products follow
// each other within microseconds), then sleep. When a call from Python returns, the workers sleep at once
// (rest): torch's own threads run the ops between our calls (the pick, the norms), and a worker of ours spinning
// on the other core made each of torch's parallel regions wait for the scheduler to take that core back, 0.3 ms
// a region, so that 2 threads decoded slower than 1. One job at a time: a caller that finds the pool busy
// (another thread's step) runs its job alone. The workers are started on first use and live as long as the
// process.
struct Job {
    void (*fn)(const void* ctx, int64_t item, int worker);  // worker: 0 the caller, 1.. the pool's
    const void* ctx;
};

namespace pool {
enum { MAX = 64, GEN = 40 };               // workers at most; the ticket's generation sits above bit GEN
static std::atomic<uint64_t> ticket{0};    // (generation << GEN) | the next item to claim
static std::atomic<int64_t> items{0}, done{0};
static std::atomic<int> active{0};         // workers 1..active - 1 take part in the current job
static std::atomic<const Job*> job{nullptr};
static std::atomic<uint64_t> posted{0};    // the last job's generation
static std::atomic<bool> resting{true};    // the caller has returned to Python: workers sleep, not spin
// never destroyed: at exit, a condition variable's destructor would wait for the sleeping workers forever
static std::mutex &busy = *new std::mutex, &sleep_lock = *new std::mutex;
static std::condition_variable& wake = *new std::condition_variable;
static int started = 0;                    // workers running (under busy)
static uint64_t generation = 0;            // under busy

// claim and run the current job's items while there are any of generation g; how many this thread ran
static int64_t work(uint64_t g, int worker) {
    int64_t ran = 0;
    for (;;) {
        uint64_t t = ticket.load(std::memory_order_acquire);
        if (t >> GEN != g || (int64_t)(t & ((1ull << GEN) - 1)) >= items.load(std::memory_order_acquire)) break;
        if (!ticket.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
        const Job* j = job.load(std::memory_order_acquire);  // the caller is inside run() until this item is done
        j->fn(j->ctx, (int64_t)(t & ((1ull << GEN) - 1)), worker);
        done.fetch_add(1, std::memory_order_release);
        ran++;
    }
    return ran;
}

static void worker_loop(int worker) {
    uint64_t seen = 0;
    for (;;) {
        uint64_t g = posted.load(std::memory_order_acquire);
        for (int spin = 0; g == seen && spin < 200000 && !resting.load(std::memory_order_relaxed); spin++) {
            _mm_pause();
            g = posted.load(std::memory_order_acquire);
        }
        if (g == seen) {
            std::unique_lock<std::mutex> lock(sleep_lock);
            wake.wait(lock, [&] { return (g = posted.load(std::memory_order_acquire)) != seen; });
        }
        seen = g;
        if (worker < active.load(std::memory_order_acquire)) work(g, worker);
    }
}

// fn(ctx, i, worker) for i in 0..n-1 on up to `threads` threads, the caller one of them
static void run(const Job& j, int64_t n, int threads) {
    if (threads > MAX) threads = MAX;
    if (threads <= 1 || n <= 1 || !busy.try_lock()) {
        for (int64_t i = 0; i < n; i++) j.fn(j.ctx, i, 0);
        return;
    }
    for (; started < threads - 1; started++) std::thread(worker_loop, started + 1).detach();
    const uint64_t g = ++generation;
    resting.store(false, std::memory_order_relaxed);
    job.store(&j, std::memory_order_release);
    items.store(n, std::memory_order_release);
    done.store(0, std::memory_order_release);
    active.store(threads, std::memory_order_release);
    ticket.store(g << GEN, std::memory_order_release);
    {
        std::lock_guard<std::mutex> lock(sleep_lock);  // a worker about to sleep sees it, or is woken
        posted.store(g, std::memory_order_release);
    }
    wake.notify_all();
    work(g, 0);
    for (int spin = 0; done.load(std::memory_order_acquire) < n; spin++) {  // only items a worker holds
        if (spin < 4096) _mm_pause();
        else std::this_thread::yield();
    }
    busy.unlock();
}

// the caller goes back to Python, where the next job may be a while: the workers stop spinning and sleep
static void rest() { resting.store(true, std::memory_order_relaxed); }
}  // namespace pool

struct LinearJob {
    const Linear* L;
    const float* xf;
    const uint16_t* xh;
    const Quantized* xq;
    int64_t B, tiles, per;  // per: tiles an item
    const Out* o;
};

static void linear_item(const void* ctx, int64_t item, int) {
    const LinearJob& j = *(const LinearJob*)ctx;
    const int64_t end = (item + 1) * j.per < j.tiles ? (item + 1) * j.per : j.tiles;
    for (int64_t t = item * j.per; t < end; t++) {
        if (j.L->kind != BF16) tile_rows_q(*j.L, t, *j.xq, j.B, *j.o);
        else tile_rows(*j.L, t, j.xf, j.xh, j.B, *j.o);
    }
}

// y = x @ W.T + bias + res for x (B, K) float32, or bf16 where x_bf16; 0, or 2 where memory ran out
static int linear(const Linear& L, int64_t B, const void* x, int x_bf16, const Out& o, int threads) {
    const int64_t K = L.K;
    const float* xf = nullptr;
    const uint16_t* xh = nullptr;
    void* own = nullptr;
    Quantized xq = {nullptr, nullptr, nullptr, nullptr};
    if (L.kind != BF16) {
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
    const int64_t rows = L.kind == BF16 ? (int64_t)R : (int64_t)R4, tiles = (L.N + rows - 1) / rows;
    // threads only for a weight worth it: handing out a small product costs more than it saves. Items of a few
    // tiles, 4 for each thread: a worker that wakes late still finds some
    const int use = threads > 1 && L.N * L.K >= PARALLEL_WORK ? threads : 1;
    const int64_t per = (tiles + 4 * use - 1) / (4 * use);
    const LinearJob job = {&L, xf, xh, &xq, B, tiles, per, &o};
    pool::run({linear_item, &job}, (tiles + per - 1) / per, use);
    free(own);
    return 0;
}

// ---- int4 weights back to floats, for a prefill's product --------------------------------------------------------
// A prefill multiplies many rows by the weight dequantized (torch's product is faster there than ours); in torch
// the nibbles' un-tiling and the float32 arithmetic took 17 ms for a 3,072 x 576 layer, here 0.4 ms. Each tile's
// block is split into its 16 rows' 32 values in input order (run j's low nibbles are inputs 8j..8j+3, its high
// ones 8j+4..8j+7), and each row turned into q * scale + zero, as torch computed it, bit for bit.
struct DequantJob {
    const Linear* L;
    void* out;
    int bf16;
};

static void dequant_tile(const void* ctx, int64_t tile, int) {
    const DequantJob& j = *(const DequantJob*)ctx;
    const Linear& L = *j.L;
    const int64_t K = L.K, blocks = K / CHUNK, G = K / L.group, per_group = L.group / CHUNK;
    const uint8_t* w = (const uint8_t*)L.w + tile * blocks * 4 * 64;
    const uint16_t *scales = L.scale4 + tile * G * R4, *zeros4 = L.zero4 + tile * G * R4;
    const int rows = (int)(L.N - tile * R4 < R4 ? L.N - tile * R4 : R4);
    for (int64_t c = 0; c < blocks; c++) {
        const int64_t g = c / per_group;
        uint8_t nib[8][64];  // run j's low nibbles in nib[2j], its high ones in nib[2j + 1], 4 bytes a row
        for (int r = 0; r < 4; r++)
            for (int b = 0; b < 64; b++) {
                const uint8_t v = w[(c * 4 + r) * 64 + b];
                nib[2 * r][b] = v & 15, nib[2 * r + 1][b] = v >> 4;
            }
        for (int i = 0; i < rows; i++) {
            uint8_t q[CHUNK];
            for (int k = 0; k < 8; k++) memcpy(q + 4 * k, nib[k] + 4 * i, 4);
            const float S = _cvtsh_ss(scales[g * R4 + i]), Z = _cvtsh_ss(zeros4[g * R4 + i]);
            const int64_t at = (tile * R4 + i) * K + c * CHUNK;
            for (int m = 0; m < CHUNK; m++) {
                const float v = (float)q[m] * S + Z;
                if (j.bf16) ((uint16_t*)j.out)[at + m] = to_bf16(v);
                else ((float*)j.out)[at + m] = v;
            }
        }
    }
}

// out (N, K) float32, or bf16 where bf16 != 0: an int4 weight's values. 0, or 1 for a weight that is not int4.
static int dequantize(const Linear& L, void* out, int bf16, int threads) {
    if (L.kind != INT4 || !takes(L)) return 1;
    const DequantJob job = {&L, out, bf16};
    pool::run({dequant_tile, &job}, (L.N + R4 - 1) / R4, threads);
    return 0;
}

// ---- a whole decode step of a block --------------------------------------------------------------------------
// Every block we load, as block_forward computes it: the input norm (RMSNorm or LayerNorm, with or without a
// bias), the fused q, k, v projection, QK-norm, RoPE on the first rd dimensions of each head (half-split pairs,
// the layer's own tables), the new key and value into the cache (a sliding-window layer's ring: slot pos % window),
// grouped-query attention over each row's visible keys, the output projection, its post-norm (Gemma 3) and the
// residual add; then the MLP's norm, its first product (gated: gate half, then up half), the activation, the down
// projection, its post-norm and add. With the parallel residual (GPT-NeoX) the MLP reads the block's input. The
// residual stream stays in the model's dtype between the sub-blocks, as in the model's own forward; the rest is
// float32.

enum { ACT_SWIGLU = 0, ACT_GEGLU = 1, ACT_GELU = 2, ACT_GELU_TANH = 3, ACT_RELU2 = 4, ACTS = 5 };

struct Norm {
    const float* gain;  // (n,) float32, an offset norm's 1 + w already added; null: no norm here
    const float* bias;  // LayerNorm's (n,) float32, or null
    float eps;
    int32_t layer;      // 1: LayerNorm (the mean taken out first), 0: RMSNorm
};

struct Block {
    Linear qkv, proj, fc, down;  // attn.c_attn, attn.c_proj, mlp.c_fc (gated: gate half, then up half), mlp.c_proj
    Norm ln1, ln2;               // (C,)
    Norm q_norm, k_norm;         // QK-norm's (hs,), shared by the heads, before RoPE (Qwen3, Gemma 3); or no gain
    Norm post1, post2;           // each sub-block's output normed before its add (Gemma 3); or no gain
    int64_t C, nh, nkv, hs, H, S;  // S: the positions of the context (the tables' rows)
    int64_t act;                 // ACT_*
    int64_t parallel;            // 1: the MLP reads the block's input, not attention's sum
    int64_t rd;                  // dimensions of each head RoPE rotates, 0: none (learned or sinusoidal positions)
    int64_t window;              // a ring's slots (the sliding window, shorter than S), else 0: S slots
    const float* cos;            // RoPE (S, rd) float32: cos, and sin with its first half negated; this layer's
    const float* sin;
};

static inline float value(const void* p, int64_t i, int bf16) {
    return bf16 ? from_bf16(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}
static inline void put(void* p, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t*)p)[i] = to_bf16(v);
    else ((float*)p)[i] = v;
}

// one row of n values normed: out may be x itself
static void norm_row(const Norm& N, const void* x, int x_bf16, int64_t n, void* out, int out_bf16) {
    float mean = 0.f, ss = 0.f;
    if (N.layer) {
        for (int64_t c = 0; c < n; c++) mean += value(x, c, x_bf16);
        mean /= n;
    }
    for (int64_t c = 0; c < n; c++) {
        const float d = value(x, c, x_bf16) - mean;
        ss += d * d;
    }
    const float inv = 1.f / sqrtf(ss / n + N.eps);
    for (int64_t c = 0; c < n; c++) {
        const float v = (value(x, c, x_bf16) - mean) * inv * N.gain[c];
        put(out, c, N.bias ? v + N.bias[c] : v, out_bf16);
    }
}

static void norm_rows(const Norm& N, const void* x, int64_t B, int64_t C, void* out, int bf16) {
    const int64_t size = bf16 ? 2 : 4;
    for (int64_t b = 0; b < B; b++) norm_row(N, (const char*)x + b * C * size, bf16, C, (char*)out + b * C * size, bf16);
}

// x += post(y) for y (B, C) float32, normed in place
static void add_normed(const Norm& post, float* y, int64_t B, int64_t C, void* x, int bf16) {
    for (int64_t b = 0; b < B; b++) {
        norm_row(post, y + b * C, 0, C, y + b * C, 0);
        for (int64_t c = 0; c < C; c++) put(x, b * C + c, value(x, b * C + c, bf16) + y[b * C + c], bf16);
    }
}

// e^x within a few float32 ulps, branch-free so that the loops below vectorize (expf, tanhf and erff are calls, a
// third of a small model's step once its products are fast): x = n ln 2 + r, |r| <= ln 2 / 2, e^r by Cephes'
// polynomial, 2^n into the exponent bits. x is clamped to where e^x is a normal float.
static inline float exp_approx(float x) {
    x = x < -87.f ? -87.f : x > 88.f ? 88.f : x;
    const float n = (x * 1.44269504f + 12582912.f) - 12582912.f;  // round to nearest: 1.5 * 2^23
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;     // ln 2 in two parts (Cody and Waite)
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

// GELU's tanh form as 0.5 g (1 + tanh(u)) = g / (1 + e^(-2u)), u = sqrt(2 / pi) (g + 0.044715 g^3)
static inline float gelu_tanh(float g) { return g / (1.f + exp_approx(-1.5957691216f * (g + 0.044715f * g * g * g))); }

// exact GELU, 0.5 g (1 + erf(g / sqrt 2)), erf by Abramowitz and Stegun's 7.1.26 (absolute error under 1.5e-7)
static inline float gelu_erf(float g) {
    const float x = g * 0.7071067812f, a = x < 0.f ? -x : x, t = 1.f / (1.f + 0.3275911f * a);
    const float poly = ((((1.061405429f * t - 1.453152027f) * t + 1.421413741f) * t - 0.284496736f) * t + 0.254829592f) * t;
    const float e = 1.f - poly * exp_approx(-x * x);
    return 0.5f * g * (1.f + (x < 0.f ? -e : e));
}

// one row's hidden layer (H,) float32 from its first product fc (2H gated: gate half, then up half; else H)
static void activate(int64_t act, const float* fc, int64_t H, float* out) {
    const float* up = fc + H;
    switch (act) {
        case ACT_SWIGLU:
            for (int64_t i = 0; i < H; i++) out[i] = fc[i] / (1.f + exp_approx(-fc[i])) * up[i];
            break;
        case ACT_GEGLU:
            for (int64_t i = 0; i < H; i++) out[i] = gelu_tanh(fc[i]) * up[i];
            break;
        case ACT_GELU:
            for (int64_t i = 0; i < H; i++) out[i] = gelu_erf(fc[i]);
            break;
        case ACT_GELU_TANH:
            for (int64_t i = 0; i < H; i++) out[i] = gelu_tanh(fc[i]);
            break;
        default:  // ACT_RELU2
            for (int64_t i = 0; i < H; i++) out[i] = fc[i] > 0.f ? fc[i] * fc[i] : 0.f;
    }
}

static inline bool gated(int64_t act) { return act == ACT_SWIGLU || act == ACT_GEGLU; }

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

// the first rd values of a head rotated in pairs (i, i + rd / 2); the rest carry no position
static void rope(float* x, const float* cos, const float* sin, int64_t rd) {
    const int64_t half = rd / 2;
    float t[512];
    memcpy(t, x, sizeof(float) * rd);
    for (int64_t i = 0; i < rd; i++) x[i] = t[i] * cos[i] + t[i < half ? i + half : i - half] * sin[i];
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

// a sub-block's output product added to the residual stream x: in the product where there is no post-norm
static int project_add(const Linear& W, const Norm& post, int64_t B, const void* in, void* x, int bf16, float* tmp,
                       int threads, double* timers) {
    if (!post.gain) return timed_linear(W, B, in, bf16, {x, x, bf16}, threads, timers);
    if (timed_linear(W, B, in, bf16, {tmp, nullptr, 0}, threads, timers)) return 2;
    add_normed(post, tmp, B, W.N, x, bf16);
    return 0;
}

// each row's new query, key and value (B, width): QK-norm, RoPE, and the key and value into the cache
static void place_keys(const Block& L, int64_t B, float* qkv, const int64_t* pos, const int64_t* rows, int ring,
                       void* kc, void* vc, int kv_bf16) {
    const int64_t nh = L.nh, nkv = L.nkv, hs = L.hs, width = (nh + 2 * nkv) * hs;
    const bool in_ring = L.window && ring;  // else the layer's cache holds every position
    const int64_t slots = in_ring ? L.window : L.S;
    for (int64_t b = 0; b < B; b++) {
        float* row = qkv + b * width;
        if (L.q_norm.gain) {  // each query and key head's hs values normed with the shared gains
            for (int64_t head = 0; head < nh + nkv; head++)
                norm_row(head < nh ? L.q_norm : L.k_norm, row + head * hs, 0, hs, row + head * hs, 0);
        }
        if (L.rd) {
            const float *c = L.cos + pos[b] * L.rd, *s = L.sin + pos[b] * L.rd;
            for (int64_t head = 0; head < nh + nkv; head++) rope(row + head * hs, c, s, L.rd);
        }
        const int64_t slot = in_ring ? pos[b] % L.window : pos[b];
        for (int64_t kh = 0; kh < nkv; kh++) {
            const int64_t at = ((rows[b] * nkv + kh) * slots + slot) * hs;
            for (int64_t d = 0; d < hs; d++) {
                put(kc, at + d, row[(nh + kh) * hs + d], kv_bf16);
                put(vc, at + d, row[(nh + nkv + kh) * hs + d], kv_bf16);
            }
        }
    }
}

// attention over the cache for every (row, key/value head) of a step, an item each: the threads' items
struct AttendJob {
    const Block* L;
    const float* qkv;  // (B, width)
    const int64_t *pos, *rows;
    int ring;
    const void *kc, *vc;
    int kv_bf16;
    float* scores;  // (threads, S): each thread its own row
    float* att;     // (B, nh * hs)
};

// the keys row b sees at position p, from the first slot `start` on, `n` of them: a ring holds exactly its window
// once full (softmax does not care in which order the slots hold them); a windowed layer whose cache holds every
// position sees the window's last keys in place; any other layer sees every position up to p
static int64_t visible(const Block& L, int ring, int64_t p, int64_t* start) {
    *start = L.window && !ring && p >= L.window ? p + 1 - L.window : 0;
    return L.window && p >= L.window ? L.window : p + 1;
}

static void attend_item(const void* ctx, int64_t t, int worker) {
    const AttendJob& j = *(const AttendJob*)ctx;
    const Block& L = *j.L;
    const int64_t nh = L.nh, nkv = L.nkv, hs = L.hs, width = (nh + 2 * nkv) * hs;
    const int64_t slots = L.window && j.ring ? L.window : L.S;
    const int64_t b = t / nkv, kh = t % nkv, group = nh / nkv;
    int64_t start;
    const int64_t n = visible(L, j.ring, j.pos[b], &start);
    const int64_t at = ((j.rows[b] * nkv + kh) * slots + start) * hs;
    attend(L, j.qkv + b * width + kh * group * hs, (const char*)j.kc + at * (j.kv_bf16 ? 2 : 4),
           (const char*)j.vc + at * (j.kv_bf16 ? 2 : 4), n, j.kv_bf16, j.scores + worker * L.S,
           j.att + (b * nh + kh * group) * hs);
}

// attention of each row's queries over its visible keys (visible()), in its cache row rows[b]
static void attend_rows(const Block& L, int64_t B, const float* qkv, const int64_t* pos, const int64_t* rows, int ring,
                        const void* kc, const void* vc, int kv_bf16, float* scores, float* att, int threads) {
    const int64_t nh = L.nh, nkv = L.nkv, hs = L.hs;
    int64_t keys = 0, start;  // the attention's work: every row's visible keys times the heads' widths
    for (int64_t b = 0; b < B; b++) keys += visible(L, ring, pos[b], &start);
    const bool split = threads > 1 && B * nkv > 1 && keys * nh * hs >= PARALLEL_WORK;
    const AttendJob job = {&L, qkv, pos, rows, ring, kc, vc, kv_bf16, scores, att};
    pool::run({attend_item, &job}, B * nkv, split ? threads : 1);
}

// one step's scratch, carved from one allocation for B rows (Scratch::carve)
struct Scratch {
    void *xn, *xn2;  // (B, C) model dtype: the attention's and the MLP's normed inputs
    float *qkv, *att, *fc, *out;  // (B, width), (B, nh * hs), (B, 2H), (B, C): a post-normed product's output
    void *atto, *h;  // (B, nh * hs), (B, H) model dtype
    float* hidden;   // (H,): one row's hidden layer in float32
    float* scores;   // (threads, S)
    static int64_t bytes(const Block& f, int64_t B, int threads) {
        const int64_t width = (f.nh + 2 * f.nkv) * f.hs, heads = f.nh * f.hs;
        return 4 * (B * (3 * f.C + width + 2 * heads + 3 * f.H) + f.H + (threads + 1) * f.S);
    }
    static Scratch carve(char* p, const Block& f, int64_t B) {
        const int64_t width = (f.nh + 2 * f.nkv) * f.hs, heads = f.nh * f.hs;
        Scratch s;
        float* at = (float*)p;
        s.xn = at, at += B * f.C;
        s.xn2 = at, at += B * f.C;
        s.out = at, at += B * f.C;
        s.qkv = at, at += B * width;
        s.att = at, at += B * heads;
        s.atto = at, at += B * heads;
        s.fc = at, at += B * 2 * f.H;
        s.h = at, at += B * f.H;
        s.hidden = at, at += f.H;
        s.scores = at;
        return s;
    }
};

static int block_step(const Block& L, int64_t B, void* x, const int64_t* pos, const int64_t* rows, int ring, void* kc,
                      void* vc, int bf16, int kv_bf16, int threads, const Scratch& s, double* timers) {
    const int64_t C = L.C, H = L.H, heads = L.nh * L.hs;
    norm_rows(L.ln1, x, B, C, s.xn, bf16);
    if (L.parallel) norm_rows(L.ln2, x, B, C, s.xn2, bf16);  // the MLP's input: the block's, before attention
    if (timed_linear(L.qkv, B, s.xn, bf16, {s.qkv, nullptr, 0}, threads, timers)) return 2;
    place_keys(L, B, s.qkv, pos, rows, ring, kc, vc, kv_bf16);
    const double t0 = timers ? now() : 0;
    attend_rows(L, B, s.qkv, pos, rows, ring, kc, vc, kv_bf16, s.scores, s.att, threads);
    if (timers) timers[1] += now() - t0;
    for (int64_t i = 0; i < B * heads; i++) put(s.atto, i, s.att[i], bf16);
    if (project_add(L.proj, L.post1, B, s.atto, x, bf16, s.out, threads, timers)) return 2;
    if (!L.parallel) norm_rows(L.ln2, x, B, C, s.xn2, bf16);
    if (timed_linear(L.fc, B, s.xn2, bf16, {s.fc, nullptr, 0}, threads, timers)) return 2;
    for (int64_t b = 0; b < B; b++) {
        activate(L.act, s.fc + b * L.fc.N, H, s.hidden);
        for (int64_t i = 0; i < H; i++) put(s.h, b * H + i, s.hidden[i], bf16);
    }
    return project_add(L.down, L.post2, B, s.h, x, bf16, s.out, threads, timers);
}

// whether ng_decode takes a layer: its products' shapes those of the first layer's scratch, its choices known
static bool takes_block(const Block& L, const Block& f) {
    if (!takes(L.qkv) || !takes(L.proj) || !takes(L.fc) || !takes(L.down) || L.hs % 16 || L.hs > 512) return false;
    const int64_t width = (L.nh + 2 * L.nkv) * L.hs;
    if (L.nkv <= 0 || L.nh % L.nkv || L.qkv.K != L.C || L.qkv.N != width || L.proj.K != L.nh * L.hs ||
        L.proj.N != L.C || L.fc.K != L.C || L.fc.N != (gated(L.act) ? 2 : 1) * L.H || L.down.K != L.H ||
        L.down.N != L.C)
        return false;
    if (L.C != f.C || L.H != f.H || L.S != f.S || width != (f.nh + 2 * f.nkv) * f.hs || L.nh * L.hs != f.nh * f.hs)
        return false;
    if (L.act < 0 || L.act >= ACTS || L.rd < 0 || L.rd > L.hs || L.rd % 2 || (L.rd && (!L.cos || !L.sin)))
        return false;
    if (L.window < 0 || L.window > L.S || !L.ln1.gain || !L.ln2.gain || !L.q_norm.gain != !L.k_norm.gain)
        return false;
    return true;
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
    {"Norm", "", 0, sizeof(Norm)},
    FIELD(Norm, gain), FIELD(Norm, bias), FIELD(Norm, eps), FIELD(Norm, layer),
    {"Block", "", 0, sizeof(Block)},
    FIELD(Block, qkv), FIELD(Block, proj), FIELD(Block, fc), FIELD(Block, down), FIELD(Block, ln1),
    FIELD(Block, ln2), FIELD(Block, q_norm), FIELD(Block, k_norm), FIELD(Block, post1), FIELD(Block, post2),
    FIELD(Block, C), FIELD(Block, nh), FIELD(Block, nkv), FIELD(Block, hs), FIELD(Block, H), FIELD(Block, S),
    FIELD(Block, act), FIELD(Block, parallel), FIELD(Block, rd), FIELD(Block, window), FIELD(Block, cos),
    FIELD(Block, sin),
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
int ng_int4_rows() { return R4; }

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
    const int rc = linear(*L, B, x, bf16, {y, res, bf16}, threads);
    pool::rest();
    return rc;
}

// out (N, K) = an int4 weight's values (w = q * scale + zero), float32 or bf16 where bf16 != 0, contiguous.
// Returns 0, or 1 for a weight that is not int4 or a shape the kernels do not take.
int ng_dequantize(const Linear* L, void* out, int bf16, int threads) {
    if (threads < 1) return 1;
    const int rc = dequantize(*L, out, bf16, threads);
    pool::rest();
    return rc;
}

// whether rows shares a cache row between two of x's rows
static bool shared(const int64_t* rows, int64_t B) {
    for (int64_t b = 0; b < B; b++)
        for (int64_t c = 0; c < b; c++)
            if (rows[b] == rows[c]) return true;
    return false;
}

static int decode_rows(const Block* blocks, int64_t n_layer, int64_t B, void* x, const int64_t* pos,
                       const int64_t* rows, int64_t cache_rows, int ring, void* const* ks, void* const* vs, int bf16,
                       int kv_bf16, int threads, double* timers) {
    bool windows = false;
    for (int64_t l = 0; l < n_layer; l++) {
        if (!takes_block(blocks[l], blocks[0])) return 1;
        windows = windows || blocks[l].window;
        for (int64_t b = 0; b < B; b++)
            if (pos[b] < 0 || pos[b] >= blocks[l].S) return 3;
    }
    for (int64_t b = 0; b < B; b++)
        if (rows[b] < 0 || rows[b] >= cache_rows) return 3;
    // a ring's later row would overwrite a key that an earlier row of its cache row still sees
    if (ring && windows && shared(rows, B)) return 1;
    const double t0 = timers ? now() : 0;
    char* mem = (char*)malloc(Scratch::bytes(blocks[0], B, threads));
    if (!mem) return 2;
    const Scratch scratch = Scratch::carve(mem, blocks[0], B);
    int rc = 0;
    for (int64_t l = 0; l < n_layer && rc == 0; l++)
        rc = block_step(blocks[l], B, x, pos, rows, ring, ks[l], vs[l], bf16, kv_bf16, threads, scratch, timers);
    free(mem);
    if (timers) timers[2] += now() - t0;
    return rc;
}

// One decode step of n_layer blocks for B rows, each one new token at its position pos[b]: x (B, C), the
// residual stream in the model's dtype (bf16 where bf16), in and out; ks[l] and vs[l] the layer's cache
// (cache_rows, nkv, slots, hs), bf16 where kv_bf16: a windowed layer's slots its window where ring (the key at
// position p in slot p % window), else S, as every other layer's (the key at p in slot p, the window's last keys
// seen). rows[b] the cache row of x's row b (null: row b); several x rows may share one (not in a ring): each
// layer writes every row's key and value before any row attends, so rows of one cache row at positions p, p + 1,
// ... are one sequence's next tokens, each seeing those before it (a speculative check). timers: the caller's
// profile clock (3 doubles, see now()) or null. Returns 0, 1 for a shape or choice the step does not take, 2
// where memory ran out, 3 for a position or row outside the cache.
int ng_decode(const Block* blocks, int64_t n_layer, int64_t B, void* x, const int64_t* pos, const int64_t* rows,
              int64_t cache_rows, int ring, void* const* ks, void* const* vs, int bf16, int kv_bf16, int threads,
              double* timers) {
    if (n_layer < 1 || B < 1 || threads < 1) return 1;
    int64_t* own = nullptr;
    if (!rows) {  // row b of x is row b of the cache
        own = (int64_t*)malloc(B * sizeof(int64_t));
        if (!own) return 2;
        for (int64_t b = 0; b < B; b++) own[b] = b;
        rows = own;
    }
    const int rc =
        decode_rows(blocks, n_layer, B, x, pos, rows, cache_rows, ring, ks, vs, bf16, kv_bf16, threads, timers);
    free(own);
    pool::rest();
    return rc;
}
}
