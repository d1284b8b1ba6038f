"""``quant_linear`` with int8 activations (``act_bits=8``): integer dot products, the ISA picked at run time.

Each row of x is quantized on the fly per weight group (the whole row with ``group_size=-1``):
``d = max|x| / 127`` and codes ``rint(x / d)`` in [-127, 127], float32 arithmetic (``d = 0``: codes
0), in parallel over rows. The weights go through panels of 16 outputs: word t of a panel holds, for
each of its 16 outputs, 4 bytes of that output's codes (4 columns of 8 bits, 8 of 4 bits), each group
padded to whole words (``ops.quant.pack_qweight`` makes the same layout once, ``packed=1``: the
engine's programs; otherwise the kernel transposes 16 rows of codes into a panel, in registers, as
it goes). One vector lane is one output, so a lane accumulates the exact integer product of its
output's group with the row's codes (``idot``) and no lanes are ever summed across; the output is
then, groups in order, ``y = fma((float)idot, d * scale, y)``. That one sequence per (row, output)
is what every path, block of rows and thread computes: the paths give the same bits, and a row's
result never depends on the rows beside it (the engine's batch invariance). The kernel is blocked
as a GEMM: a panel (in L1) against 8 rows at a time (AVX-512; else 4), both
cores taking runs of consecutive panels from the thread pool (``compiler/par.py``; a run is one
stream of memory: about 8 a thread, for a single row one, its first 4 KiB asked for at once), so one
kernel serves decode and prefill. A panel's scales are transposed into its lanes in registers
(16 x 16 or 8 x 8 at a time; a strided scalar copy had cost more than the products). Decode (one
row) reads every weight once from memory: as it reads a group it prefetches the codes 4 KiB on and a
line of the scales two panels on.

The dot products use the widest integer instructions the CPU has, chosen when the kernel runs
(``__builtin_cpu_supports``), never from the build machine's ``-march``: AVX-512 VNNI
(``vpdpbusd``, 16 outputs a vector), AVX-VNNI (the same on 256 bits, two vectors a panel), AVX2
(``vpmaddubsw`` + ``vpmaddwd``), or portable C. ``vpdpbusd`` multiplies unsigned by signed bytes:
4-bit codes are unsigned already (``idot = sum q x - zero * sum x``); 8-bit codes are made unsigned
as they are read, ``q ^ 0x80 = q + 128`` (``idot = sum (q + 128) x - 128 * sum x``); the AVX2 path
uses ``|q|`` and ``x * sign(q)`` instead (``vpmaddubsw`` saturates int16 otherwise), and for 4 bits
adds ``vpmaddubsw``'s pair sums in int16 over 4 words (|sum| <= 8 * 2 * 15 * 127 < 2^15: exact)
before one ``vpmaddwd``. The correction
(``- zero * sum x``, from the row's code sums) starts each group's accumulator, so ``idot`` is exact
on every path.

Scales in float16 (``packed=2``: the engine's panels of weights quantized with float16 scales,
4.5 bits a weight in groups of 32 where float32 scales make 5) come a panel at a time, in its
lanes' order (``ops.quant.half_scales``), so they are widened to float32 without transposing,
exactly (every float16 is a float32): the output bits are those of the float32 scales. With F16C's
``vcvtph2ps`` where the CPU has it (CPUID, asked once) and the path is not the portable one, else
in plain C.

``LLMKIT_INT_ISA`` (``auto``, ``avx512vnni``, ``avxvnni``, ``avx2``, ``c``) or :func:`set_int_isa`
forces a path (the kernel never goes above what the CPU has); :func:`cpu_int_isas` lists what
this CPU offers; ``LLMKIT_F16C=off`` or :func:`set_f16c` (False) converts float16 scales in C on
every path, as a CPU without F16C does. AMX is not used (this project's Intel VMs advertise tiles
that fault; its AMD ones have none).
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
_f16c: bool | None = None


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


def set_f16c(enabled: bool | None) -> None:
    """False: float16 scales converted in plain C even where the CPU has F16C (None: back to
    ``LLMKIT_F16C``, ``auto`` or ``off``). Takes effect for programs planned afterwards."""
    global _f16c
    _f16c = enabled


def f16c_code() -> int:
    """The kernel's ``f16c`` size: 1 (F16C where the CPU has it) or 0 (plain C)."""
    if _f16c is not None:
        return int(_f16c)
    name = os.environ.get("LLMKIT_F16C", "auto")
    if name not in ("auto", "off"):
        raise IsaError(f"LLMKIT_F16C must be auto or off, got {name!r}")
    return int(name == "auto")


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
#include <cpuid.h>
#define KERNEL_FN_X86 1
#define KERNEL_FN_T2 __attribute__((target("avx2,fma")))
#define KERNEL_FN_TV __attribute__((target("avx2,fma,avxvnni")))
#define KERNEL_FN_T5 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
#endif
#define KERNEL_FN_NR 16 /* output columns per panel: the lanes of one AVX-512 vector, two AVX2 ones */

/* One call. Weights go through panels of NR output columns: dword p of a panel (p = gi * GW + t: a
   group's t-th 4 bytes of codes, each group padded to GW dwords) holds NR dwords, lane l the 4 code
   bytes of output n0 + l (8 bits: 4 columns; 4 bits: 8 columns, even ones in the low nibbles). Each
   lane's integer products are those of one output, so no lanes are ever summed across: for every
   (m, n) the result is the same sequence whatever the path, the block of rows or the thread.
   Activations, row m: KX bytes; group gi at gi * GW * XB, XB bytes per weight dword (8 bits: the 4
   codes of its columns; 4 bits: the 4 codes of its even columns, then the 4 of its odd ones);
   xd[m * G + gi] the scale d, xs[m * G + gi] the sum of the group's codes. */
typedef struct {
  const float *x, *s;
  const uint8_t *q, *z;
  float *y;
  int8_t *xq;
  float *xd;
  int32_t *xs;
  uint8_t *pbuf;
  int64_t M, K, N, G, g, gb, GW, XB, KX, RB, bits, isa, off, flip, pstride, mr, nt, packed, pc;
  int64_t hs, f16c; /* s holds float16 scales (packed=2); convert them with F16C */
  int64_t nw; /* weights of one x (quant_linears): this job and the nw - 1 after it */
} KERNEL_FN_ijob;

/* a float16 number as float32 (exact: every float16 is one), in plain C */
static inline float KERNEL_FN_h2f(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, em = h & 0x7fffu;
  uint32_t u;
  float f;
  if (em >= 0x7c00u) { /* inf, nan */
    u = sign | 0x7f800000u | (em & 0x3ffu) << 13;
  } else if (em >= 0x0400u) { /* normal: the exponent rebased from 15 to 127 */
    u = sign | (em + ((127 - 15) << 10)) << 13;
  } else { /* zero, subnormal: em * 2^-24 */
    f = (float)em * 5.9604644775390625e-08f;
    memcpy(&u, &f, 4);
    u |= sign;
  }
  memcpy(&f, &u, 4);
  return f;
}

