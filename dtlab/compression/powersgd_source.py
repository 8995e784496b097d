"""The C source of :mod:`dtlab.compression.powersgd_kernels`: PowerSGD's three passes over the
compressed matrices of a buffer, each reading the gradient once (plain C11; AVX2 and FMA where the
CPU has both, a scalar loop with eight independent lanes per factor column otherwise).

``mats`` is PowerSGD's state table, int64 rows ``(offset, numel, rows, cols)``; matrix ``i`` has rank
``r = min(rank, rows, cols)`` (at most :data:`MAX_RANK`) and its factors lie one after the other in
flat buffers: ``P`` as ``rows x r``, ``Q`` as ``cols x r``, both row-major. A matrix with ``numel <
rows * cols`` is a buffer zero-padded to its near-square shape: the missing elements count as zeros
and are never read or written. Every element's sum runs in a fixed order (a row's products eight
lanes at a time, then the lanes added pairwise; a column's over rows in ascending order), so the
same inputs give the same bits on every rank of a machine type. Also the ``ctypes`` signatures."""

import ctypes

#: the largest factor rank the kernels handle (a larger one takes the torch fallback)
MAX_RANK = 8

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PSGD_AVX2 1
#endif

#define PSGD_MAX_RANK 8
#define PSGD_INLINE static inline __attribute__((always_inline))
/* matrices at least this large (floats) bypass the cache when their average is written */
#define PSGD_STREAM_NUMEL (1 << 22)

static int psgd_rank(int64_t rank, int64_t rows, int64_t cols) {
    int64_t r = rank < rows ? rank : rows;
    return (int)(r < cols ? r : cols);
}

/* elements of row i of a matrix holding numel elements (the rows of a zero-padded buffer run short) */
static int64_t psgd_len(int64_t i, int64_t cols, int64_t numel) {
    int64_t len = numel - i * cols;
    return len < 0 ? 0 : (len > cols ? cols : len);
}

/* dst (b x a) = the transpose of src (a x b) */
static void psgd_transpose(const float* src, int64_t a, int64_t b, float* dst) {
    for (int64_t i = 0; i < a; i++)
        for (int64_t j = 0; j < b; j++) dst[j * a + i] = src[i * b + j];
}

#ifdef PSGD_AVX2
PSGD_INLINE __m256i psgd_mask(int64_t left) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left < 8 ? left : 8)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
/* ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) */
PSGD_INLINE float psgd_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#else
PSGD_INLINE float psgd_hsum8(const float* l) {
    float a = l[0] + l[4], b = l[2] + l[6], c = l[1] + l[5], d = l[3] + l[7];
    return (a + b) + (c + d);
}
#endif

static inline int psgd_nonfinite(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return ((u >> 23) & 0xffu) == 0xffu;
}

/* out[t * R + k] = sum_j x[t * cols + j] * qt[k * cols + j] for NR rows t of len elements each (rows
   of P = M Q; the rows share the loads of Q^T), x = a. ADD (a constant): x = a + b instead, written
   into sum as it is read (the error-feedback add in the same pass); returns how many x are NaN/Inf */
