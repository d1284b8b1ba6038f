"""``quant_linear`` with int8 activations (``act_bits=8``): integer dot products, the ISA picked at run time.

Each row of x is quantized on the fly, per block of 32 columns of a weight group (a group's last
block shorter when 32 does not divide it; llama.cpp's Q8_0 activations): ``d = max|x| / 127`` and
codes ``rint(x / d)`` in [-127, 127], float32 arithmetic (``d = 0``: codes 0). A block's product
with a row of weight codes is an exact integer; the output is the float sum over blocks, in order,
of ``(d * scale[n, group]) * idot``. Every row is quantized and multiplied alone (the engine's
batch invariance).

The dot products use the widest integer instructions the CPU has, chosen when the kernel runs
(``__builtin_cpu_supports``), never from the build machine's ``-march``: AVX-512 VNNI
(``vpdpbusd`` on two blocks at once), AVX-VNNI (the same on one block, 256 bits), AVX2
(``vpmaddubsw`` + ``vpmaddwd``), or portable C. ``vpdpbusd`` multiplies unsigned by signed bytes:
4-bit codes are unsigned already (``idot = sum q x - zero * sum x``); 8-bit codes are made
unsigned by ``q ^ 0x80 = q + 128`` (``idot = sum (q + 128) x - 128 * sum x``); the AVX2 path uses
``|q|`` and ``x * sign(q)`` instead (``vpmaddubsw`` saturates int16 otherwise). The correction
starts each block's integer accumulator, so ``idot`` is exact on every path.

``LLMKIT_INT_ISA`` (``auto``, ``avx512vnni``, ``avxvnni``, ``avx2``, ``c``) or :func:`set_int_isa`
forces a path (the kernel never goes above what the CPU has); :func:`cpu_int_isas` lists what
this CPU offers. AMX is not used (this project's VMs advertise tiles that fault).
"""

from __future__ import annotations

import os
from functools import cache

INT_ISAS = ("c", "avx2", "avxvnni", "avx512vnni")  # the kernel's codes 0 .. 3, narrowest first
_FLAGS = {  # /proc/cpuinfo flags each path needs
    "c": (),
    "avx2": ("avx2", "fma"),
    "avxvnni": ("avx2", "fma", "avx_vnni"),
    "avx512vnni": ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
}
_forced: str | None = None


class IsaError(ValueError):
    """An unknown instruction-set name in ``LLMKIT_INT_ISA`` or :func:`set_int_isa`."""


def set_int_isa(name: str | None) -> None:
    """Force the integer kernels' path (None: back to ``LLMKIT_INT_ISA``, else ``auto``). Takes
    effect for programs planned afterwards (a replay fixes its kernels' sizes when it is built)."""
    global _forced
    if name is not None and name != "auto" and name not in INT_ISAS:
        raise IsaError(f"int ISA must be auto or one of {', '.join(INT_ISAS)}, got {name!r}")
    _forced = name


def int_isa_code() -> int:
    """The kernel's ``isa`` size: -1 (the best the CPU has) or a forced path's index in INT_ISAS."""
    name = _forced if _forced is not None else os.environ.get("LLMKIT_INT_ISA", "auto")
    if name == "auto":
        return -1
    if name not in INT_ISAS:
        raise IsaError(f"LLMKIT_INT_ISA must be auto or one of {', '.join(INT_ISAS)}, got {name!r}")
    return INT_ISAS.index(name)