#ifdef KERNEL_FN_X86
__attribute__((target("avx,f16c"))) static void KERNEL_FN_widen_f16c(const uint16_t *h, int64_t n,
                                                                     float *o) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(o + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
  for (; i < n; i++) o[i] = KERNEL_FN_h2f(h[i]);
}

/* F16C (CPUID.1:ECX bit 29), asked of the CPU the first time the kernel runs (CPUID traps to the
   hypervisor in a VM: microseconds, too slow for every call) */
static int64_t KERNEL_FN_has_f16c(void) {
  static volatile int64_t known = -1;
  if (known < 0) {
    unsigned a, b, c, d;
    known = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) ? 1 : 0;
  }
  return known;
}
#endif

/* n float16 numbers at h as float32 at o */
static void KERNEL_FN_widen(const KERNEL_FN_ijob *j, const uint16_t *h, int64_t n, float *o) {
#ifdef KERNEL_FN_X86
  if (j->f16c) {
    KERNEL_FN_widen_f16c(h, n, o);
    return;
  }
#endif
  (void)j;
  for (int64_t i = 0; i < n; i++) o[i] = KERNEL_FN_h2f(h[i]);
}

/* the byte of column c (of a group) among the group's activation codes */
static inline int64_t KERNEL_FN_at(int64_t bits, int64_t c) {
  return bits == 8 ? c : (c / 8) * 8 + (c % 2) * 4 + (c % 8) / 2;
}

static inline int64_t KERNEL_FN_width(const KERNEL_FN_ijob *j, int64_t gi) {
  const int64_t k0 = gi * j->g;
  return (k0 + j->g < j->K ? k0 + j->g : j->K) - k0;
}

/* one group of w columns of a row at xm: d = max|x| / 127, codes rint(x / d) (float32, round half to
   even; d = 0: codes 0) at their bytes of o, their sum */
static void KERNEL_FN_quantize_c(const float *xm, int64_t w, int64_t bits, int8_t *o, float *d_out,
                                 int32_t *sum_out) {
  float amax = 0.0f;
  for (int64_t t = 0; t < w; t++) amax = fmaxf(amax, fabsf(xm[t]));
  const float d = amax / 127.0f;
  int32_t sum = 0;
  if (d > 0.0f)
    for (int64_t t = 0; t < w; t++) {
      float v = rintf(xm[t] / d);
      v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
      const int8_t q = (int8_t)v;
      sum += q;
      o[KERNEL_FN_at(bits, t)] = q;
    }
  *d_out = d;
  *sum_out = sum;
}

#ifdef KERNEL_FN_X86
/* the same, 8 columns a step (a maximum, a correctly rounded quotient and its rounding are the
   scalar ones lane by lane; the sum is exact): the same bytes */
KERNEL_FN_T2 static void KERNEL_FN_quantize_avx2(const float *xm, int64_t w, int64_t bits, int8_t *o,
                                                 float *d_out, int32_t *sum_out) {
  const int64_t w8 = w / 8 * 8;
  const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 mv = _mm256_setzero_ps();
  for (int64_t t = 0; t < w8; t += 8) /* max(|x|, m): a NaN |x| leaves m, as fmaxf does */
    mv = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xm + t), absm), mv);
  /* the lanes' maximum (none NaN, none below +0: fmaxf's, without a call per lane) */
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
  for (int64_t t = w8; t < w; t++) amax = fmaxf(amax, fabsf(xm[t]));
  const float d = amax / 127.0f;
  int32_t sum = 0;
  if (d > 0.0f) {
    const __m256 dv = _mm256_set1_ps(d), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    const __m256i order = bits == 8 ? _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)
                                    : _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7); /* KERNEL_FN_at */
    __m256i sv = _mm256_setzero_si256();
    for (int64_t t = 0; t < w8; t += 8) {
      __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(xm + t), dv),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256i q = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
      sv = _mm256_add_epi32(sv, q);
      const __m256i p = _mm256_permutevar8x32_epi32(q, order);
      const __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
      _mm_storel_epi64((__m128i *)(o + t), _mm_packs_epi16(h, h));
    }
    int32_t s8[8];
    _mm256_storeu_si256((__m256i *)s8, sv);
    for (int i = 0; i < 8; i++) sum += s8[i];
    for (int64_t t = w8; t < w; t++) {
      float v = rintf(xm[t] / d);
      v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
      const int8_t q = (int8_t)v;
      sum += q;
      o[KERNEL_FN_at(bits, t)] = q;
    }
  }
  *d_out = d;
  *sum_out = sum;
}
#endif

/* rows c * 8 .. : every group of the row quantized (the vector path where the ISA allows) */
static void KERNEL_FN_quantize_rows(void *arg, int64_t c, int64_t worker) {
  (void)worker;
  const KERNEL_FN_ijob *j = (const KERNEL_FN_ijob *)arg;
  const int64_t m1 = (c + 1) * 8 < j->M ? (c + 1) * 8 : j->M;
  for (int64_t m = c * 8; m < m1; m++) {
    const float *xm = j->x + m * j->K;
    int8_t *row = j->xq + m * j->KX;
    memset(row, 0, (size_t)j->KX);
    for (int64_t gi = 0; gi < j->G; gi++) {
      const int64_t i = m * j->G + gi;
      const float *xg = xm + gi * j->g;
      int8_t *o = row + gi * j->GW * j->XB;
#ifdef KERNEL_FN_X86
      if (j->isa >= 1) KERNEL_FN_quantize_avx2(xg, KERNEL_FN_width(j, gi), j->bits, o, j->xd + i, j->xs + i);
      else
#endif
        KERNEL_FN_quantize_c(xg, KERNEL_FN_width(j, gi), j->bits, o, j->xd + i, j->xs + i);
    }
  }
}

/* the panel of outputs n0 .. n0 + nn - 1: codes as above, the bytes as stored (so a weight packed
   once, ``pack_qweight``, is this same layout); lanes >= nn 0 */
static void KERNEL_FN_pack_c(const KERNEL_FN_ijob *j, int64_t n0, int64_t nn, uint8_t *pw) {
  const int64_t NR = KERNEL_FN_NR;
  for (int64_t gi = 0; gi < j->G; gi++) {
    const int64_t bytes = j->bits == 8 ? KERNEL_FN_width(j, gi) : KERNEL_FN_width(j, gi) / 2;
    for (int64_t t = 0; t < j->GW; t++)
      for (int64_t l = 0; l < NR; l++)
        for (int64_t b = 0; b < 4; b++) {
          const int64_t at = 4 * t + b;
          uint8_t v = l < nn && at < bytes ? j->q[(n0 + l) * j->RB + gi * j->gb + at] : 0;
          pw[((gi * j->GW + t) * NR + l) * 4 + b] = v;
        }
  }
}

/* the panel's float32 scales [G][NR] (ps NULL: not these) and, with zeros, their negatives [G][NR]
   (int32); lanes >= nn 0 */
