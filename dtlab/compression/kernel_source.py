"""The C source of :mod:`dtlab.compression.kernels` (plain C11, no headers beyond libc and, where the
CPU has F16C, the x86 intrinsics; built with ``-ffp-contract=off``, so every float operation rounds
exactly as the torch fallback's), and the ``ctypes`` signatures of its functions."""

import ctypes

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

static inline int nonfinite(float v) { uint32_t u; memcpy(&u, &v, 4); return ((u >> 23) & 0xffu) == 0xffu; }

int64_t dt_add_count_nonfinite(const float* a, const float* b, float* out, int64_t n) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) { float v = a[i] + b[i]; out[i] = v; bad += nonfinite(v); }
    return bad;
}

/* indices i with |x[i]| >= thr (strict: |x[i]| > thr); the first cap are written; returns the count.
   With AVX2: eight comparisons at a time, then the set bits of their mask; otherwise blocks of 64 are
   tested without branches first (vectorized) and only blocks with a hit are scanned. */
#define DT_TAKE(v) (strict ? fabsf(v) > thr : fabsf(v) >= thr)
int64_t dt_indices_above(const float* x, int64_t n, float thr, int strict, int64_t* out, int64_t cap) {
    int64_t c = 0, i = 0;
#ifdef __AVX2__
    const __m256 vt = _mm256_set1_ps(thr), sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) {
        __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i));
        unsigned m = (unsigned)_mm256_movemask_ps(strict ? _mm256_cmp_ps(a, vt, _CMP_GT_OQ)
                                                         : _mm256_cmp_ps(a, vt, _CMP_GE_OQ));
        while (m) {
            int j = __builtin_ctz(m);
            if (c < cap) out[c] = i + j;
            c++;
            m &= m - 1;
        }
    }
#else
    for (; i + 64 <= n; i += 64) {
        int hit = 0;
        for (int j = 0; j < 64; j++) hit |= DT_TAKE(x[i + j]);
        if (!hit) continue;
        for (int64_t j = i; j < i + 64; j++) if (DT_TAKE(x[j])) { if (c < cap) out[c] = j; c++; }
    }
#endif
    for (; i < n; i++) if (DT_TAKE(x[i])) { if (c < cap) out[c] = i; c++; }
    return c;
}

/* out = a + b, the count of non-finite values of out (into *bad), and the indices i with
   |out[i]| >= thr (strict: > thr) as dt_indices_above: one pass instead of two. zero_a: a is zeroed
   as it is read (its cache lines are written back, never fetched again: cheaper than a later memset) */
int64_t dt_add_select(float* restrict a, const float* restrict b, float* restrict out, int64_t n,
                      float thr, int strict, int64_t* restrict idx, int64_t cap, int64_t* bad_out,
                      int zero_a) {
    int64_t c = 0, bad = 0, i = 0;
#ifdef __AVX2__
    const __m256 vt = _mm256_set1_ps(thr), sign = _mm256_set1_ps(-0.0f);
    const __m256i em = _mm256_set1_epi32(0x7f800000);
    __m256i vbad = _mm256_setzero_si256();
    const __m256 zero = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i));
        _mm256_storeu_ps(out + i, v);
        if (zero_a) _mm256_storeu_ps(a + i, zero);
        __m256i e = _mm256_and_si256(_mm256_castps_si256(v), em);
        vbad = _mm256_sub_epi32(vbad, _mm256_cmpeq_epi32(e, em));
        __m256 av = _mm256_andnot_ps(sign, v);
        unsigned m = (unsigned)_mm256_movemask_ps(strict ? _mm256_cmp_ps(av, vt, _CMP_GT_OQ)
                                                         : _mm256_cmp_ps(av, vt, _CMP_GE_OQ));
        while (m) {
            int j = __builtin_ctz(m);
            if (c < cap) idx[c] = i + j;
            c++;
            m &= m - 1;
        }
    }
    int32_t lanes[8];
    _mm256_storeu_si256((__m256i*)lanes, vbad);
    for (int j = 0; j < 8; j++) bad += lanes[j];
#else
    for (; i + 64 <= n; i += 64) {
        int hit = 0;
        for (int j = 0; j < 64; j++) {
            float v = a[i + j] + b[i + j];
            out[i + j] = v;
            if (zero_a) a[i + j] = 0.0f;
            bad += nonfinite(v);
            hit |= DT_TAKE(v);
        }
        if (!hit) continue;
        for (int64_t j = i; j < i + 64; j++) if (DT_TAKE(out[j])) { if (c < cap) idx[c] = j; c++; }
    }
#endif
    for (; i < n; i++) {
        float v = a[i] + b[i];
        out[i] = v;
        if (zero_a) a[i] = 0.0f;
        bad += nonfinite(v);
        if (DT_TAKE(v)) { if (c < cap) idx[c] = i; c++; }
    }
    *bad_out = bad;
    return c;
}

