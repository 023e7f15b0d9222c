//! Vector kernels chosen at run time: AVX-512 where the CPU has it (x86-64 with AVX-512
//! F/BW/VL/DQ, AVX2 and FMA), AVX2 + FMA where it has those, portable Rust everywhere else. Every
//! level gives the same bits — the kernels use only exact operations (IEEE division and square
//! root, fused multiply-add, comparisons, integer arithmetic) in the same order — and tests
//! compare them; only speed differs.
//!
//! [`multiversion!`](crate::multiversion) compiles a portable loop once per level (so LLVM
//! vectorizes it with the level's registers and inlines `mul_add`), and the code-map kernels in
//! [`crate::CodeMap`] add hand-written AVX-512 gathers.

use std::sync::atomic::{AtomicU8, Ordering};

/// Which kernels run, lowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Portable Rust, compiled for the baseline target.
    Portable,
    /// Portable Rust compiled with AVX2 and FMA (x86-64 since 2013): `mul_add` is one
    /// instruction instead of a library call; the code-map kernels gather with AVX2.
    Avx2,
    /// AVX-512 (F, BW, VL, DQ) with AVX2 and FMA, without VBMI (Skylake-SP to Cascade Lake: most
    /// cloud Intel parts): the code-map kernels gather their tables.
    Avx512,
    /// AVX-512 with VBMI (Ice Lake and later, AMD Zen 4 and later): the code-map kernels look their
    /// tables up from registers (byte permutes) instead of gathering them.
    Avx512Vbmi,
}

impl Level {
    /// Every level, lowest first.
    pub const ALL: [Level; 4] = [
        Level::Portable,
        Level::Avx2,
        Level::Avx512,
        Level::Avx512Vbmi,
    ];

    /// The name `LPMM_SIMD` takes for it (`portable`, `avx2`, `avx512`, `vbmi`).
    pub const fn name(self) -> &'static str {
        match self {
            Level::Portable => "portable",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
            Level::Avx512Vbmi => "vbmi",
        }
    }

    /// The level `LPMM_SIMD` names (see [`Level::name`]).
    pub fn from_name(name: &str) -> Option<Level> {
        Level::ALL.into_iter().find(|l| l.name() == name)
    }

    const fn code(self) -> u8 {
        self as u8 + 1
    }

    const fn from_code(code: u8) -> Level {
        match code {
            2 => Level::Avx2,
            3 => Level::Avx512,
            4 => Level::Avx512Vbmi,
            _ => Level::Portable,
        }
    }
}

const UNKNOWN: u8 = 0;

static DETECTED: AtomicU8 = AtomicU8::new(UNKNOWN);
static FORCED: AtomicU8 = AtomicU8::new(UNKNOWN);