static void KERNEL_FN_pack_meta(const KERNEL_FN_ijob *j, int64_t n0, int64_t nn, float *ps, int32_t *pz) {
  for (int64_t gi = 0; gi < j->G; gi++)
    for (int64_t l = 0; l < KERNEL_FN_NR; l++) {
      if (ps) ps[gi * KERNEL_FN_NR + l] = l < nn ? j->s[(n0 + l) * j->G + gi] : 0.0f;
      if (j->z) pz[gi * KERNEL_FN_NR + l] = l < nn ? -(int32_t)j->z[(n0 + l) * j->G + gi] : 0;
    }
}

/* portable C: rows m0 .. m0 + mb - 1 of the panel; per lane and group the exact integer product,
   then y = fma((float)idot, d * s, y), groups in order */
static void KERNEL_FN_panel_c(const KERNEL_FN_ijob *j, const uint8_t *pw, const float *ps,
                              const int32_t *pz, int64_t m0, int64_t mb, int64_t n0, int64_t nn) {
  for (int64_t r = 0; r < mb; r++) {
    const int64_t m = m0 + r;
    for (int64_t l = 0; l < nn; l++) {
      float y = 0.0f;
      for (int64_t gi = 0; gi < j->G; gi++) {
        const int64_t i = m * j->G + gi;
        int32_t acc = (j->z ? pz[gi * KERNEL_FN_NR + l] : -(int32_t)j->off) * j->xs[i];
        const int8_t *xg = j->xq + m * j->KX + gi * j->GW * j->XB;
        for (int64_t t = 0; t < j->GW; t++) {
          const uint8_t *w = pw + ((gi * j->GW + t) * KERNEL_FN_NR + l) * 4;
          for (int b = 0; b < 4; b++) {
            if (j->bits == 8) {
              acc += (int32_t)(int8_t)w[b] * xg[4 * t + b];
            } else {
              acc += (int32_t)(w[b] & 15) * xg[8 * t + b] + (int32_t)(w[b] >> 4) * xg[8 * t + 4 + b];
            }
          }
        }
        y = fmaf((float)acc, j->xd[i] * ps[gi * KERNEL_FN_NR + l], y);
      }
      j->y[m * j->N + n0 + l] = y;
    }
  }
}

#ifdef KERNEL_FN_X86
/* dst[p * 64 + 4 * l ..] = dword p of row l (rows `stride` bytes apart from src; rows >= nn repeat
   the last, their lanes never stored), p < dw: 16 rows x 16 dwords at a time, transposed in
   registers (unpack 32, unpack 64, then the 128-bit lanes) */
KERNEL_FN_T5 static void KERNEL_FN_t16(const uint8_t *src, int64_t stride, int64_t nn, int64_t dw,
                                       uint8_t *dst) {
  const uint8_t *row[16];
  for (int l = 0; l < 16; l++) row[l] = src + (l < nn ? l : nn - 1) * stride;
  for (int64_t p = 0; p < dw; p += 16) {
    const __mmask16 k = dw - p >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (dw - p)) - 1);
    __m512i r[16], t[16], u[16];
    for (int l = 0; l < 16; l++) r[l] = _mm512_maskz_loadu_epi32(k, (const void *)(row[l] + 4 * p));
    for (int i = 0; i < 8; i++) {
      t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* u[4i + c] lane L: rows 4i .. 4i + 3 at dword 4L + c */
      u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
      u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
      u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
      u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {
      const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
      const __m512i v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
      const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
      const __m512i v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
      const __m512i o[4] = {_mm512_shuffle_i32x4(v0, v2, 0x88), _mm512_shuffle_i32x4(v0, v2, 0xDD),
                            _mm512_shuffle_i32x4(v1, v3, 0x88), _mm512_shuffle_i32x4(v1, v3, 0xDD)};
      for (int L = 0; L < 4; L++)
        if (p + 4 * L + c < dw) _mm512_storeu_si512((void *)(dst + (p + 4 * L + c) * 64), o[L]);
    }
  }
}

/* KERNEL_FN_t16 on AVX2: dst[p * 64 + 4 * l ..] = dword p of row l (rows >= nn repeat the last),
   8 rows x 8 dwords at a time (unpack 32, shuffle 64, then the 128-bit lanes), the last dw % 8 one
   by one */
KERNEL_FN_T2 static void KERNEL_FN_t8(const uint8_t *src, int64_t stride, int64_t nn, int64_t dw,
                                      uint8_t *dst) {
  for (int h = 0; h < 2; h++) {
    const float *row[8];
    for (int l = 0; l < 8; l++) {
      const int64_t at = 8 * h + l < nn ? 8 * h + l : nn - 1;
      row[l] = (const float *)(src + at * stride);
    }
    float *out = (float *)dst + 8 * h;
    int64_t p = 0;
    for (; p + 8 <= dw; p += 8) {
      __m256 r[8], t[8], u[8];
      for (int l = 0; l < 8; l++) r[l] = _mm256_loadu_ps(row[l] + p);
      for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
      }
      for (int i = 0; i < 2; i++) { /* u[4i + c]: rows 4i .. 4i + 3 at dwords c and 4 + c */
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
      }
      for (int c = 0; c < 4; c++) {
        _mm256_storeu_ps(out + (p + c) * 16, _mm256_permute2f128_ps(u[c], u[4 + c], 0x20));
        _mm256_storeu_ps(out + (p + 4 + c) * 16, _mm256_permute2f128_ps(u[c], u[4 + c], 0x31));
      }
    }
    for (; p < dw; p++)
      for (int l = 0; l < 8; l++) out[p * 16 + l] = row[l][p];
  }
}

/* the panel's codes when every group's codes are whole dwords (the row's dword p is the panel's
   dword p); padding dwords of a short last group 0 */
KERNEL_FN_T5 static void KERNEL_FN_pack_512(const KERNEL_FN_ijob *j, int64_t n0, int64_t nn, uint8_t *pw) {
  const int64_t dw = j->RB / 4, all = j->G * j->GW;
  KERNEL_FN_t16(j->q + n0 * j->RB, j->RB, nn, dw, pw);
  for (int64_t p = dw; p < all; p++) _mm512_storeu_si512((void *)(pw + p * 64), _mm512_setzero_si512());
}

KERNEL_FN_T2 static void KERNEL_FN_pack_256(const KERNEL_FN_ijob *j, int64_t n0, int64_t nn, uint8_t *pw) {
  const int64_t dw = j->RB / 4, all = j->G * j->GW;
  for (int h = 0; h < 2; h++) {
    int32_t ix[8];
    for (int l = 0; l < 8; l++) ix[l] = (int32_t)((8 * h + l < nn ? 8 * h + l : 0) * j->RB);
    const __m256i idx = _mm256_loadu_si256((const __m256i *)ix);
    int32_t mk[8];
    for (int l = 0; l < 8; l++) mk[l] = 8 * h + l < nn ? -1 : 0;
    const __m256i mask = _mm256_loadu_si256((const __m256i *)mk);
    const int *base = (const int *)(j->q + n0 * j->RB);
    for (int64_t p = 0; p < dw; p++) {
      const int *at = (const int *)((const uint8_t *)base + 4 * p);
      const __m256i v = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), at, idx, mask, 1);
      _mm256_storeu_si256((__m256i *)(pw + p * 64 + 32 * h), v);
    }
    for (int64_t p = dw; p < all; p++)
      _mm256_storeu_si256((__m256i *)(pw + p * 64 + 32 * h), _mm256_setzero_si256());
  }
}