/* sorted unique indices of the concatenation of runs (each sorted ascending, no repeats inside a
   run) and the sums of their values, added in input order starting from 0 (as index_add_ into
   zeros); returns the number of unique indices */
int64_t dt_merge_runs(const int64_t* idx, const float* vals, const int64_t* starts, int64_t runs,
                      int64_t* out_idx, float* out_vals) {
    int64_t pos[64], end[64], c = 0;
    for (int64_t r = 0; r < runs; r++) { pos[r] = starts[r]; end[r] = starts[r + 1]; }
    for (;;) {
        int64_t best = -1;
        for (int64_t r = 0; r < runs; r++)
            if (pos[r] < end[r] && (best < 0 || idx[pos[r]] < best)) best = idx[pos[r]];
        if (best < 0) break;
        float s = 0.0f;
        for (int64_t r = 0; r < runs; r++)
            if (pos[r] < end[r] && idx[pos[r]] == best) { s = s + vals[pos[r]]; pos[r]++; }
        out_idx[c] = best; out_vals[c] = s; c++;
    }
    return c;
}

int64_t dt_intersect_sorted(const int64_t* a, int64_t na, const int64_t* b, int64_t nb, int64_t* out) {
    int64_t i = 0, j = 0, c = 0;
    while (i < na && j < nb) {
        if (a[i] < b[j]) i++;
        else if (b[j] < a[i]) j++;
        else { out[c++] = a[i]; i++; }
    }
    return c;
}

static inline uint32_t mul32(uint32_t x, uint32_t c) { return x * c; }
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16; x = mul32(x, 0x7feb352du); x ^= x >> 15; x = mul32(x, 0x846ca68bu); x ^= x >> 16;
    return x;
}

/* QSGD codes of x[lo:hi] (all inside the buffer); x becomes x - code * scale; returns nonzero codes */
static int64_t qsgd_block(float* restrict x, int8_t* restrict codes, int64_t lo, int64_t hi, uint32_t key,
                          float safe, float lv, float scale) {
    int64_t sent = 0;
    for (int64_t i = lo; i < hi; i++) {
        float v = x[i];
        float u = (float)(int32_t)(mix32((uint32_t)i ^ key) >> 8) * 5.9604644775390625e-08f;
        float t = fabsf(v) / safe;
        t = t * lv;
        t = t + u;
        float level = (float)(int32_t)t;  /* t >= 0 and small: truncation is floor */
        level = level > lv ? lv : level;
        float s = v > 0.0f ? 1.0f : (v < 0.0f ? -1.0f : 0.0f);
        float code = s * level;
        codes[i] = (int8_t)(int32_t)code;
        sent += code != 0.0f;
        x[i] = v - code * scale;
    }
    return sent;
}

/* QSGD codes of x (n values, buckets of b, the last one zero-padded); x becomes x - code * norm/levels */
int64_t dt_qsgd_encode(float* x, int64_t n, int64_t b, const float* norms, int32_t levels, uint32_t key,
                       int8_t* codes) {
    int64_t nb = (n + b - 1) / b, sent = 0;
    float lv = (float)levels;
    for (int64_t j = 0; j < nb; j++) {
        float norm = norms[j], safe = norm > 0.0f ? norm : 1.0f, scale = norm / lv;
        int64_t lo = j * b, hi = lo + b < n ? lo + b : n;
        sent += qsgd_block(x, codes, lo, hi, key, safe, lv, scale);
        for (int64_t i = hi; i < lo + b; i++) codes[i] = 0;  /* padding: sign(0) * level = 0 */
    }
    return sent;
}

/* out[i] = (sum over r of codes[r][i] * (norms[r][i / b] / levels)) / p; returns the nonzero count */
int64_t dt_qsgd_decode_mean(const int8_t* codes, const float* norms, int64_t p, int64_t nb, int64_t b,
                            int64_t n, int32_t levels, float* out) {
    int64_t nz = 0;
    float lv = (float)levels, fp = (float)p;
    for (int64_t j = 0; j < nb; j++) {
        int64_t lo = j * b, hi = lo + b < n ? lo + b : n;
        for (int64_t i = lo; i < hi; i++) out[i] = 0.0f;
        for (int64_t r = 0; r < p; r++) {
            float scale = norms[r * nb + j] / lv;
            const int8_t* c = codes + r * nb * b;
            for (int64_t i = lo; i < hi; i++) { float d = (float)c[i] * scale; out[i] = out[i] + d; }
        }
        for (int64_t i = lo; i < hi; i++) { out[i] = out[i] / fp; nz += out[i] != 0.0f; }
    }
    return nz;
}