PSGD_INLINE int64_t psgd_dot_rows(const float* restrict a, const float* restrict b, float* restrict sum,
                                  int ADD, int64_t cols, int64_t len, int NR, const float* restrict qt, int R,
                                  float* restrict out) {
    int64_t bad = 0;
#ifdef PSGD_AVX2
    const __m256i em = _mm256_set1_epi32(0x7f800000);
    __m256i vbad = _mm256_setzero_si256();
    __m256 s[4][PSGD_MAX_RANK];
    for (int t = 0; t < NR; t++) for (int k = 0; k < R; k++) s[t][k] = _mm256_setzero_ps();
    for (int64_t j = 0; j < len; j += 8) {
        int full = j + 8 <= len;  /* the tail, masked: element j + l goes to lane l as in the loop */
        __m256i m = psgd_mask(len - j);
        __m256 v[4];
        for (int t = 0; t < NR; t++) {
            int64_t o = t * cols + j;
            __m256 x = full ? _mm256_loadu_ps(a + o) : _mm256_maskload_ps(a + o, m);
            if (ADD) {
                x = _mm256_add_ps(x, full ? _mm256_loadu_ps(b + o) : _mm256_maskload_ps(b + o, m));
                if (full) _mm256_storeu_ps(sum + o, x); else _mm256_maskstore_ps(sum + o, m, x);
                __m256i e = _mm256_and_si256(_mm256_castps_si256(x), em);
                vbad = _mm256_sub_epi32(vbad, _mm256_cmpeq_epi32(e, em));
            }
            v[t] = x;
        }
        for (int k = 0; k < R; k++) {
            __m256 q = full ? _mm256_loadu_ps(qt + k * cols + j) : _mm256_maskload_ps(qt + k * cols + j, m);
            for (int t = 0; t < NR; t++) s[t][k] = _mm256_fmadd_ps(v[t], q, s[t][k]);
        }
    }
    for (int t = 0; t < NR; t++) for (int k = 0; k < R; k++) out[t * R + k] = psgd_hsum(s[t][k]);
    if (ADD) {
        int32_t lanes[8];
        _mm256_storeu_si256((__m256i*)lanes, vbad);
        for (int l = 0; l < 8; l++) bad += lanes[l];
    }
#else
    float s[4][PSGD_MAX_RANK][8];
    memset(s, 0, sizeof(s));
    for (int64_t j = 0; j < len; j += 8) {
        int w = len - j < 8 ? (int)(len - j) : 8;
        for (int t = 0; t < NR; t++) {
            float x[8];
            for (int l = 0; l < w; l++) {
                int64_t o = t * cols + j + l;
                x[l] = a[o];
                if (ADD) { x[l] = x[l] + b[o]; sum[o] = x[l]; bad += psgd_nonfinite(x[l]); }
            }
            for (int k = 0; k < R; k++)
                for (int l = 0; l < w; l++) s[t][k][l] = s[t][k][l] + x[l] * qt[k * cols + j + l];
        }
    }
    for (int t = 0; t < NR; t++) for (int k = 0; k < R; k++) out[t * R + k] = psgd_hsum8(s[t][k]);
#endif
    return bad;
}

/* qt[k * cols + j] += sum over the NR rows t, in order, of a[t * cols + j] * p[t * R + k]
   (rows of (M^T P)^T; qt, R x cols, stays in cache) */
PSGD_INLINE void psgd_axpy_rows(const float* restrict a, int64_t cols, int64_t len, int NR,
                                const float* restrict p, int R, float* restrict qt) {
#ifdef PSGD_AVX2
    __m256 b[8][PSGD_MAX_RANK];
    for (int t = 0; t < NR; t++) for (int k = 0; k < R; k++) b[t][k] = _mm256_set1_ps(p[t * R + k]);
    int64_t j = 0;
    for (; j + 8 <= len; j += 8) {
        __m256 s[PSGD_MAX_RANK];
        for (int k = 0; k < R; k++) s[k] = _mm256_loadu_ps(qt + k * cols + j);
        for (int t = 0; t < NR; t++) {
            __m256 v = _mm256_loadu_ps(a + t * cols + j);
            for (int k = 0; k < R; k++) s[k] = _mm256_fmadd_ps(v, b[t][k], s[k]);
        }
        for (int k = 0; k < R; k++) _mm256_storeu_ps(qt + k * cols + j, s[k]);
    }
    if (j < len) {
        __m256i m = psgd_mask(len - j);
        __m256 s[PSGD_MAX_RANK];
        for (int k = 0; k < R; k++) s[k] = _mm256_maskload_ps(qt + k * cols + j, m);
        for (int t = 0; t < NR; t++) {
            __m256 v = _mm256_maskload_ps(a + t * cols + j, m);
            for (int k = 0; k < R; k++) s[k] = _mm256_fmadd_ps(v, b[t][k], s[k]);
        }
        for (int k = 0; k < R; k++) _mm256_maskstore_ps(qt + k * cols + j, m, s[k]);
    }
#else
    for (int t = 0; t < NR; t++)
        for (int k = 0; k < R; k++) {
            float pk = p[t * R + k];
            float* q = qt + k * cols;
            const float* row = a + t * cols;
            for (int64_t j = 0; j < len; j++) q[j] = q[j] + row[j] * pk;
        }
#endif
}

