// vpdpbusd written as inline asm, accumulating in place.
//
// GCC 12 compiles _mm512_dpbusd_epi32(acc, a, b) in a loop-carried accumulator array by copying each
// accumulator into a scratch register, multiplying there and copying it back. With few accumulators the
// copies cost little (register moves are eliminated at rename; the decode attention's key scores, 6-8
// accumulators, measured 0.93-1.02x with this asm, so they keep the intrinsic), but past 16 accumulators the
// copies go through the stack: the small-batch panel loop (24 accumulators) ran at half its rate. The asm
// pins the accumulator as an in/out operand, so the loop is the products and their loads alone.
#pragma once

#if defined(__AVX512VNNI__)
#include <immintrin.h>

namespace freight {

// acc += per 32-bit lane the sum of 4 products of u8 (from u) by s8 (from s), no saturation.
__attribute__((always_inline)) inline void dpbusd(__m512i& acc, __m512i u, __m512i s) {
  asm("vpdpbusd %[s], %[u], %[acc]" : [acc] "+v"(acc) : [u] "v"(u), [s] "v"(s));
}

}  // namespace freight
#endif