/* out = 0 except out[idx[j]] = vals[j] (idx sorted ascending, unique, in range): one sequential pass */
void dt_write_sparse(float* out, int64_t n, const int64_t* idx, const float* vals, int64_t k) {
    int64_t pos = 0;
    for (int64_t j = 0; j < k; j++) {
        int64_t i = idx[j];
        if (i > pos) memset(out + pos, 0, (size_t)(i - pos) * sizeof(float));
        out[i] = vals[j];
        pos = i + 1;
    }
    if (n > pos) memset(out + pos, 0, (size_t)(n - pos) * sizeof(float));
}

/* sum and sum of squares of x in double, eight independent lanes (vectorized) */
void dt_sum_sumsq(const float* x, int64_t n, double* out) {
    double s[8] = {0}, q[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        for (int j = 0; j < 8; j++) { double v = (double)x[i + j]; s[j] += v; q[j] += v * v; }
    }
    double st = 0.0, qt = 0.0;
    for (; i < n; i++) { double v = (double)x[i]; st += v; qt += v * v; }
    for (int j = 0; j < 8; j++) { st += s[j]; qt += q[j]; }
    out[0] = st; out[1] = qt;
}

/* out = a + b and the count of its non-finite values (returned), with the sum and the sum of
   squares of out in double (into sums[0], sums[1]) accumulated exactly as dt_sum_sumsq does */
int64_t dt_add_sumsq(const float* restrict a, const float* restrict b, float* restrict out, int64_t n,
                     double* sums) {
    double s[8] = {0}, q[8] = {0};
    int64_t i = 0, bad = 0;
#ifdef __AVX2__
    /* the same eight lanes, two registers of four doubles each */
    __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd(), q0 = _mm256_setzero_pd(),
            q1 = _mm256_setzero_pd();
    const __m256i em = _mm256_set1_epi32(0x7f800000);
    __m256i vbad = _mm256_setzero_si256();
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i));
        _mm256_storeu_ps(out + i, v);
        __m256i e = _mm256_and_si256(_mm256_castps_si256(v), em);
        vbad = _mm256_sub_epi32(vbad, _mm256_cmpeq_epi32(e, em));
        __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
        __m256d d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
        s0 = _mm256_add_pd(s0, d0); s1 = _mm256_add_pd(s1, d1);
        q0 = _mm256_add_pd(q0, _mm256_mul_pd(d0, d0)); q1 = _mm256_add_pd(q1, _mm256_mul_pd(d1, d1));
    }
    _mm256_storeu_pd(s, s0); _mm256_storeu_pd(s + 4, s1);
    _mm256_storeu_pd(q, q0); _mm256_storeu_pd(q + 4, q1);
    int32_t lanes[8];
    _mm256_storeu_si256((__m256i*)lanes, vbad);
    for (int j = 0; j < 8; j++) bad += lanes[j];
#else
    for (; i + 8 <= n; i += 8) {
        for (int j = 0; j < 8; j++) {
            float v = a[i + j] + b[i + j];
            out[i + j] = v;
            bad += nonfinite(v);
            double d = (double)v; s[j] += d; q[j] += d * d;
        }
    }
#endif
    double st = 0.0, qt = 0.0;
    for (; i < n; i++) {
        float v = a[i] + b[i];
        out[i] = v;
        bad += nonfinite(v);
        double d = (double)v; st += d; qt += d * d;
    }
    for (int j = 0; j < 8; j++) { st += s[j]; qt += q[j]; }
    sums[0] = st; sums[1] = qt;
    return bad;
}

/* hist[d] = how many of the positive floats among x (as int32 bits: 0 < bits <= +inf's; they order
   like their bits) have the bits above shift + 8 equal to prefix's and the byte at shift equal to d:
   one round of a radix select */
void dt_radix_hist(const int32_t* x, int64_t n, int shift, int32_t prefix, int64_t* hist) {
    uint32_t high = shift >= 24 ? 0u : ~0u << (shift + 8), want = (uint32_t)prefix & high;
    memset(hist, 0, 256 * sizeof(int64_t));
    for (int64_t i = 0; i < n; i++) {
        int32_t b = x[i];
        uint32_t u = (uint32_t)b;
        if (b > 0 && b <= 0x7f800000 && (u & high) == want) hist[(u >> shift) & 0xffu]++;
    }
}

/* out[j] = |x[pos[j]]| (independent loads: the memory system overlaps the misses) */
void dt_gather_abs(const float* x, const int64_t* pos, int64_t m, float* out) {
    for (int64_t j = 0; j < m; j++) out[j] = fabsf(x[pos[j]]);
}

/* out[j] = |a[pos[j]] + b[pos[j]]| (the magnitude of a sum that is not written yet) */
void dt_gather_add_abs(const float* a, const float* b, const int64_t* pos, int64_t m, float* out) {
    for (int64_t j = 0; j < m; j++) { float v = a[pos[j]] + b[pos[j]]; out[j] = fabsf(v); }
}