/* NR rows t: acc[t cols + j] -= sum_k pl[t R + k] * ql[k cols + j] (the residual) and out[t cols + j] =
   sum_k ps[t R + k] * qs[k cols + j] (the average), each sum from k = 0 up; the rows share the loads
   of the factors. nt: every row of out is 32-byte aligned, and is written with streaming stores (it
   is not read again here: no read for ownership) */
PSGD_INLINE void psgd_finish_rows(float* restrict acc, float* restrict out, int64_t cols, int64_t len,
                                  int NR, const float* pl, const float* restrict ql, const float* ps,
                                  const float* restrict qs, int R, int nt) {
#ifdef PSGD_AVX2
    __m256 bl[4][PSGD_MAX_RANK], bs[4][PSGD_MAX_RANK];
    for (int t = 0; t < NR; t++)
        for (int k = 0; k < R; k++) {
            bl[t][k] = _mm256_set1_ps(pl[t * R + k]);
            bs[t][k] = _mm256_set1_ps(ps[t * R + k]);
        }
    for (int64_t j = 0; j < len; j += 8) {
        int full = j + 8 <= len;
        __m256i m = psgd_mask(len - j);
        __m256 c[4], o[4];
        for (int k = 0; k < R; k++) {
            __m256 a = full ? _mm256_loadu_ps(ql + k * cols + j) : _mm256_maskload_ps(ql + k * cols + j, m);
            __m256 b = full ? _mm256_loadu_ps(qs + k * cols + j) : _mm256_maskload_ps(qs + k * cols + j, m);
            for (int t = 0; t < NR; t++) {
                c[t] = k == 0 ? _mm256_mul_ps(bl[t][0], a) : _mm256_fmadd_ps(bl[t][k], a, c[t]);
                o[t] = k == 0 ? _mm256_mul_ps(bs[t][0], b) : _mm256_fmadd_ps(bs[t][k], b, o[t]);
            }
        }
        for (int t = 0; t < NR; t++) {
            float *x = acc + t * cols + j, *y = out + t * cols + j;
            if (full) {
                _mm256_storeu_ps(x, _mm256_sub_ps(_mm256_loadu_ps(x), c[t]));
                if (nt) _mm256_stream_ps(y, o[t]); else _mm256_storeu_ps(y, o[t]);
            } else {
                _mm256_maskstore_ps(x, m, _mm256_sub_ps(_mm256_maskload_ps(x, m), c[t]));
                _mm256_maskstore_ps(y, m, o[t]);
            }
        }
    }
#else
    (void)nt;
    for (int t = 0; t < NR; t++)
        for (int64_t j = 0; j < len; j++) {
            float c = pl[t * R] * ql[j], o = ps[t * R] * qs[j];
            for (int k = 1; k < R; k++) {
                c = c + pl[t * R + k] * ql[k * cols + j];
                o = o + ps[t * R + k] * qs[k * cols + j];
            }
            acc[t * cols + j] = acc[t * cols + j] - c;
            out[t * cols + j] = o;
        }
#endif
}

/* p (every matrix's rows x r, one after the other) = M Q, M read once, rows in blocks of up to 16
   accumulators; ADD: M = a + b, written into sum (returns its NaN/Inf count); scratch: r * cols floats */
