// Floats: bf16 rounding (lpmm-formats float.rs; half's conversion). The fused multiply-add is
// CUDA's `__fmaf_rn` (one IEEE rounding, where the CPU writes `mul_add`); nothing else is fused
// (--fmad=false), and division and square root are IEEE (--prec-div, --prec-sqrt), so the WGSL
// program's software fma and arithmetic probe have no counterpart here.

// ---------------------------------------------------------------------------------------------
// Floats (lpmm-formats float.rs, split.rs; half's bf16 conversion).

__device__ __forceinline__ bool is_finite(float x) {
    return (f2u(x) & 0x7F800000u) != 0x7F800000u;
}

// format/mod.rs `fits`: finite and at most `limit` (f32 bits) in magnitude.
__device__ __forceinline__ bool fits(float x, uint32_t limit) {
    // sass: checks
    return (f2u(x) & 0x7FFFFFFFu) <= limit;
}

// half::bf16::from_f32: round to nearest even, NaN kept quiet with its sign.
__device__ __forceinline__ uint32_t bf16_nearest(float x) {
    // sass: round
    uint32_t b = f2u(x);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) {
        return (b >> 16u) | 0x40u;
    }
    if ((b & 0x8000u) != 0u && (b & 0x17FFFu) != 0u) {
        return (b >> 16u) + 1u;
    }
    return b >> 16u;
}

// float::bf16_stochastic.
__device__ __forceinline__ uint32_t bf16_stochastic(float x, uint32_t r) {
    // sass: round
    uint32_t b = f2u(x);
    if ((b & 0x7FFFFFFFu) >= 0x7F800000u) {
        return bf16_nearest(x);
    }
    uint32_t up = (r >> 16u) < (b & 0xFFFFu) ? 1u : 0u;
    uint32_t res = (b >> 16u) + up;
    if ((res & 0x7FFFu) == 0x7F80u) {
        return bf16_nearest(x);
    }
    return res;
}

__device__ __forceinline__ float bf16_value(uint32_t h) {
    // sass: decode
    return u2f(h << 16u);
}

// Order-free sums of squares (lpmm-optim fixed.rs): x = m 2^e0 with an integer significand
// m < 2^24: (m^2, exact in 64 bits, and e0).
struct Square {
    uint64_t sq;
    int32_t e0;
};

__device__ __forceinline__ Square square(float x) {
    uint32_t b = f2u(x) & 0x7FFFFFFFu;
    uint32_t eb = b >> 23u;
    uint32_t m = b & 0x7FFFFFu;
    int32_t e0 = -149;
    if (eb != 0u) {
        m = m | 0x800000u;
        e0 = (int32_t)eb - 150;
    }
    Square out;
    out.sq = (uint64_t)m * (uint64_t)m;
    out.e0 = e0;
    return out;
}

// Fractional bits of a sum over `count` terms (fixed.rs `frac_bits`).
__device__ __forceinline__ int32_t frac_bits(uint64_t count) {
    return 62 - (int32_t)bitlen64(count);
}

// Whether x counts in a fold: finite and not zero.
__device__ __forceinline__ bool fixed_counts(float x) {
    return is_finite(x) && x != 0.0f;
}

// The first fold's value: the exponent of x^2 + 1024 (fixed.rs `exponent` + EXP_BIAS).
__device__ __forceinline__ uint32_t fixed_exponent(float x) {
    Square q = square(x);
    return (uint32_t)((int32_t)bitlen64(q.sq) - 1 + 2 * q.e0 + 1024);
}

// The second fold's term: floor(x^2 2^(frac - E)) for the stored exponent of the sum (fixed.rs
// `term`).
__device__ __forceinline__ uint64_t fixed_term(float x, uint32_t stored, int32_t frac) {
    Square q = square(x);
    int32_t shift = 2 * q.e0 + frac - ((int32_t)stored - 1024);
    return shift >= 0 ? shl64(q.sq, (uint32_t)shift) : shr64(q.sq, (uint32_t)(-shift));
}
