"""Vector helpers the hand-written kernels share: loads, stores, splats, multiply-adds, lane sums.

Multiply-accumulate is fused (one rounding) where the CPU has FMA, else a multiply then an add; the
vector lanes and the scalar tails round the same way, so a column's result does not depend on
whether it fell in a vector or in the tail. Every name starts with ``KERNEL_FN``, so each kernel
that includes them has its own copy.
"""

from __future__ import annotations

VEC = r"""
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256 KERNEL_FN_v;
static inline KERNEL_FN_v KERNEL_FN_ld(const float *p) { return _mm256_loadu_ps(p); }
static inline void KERNEL_FN_st(float *p, KERNEL_FN_v v) { _mm256_storeu_ps(p, v); }
static inline KERNEL_FN_v KERNEL_FN_splat(float a) { return _mm256_set1_ps(a); }
static inline KERNEL_FN_v KERNEL_FN_mac(KERNEL_FN_v acc, KERNEL_FN_v a, KERNEL_FN_v b) {
  return _mm256_fmadd_ps(a, b, acc);
}
static inline float KERNEL_FN_smac(float acc, float a, float b) { return fmaf(a, b, acc); }
#else
typedef float KERNEL_FN_v __attribute__((vector_size(32)));
typedef float KERNEL_FN_vu __attribute__((vector_size(32), aligned(4)));
static inline KERNEL_FN_v KERNEL_FN_ld(const float *p) { return *(const KERNEL_FN_vu *)p; }
static inline void KERNEL_FN_st(float *p, KERNEL_FN_v v) { *(KERNEL_FN_vu *)p = v; }
static inline KERNEL_FN_v KERNEL_FN_splat(float a) { return (KERNEL_FN_v){a, a, a, a, a, a, a, a}; }
static inline KERNEL_FN_v KERNEL_FN_mac(KERNEL_FN_v acc, KERNEL_FN_v a, KERNEL_FN_v b) {
  return acc + a * b;
}
static inline float KERNEL_FN_smac(float acc, float a, float b) { return acc + a * b; }
#endif
/* sum of the 8 lanes as a fixed tree: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)) */
static inline float KERNEL_FN_hsum(KERNEL_FN_v v) {
#if defined(__AVX2__) && defined(__FMA__)
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  return _mm_cvtss_f32(_mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1)));
#else
  float l[8];
  KERNEL_FN_st(l, v);
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
#endif
}
/* the 8 sums hsum(a[0]) .. hsum(a[7]) as one vector, each by the same tree (a transpose on the way) */
static inline KERNEL_FN_v KERNEL_FN_hsum8(const KERNEL_FN_v *a) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 p[4]; /* pair (2r, 2r+1): [l0+l4, l1+l5, l2+l6, l3+l7] of each */
  for (int r = 0; r < 4; r++)
    p[r] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * r], a[2 * r + 1], 0x20),
                         _mm256_permute2f128_ps(a[2 * r], a[2 * r + 1], 0x31));
  /* (l0+l4)+(l2+l6) and (l1+l5)+(l3+l7): [A0 B0 A2 B2 | A1 B1 A3 B3], then for 4..7 */
  const __m256 q0 = _mm256_add_ps(_mm256_shuffle_ps(p[0], p[1], 0x44), _mm256_shuffle_ps(p[0], p[1], 0xEE));
  const __m256 q1 = _mm256_add_ps(_mm256_shuffle_ps(p[2], p[3], 0x44), _mm256_shuffle_ps(p[2], p[3], 0xEE));
  /* A + B: [s0 s2 s4 s6 | s1 s3 s5 s7], then into order */
  const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(q0, q1, 0x88), _mm256_shuffle_ps(q0, q1, 0xDD));
  return _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
#else
  float l[8];
  for (int r = 0; r < 8; r++) l[r] = KERNEL_FN_hsum(a[r]);
  return KERNEL_FN_ld(l);
#endif
}
"""

# after VEC: a vector exp (tiled_linear_logprobs' log-sum-exp, the attention kernels' softmax)
EXP = r"""
typedef int32_t KERNEL_FN_vi __attribute__((vector_size(32)));
/* exp(d) in 8 float lanes: d = n ln2 + r (n by the 1.5 * 2^23 rounding trick, ln2 in two parts so
   r is exact to float's rounding), exp(r) by its Taylor series to r^7 (|r| <= ln2 / 2: the next term
   is below 3e-9 of the sum), times 2^n put into the exponent bits. d below -87 (where 2^n leaves
   float's range, -inf included) gives 0, above 88 (past float's largest, +inf included) inf; NaN
   stays NaN. */
static inline KERNEL_FN_v KERNEL_FN_exp(KERNEL_FN_v d) {
  const KERNEL_FN_v big = KERNEL_FN_splat(12582912.0f), one = KERNEL_FN_splat(1.0f);
  const KERNEL_FN_v t = d * KERNEL_FN_splat(1.44269504088896341f) + big, n = t - big;
  const KERNEL_FN_v r = (d - n * KERNEL_FN_splat(0.693359375f)) - n * KERNEL_FN_splat(-2.12194440e-4f);
  KERNEL_FN_v p = KERNEL_FN_splat(1.0f / 5040);
  p = p * r + KERNEL_FN_splat(1.0f / 720), p = p * r + KERNEL_FN_splat(1.0f / 120);
  p = p * r + KERNEL_FN_splat(1.0f / 24), p = p * r + KERNEL_FN_splat(1.0f / 6);
  p = p * r + KERNEL_FN_splat(0.5f), p = p * r + one, p = p * r + one;
  const KERNEL_FN_vi e = (((KERNEL_FN_vi)t - (KERNEL_FN_vi)big) + 127) << 23;
  const KERNEL_FN_vi low = d < KERNEL_FN_splat(-87.0f), high = d > KERNEL_FN_splat(88.0f);
  const KERNEL_FN_vi out = (KERNEL_FN_vi)(p * (KERNEL_FN_v)e) & ~(low | high);
  return (KERNEL_FN_v)(out | ((KERNEL_FN_vi)KERNEL_FN_splat(INFINITY) & high));
}
"""