PSGD_INLINE int64_t psgd_project_one(const float* a, const float* b, float* sum, int ADD, int64_t numel,
                                     int64_t rows, int64_t cols, int R, const float* q, float* p, float* qt) {
    psgd_transpose(q, cols, R, qt);
    int64_t i = 0, bad = 0;
    const int NR = R <= 4 ? 4 : 2;
    for (; i + NR <= rows && psgd_len(i + NR - 1, cols, numel) == cols; i += NR) {
        int64_t o = i * cols;
        bad += psgd_dot_rows(a + o, b + o, sum + o, ADD, cols, cols, NR, qt, R, p + i * R);
    }
    for (; i < rows; i++) {
        int64_t o = i * cols;
        bad += psgd_dot_rows(a + o, b + o, sum + o, ADD, cols, psgd_len(i, cols, numel), 1, qt, R, p + i * R);
    }
    return bad;
}

void dt_psgd_project(const float* acc, const int64_t* mats, int64_t m, int64_t rank, const float* q,
                     float* p, float* scratch) {
    for (int64_t i = 0; i < m; i++) {
        const int64_t* e = mats + 4 * i;
        int R = psgd_rank(rank, e[2], e[3]);
        switch (R) {  /* a constant rank: the accumulators stay in registers */
#define PSGD_CASE(n) case n: psgd_project_one(acc + e[0], acc, NULL, 0, e[1], e[2], e[3], n, q, p, scratch); \
                             break;
            PSGD_CASE(1) PSGD_CASE(2) PSGD_CASE(3) PSGD_CASE(4)
            PSGD_CASE(5) PSGD_CASE(6) PSGD_CASE(7) PSGD_CASE(8)
#undef PSGD_CASE
            default: break;
        }
        q += e[3] * R;
        p += e[2] * R;
    }
}

static int64_t psgd_add(const float* a, const float* b, float* out, int64_t n) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) { float v = a[i] + b[i]; out[i] = v; bad += psgd_nonfinite(v); }
    return bad;
}

/* out = a + b over the whole buffer (n floats; returns its NaN/Inf count) and, in the same pass, p = M Q
   on the sum as dt_psgd_project computes it (the same bits) */
int64_t dt_psgd_add_project(const float* a, const float* b, float* out, int64_t n, const int64_t* mats,
                            int64_t m, int64_t rank, const float* q, float* p, float* scratch) {
    int64_t bad = 0, pos = 0;
    for (int64_t i = 0; i < m; i++) {
        const int64_t* e = mats + 4 * i;
        int64_t o = e[0];
        int R = psgd_rank(rank, e[2], e[3]);
        bad += psgd_add(a + pos, b + pos, out + pos, o - pos);  /* the elements between matrices */
        switch (R) {
#define PSGD_CASE(n) case n: bad += psgd_project_one(a + o, b + o, out + o, 1, e[1], e[2], e[3], n, q, p, \
                                                     scratch); break;
            PSGD_CASE(1) PSGD_CASE(2) PSGD_CASE(3) PSGD_CASE(4)
            PSGD_CASE(5) PSGD_CASE(6) PSGD_CASE(7) PSGD_CASE(8)
#undef PSGD_CASE
            default: break;
        }
        pos = o + e[1];
        q += e[3] * R;
        p += e[2] * R;
    }
    return bad + psgd_add(a + pos, b + pos, out + pos, n - pos);
}

/* q (every matrix's cols x r) = M^T P, M read once, row by row; scratch: r * cols floats */
PSGD_INLINE void psgd_back_one(const float* a, int64_t numel, int64_t rows, int64_t cols, int R,
                          const float* p, float* q, float* qt) {
    memset(qt, 0, (size_t)(R * cols) * sizeof(float));
    int64_t i = 0;
    const int NR = R <= 4 ? 8 : 4;  /* rows per block: fewer passes of the block through the cache */
    for (; i + NR <= rows && psgd_len(i + NR - 1, cols, numel) == cols; i += NR)
        psgd_axpy_rows(a + i * cols, cols, cols, NR, p + i * R, R, qt);
    for (; i < rows; i++) psgd_axpy_rows(a + i * cols, cols, psgd_len(i, cols, numel), 1, p + i * R, R, qt);
    psgd_transpose(qt, R, cols, q);
}