/// What this CPU supports (detected once).
pub fn detected() -> Level {
    let mut d = DETECTED.load(Ordering::Relaxed);
    if d == UNKNOWN {
        d = detect().code();
        DETECTED.store(d, Ordering::Relaxed);
    }
    Level::from_code(d)
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Level {
    let avx2 = std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma");
    let avx512 = std::is_x86_feature_detected!("avx512f")
        && std::is_x86_feature_detected!("avx512bw")
        && std::is_x86_feature_detected!("avx512vl")
        && std::is_x86_feature_detected!("avx512dq");
    let vbmi = std::is_x86_feature_detected!("avx512vbmi");
    match (avx2, avx512, vbmi) {
        (true, true, true) => Level::Avx512Vbmi,
        (true, true, false) => Level::Avx512,
        (true, false, _) => Level::Avx2,
        _ => Level::Portable,
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Level {
    Level::Portable
}

/// Whether the AVX-512 kernels run ([`Level::Avx512`] or [`Level::Avx512Vbmi`]).
#[inline]
pub fn avx512() -> bool {
    level() >= Level::Avx512
}

/// Whether the AVX-512 kernels may also use AVX-512 VBMI (byte permutes: table lookups from
/// registers): the level in use is [`Level::Avx512Vbmi`].
#[inline]
pub fn vbmi() -> bool {
    level() == Level::Avx512Vbmi
}

/// The kernels in use: [`detected`], unless lowered by [`force`] or by the environment variable
/// `LPMM_SIMD` (`portable`, `avx2`, `avx512` or `vbmi`: [`Level::name`]) read the first time.
#[inline]
pub fn level() -> Level {
    match FORCED.load(Ordering::Relaxed) {
        UNKNOWN => level_from_env(),
        code => Level::from_code(code),
    }
}

/// [`level`]'s first call: reads `LPMM_SIMD`. Out of line (and not recursive), so that the
/// check every kernel call makes inlines into it.
#[cold]
#[inline(never)]
fn level_from_env() -> Level {
    let from_env = std::env::var("LPMM_SIMD")
        .ok()
        .and_then(|v| Level::from_name(&v));
    force(from_env)
}

/// Runs the kernels of `level` (at most what the CPU supports) from now on, on every thread;
/// `None` goes back to the detected level. Results do not change, only speed: this exists for
/// tests and benchmarks. Returns the level now in use.
pub fn force(level: Option<Level>) -> Level {
    let d = detected();
    let l = match level {
        Some(l) if l < d => l,
        _ => d,
    };
    FORCED.store(l.code(), Ordering::Relaxed);
    l
}

/// Defines a function whose body is compiled three times, for the baseline target, with AVX2 and
/// FMA, and with AVX-512, and picks one at run time by [`level`]. The body must be plain Rust (no
/// intrinsics): enabling the features changes how it is compiled, never what it computes.
///
/// ```
/// lpmm_formats::multiversion! {
///     /// Doubles every element.
///     pub fn double(xs: &mut [f32]) {
///         xs.iter_mut().for_each(|x| *x *= 2.0);
///     }
/// }
/// let mut v = [1.0f32, 2.0];
/// double(&mut v);
/// assert_eq!(v, [2.0, 4.0]);
/// ```
///
/// A body that stores code-generation choices by level takes one `const` parameter, `true` in
/// the AVX-512 version and `false` in the others (AVX-512 has single-instruction masked stores;
/// AVX2's `vmaskmovps` is microcoded on AMD's cores, so a body may keep LLVM from forming it
/// there: see lpmm-optim's `apply_run`):
///
/// ```
/// lpmm_formats::multiversion! {
///     /// Halves every element (the flag is unused here).
///     pub fn halve<const AVX512: bool>(xs: &mut [f32]) {
///         xs.iter_mut().for_each(|x| *x *= 0.5);
///     }
/// }
/// let mut v = [1.0f32, 2.0];
/// halve(&mut v);
/// assert_eq!(v, [0.5, 1.0]);
/// ```
#[macro_export]
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident<const $flag:ident: bool>($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn portable<const $flag: bool>($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
            fn avx512($($arg: $ty),*) $(-> $ret)? {
                portable::<true>($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            fn avx2($($arg: $ty),*) $(-> $ret)? {
                portable::<false>($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            match $crate::simd::level() {
                // SAFETY: `level()` is `Avx512` or `Avx512Vbmi` only after run-time detection found
                // every feature enabled on `avx512` (simd::detect).
                $crate::simd::Level::Avx512 | $crate::simd::Level::Avx512Vbmi => return unsafe { avx512($($arg),*) },
                // SAFETY: `level()` is `Avx2` (or above) only after run-time detection of AVX2 and
                // FMA.
                $crate::simd::Level::Avx2 => return unsafe { avx2($($arg),*) },
                $crate::simd::Level::Portable => {}
            }
            portable::<false>($($arg),*)
        }
    };
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $crate::multiversion! {
            $(#[$meta])*
            $vis fn $name<const _AVX512: bool>($($arg: $ty),*) $(-> $ret)? $body
        }
    };
}

multiversion! {
    /// bf16 to f32 (exact).
    pub fn bf16_to_f32(xs: &[half::bf16], out: &mut [f32]) {
        out.iter_mut()
            .zip(xs)
            .for_each(|(o, b)| *o = f32::from_bits(u32::from(b.to_bits()) << 16));
    }
}

multiversion! {
    /// f32 to bf16 rounding to nearest, ties to even: the same bits as
    /// [`crate::float::bf16_nearest`] (crate `half`) for every input, NaN payloads included,
    /// written without branches so it vectorizes.
    pub fn f32_to_bf16_nearest(xs: &[f32], out: &mut [half::bf16]) {
        out.iter_mut().zip(xs).for_each(|(o, &x)| {
            let b = x.to_bits();
            let rounded = (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16;
            let quiet_nan = ((b >> 16) | 0x40) as u16;
            let nan = b & 0x7FFF_FFFF > 0x7F80_0000;
            *o = half::bf16::from_bits(if nan { quiet_nan } else { rounded });
        });
    }
}

multiversion! {
    /// f32 to bf16 with stochastic rounding, element `j` with the random word `bits[j]`: the same
    /// bits as [`crate::float::bf16_stochastic`] for every input, written without branches so
    /// it vectorizes. Writes `min(xs.len(), bits.len(), out.len())` values.
    pub fn f32_to_bf16_stochastic(xs: &[f32], bits: &[u32], out: &mut [half::bf16]) {
        out.iter_mut().zip(xs).zip(bits).for_each(|((o, &x), &r)| {
            let b = x.to_bits();
            let nearest = (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16;
            let quiet_nan = ((b >> 16) | 0x40) as u16;
            let nearest = if b & 0x7FFF_FFFF > 0x7F80_0000 { quiet_nan } else { nearest };
            let up = u32::from((r >> 16) < (b & 0xFFFF));
            let rounded = (b >> 16) + up;
            // NaN and ±Inf, and a finite value rounded up past bf16::MAX, take the nearest.
            let keep = b & 0x7FFF_FFFF >= 0x7F80_0000 || rounded & 0x7FFF == 0x7F80;
            *o = half::bf16::from_bits(if keep { nearest } else { rounded as u16 });
        });
    }
}

multiversion! {
    /// The largest bit pattern of `xs`, read as `u32` (0 for an empty slice): above `-0.0`'s
    /// (`0x8000_0000`) exactly when some element is negative (or a NaN with its sign bit set).
    pub fn max_bits(xs: &[f32]) -> u32 {
        xs.iter().fold(0u32, |m, v| m.max(v.to_bits()))
    }
}

multiversion! {
    /// The largest `|x|` of `xs` as a bit pattern (0 for an empty slice): NaN and ±Inf patterns
    /// exceed every finite one, so a result `>= 0x7F80_0000` means a non-finite input.
    pub fn abs_max_bits(xs: &[f32]) -> u32 {
        xs.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7FFF_FFFF))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::float::bf16_nearest;

    #[test]
    fn bf16_slice_conversion_equals_half_for_every_pattern() {
        // All 2^32 inputs in slices of 2^16, on whichever path this CPU takes.
        let mut xs = vec![0f32; 1 << 16];
        let mut out = vec![half::bf16::ZERO; 1 << 16];
        for hi in 0u32..1 << 16 {
            for (lo, x) in xs.iter_mut().enumerate() {
                *x = f32::from_bits(hi << 16 | lo as u32);
            }
            f32_to_bf16_nearest(&xs, &mut out);
            for (x, o) in xs.iter().zip(&out) {
                assert_eq!(
                    o.to_bits(),
                    bf16_nearest(*x).to_bits(),
                    "{:#010x}",
                    x.to_bits()
                );
            }
        }
    }

    #[test]
    fn bf16_stochastic_slices_equal_the_scalar_rounding() {
        use crate::float::bf16_stochastic;
        // Every sign and exponent with low bits that exercise rounding up, plus the specials;
        // each with random words below, at and above the cut.
        let mut xs = Vec::new();
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for high in 0..=0xFFFFu32 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            xs.push(f32::from_bits(high << 16 | (state as u32 & 0xFFFF)));
            xs.push(f32::from_bits(high << 16 | 0xFFFF));
        }
        let bits: Vec<u32> = (0..xs.len() as u32)
            .map(|i| i.wrapping_mul(0x9E37_79B9).rotate_left(7))
            .chain([0, u32::MAX])
            .collect();
        for level in Level::ALL {
            force(Some(level));
            let mut out = vec![half::bf16::ZERO; xs.len()];
            f32_to_bf16_stochastic(&xs, &bits, &mut out);
            for ((x, r), o) in xs.iter().zip(&bits).zip(&out) {
                assert_eq!(
                    o.to_bits(),
                    bf16_stochastic(*x, *r).to_bits(),
                    "{level:?} {:#x} {r:#x}",
                    x.to_bits()
                );
            }
        }
        force(None);
    }

    #[test]
    fn max_bits_finds_negative_values() {
        assert_eq!(max_bits(&[]), 0);
        assert_eq!(max_bits(&[3.0, -0.0, 2.0]), (-0.0f32).to_bits());
        assert_eq!(max_bits(&[1.0, 2.0]), 2.0f32.to_bits());
        let mut xs = vec![0.5f32; 1000];
        xs[977] = -1e-30;
        assert_eq!(max_bits(&xs), (-1e-30f32).to_bits());
    }

    #[test]
    fn abs_max_bits_finds_non_finite_values() {
        assert_eq!(abs_max_bits(&[]), 0);
        assert_eq!(abs_max_bits(&[-3.0, 2.0]), 3.0f32.to_bits());
        assert!(abs_max_bits(&[1.0, f32::NAN, 2.0]) > 0x7F80_0000);
        assert_eq!(abs_max_bits(&[1.0, f32::NEG_INFINITY]), 0x7F80_0000);
    }
}