/* float32 -> float16 bits, round to nearest even (F. Giesen's float_to_half_fast3_rtne) */
static inline uint16_t to_f16(float ff) {
    uint32_t f; memcpy(&f, &ff, 4);
    const uint32_t f32infty = 255u << 23, f16max = (127u + 16u) << 23;
    const uint32_t magic_u = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    uint32_t sign = f & 0x80000000u; f ^= sign;
    uint16_t o;
    if (f >= f16max) {
        o = f > f32infty ? 0x7e00 : 0x7c00;
    } else if (f < (113u << 23)) {
        float t, magic; memcpy(&t, &f, 4); memcpy(&magic, &magic_u, 4);
        t += magic;
        uint32_t u; memcpy(&u, &t, 4);
        o = (uint16_t)(u - magic_u);
    } else {
        uint32_t mant_odd = (f >> 13) & 1u;
        f += ((uint32_t)(15 - 127) << 23) + 0xfffu;
        f += mant_odd;
        o = (uint16_t)(f >> 13);
    }
    return o | (uint16_t)(sign >> 16);
}
static inline float from_f16(uint16_t h) {
    const uint32_t shifted_exp = 0x7c00u << 13;
    uint32_t u = ((uint32_t)h & 0x7fffu) << 13, e = shifted_exp & u;
    u += (127u - 15u) << 23;
    float f;
    if (e == shifted_exp) { u += (128u - 16u) << 23; memcpy(&f, &u, 4); }
    else if (e == 0) { u += 1u << 23; memcpy(&f, &u, 4); f -= 6.103515625e-05f; }
    else memcpy(&f, &u, 4);
    uint32_t r; memcpy(&r, &f, 4); r |= ((uint32_t)h & 0x8000u) << 16; memcpy(&f, &r, 4);
    return f;
}

static inline uint16_t to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f;
}

/* low = (x / p) in bf16 (kind 1) or fp16 (kind 0); x becomes x - float(low) * p */
void dt_cast_with_residual(float* restrict x, int64_t n, int64_t p, int kind, uint16_t* restrict low) {
    float fp = (float)p;
    int64_t i = 0;
    if (kind == 1) {
        for (; i < n; i++) {
            uint16_t h = to_bf16(x[i] / fp); low[i] = h;
            float c = from_bf16(h) * fp; x[i] = x[i] - c;
        }
        return;
    }
#ifdef __F16C__
    __m256 vp = _mm256_set1_ps(fp);
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        __m128i h = _mm256_cvtps_ph(_mm256_div_ps(v, vp), _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((__m128i*)(low + i), h);
        _mm256_storeu_ps(x + i, _mm256_sub_ps(v, _mm256_mul_ps(_mm256_cvtph_ps(h), vp)));
    }
#endif
    for (; i < n; i++) {
        uint16_t h = to_f16(x[i] / fp); low[i] = h;
        float c = from_f16(h) * fp; x[i] = x[i] - c;
    }
}
"""

_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "dt_add_count_nonfinite": (_I64, [_PTR, _PTR, _PTR, _I64]),
    "dt_indices_above": (_I64, [_PTR, _I64, _F32, ctypes.c_int, _PTR, _I64]),
    "dt_add_select": (_I64, [_PTR, _PTR, _PTR, _I64, _F32, ctypes.c_int, _PTR, _I64, _PTR, ctypes.c_int]),
    "dt_intersect_sorted": (_I64, [_PTR, _I64, _PTR, _I64, _PTR]),
    "dt_qsgd_encode": (_I64, [_PTR, _I64, _I64, _PTR, ctypes.c_int32, ctypes.c_uint32, _PTR]),
    "dt_qsgd_decode_mean": (_I64, [_PTR, _PTR, _I64, _I64, _I64, _I64, ctypes.c_int32, _PTR]),
    "dt_cast_with_residual": (None, [_PTR, _I64, _I64, ctypes.c_int, _PTR]),
    "dt_gather_abs": (None, [_PTR, _PTR, _I64, _PTR]),
    "dt_gather_add_abs": (None, [_PTR, _PTR, _PTR, _I64, _PTR]),
    "dt_sum_sumsq": (None, [_PTR, _I64, _PTR]),
    "dt_add_sumsq": (_I64, [_PTR, _PTR, _PTR, _I64, _PTR]),
    "dt_write_sparse": (None, [_PTR, _I64, _PTR, _PTR, _I64]),
    "dt_merge_runs": (_I64, [_PTR, _PTR, _PTR, _I64, _PTR, _PTR]),
    "dt_radix_hist": (None, [_PTR, _I64, ctypes.c_int, ctypes.c_int32, _PTR]),
}