/* one row (decode) streams the weights from memory once: as group gi's words are read, those 4 KiB
   on are asked for (packed weights are one run of panels), and group gi's part of the scales two
   panels on (a panel's scales are G lines of float32, G / 2 of float16) */
static inline __attribute__((always_inline)) void KERNEL_FN_ahead(const KERNEL_FN_ijob *j, const uint8_t *w,
                                                                 int64_t words, int64_t n0, int64_t gi) {
  if (!j->packed) return;
  for (int64_t t = 0; t < words; t++) _mm_prefetch((const char *)(w + 4096 + t * 64), _MM_HINT_T0);
  if (n0 + 3 * KERNEL_FN_NR <= j->N && !(j->hs && gi % 2)) /* float16: a line holds two groups */
    _mm_prefetch((const char *)j->s + ((n0 + 2 * KERNEL_FN_NR) * j->G + gi * KERNEL_FN_NR) * (j->hs ? 2 : 4),
                 _MM_HINT_T0);
}

/* AVX-512 VNNI: rows m0 .. m0 + mb - 1 (mb a constant where inlined), one vector of 16 outputs */
KERNEL_FN_T5 static inline __attribute__((always_inline)) void KERNEL_FN_mk512(
    const KERNEL_FN_ijob *j, const uint8_t *pw, const float *ps, const int32_t *pz, int64_t m0, const int mb,
    int64_t n0, int64_t nn, const int bits) {
  __m512 f[8];
  for (int r = 0; r < mb; r++) f[r] = _mm512_setzero_ps();
  const __m512i lo4 = _mm512_set1_epi8(15), fl = _mm512_set1_epi8(bits == 8 ? (char)0x80 : 0);
  for (int64_t gi = 0; gi < j->G; gi++) {
    /* integer chains per row (exact, so their sum is the same however split): with one or two rows
       4 bits a the low nibbles, b the high ones, and c, e every other word (a single chain would wait
       on vpdpbusd's latency); 8 bits a and b alternate words; 4 bits with more rows, a alone */
    __m512i a[8], b[8], c[8], e[8];
    const int8_t *xr = j->xq + m0 * j->KX + gi * j->GW * j->XB;
    const int32_t *xs = j->xs + m0 * j->G + gi;
    if (j->z) {
      const __m512i zv = _mm512_loadu_si512((const void *)(pz + gi * 16));
      for (int r = 0; r < mb; r++) a[r] = _mm512_mullo_epi32(zv, _mm512_set1_epi32(xs[r * j->G]));
    } else {
      for (int r = 0; r < mb; r++) a[r] = _mm512_set1_epi32(-(int32_t)j->off * xs[r * j->G]);
    }
    const int split = mb <= 2 || bits == 8; /* b in use (4 bits, 3 rows or more: one chain a row) */
    for (int r = 0; r < mb; r++) {
      if (split) b[r] = _mm512_setzero_si512();
      if (mb <= 2) c[r] = e[r] = _mm512_setzero_si512();
    }
    const uint8_t *w = pw + gi * j->GW * 64;
    if (mb == 1) KERNEL_FN_ahead(j, w, j->GW, n0, gi);
#define KERNEL_FN_S512(t, A, B)                                                                       \
  do {                                                                                                \
    const __m512i w0 = _mm512_loadu_si512((const void *)(w + (t) * 64));                              \
    const __m512i wv = bits == 8 ? _mm512_xor_si512(w0, fl) : w0;                                     \
    if (bits == 4) {                                                                                  \
      const __m512i lo = _mm512_and_si512(wv, lo4), hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), lo4); \
      for (int r = 0; r < mb; r++) {                                                                  \
        const int8_t *x = xr + r * j->KX + 8 * (t);                                                   \
        A[r] = _mm512_dpbusd_epi32(A[r], lo, _mm512_set1_epi32(*(const int32_t *)x));                 \
        B[r] = _mm512_dpbusd_epi32(B[r], hi, _mm512_set1_epi32(*(const int32_t *)(x + 4)));           \
      }                                                                                               \
    } else {                                                                                          \
      for (int r = 0; r < mb; r++) {                                                                  \
        const int8_t *x = xr + r * j->KX + 4 * (t);                                                   \
        A[r] = _mm512_dpbusd_epi32(A[r], wv, _mm512_set1_epi32(*(const int32_t *)x));                 \
      }                                                                                               \
    }                                                                                                 \
  } while (0)
    int64_t t = 0;
    if (mb <= 2)
      for (; t + 1 < j->GW; t += 2) {
        KERNEL_FN_S512(t, a, b);
        KERNEL_FN_S512(t + 1, c, e);
      }
    else if (bits == 8)
      for (; t + 1 < j->GW; t += 2) {
        KERNEL_FN_S512(t, a, a);
        KERNEL_FN_S512(t + 1, b, b);
      }
    if (split)
      for (; t < j->GW; t++) KERNEL_FN_S512(t, a, b);
    else
      for (; t < j->GW; t++) KERNEL_FN_S512(t, a, a);
#undef KERNEL_FN_S512
    for (int r = 0; r < mb; r++) {
      if (split) a[r] = _mm512_add_epi32(a[r], b[r]);
      if (mb <= 2) a[r] = _mm512_add_epi32(a[r], _mm512_add_epi32(c[r], e[r]));
    }
    const __m512 sv = _mm512_loadu_ps(ps + gi * 16);
    for (int r = 0; r < mb; r++)
      f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r]),
                             _mm512_mul_ps(_mm512_set1_ps(j->xd[(m0 + r) * j->G + gi]), sv), f[r]);
  }
  const __mmask16 lanes = (__mmask16)((1u << nn) - 1);
  for (int r = 0; r < mb; r++) _mm512_mask_storeu_ps(j->y + (m0 + r) * j->N + n0, lanes, f[r]);
}

#define KERNEL_FN_CASES(F, ...)                    \
  switch (mb) {                                    \
    case 8: F(__VA_ARGS__, 8); break;              \
    case 7: F(__VA_ARGS__, 7); break;              \
    case 6: F(__VA_ARGS__, 6); break;              \
    case 5: F(__VA_ARGS__, 5); break;              \
    case 4: F(__VA_ARGS__, 4); break;              \
    case 3: F(__VA_ARGS__, 3); break;              \
    case 2: F(__VA_ARGS__, 2); break;              \
    default: F(__VA_ARGS__, 1); break;             \
  }