void dt_psgd_back(const float* acc, const int64_t* mats, int64_t m, int64_t rank, const float* p,
                  float* q, float* scratch) {
    for (int64_t i = 0; i < m; i++) {
        const int64_t* e = mats + 4 * i;
        int R = psgd_rank(rank, e[2], e[3]);
        switch (R) {
#define PSGD_CASE(n) case n: psgd_back_one(acc + e[0], e[1], e[2], e[3], n, p, q, scratch); break;
            PSGD_CASE(1) PSGD_CASE(2) PSGD_CASE(3) PSGD_CASE(4)
            PSGD_CASE(5) PSGD_CASE(6) PSGD_CASE(7) PSGD_CASE(8)
#undef PSGD_CASE
            default: break;
        }
        q += e[3] * R;
        p += e[2] * R;
    }
}

/* acc -= P Ql^T (the residual) and out = (P / world) Qs^T (the average), one pass; scratch: 2 r cols */
PSGD_INLINE void psgd_finish_one(float* a, float* o, int64_t numel, int64_t rows, int64_t cols, int R,
                                 const float* p, const float* ql, const float* qs, float world,
                                 float* scratch) {
    float *tl = scratch, *ts = scratch + R * cols;
    psgd_transpose(ql, cols, R, tl);
    psgd_transpose(qs, cols, R, ts);
    /* streaming stores: rows 32-byte aligned, and a matrix too large to stay in cache anyway */
    int nt = ((uintptr_t)o & 31u) == 0 && cols % 8 == 0 && numel >= PSGD_STREAM_NUMEL;
    int64_t i = 0;
    float pw[2 * PSGD_MAX_RANK];
    for (; i + 2 <= rows && psgd_len(i + 1, cols, numel) == cols; i += 2) {
        for (int k = 0; k < 2 * R; k++) pw[k] = p[i * R + k] / world;
        psgd_finish_rows(a + i * cols, o + i * cols, cols, cols, 2, p + i * R, tl, pw, ts, R, nt);
    }
    for (; i < rows; i++) {
        for (int k = 0; k < R; k++) pw[k] = p[i * R + k] / world;
        psgd_finish_rows(a + i * cols, o + i * cols, cols, psgd_len(i, cols, numel), 1, p + i * R, tl, pw, ts,
                         R, nt);
    }
}

void dt_psgd_finish(float* acc, float* out, const int64_t* mats, int64_t m, int64_t rank, const float* p,
                    const float* ql, const float* qs, int64_t world, float* scratch) {
    float w = (float)world;
    for (int64_t i = 0; i < m; i++) {
        const int64_t* e = mats + 4 * i;
        int R = psgd_rank(rank, e[2], e[3]);
        switch (R) {
#define PSGD_CASE(n) case n: psgd_finish_one(acc + e[0], out + e[0], e[1], e[2], e[3], n, p, ql, qs, w, \
                                             scratch); break;
            PSGD_CASE(1) PSGD_CASE(2) PSGD_CASE(3) PSGD_CASE(4)
            PSGD_CASE(5) PSGD_CASE(6) PSGD_CASE(7) PSGD_CASE(8)
#undef PSGD_CASE
            default: break;
        }
        ql += e[3] * R;
        qs += e[3] * R;
        p += e[2] * R;
    }
#ifdef PSGD_AVX2
    _mm_sfence();  /* the streaming stores are visible before the caller reads out */
#endif
}
"""

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "dt_psgd_project": (None, [_PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR]),
    "dt_psgd_add_project": (_I64, [_PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _PTR, _PTR, _PTR]),
    "dt_psgd_back": (None, [_PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR]),
    "dt_psgd_finish": (None, [_PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR]),
}
