// Cheap exact arithmetic for the specialized steps (kernels/plan.cuh): each function returns the
// bits of the dearer operation it stands for, under the conditions stated beside it. The
// arguments are in docs/FORMATS.md ("Exact shortcuts of the CUDA specialized steps"); the tests
// that would catch a wrong bit are crates/lpmm-cuda/tests/exact.rs (the schemes, on adversarial
// and exhaustive inputs) and tests/plans.rs (every plan against the CPU reference).

// The quotient a / b correctly rounded, from rb = RN(1 / b) (one IEEE division per divisor,
// shared by every quotient by it): q0 = RN(a rb), then one correction with the exact remainder
// r = a - b q0 (Markstein). It is RN(a / b) when 1/b is normal, |a / b| >= 2^-125 and |a| >=
// 2^-100 (no intermediate underflows); exact_small_quotient bounds it where a is smaller.
__device__ __forceinline__ float exact_quotient(float a, float b, float rb) {
    float q0 = a * rb;
    float r = __fmaf_rn(-b, q0, a);
    return __fmaf_rn(r, rb, q0);
}

// The divisors exact_quotient takes in the specialized steps: 2^-70 <= b <= 2^120 (a block's
// absmax; a bias correction), so 1/b is normal and every quotient by b of an |a| >= b 2^-30 meets
// exact_quotient's conditions. Outside, the steps divide in IEEE arithmetic (a cold path).
__device__ __forceinline__ bool exact_divisor(float b) {
    return b >= 0x1p-70f && b <= 0x1p120f;
}

// bf16 rounding, the bf16 in the top half of the result (exact_pack_halves packs two): for |x|
// <= 0x7F7F7FFF as bits (finite, rounding to a finite bf16), half::bf16::from_f32 (float.cuh
// bf16_nearest) is the top half of x + 0x7FFF + (bit 16 of x), to nearest even; the non-finite
// cases of bf16_nearest never arise there, and the carry never reaches the sign.
__device__ __forceinline__ uint32_t exact_bf16_nearest(float x) {
    // sass: round
    uint32_t b = f2u(x);
    return b + 0x7FFFu + ((b >> 16u) & 1u);
}

// float.cuh bf16_stochastic with the draw d in the top half of r (its low half 0), for |x| <=
// 0x7F7EFFFF as bits: the top half of b + 0xFFFF - d, which carries into it exactly when d < the
// low half of b (bf16_stochastic's `up`). Its result never reaches infinity, so neither of
// bf16_stochastic's fallbacks to nearest rounding is taken.
__device__ __forceinline__ uint32_t exact_bf16_stochastic(float x, uint32_t r) {
    // sass: round
    return f2u(x) + ((~r) >> 16u);
}

// The top halves of a and b as the low and high half of one word (a bf16 pair).
__device__ __forceinline__ uint32_t exact_pack_halves(uint32_t a, uint32_t b) {
    // sass: pack
    return (a >> 16u) | (b & 0xFFFF0000u);
}

// The nearest-code bucket of y (|y| <= 1, the quotient by a block's absmax): the sign, the
// exponent and the top 7 bits of the mantissa of max(|y|, 2^-31) (so every magnitude below
// 2^-31 (1 + 2^-7) shares its sign's first bucket), less the bucket of 2^-31: 0 ..= 0xF80 for a
// sign bit of 0, 0x8000 ..= 0x8F80 for 1. Each bucket is an interval of values; lpmm-backend's
// plans.rs takes a map for a specialized step only if none of its buckets holds two thresholds
// (codemap's `nearest` is then the count at the bucket's lowest value plus one comparison).
__device__ __forceinline__ uint32_t exact_bucket(float y) {
    // sass: search
    float a = fmaxf(fabsf(y), 0x1p-31f);
    return ((f2u(a) | (f2u(y) & 0x80000000u)) >> 16u) - 0x3000u;
}

// The bucket of y (|y| <= 1) on a uniform grid of 256 buckets of width 2^-7: RN(128 y + 128)
// (0 ..= 256), read from the bits of y 128 + (128 + 1.5 2^23), whose rounding to an integer is
// the fma's. Monotone in y, so each bucket is an interval of values; for the maps whose keys are
// at least a bucket apart (plans.rs: the linear maps).
__device__ __forceinline__ uint32_t exact_linear_bucket(float y) {
    // sass: search
    return f2u(__fmaf_rn(y, 128.0f, 12583040.0f)) & 0x1FFu;
}

// The lowest value of bucket k (0 ..= 0xFFF or 0x8000 ..= 0x8FFF; past magnitude 1, its sign's
// 1): the inverse of exact_bucket at the bucket's low end.
__device__ __forceinline__ float exact_bucket_low(uint32_t k) {
    uint32_t h = (k & 0xFFFu) + 0x3000u;
    h = h < 0x3F80u ? h : 0x3F80u;
    if (k < 0x8000u) {
        return h == 0x3000u ? 0.0f : u2f(h << 16u);
    }
    return u2f(0x80000000u | (h << 16u) | 0xFFFFu);
}

// The number of thresholds <= y of a sorted table of 256 (NaN past the last one, so they never
// count): a binary search, for building the bucket table.
__device__ __forceinline__ uint32_t exact_count(const float* thresholds, float y) {
    uint32_t c = 0u;
#pragma unroll
    for (uint32_t step = 128u; step > 0u; step /= 2u) {
        c = thresholds[c + step - 1u] <= y ? c + step : c;
    }
    return c;
}