#define KERNEL_FN_MK512(bits, mbc) KERNEL_FN_mk512(j, pw, ps, pz, m0, mbc, n0, nn, bits)
KERNEL_FN_T5 static void KERNEL_FN_panel_512(const KERNEL_FN_ijob *j, const uint8_t *pw, const float *ps,
                                              const int32_t *pz, int64_t m0, int64_t mb, int64_t n0,
                                              int64_t nn) {
  if (j->bits == 4) {
    KERNEL_FN_CASES(KERNEL_FN_MK512, 4)
  } else {
    KERNEL_FN_CASES(KERNEL_FN_MK512, 8)
  }
}

/* the 256-bit paths: two vectors of 8 outputs; DOT(acc, w, x) adds w (unsigned, 8 bits signed on
   AVX2) times x's 4 bytes in every lane */
KERNEL_FN_T2 static inline __m256i KERNEL_FN_dot_avx2(__m256i acc, __m256i w, __m256i x, const int bits) {
  const __m256i u = bits == 8 ? _mm256_abs_epi8(w) : w;
  const __m256i s = bits == 8 ? _mm256_sign_epi8(x, w) : x;
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#define KERNEL_FN_DOT_AVX2(acc, w, x, bits) KERNEL_FN_dot_avx2(acc, w, x, bits)
#define KERNEL_FN_DOT_VNNI(acc, w, x, bits) _mm256_dpbusd_avx_epi32(acc, w, x)

/* AVX2, 4 bits, one row (decode): vpmaddubsw's pair sums (|.| <= 2 * 15 * 127 = 3810) add up in
   int16 over 4 words of a group (8 of them, |.| <= 30480 < 2^15: exact), the low and the high nibbles
   in chains of their own (kept in registers and in order: GCC would otherwise reassociate them and
   spill), then one vpmaddwd takes them to int32; the same integer product as every path. Each word
   asks for the line 4 KiB on as it is read (KERNEL_FN_ahead's stream, without its loop). */
KERNEL_FN_T2 static inline __attribute__((always_inline)) void KERNEL_FN_q4row(
    const KERNEL_FN_ijob *j, const uint8_t *w, const float *ps, const int32_t *pz, int64_t m0, int64_t n0,
    int64_t nn, const int64_t GW) {
  __m256 f0 = _mm256_setzero_ps(), f1 = _mm256_setzero_ps();
  const __m256i lo4 = _mm256_set1_epi8(15), one = _mm256_set1_epi16(1);
  const int64_t G = j->G, ahead = j->packed ? 4096 : 0, sb = j->hs ? 2 : 4, off = -j->off;
  const int8_t *x = j->xq + m0 * j->KX;
  const float *xd = j->xd + m0 * G;
  const int32_t *xs = j->xs + m0 * G;
  /* the scales two panels on, a group's part as its words are read (KERNEL_FN_ahead's) */
  const char *sa = (const char *)j->s + (n0 + 2 * KERNEL_FN_NR) * G * sb;
  if (!ahead || n0 + 3 * KERNEL_FN_NR > j->N) sa = 0;
  for (int64_t gi = 0; gi < G; gi++) {
    if (sa) _mm_prefetch(sa + gi * KERNEL_FN_NR * sb, _MM_HINT_T0);
    __m256i a0 = _mm256_set1_epi32((int32_t)off * xs[gi]), a1 = a0;
    if (j->z) {
      const __m256i xv = _mm256_set1_epi32(xs[gi]);
      a0 = _mm256_mullo_epi32(_mm256_loadu_si256((const __m256i *)(pz + gi * 16)), xv);
      a1 = _mm256_mullo_epi32(_mm256_loadu_si256((const __m256i *)(pz + gi * 16 + 8)), xv);
    }
    for (int64_t t0 = 0; t0 < GW; t0 += 4) {
      __m256i h0 = _mm256_setzero_si256(), h1 = h0, k0 = h0, k1 = h0;
#define KERNEL_FN_ROW4                                                                                \
  do {                                                                                                \
    const __m256i xl = _mm256_set1_epi32(*(const int32_t *)x);                                        \
    const __m256i xh = _mm256_set1_epi32(*(const int32_t *)(x + 4));                                  \
    const __m256i w0 = _mm256_loadu_si256((const __m256i *)w);                                        \
    const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + 32));                                 \
    if (ahead) _mm_prefetch((const char *)w + ahead, _MM_HINT_T0);                                    \
    h0 = _mm256_add_epi16(h0, _mm256_maddubs_epi16(_mm256_and_si256(w0, lo4), xl));                   \
    k0 = _mm256_add_epi16(k0, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w0, 4), lo4), xh)); \
    h1 = _mm256_add_epi16(h1, _mm256_maddubs_epi16(_mm256_and_si256(w1, lo4), xl));                   \
    k1 = _mm256_add_epi16(k1, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w1, 4), lo4), xh)); \
    __asm__("" : "+x"(h0), "+x"(h1), "+x"(k0), "+x"(k1));                                            \
    w += 64, x += 8;                                                                                  \
  } while (0)
      if (GW - t0 >= 4) {
        KERNEL_FN_ROW4;
        KERNEL_FN_ROW4;
        KERNEL_FN_ROW4;
        KERNEL_FN_ROW4;
      } else {
        for (int64_t t = t0; t < GW; t++) KERNEL_FN_ROW4;
      }
#undef KERNEL_FN_ROW4
      a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_add_epi16(h0, k0), one));
      a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_add_epi16(h1, k1), one));
    }
    const __m256 d = _mm256_set1_ps(xd[gi]);
    f0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a0), _mm256_mul_ps(d, _mm256_loadu_ps(ps + gi * 16)), f0);
    f1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a1), _mm256_mul_ps(d, _mm256_loadu_ps(ps + gi * 16 + 8)), f1);
  }
  float o[16];
  _mm256_storeu_ps(o, f0);
  _mm256_storeu_ps(o + 8, f1);
  memcpy(j->y + m0 * j->N + n0, o, (size_t)nn * sizeof(float));
}

/* AVX2, 4 bits, 2 to 4 rows (mb, a constant), the panel's two vectors of 8 outputs (the lanes past
   a last panel's outputs hold zero codes: computed, never stored). One word (64 bytes at w) against the rows
   (activations at x, rows KX bytes apart): the nibbles unpacked once for the rows, each row's
   activations broadcast once for both vectors; vpmaddubsw's pair sums start (first) or add to the
   rows' int16 chains h (8 registers, the unpacked words 4 more: no spills) */
KERNEL_FN_T2 static inline __attribute__((always_inline)) void KERNEL_FN_q4word(
    const uint8_t *w, const int8_t *x, int64_t KX, const int mb, __m256i h[4][2], const int first) {
  const __m256i lo4 = _mm256_set1_epi8(15);
  __m256i lo[2], hi[2];
  for (int v = 0; v < 2; v++) {
    const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + 32 * v));
    lo[v] = _mm256_and_si256(wv, lo4);
    hi[v] = _mm256_and_si256(_mm256_srli_epi16(wv, 4), lo4);
  }
  for (int r = 0; r < mb; r++) {
    const __m256i xl = _mm256_set1_epi32(*(const int32_t *)(x + r * KX));
    for (int v = 0; v < 2; v++) {
      const __m256i p = _mm256_maddubs_epi16(lo[v], xl);
      h[r][v] = first ? p : _mm256_add_epi16(h[r][v], p);
      __asm__("" : "+x"(h[r][v])); /* the sum so far in a register: GCC would otherwise reassociate the
                                      8 products of every row and spill them all */
    }
    const __m256i xh = _mm256_set1_epi32(*(const int32_t *)(x + r * KX + 4));
    for (int v = 0; v < 2; v++) {
      h[r][v] = _mm256_add_epi16(h[r][v], _mm256_maddubs_epi16(hi[v], xh));
      __asm__("" : "+x"(h[r][v]));
    }
  }
}

