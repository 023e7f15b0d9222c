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
    return (f2u(x) & 0x7FFFFFFFu) <= limit;
}

// half::bf16::from_f32: round to nearest even, NaN kept quiet with its sign.
__device__ __forceinline__ uint32_t bf16_nearest(float x) {
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
    return u2f(h << 16u);
}