@cache
def cpu_int_isas() -> tuple[str, ...]:
    """The paths this CPU runs (from /proc/cpuinfo; just ``c`` where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith("flags")]
        flags = set(lines[0].split(":", 1)[1].split()) if lines else set()
    except OSError:
        flags = set()
    return tuple(n for n in INT_ISAS if set(_FLAGS[n]) <= flags)


QUANT_INT = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KERNEL_FN_X86 1
#define KERNEL_FN_T2 __attribute__((target("avx2,fma")))
#define KERNEL_FN_TV __attribute__((target("avx2,fma,avxvnni")))
#define KERNEL_FN_T5 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
#endif

/* One call's int8 activations. Row m, group gi (i = m * G + gi): codes at xq + m * KP + gi * GP (GP:
   the group's width rounded up to 32, zero-padded; column t at KERNEL_FN_at, in the order of the
   codes' bytes: 4 bits, even columns against low nibbles, odd ones against high ones), the scale
   d at xd[i] and 8 copies at xe[i * 8], and at xl[i * 8] lane 0 the correction seed of the vector
   paths: -off * (sum of the codes of the group's whole 32s) (asym 4 bits: -(that sum), times the
   group's zero later), the 7 lanes after it 0. */
typedef struct {
  const float *x, *s;
  const uint8_t *q, *z;
  float *y;
  int8_t *xq;
  float *xd, *xe;
  int32_t *xl;
  int64_t M, K, N, G, g, GP, KP, bits, rows, isa;
} KERNEL_FN_ijob;

/* where column t (of a group of w columns) sits among its group's codes: 8 bits, in order; 4 bits,
   in the group's whole 128s (units matching 64 bytes of codes) the unit's 64 even columns then its
   64 odd ones, after them per 32 the 16 even then the 16 odd (matching KERNEL_FN_w32) */
static inline int64_t KERNEL_FN_at(int64_t bits, int64_t t, int64_t w) {
  if (bits == 8) return t;
  if (t < w / 128 * 128) return (t / 128) * 128 + (t % 2) * 64 + (t % 128) / 2;
  return (t / 32) * 32 + (t % 2) * 16 + (t % 32) / 2;
}

/* the 32 activation codes of the 32 columns at c (a multiple of 32) of group xg (w columns), in
   KERNEL_FN_w32's order */
#define KERNEL_FN_X32(bits, xg, c, w)                                                                  \
  ((bits) == 4 && (c) < (w) / 128 * 128                                                              \
       ? _mm256_set_m128i(_mm_loadu_si128((const __m128i *)((xg) + ((c) / 128) * 128 + 64 + (c) % 128 / 2)), \
                          _mm_loadu_si128((const __m128i *)((xg) + ((c) / 128) * 128 + (c) % 128 / 2)))  \
       : _mm256_loadu_si256((const __m256i *)((xg) + (c))))

/* the zero the codes' unsigned form is offset by: 8-bit codes q + 128 for vpdpbusd, else 0;
   4-bit: the zero point (8, or the zeros tensor: 1 here, the zero applied later) */
static inline int32_t KERNEL_FN_off(const KERNEL_FN_ijob *j) {
  if (j->bits == 8) return j->isa >= 2 ? 128 : 0;
  return j->z ? 1 : 8;
}

/* row m, group gi: d = max|x| / 127, codes rint(x / d) (float32, round half to even; d = 0: 0) */
static void KERNEL_FN_quantize_rows(KERNEL_FN_ijob *j) {
  const int32_t off = KERNEL_FN_off(j);
  for (int64_t m = 0; m < j->M; m++) {
    const float *xm = j->x + m * j->K;
    for (int64_t gi = 0; gi < j->G; gi++) {
      const int64_t k0 = gi * j->g, w = (k0 + j->g < j->K ? k0 + j->g : j->K) - k0, i = m * j->G + gi;
      float amax = 0.0f;
      for (int64_t t = 0; t < w; t++) amax = fmaxf(amax, fabsf(xm[k0 + t]));
      const float d = amax / 127.0f;
      int8_t *o = j->xq + m * j->KP + gi * j->GP;
      memset(o, 0, (size_t)j->GP);
      int32_t sum = 0; /* of the codes in whole 32s: the vector paths' columns */
      for (int64_t t = 0; t < w; t++) {
        float v = d > 0.0f ? rintf(xm[k0 + t] / d) : 0.0f;
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        const int8_t c = (int8_t)v;
        if (t < w / 32 * 32) sum += c;
        const int64_t at = KERNEL_FN_at(j->bits, t, w);
        o[at] = c;
      }
      j->xd[i] = d;
      for (int t = 0; t < 8; t++) {
        j->xe[i * 8 + t] = d;
        j->xl[i * 8 + t] = t ? 0 : -off * sum;
      }
    }
  }
}

/* the exact integer product of columns k0 + c0 .. k0 + w - 1 of group gi, row m, output n (codes
   minus their zero), one column at a time */
static inline int32_t KERNEL_FN_idot_c(const KERNEL_FN_ijob *j, int64_t m, int64_t n, int64_t gi, int64_t c0,
                                       int64_t w) {
  const int64_t k0 = gi * j->g;
  const int8_t *xg = j->xq + m * j->KP + gi * j->GP;
  int32_t acc = 0;
  if (j->bits == 8) {
    const int8_t *qn = (const int8_t *)j->q + n * j->K + k0;
    for (int64_t t = c0; t < w; t++) acc += (int32_t)xg[t] * qn[t];
  } else {
    const uint8_t *qn = j->q + n * (j->K / 2) + k0 / 2;
    const int32_t zero = j->z ? j->z[n * j->G + gi] : 8;
    for (int64_t t = c0; t < w; t++) {
      const int32_t q = (t % 2 ? qn[t / 2] >> 4 : qn[t / 2] & 15) - zero;
      acc += (int32_t)xg[KERNEL_FN_at(4, t, w)] * q;
    }
  }
  return acc;
}

static inline int64_t KERNEL_FN_width(const KERNEL_FN_ijob *j, int64_t gi) {
  const int64_t k0 = gi * j->g;
  return (k0 + j->g < j->K ? k0 + j->g : j->K) - k0;
}

/* portable C: y = sum over groups, in order, of (d * scale) * idot */
static void KERNEL_FN_rows_c(const KERNEL_FN_ijob *j, int64_t n, int64_t m0, int64_t mb) {
  for (int64_t r = 0; r < mb; r++) {
    const int64_t m = m0 + r;
    float y = 0.0f;
    for (int64_t gi = 0; gi < j->G; gi++)
      y += (j->xd[m * j->G + gi] * j->s[n * j->G + gi]) *
           (float)KERNEL_FN_idot_c(j, m, n, gi, 0, KERNEL_FN_width(j, gi));
    j->y[m * j->N + n] = y;
  }
}

#ifdef KERNEL_FN_X86
enum { KERNEL_FN_IMB = 4, KERNEL_FN_IMB5 = 8 }; /* rows of x per pass over a row of codes: AVX2, AVX-512 */

KERNEL_FN_T2 static inline float KERNEL_FN_ihsum(__m256 v) { /* 8 lanes by a fixed tree */
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  return _mm_cvtss_f32(_mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1)));
}

/* 32 codes at column k of output n as bytes in xq's layout (4 bits: [low nibbles | high ones]);
   8 bits with `flip`, as q + 128 */
KERNEL_FN_T2 static inline __m256i KERNEL_FN_w32(const KERNEL_FN_ijob *j, int64_t n, int64_t k, int flip) {
  if (j->bits == 8) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(j->q + n * j->K + k));
    return flip ? _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)) : v;
  }
  const __m128i v = _mm_loadu_si128((const __m128i *)(j->q + n * (j->K / 2) + k / 2));
  const __m128i f = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), f), _mm_and_si128(v, f));
}

/* group gi's integer seed for row m: the correction (times the zero, asym), plus the exact product
   of the columns after the group's last whole 32, in C */
KERNEL_FN_T2 static inline __m256i KERNEL_FN_seed(const KERNEL_FN_ijob *j, int64_t m, int64_t n, int64_t gi,
                                                  int64_t full, int64_t w) {
  const int64_t i = m * j->G + gi;
  int32_t c = j->xl[i * 8];
  if (j->z) c *= j->z[n * j->G + gi];
  if (full < w) c += KERNEL_FN_idot_c(j, m, n, gi, full, w);
  return _mm256_setr_epi32(c, 0, 0, 0, 0, 0, 0, 0);
}

/* the 256-bit paths: DOT(acc, w, x) adds 32 products to 8 int32 lanes; FLIP: 8-bit codes as q + 128 */
#define KERNEL_FN_ROWS256(NAME, TGT, DOT, FLIP)                                                      \
  TGT static inline __attribute__((always_inline)) void NAME##_mb(const KERNEL_FN_ijob *j, int64_t n, \
                                                                  int64_t m0, const int mb) {         \
    __m256 acc[KERNEL_FN_IMB];                                                                     \
    for (int r = 0; r < KERNEL_FN_IMB; r++) acc[r] = _mm256_setzero_ps();                          \
    for (int64_t gi = 0; gi < j->G; gi++) {                                                        \
      const int64_t k0 = gi * j->g, w = KERNEL_FN_width(j, gi), full = w / 32 * 32;                \
      __m256i ia[KERNEL_FN_IMB];                                                                   \
      for (int64_t r = 0; r < mb; r++)                                                             \
        ia[r] = j->z || full < w ? KERNEL_FN_seed(j, m0 + r, n, gi, full, w)                       \
                                 : _mm256_loadu_si256((const __m256i *)(j->xl + ((m0 + r) * j->G + gi) * 8));\
      for (int64_t c = 0; c < full; c += 32) {                                                     \
        const __m256i wv = KERNEL_FN_w32(j, n, k0 + c, FLIP);                                      \
        for (int64_t r = 0; r < mb; r++)                                                           \
          ia[r] = DOT(ia[r], wv, KERNEL_FN_X32(j->bits, j->xq + (m0 + r) * j->KP + gi * j->GP, c, w)); \
      }                                                                                            \
      const float ws = j->s[n * j->G + gi];                                                        \
      for (int64_t r = 0; r < mb; r++)                                                             \
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[r]),                                        \
                                 _mm256_set1_ps(j->xd[(m0 + r) * j->G + gi] * ws), acc[r]);        \
    }                                                                                              \
    for (int64_t r = 0; r < mb; r++) j->y[(m0 + r) * j->N + n] = KERNEL_FN_ihsum(acc[r]);          \
  }                                                                                                \
  TGT static void NAME(const KERNEL_FN_ijob *j, int64_t n, int64_t m0, int64_t mb) {                \
    switch (mb) { /* a constant count: the accumulators stay in registers */                        \
      case 4: NAME##_mb(j, n, m0, 4); break;                                                       \
      case 3: NAME##_mb(j, n, m0, 3); break;                                                       \
      case 2: NAME##_mb(j, n, m0, 2); break;                                                       \
      default: NAME##_mb(j, n, m0, 1); break;                                                      \
    }                                                                                              \
  }

/* AVX2: vpmaddubsw on (|q|, x * sign(q)) for 8 bits (int16 pairs at most 2 * 127 * 127), (q, x) for
   4, then vpmaddwd by ones into int32 */
KERNEL_FN_T2 static inline __m256i KERNEL_FN_dot_avx2(const KERNEL_FN_ijob *j, __m256i acc, __m256i w,
                                                      __m256i x) {
  const __m256i u = j->bits == 8 ? _mm256_abs_epi8(w) : w;
  const __m256i s = j->bits == 8 ? _mm256_sign_epi8(x, w) : x;
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#define KERNEL_FN_DOT_AVX2(acc, w, x) KERNEL_FN_dot_avx2(j, acc, w, x)
KERNEL_FN_ROWS256(KERNEL_FN_rows_avx2, KERNEL_FN_T2, KERNEL_FN_DOT_AVX2, 0)

/* AVX-VNNI: vpdpbusd (unsigned codes x signed activations, 4 products into each int32 lane) */
#define KERNEL_FN_DOT_VNNI(acc, w, x) _mm256_dpbusd_avx_epi32(acc, w, x)
KERNEL_FN_ROWS256(KERNEL_FN_rows_avxvnni, KERNEL_FN_TV, KERNEL_FN_DOT_VNNI, 1)

/* 64 codes at column k of output n, as two KERNEL_FN_w32 (8 bits: q + 128) side by side */
KERNEL_FN_T5 static inline __m512i KERNEL_FN_w64(const KERNEL_FN_ijob *j, int64_t n, int64_t k) {
  if (j->bits == 8)
    return _mm512_xor_si512(_mm512_loadu_si512((const void *)(j->q + n * j->K + k)),
                            _mm512_set1_epi8((char)0x80));
  const __m256i v = _mm256_loadu_si256((const __m256i *)(j->q + n * (j->K / 2) + k / 2));
  const __m256i f = _mm256_set1_epi8(15);
  const __m256i lo = _mm256_and_si256(v, f), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), f);
  /* [lo 0-31 | lo 32-63 | hi 0-31 | hi 32-63] in 128-bit lanes -> [lo, hi of 0-31 | lo, hi of 32-63] */
  const __m512i t = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  return _mm512_shuffle_i64x2(t, t, 0xD8);
}

/* AVX-512 VNNI: groups of 32 columns two at a time (lanes 0-7 the first, 8-15 the second); wider
   groups 64 columns per vpdpbusd, a last 32 on 256 bits (AVX-512 VL), the rest in C */
KERNEL_FN_T5 static inline __attribute__((always_inline)) void KERNEL_FN_avx512_mb(const KERNEL_FN_ijob *j,
                                                                                 int64_t n, int64_t m0,
                                                                                 const int mb) {
  __m512 acc[KERNEL_FN_IMB5];
  for (int r = 0; r < mb; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < j->G;) {
    const int64_t k0 = gi * j->g, w = KERNEL_FN_width(j, gi);
    if (j->g == 32 && w == 32 && gi + 1 < j->G && KERNEL_FN_width(j, gi + 1) == 32) {
      const __m512i wv = KERNEL_FN_w64(j, n, k0);
      const __m512 ws = _mm512_insertf32x8(_mm512_set1_ps(j->s[n * j->G + gi]),
                                           _mm256_set1_ps(j->s[n * j->G + gi + 1]), 1);
      __m512i zv = _mm512_set1_epi32(1);
      if (j->z)
        zv = _mm512_inserti64x4(_mm512_set1_epi32(j->z[n * j->G + gi]),
                                _mm256_set1_epi32(j->z[n * j->G + gi + 1]), 1);
      for (int64_t r = 0; r < mb; r++) {
        const int64_t i = (m0 + r) * j->G + gi;
        __m512i seed = _mm512_loadu_si512((const void *)(j->xl + i * 8));
        if (j->z) seed = _mm512_mullo_epi32(seed, zv);
        const __m512i x = _mm512_loadu_si512((const void *)(j->xq + (m0 + r) * j->KP + gi * j->GP));
        const __m512i d = _mm512_dpbusd_epi32(seed, wv, x);
        const __m512 sc = _mm512_mul_ps(_mm512_loadu_ps(j->xe + i * 8), ws);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sc, acc[r]);
      }
      gi += 2;
      continue;
    }
    const int64_t full = w / 32 * 32, wide = w / 64 * 64, slow = j->z || full < w;
    const int8_t *xg = j->xq + m0 * j->KP + gi * j->GP;
    __m512i ia[KERNEL_FN_IMB5]; /* the group's integer product, lanes summed at the end */
    for (int64_t r = 0; r < mb; r++) {
      const __m256i seed = slow ? KERNEL_FN_seed(j, m0 + r, n, gi, full, w)
                                : _mm256_loadu_si256((const __m256i *)(j->xl + ((m0 + r) * j->G + gi) * 8));
      ia[r] = _mm512_zextsi256_si512(seed);
    }
    const int64_t units = j->bits == 4 ? w / 128 * 128 : 0;
    if (units) { /* 128 columns a step: low nibbles (even columns) as they are, high ones as 16 q */
      __m512i ih[KERNEL_FN_IMB5];
      for (int64_t r = 0; r < mb; r++) ih[r] = _mm512_setzero_si512();
      const __m512i f = _mm512_set1_epi8(15), f4 = _mm512_set1_epi8((char)0xF0);
      for (int64_t c = 0; c < units; c += 128) {
        const __m512i v = _mm512_loadu_si512((const void *)(j->q + n * (j->K / 2) + (k0 + c) / 2));
        const __m512i lo = _mm512_and_si512(v, f), hi = _mm512_and_si512(v, f4);
        for (int64_t r = 0; r < mb; r++) {
          const int8_t *xu = xg + r * j->KP + c;
          ia[r] = _mm512_dpbusd_epi32(ia[r], lo, _mm512_loadu_si512((const void *)xu));
          ih[r] = _mm512_dpbusd_epi32(ih[r], hi, _mm512_loadu_si512((const void *)(xu + 64)));
        }
      }
      for (int64_t r = 0; r < mb; r++) /* each lane a multiple of 16: the shift is exact */
        ia[r] = _mm512_add_epi32(ia[r], _mm512_srai_epi32(ih[r], 4));
    }
    for (int64_t c = units; c < wide; c += 64) {
      const __m512i wv = KERNEL_FN_w64(j, n, k0 + c);
      for (int64_t r = 0; r < mb; r++)
        ia[r] = _mm512_dpbusd_epi32(ia[r], wv, _mm512_loadu_si512((const void *)(xg + r * j->KP + c)));
    }
    if (wide < full) { /* a last 32 columns: on 256 bits, into the low half */
      const __m256i wv = KERNEL_FN_w32(j, n, k0 + wide, 1);
      for (int64_t r = 0; r < mb; r++) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xg + r * j->KP + wide));
        const __m256i d = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wv, x);
        ia[r] = _mm512_add_epi32(ia[r], _mm512_zextsi256_si512(d));
      }
    }
    const float ws = j->s[n * j->G + gi];
    for (int64_t r = 0; r < mb; r++) {
      const __m512 sc = _mm512_set1_ps(j->xd[(m0 + r) * j->G + gi] * ws);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r]), sc, acc[r]);
    }
    gi += 1;
  }
  for (int64_t r = 0; r < mb; r++)
    j->y[(m0 + r) * j->N + n] =
        KERNEL_FN_ihsum(_mm256_add_ps(_mm512_castps512_ps256(acc[r]), _mm512_extractf32x8_ps(acc[r], 1)));
}

KERNEL_FN_T5 static void KERNEL_FN_rows_avx512(const KERNEL_FN_ijob *j, int64_t n, int64_t m0, int64_t mb) {
  switch (mb) {
    case 8: KERNEL_FN_avx512_mb(j, n, m0, 8); break;
    case 7: KERNEL_FN_avx512_mb(j, n, m0, 7); break;
    case 6: KERNEL_FN_avx512_mb(j, n, m0, 6); break;
    case 5: KERNEL_FN_avx512_mb(j, n, m0, 5); break;
    case 4: KERNEL_FN_avx512_mb(j, n, m0, 4); break;
    case 3: KERNEL_FN_avx512_mb(j, n, m0, 3); break;
    case 2: KERNEL_FN_avx512_mb(j, n, m0, 2); break;
    default: KERNEL_FN_avx512_mb(j, n, m0, 1); break;
  }
}
#endif

enum { KERNEL_FN_IMB0 = 4 }; /* rows per pass but on AVX-512 */

/* the best path this CPU has, at most `want` (-1: no limit) */
static int64_t KERNEL_FN_pick(int64_t want) {
  int64_t best = 0;
#ifdef KERNEL_FN_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = 1;
  if (best == 1 && __builtin_cpu_supports("avxvnni")) best = 2;
  if (best >= 1 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512vnni"))
    best = 3;
#endif
  return want < 0 || want > best ? best : want;
}

/* one claim: outputs c * rows .. (c + 1) * rows - 1, each against the rows of x 4 (8) at a time */
static void KERNEL_FN_ioutputs(void *arg, int64_t c, int64_t worker) {
  (void)worker;
  const KERNEL_FN_ijob *j = (const KERNEL_FN_ijob *)arg;
  const int64_t n1 = (c + 1) * j->rows < j->N ? (c + 1) * j->rows : j->N;
  const int64_t step = j->isa == 3 ? KERNEL_FN_IMB5 : KERNEL_FN_IMB0;
  for (int64_t n = c * j->rows; n < n1; n++) {
    for (int64_t m = 0; m < j->M; m += step) {
      const int64_t mb = j->M - m < step ? j->M - m : step;
#ifdef KERNEL_FN_X86
      if (j->isa == 3) KERNEL_FN_rows_avx512(j, n, m, mb);
      else if (j->isa == 2) KERNEL_FN_rows_avxvnni(j, n, m, mb);
      else if (j->isa == 1) KERNEL_FN_rows_avx2(j, n, m, mb);
      else
#endif
        KERNEL_FN_rows_c(j, n, m, mb);
    }
  }
}

/* bufs: x [M, K], qweight, scales [N, G], zeros?, y [M, N], status; g: group columns */
static void KERNEL_FN_int8(void **bufs, int64_t M, int64_t K, int64_t N, int64_t bits, int64_t g,
                           int64_t has_z, int64_t want, int64_t nthreads) {
  int64_t *status = (int64_t *)bufs[4 + has_z];
  const int64_t G = K > 0 ? (K + g - 1) / g : 0, GP = (g + 31) / 32 * 32;
  KERNEL_FN_ijob j = {(const float *)bufs[0], (const float *)bufs[2], (const uint8_t *)bufs[1],
                      has_z ? (const uint8_t *)bufs[3] : NULL, (float *)bufs[3 + has_z], NULL, NULL,
                      NULL, NULL, M, K, N, G, g, GP, G * GP, bits, 1, KERNEL_FN_pick(want)};
  if (G == 0 || M == 0) {
    for (int64_t i = 0; i < M * N; i++) j.y[i] = 0.0f;
    return;
  }
  const size_t rg = (size_t)M * (size_t)G;
  j.xq = (int8_t *)malloc((size_t)M * (size_t)j.KP + 64); /* + 64: a pair's load may pass the end */
  j.xd = (float *)malloc(rg * sizeof(float));
  j.xe = (float *)malloc(rg * 8 * sizeof(float) + 64);
  j.xl = (int32_t *)malloc(rg * 8 * sizeof(int32_t) + 64);
  if (!j.xq || !j.xd || !j.xe || !j.xl) {
    status[0] = 3;
  } else {
    KERNEL_FN_quantize_rows(&j);
    int64_t nt = M * N * K < (1 << 17) || nthreads < 1 ? 1 : nthreads;
    j.rows = (N + 8 * nt - 1) / (8 * nt);
    if (j.rows < 1) j.rows = 1;
    const int64_t chunks = (N + j.rows - 1) / j.rows;
    if (nt > chunks) nt = chunks > 0 ? chunks : 1;
    llmkit_par_for(chunks, nt, KERNEL_FN_ioutputs, &j);
  }
  free(j.xq);
  free(j.xd);
  free(j.xe);
  free(j.xl);
}
"""