/* words t .. t + n - 1 of group gi (n <= 4: 8 pair sums at most in an int16 chain, as above), then one
   vpmaddwd a chain; the group's int32 sums so far wait in ab (first: none yet); after its last words
   the correction and the group's multiply-add into the float sums fb. ab and fb are memory (L1): the
   16 registers hold the chains. */
KERNEL_FN_T2 static inline __attribute__((always_inline)) void KERNEL_FN_q4run(
    const KERNEL_FN_ijob *j, const uint8_t *w, const int8_t *x, const float *ps, const int32_t *pz,
    int64_t m0, const int mb, int64_t gi, const int64_t n, const int first, const int last, float fb[4][16],
    int32_t ab[4][16]) {
  const int64_t KX = j->KX, G = j->G;
  __m256i h[4][2];
  KERNEL_FN_q4word(w, x, KX, mb, h, 1);
  if (n == 4) { /* unrolled: the chains stay in registers */
    KERNEL_FN_q4word(w + 64, x + 8, KX, mb, h, 0);
    KERNEL_FN_q4word(w + 128, x + 16, KX, mb, h, 0);
    KERNEL_FN_q4word(w + 192, x + 24, KX, mb, h, 0);
  } else {
    for (int64_t t = 1; t < n; t++) KERNEL_FN_q4word(w + t * 64, x + 8 * t, KX, mb, h, 0);
  }
  const __m256i one = _mm256_set1_epi16(1);
  for (int r = 0; r < mb; r++) {
    const __m256i xs = _mm256_set1_epi32(j->xs[(m0 + r) * G + gi]);
    const __m256 d = _mm256_set1_ps(j->xd[(m0 + r) * G + gi]);
    for (int v = 0; v < 2; v++) {
      __m256i s = _mm256_madd_epi16(h[r][v], one);
      if (!first) s = _mm256_add_epi32(s, _mm256_load_si256((const __m256i *)(ab[r] + 8 * v)));
      if (!last) {
        _mm256_store_si256((__m256i *)(ab[r] + 8 * v), s);
        continue;
      }
      if (j->z)
        s = _mm256_add_epi32(
            s, _mm256_mullo_epi32(_mm256_loadu_si256((const __m256i *)(pz + gi * 16 + 8 * v)), xs));
      else /* - off * sum x, off = 8: a shift (the product taken in scalar cost the kernel 30%) */
        s = _mm256_sub_epi32(s, _mm256_slli_epi32(xs, 3));
      _mm256_store_ps(fb[r] + 8 * v, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s),
                                                     _mm256_mul_ps(d, _mm256_loadu_ps(ps + gi * 16 + 8 * v)),
                                                     _mm256_load_ps(fb[r] + 8 * v)));
    }
  }
}

/* the panel against rows m0 .. m0 + mb - 1, group by group in runs of 4 words; gw: the group's words
   (constant 4 for groups of 32, 16 for 128) */
KERNEL_FN_T2 static inline __attribute__((always_inline)) void KERNEL_FN_q4blk(
    const KERNEL_FN_ijob *j, const uint8_t *pw, const float *ps, const int32_t *pz, int64_t m0, const int mb,
    int64_t n0, int64_t nn, const int64_t gw) {
  float fb[4][16] __attribute__((aligned(32)));
  int32_t ab[4][16] __attribute__((aligned(32)));
  for (int r = 0; r < mb; r++)
    for (int v = 0; v < 2; v++) _mm256_store_ps(fb[r] + 8 * v, _mm256_setzero_ps());
  const int8_t *x = j->xq + m0 * j->KX;
  const uint8_t *w = pw;
  for (int64_t gi = 0; gi < j->G; gi++, w += gw * 64, x += gw * 8) {
    if (gw <= 4) {
      KERNEL_FN_q4run(j, w, x, ps, pz, m0, mb, gi, gw, 1, 1, fb, ab);
      continue;
    }
    KERNEL_FN_q4run(j, w, x, ps, pz, m0, mb, gi, 4, 1, 0, fb, ab);
    int64_t t = 4;
    for (; t + 4 < gw; t += 4) KERNEL_FN_q4run(j, w + t * 64, x + t * 8, ps, pz, m0, mb, gi, 4, 0, 0, fb, ab);
    KERNEL_FN_q4run(j, w + t * 64, x + t * 8, ps, pz, m0, mb, gi, gw - t, 0, 1, fb, ab);
  }
  for (int r = 0; r < mb; r++) {
    float *y = j->y + (m0 + r) * j->N + n0;
    if (nn == 16) { /* whole vectors stored as they are (a memcpy of a variable size costs more) */
      _mm256_storeu_ps(y, _mm256_load_ps(fb[r]));
      _mm256_storeu_ps(y + 8, _mm256_load_ps(fb[r] + 8));
    } else {
      memcpy(y, fb[r], (size_t)nn * sizeof(float));
    }
  }
}

/* the AVX2 4-bit kernel of mb rows (a constant): one as above (decode: the weights streamed,
   prefetched), more by KERNEL_FN_q4blk */
KERNEL_FN_T2 static inline __attribute__((always_inline)) void KERNEL_FN_q4_avx2(
    const KERNEL_FN_ijob *j, const uint8_t *pw, const float *ps, const int32_t *pz, int64_t m0, const int mb,
    int64_t n0, int64_t nn, const int bits) {
  (void)bits;
  if (mb == 1 && j->GW == 4) KERNEL_FN_q4row(j, pw, ps, pz, m0, n0, nn, 4); /* groups of 32 */
  else if (mb == 1) KERNEL_FN_q4row(j, pw, ps, pz, m0, n0, nn, j->GW);
  else if (j->GW == 4) KERNEL_FN_q4blk(j, pw, ps, pz, m0, mb, n0, nn, 4);
  else if (j->GW == 16) KERNEL_FN_q4blk(j, pw, ps, pz, m0, mb, n0, nn, 16); /* groups of 128 */
  else KERNEL_FN_q4blk(j, pw, ps, pz, m0, mb, n0, nn, j->GW);
}

#define KERNEL_FN_MK256(NAME, TGT, DOT, Q4)                                                             \
  TGT static inline __attribute__((always_inline)) void NAME##_mk(                                     \
      const KERNEL_FN_ijob *j, const uint8_t *pw, const float *ps, const int32_t *pz, int64_t m0,      \
      const int mb, int64_t n0, int64_t nn, const int bits) {                                          \
    __m256 f[4][2];                                                                                   \
    for (int r = 0; r < mb; r++) f[r][0] = f[r][1] = _mm256_setzero_ps();                             \
    const __m256i lo4 = _mm256_set1_epi8(15), fl = _mm256_set1_epi8(bits == 8 && j->flip ? (char)0x80 : 0); \
    for (int64_t gi = 0; gi < j->G; gi++) {                                                           \
      __m256i a[4][2];                                                                                \
      const int8_t *xr = j->xq + m0 * j->KX + gi * j->GW * j->XB;                                     \
      const int32_t *xs = j->xs + m0 * j->G + gi;                                                     \
      for (int r = 0; r < mb; r++)                                                                    \
        for (int v = 0; v < 2; v++)                                                                   \
          a[r][v] = j->z ? _mm256_mullo_epi32(_mm256_loadu_si256((const __m256i *)(pz + gi * 16 + 8 * v)), \
                                              _mm256_set1_epi32(xs[r * j->G]))                        \
                         : _mm256_set1_epi32(-(int32_t)j->off * xs[r * j->G]);                        \
      const uint8_t *w = pw + gi * j->GW * 64;                                                        \
      if (mb == 1) KERNEL_FN_ahead(j, w, j->GW, n0, gi);                                              \
      for (int64_t t = 0; t < j->GW; t++) {                                                           \
        for (int v = 0; v < 2; v++) {                                                                 \
          const __m256i wv =                                                                          \
              _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + t * 64 + 32 * v)), fl);        \
          if (bits == 4) {                                                                            \
            const __m256i lo = _mm256_and_si256(wv, lo4);                                             \
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), lo4);                       \
            for (int r = 0; r < mb; r++) {                                                            \
              const int8_t *x = xr + r * j->KX + 8 * t;                                               \
              a[r][v] = DOT(a[r][v], lo, _mm256_set1_epi32(*(const int32_t *)x), 4);                  \
              a[r][v] = DOT(a[r][v], hi, _mm256_set1_epi32(*(const int32_t *)(x + 4)), 4);            \
            }                                                                                         \
          } else {                                                                                    \
            for (int r = 0; r < mb; r++)                                                              \
              a[r][v] = DOT(a[r][v], wv, _mm256_set1_epi32(*(const int32_t *)(xr + r * j->KX + 4 * t)), 8); \
          }                                                                                           \
        }                                                                                             \
      }                                                                                               \
      for (int v = 0; v < 2; v++) {                                                                   \
        const __m256 sv = _mm256_loadu_ps(ps + gi * 16 + 8 * v);                                     \
        for (int r = 0; r < mb; r++)                                                                  \
          f[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][v]),                                      \
                                    _mm256_mul_ps(_mm256_set1_ps(j->xd[(m0 + r) * j->G + gi]), sv),   \
                                    f[r][v]);                                                         \
      }                                                                                               \
    }                                                                                                 \
    for (int r = 0; r < mb; r++) {                                                                    \
      float o[16];                                                                                    \
      _mm256_storeu_ps(o, f[r][0]);                                                                   \
      _mm256_storeu_ps(o + 8, f[r][1]);                                                               \
      memcpy(j->y + (m0 + r) * j->N + n0, o, (size_t)nn * sizeof(float));                            \
    }                                                                                                 \
  }                                                                                                   \
  TGT static void NAME(const KERNEL_FN_ijob *j, const uint8_t *pw, const float *ps, const int32_t *pz, \
                       int64_t m0, int64_t mb, int64_t n0, int64_t nn) {                              \
    switch (mb * 16 + j->bits) {                                                                      \
      case 4 * 16 + 4: Q4(j, pw, ps, pz, m0, 4, n0, nn, 4); break;                                   \
      case 3 * 16 + 4: Q4(j, pw, ps, pz, m0, 3, n0, nn, 4); break;                                   \
      case 2 * 16 + 4: Q4(j, pw, ps, pz, m0, 2, n0, nn, 4); break;                                   \
      case 1 * 16 + 4: Q4(j, pw, ps, pz, m0, 1, n0, nn, 4); break;                                   \
      case 4 * 16 + 8: NAME##_mk(j, pw, ps, pz, m0, 4, n0, nn, 8); break;                             \
      case 3 * 16 + 8: NAME##_mk(j, pw, ps, pz, m0, 3, n0, nn, 8); break;                             \
      case 2 * 16 + 8: NAME##_mk(j, pw, ps, pz, m0, 2, n0, nn, 8); break;                             \
      default: NAME##_mk(j, pw, ps, pz, m0, 1, n0, nn, 8); break;                                     \
    }                                                                                                 \
  }
KERNEL_FN_MK256(KERNEL_FN_panel_avx2, KERNEL_FN_T2, KERNEL_FN_DOT_AVX2, KERNEL_FN_q4_avx2)
KERNEL_FN_MK256(KERNEL_FN_panel_avxvnni, KERNEL_FN_TV, KERNEL_FN_DOT_VNNI, KERNEL_FN_panel_avxvnni_mk)
#endif

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

/* panel c (outputs c * NR ..), packed into this worker's buffer, against every row of x, mr rows at
   a time */
static void KERNEL_FN_ipanel(const KERNEL_FN_ijob *j, int64_t c, int64_t worker) {
  const int64_t n0 = c * KERNEL_FN_NR, nn = j->N - n0 < KERNEL_FN_NR ? j->N - n0 : KERNEL_FN_NR;
  uint8_t *pw = j->pbuf + worker * j->pstride;
  float *ps = (float *)(pw + j->G * j->GW * 4 * KERNEL_FN_NR); /* after the codes (unused when packed) */
  int32_t *pz = (int32_t *)(ps + j->G * KERNEL_FN_NR);
  const int fast = j->gb % 4 == 0 && j->RB % 4 == 0;
  if (j->packed) pw = (uint8_t *)j->q + c * j->G * j->GW * 4 * KERNEL_FN_NR; /* packed at load */
#ifdef KERNEL_FN_X86
  else if (fast && j->isa == 3) KERNEL_FN_pack_512(j, n0, nn, pw);
  else if (fast && j->isa >= 1) KERNEL_FN_pack_256(j, n0, nn, pw);
#endif
  else KERNEL_FN_pack_c(j, n0, nn, pw);
  if (j->hs) { /* float16 scales, a panel's [G][nn] (ops.quant.half_scales): widened, no transposing */
    const uint16_t *h = (const uint16_t *)j->s + n0 * j->G;
    if (nn == KERNEL_FN_NR) {
      KERNEL_FN_widen(j, h, KERNEL_FN_NR * j->G, ps);
    } else {
      float *wide = (float *)(pz + j->G * KERNEL_FN_NR);
      KERNEL_FN_widen(j, h, nn * j->G, wide);
      for (int64_t gi = 0; gi < j->G; gi++)
        for (int64_t l = 0; l < KERNEL_FN_NR; l++)
          ps[gi * KERNEL_FN_NR + l] = l < nn ? wide[gi * nn + l] : 0.0f;
    }
    if (j->z) KERNEL_FN_pack_meta(j, n0, nn, NULL, pz);
  }
#ifdef KERNEL_FN_X86
  else if (j->isa == 3 && !j->z) /* the scales: 16 rows of G dwords, transposed as the codes are */
    KERNEL_FN_t16((const uint8_t *)(j->s + n0 * j->G), j->G * 4, nn, j->G, (uint8_t *)ps);
  else if (j->isa >= 1 && !j->z)
    KERNEL_FN_t8((const uint8_t *)(j->s + n0 * j->G), j->G * 4, nn, j->G, (uint8_t *)ps);
#endif
  else
    KERNEL_FN_pack_meta(j, n0, nn, ps, pz);
  for (int64_t m = 0; m < j->M; m += j->mr) {
    const int64_t mb = j->M - m < j->mr ? j->M - m : j->mr;
#ifdef KERNEL_FN_X86
    if (j->isa == 3) KERNEL_FN_panel_512(j, pw, ps, pz, m, mb, n0, nn);
    else if (j->isa == 2) KERNEL_FN_panel_avxvnni(j, pw, ps, pz, m, mb, n0, nn);
    else if (j->isa == 1) KERNEL_FN_panel_avx2(j, pw, ps, pz, m, mb, n0, nn);
    else
#endif
      KERNEL_FN_panel_c(j, pw, ps, pz, m, mb, n0, nn);
  }
}

/* one claim: panels c * pc .. (c + 1) * pc - 1, numbered across the weights' jobs (consecutive
   panels: one stream of memory a thread, which the prefetchers follow better than every other panel) */
static void KERNEL_FN_ipanels(void *arg, int64_t c, int64_t worker) {
  const KERNEL_FN_ijob *j = (const KERNEL_FN_ijob *)arg, *end = j + j->nw;
  int64_t p = c * j->pc, left = j->pc;
  for (; j < end && left > 0; j++) {
    const int64_t panels = (j->N + KERNEL_FN_NR - 1) / KERNEL_FN_NR;
    const int64_t p1 = p + left < panels ? p + left : panels;
    if (p >= panels) { /* the claim starts in a later weight */
      p -= panels;
      continue;
    }
#ifdef KERNEL_FN_X86
    if (j->M == 1 && j->packed) { /* the first 4 KiB of the claim's stream asked for at once */
      const int64_t pb = j->G * j->GW * 4 * KERNEL_FN_NR, n = (p1 - p) * pb;
      const char *at = (const char *)j->q + p * pb;
      for (int64_t b = 0; b < 4096 && b < n; b += 64) _mm_prefetch(at + b, _MM_HINT_T0);
    }
#endif
    left -= p1 - p;
    for (; p < p1; p++) KERNEL_FN_ipanel(j, p, worker);
    p = 0;
  }
}

/* W products of one x: bufs: x [M, K], then each weight's qweight ([N, K] int8 | [N, K / 2] uint8, or
   with `packed` its panels [ceil(N / NR), G * GW * 4 * NR] uint8), scales [N, G] (float32; float16
   with packed 2) and zeros?, then each weight's y [M, N] (N = Ns[w]), status; g: group columns; f16c:
   0 converts float16 scales in plain C even where the CPU has F16C. x is quantized once; the threads
   claim runs of the weights' panels, each panel computed as the weight's alone would be. */
static void KERNEL_FN_int8(void **bufs, int64_t W, const int64_t *Ns, int64_t M, int64_t K, int64_t bits,
                           int64_t g, int64_t has_z, int64_t want, int64_t packed, int64_t f16c,
                           int64_t nthreads) {
  int64_t *status = (int64_t *)bufs[1 + W * (3 + has_z)], panels = 0, N = 0;
  const int64_t G = K > 0 ? (K + g - 1) / g : 0, gb = bits == 8 ? g : g / 2, GW = (gb + 3) / 4;
  const int64_t isa = KERNEL_FN_pick(want), XB = bits == 8 ? 4 : 8;
  KERNEL_FN_ijob js[W > 0 ? W : 1];
  KERNEL_FN_ijob j = {(const float *)bufs[0], NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                      M, K, 0, G, g, gb, GW, XB, G * GW * XB, bits == 8 ? K : K / 2, bits, isa,
                      0, 0, 0, isa == 3 ? 8 : 4, 1, packed != 0, 1,
                      packed == 2, 0, W};
  for (int64_t w = 0; w < W; w++) N += Ns[w], panels += (Ns[w] + KERNEL_FN_NR - 1) / KERNEL_FN_NR;
  if (G == 0 || M == 0 || N == 0) {
    for (int64_t w = 0; w < W; w++)
      memset(bufs[1 + W * (2 + has_z) + w], 0, (size_t)(M * Ns[w]) * sizeof(float));
    return;
  }
#ifdef KERNEL_FN_X86
  j.f16c = j.hs && f16c && isa >= 1 && KERNEL_FN_has_f16c(); /* the portable path converts in C */
#else
  (void)f16c;
#endif
  j.flip = bits == 8 && isa >= 2; /* vpdpbusd: unsigned codes q + 128, flipped as they are read */
  j.off = bits == 8 ? (j.flip ? 128 : 0) : (has_z ? 0 : 8);
  int64_t nt = M * N * K < (1 << 17) || nthreads < 1 ? 1 : nthreads;
  if (nt > panels) nt = panels;
  j.pstride = (G * GW * 4 * KERNEL_FN_NR + 3 * G * KERNEL_FN_NR * 4 + 63) / 64 * 64;
  const size_t rg = (size_t)M * (size_t)G;
  j.xq = (int8_t *)malloc((size_t)M * (size_t)j.KX + 64);
  j.xd = (float *)malloc(rg * sizeof(float));
  j.xs = (int32_t *)malloc(rg * sizeof(int32_t));
  j.pbuf = (uint8_t *)aligned_alloc(64, (size_t)(nt * j.pstride));
  if (!j.xq || !j.xd || !j.xs || !j.pbuf) {
    status[0] = 3;
  } else {
    llmkit_par_for((M + 7) / 8, M * K < (1 << 15) ? 1 : nthreads, KERNEL_FN_quantize_rows, &j);
    /* one row: a claim a thread (each one stream of memory, ahead of its prefetches); else about 8 */
    j.pc = M == 1 ? (panels + nt - 1) / nt : nt > 1 && panels > 8 * nt ? panels / (8 * nt) : 1;
    for (int64_t w = 0; w < W; w++) { /* the weights' jobs: all but the tensors and N the same */
      void **t = bufs + 1 + w * (2 + has_z);
      js[w] = j;
      js[w].q = (const uint8_t *)t[0], js[w].s = (const float *)t[1], js[w].N = Ns[w];
      js[w].z = has_z ? (const uint8_t *)t[2] : NULL, js[w].y = (float *)bufs[1 + W * (2 + has_z) + w];
    }
    llmkit_par_for((panels + j.pc - 1) / j.pc, nt, KERNEL_FN_ipanels, js);
  }
  free(j.xq);
  free(j.xd);
  free(j.xs);
  free(j.pbuf);
}
"""
