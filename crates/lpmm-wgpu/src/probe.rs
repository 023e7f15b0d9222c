//! The probe of the driver's f32 arithmetic, run when the backend is created: which results
//! equal the CPU's bit for bit (is `fma` fused, are division and `sqrt` correctly rounded, are
//! subnormals kept), by running `arith_main` (kernels/float.wgsl) on inputs whose correctly
//! rounded results are known on the host.

use lpmm_optim::backend::BackendError;
use wgpu::util::DeviceExt;

use crate::{Arithmetic, WgpuRuntime};

/// What the driver's f32 arithmetic does, measured by running the probe kernel on inputs whose
/// correctly rounded results are known on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FloatBehaviour {
    /// WGSL `fma` is fused (one rounding) on every probe input: the shader uses it; otherwise
    /// it uses its exact software fma.
    pub fma_fused: bool,
    /// The software fma equals the CPU's `mul_add` on every probe input (always expected).
    pub fma_soft_exact: bool,
    /// `a / b` is correctly rounded on every probe input: the shader uses it; otherwise it uses
    /// its exact software division.
    pub div_exact: bool,
    /// `sqrt` is correctly rounded on every probe input: the shader uses it; otherwise it uses
    /// its exact software square root.
    pub sqrt_exact: bool,
    /// The software division equals the CPU's `/` on every probe input (always expected).
    pub div_soft_exact: bool,
    /// The software square root equals the CPU's `sqrt` on every probe input (always expected).
    pub sqrt_soft_exact: bool,
    /// Subnormal results are kept (not flushed to zero): a rounded product plus an addend
    /// gives the CPU's `x * y + z` wherever that is subnormal.
    pub subnormals_kept: bool,
}

impl FloatBehaviour {
    /// Whether every step is bit-exact with the CPU backend with the default
    /// [`Arithmetic::Exact`]: fma, division and square root exact (the driver's where the probe
    /// found them so, the shader's software ones otherwise), and subnormals kept.
    pub fn bit_exact(&self) -> bool {
        self.bit_exact_with(Arithmetic::Exact)
    }

    /// [`FloatBehaviour::bit_exact`] with the operations `arithmetic` chooses.
    pub fn bit_exact_with(&self, arithmetic: Arithmetic) -> bool {
        self.differences(arithmetic).is_empty()
    }

    /// What a user is told (a `tracing` warning when the backend is created) where results will
    /// not equal the CPU backend's bit for bit with [`Arithmetic::Exact`]; `None` where they
    /// will.
    pub fn inexact_warning(&self) -> Option<String> {
        self.inexact_warning_with(Arithmetic::Exact)
    }

    /// [`FloatBehaviour::inexact_warning`] with the operations `arithmetic` chooses.
    pub fn inexact_warning_with(&self, arithmetic: Arithmetic) -> Option<String> {
        let what = self.differences(arithmetic);
        if what.is_empty() {
            return None;
        }
        Some(format!(
            "this adapter's f32 arithmetic differs from the CPU's ({}): steps can differ from \
             the CPU backend's in the last bits (docs/BACKENDS.md, \"Bit-exactness\")",
            what.join(", ")
        ))
    }

    /// Why results will differ from the CPU's with `arithmetic` (empty where they will not).
    fn differences(&self, arithmetic: Arithmetic) -> Vec<&'static str> {
        let mut what = Vec::new();
        if !self.subnormals_kept {
            what.push("subnormal results are flushed to zero");
        }
        let [div, sqrt] = match arithmetic {
            Arithmetic::Exact => [
                (
                    self.div_exact || self.div_soft_exact,
                    "neither the driver's division nor the software one is exact",
                ),
                (
                    self.sqrt_exact || self.sqrt_soft_exact,
                    "neither the driver's square root nor the software one is exact",
                ),
            ],
            Arithmetic::Software => [
                (self.div_soft_exact, "the software division is not exact"),
                (
                    self.sqrt_soft_exact,
                    "the software square root is not exact",
                ),
            ],
            Arithmetic::DriverDivision => [
                (
                    self.div_exact,
                    "the driver's division is not correctly rounded (Arithmetic::DriverDivision)",
                ),
                (
                    self.sqrt_exact,
                    "the driver's square root is not correctly rounded \
                     (Arithmetic::DriverDivision)",
                ),
            ],
        };
        for (exact, wrong) in [
            (self.fma_soft_exact, "the software fma is not exact"),
            div,
            sqrt,
        ] {
            if !exact {
                what.push(wrong);
            }
        }
        what
    }
}

/// The probe's inputs: products that need a fused rounding, cancellations, results that are
/// subnormal or overflow, and quotients and roots across the exponent range.
pub fn probe_inputs() -> Vec<[f32; 3]> {
    use rand_core::{Rng as _, SeedableRng};
    let mut rng = rand_xoshiro::SplitMix64::seed_from_u64(0x1234_5678_9ABC_DEF0);
    let mut next = move || rng.next_u64();
    let mut out = Vec::new();
    let finite = |b: u32| {
        let x = f32::from_bits(b);
        if x.is_finite() { x } else { 1.0 }
    };
    for k in 0..4096 {
        let r = next();
        let a = finite(r as u32);
        let b = finite((r >> 32) as u32);
        let c = match k % 4 {
            // Cancellation: c close to -(a * b).
            0 => -(a * b) * (1.0 + f32::EPSILON * ((next() % 5) as f32 - 2.0)),
            1 => finite(next() as u32),
            // Moderate magnitudes, where fused and unfused differ most often.
            2 => a * b * 1e-3,
            _ => 0.0,
        };
        out.push([a, b, c]);
        // Ordinary magnitudes.
        let u = |x: u64| (x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
        out.push([u(next()) + 0.5, u(next()) * 3.0, u(next())]);
    }
    // Subnormal results of the plain product and of fma.
    for k in 0..64 {
        let a = 1.5e-20f32 * (1.0 + k as f32 / 64.0);
        out.push([a, 3.1e-20, 0.0]);
        out.push([a, -2.7e-19, 1e-39]);
    }
    out
}

pub(crate) fn probe(rt: &WgpuRuntime) -> Result<FloatBehaviour, BackendError> {
    let inputs = probe_inputs();
    let out = run_arith(rt, &inputs)?;
    let same = |x: f32, y: f32| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan());
    let mut b = FloatBehaviour {
        fma_fused: true,
        fma_soft_exact: true,
        div_exact: true,
        sqrt_exact: true,
        div_soft_exact: true,
        sqrt_soft_exact: true,
        subnormals_kept: true,
    };
    for (&[x, y, z], o) in inputs.iter().zip(&out) {
        let fused = x.mul_add(y, z);
        b.fma_fused &= same(o[0], fused);
        b.fma_soft_exact &= same(o[1], fused);
        let plain = x * y + z;
        if plain != 0.0 && plain.abs() < f32::MIN_POSITIVE {
            b.subnormals_kept &= same(o[2], plain);
        }
        let q = x / y;
        if q.is_normal() && x.is_normal() && y.is_normal() {
            b.div_exact &= same(o[3], q);
        }
        if x.is_normal() {
            b.sqrt_exact &= same(o[4], x.abs().sqrt());
        }
        b.div_soft_exact &= same(o[5], q);
        b.sqrt_soft_exact &= same(o[6], x.abs().sqrt());
    }
    Ok(b)
}

/// Floats per triple in `arith_main`'s io buffer: the triple and the seven results.
const ARITH_STRIDE: usize = 10;

/// Runs `arith_main` (kernels/float.wgsl) over `triples`, [`ARITH_STRIDE`] floats apart in an io
/// buffer.
pub(crate) fn run_arith(
    rt: &WgpuRuntime,
    triples: &[[f32; 3]],
) -> Result<Vec<[f32; 7]>, BackendError> {
    let mut data = vec![0f32; ARITH_STRIDE * triples.len()];
    for (k, t) in triples.iter().enumerate() {
        data[ARITH_STRIDE * k..ARITH_STRIDE * k + 3].copy_from_slice(t);
    }
    let io = rt
        .device
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("lpmm probe io"),
            contents: bytemuck::cast_slice(&data),
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        });
    let work = rt
        .device
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("lpmm probe work"),
            contents: bytemuck::cast_slice(&[triples.len() as u32, 0u32]),
            usage: wgpu::BufferUsages::STORAGE,
        });
    let buffers = [
        &rt.dummy,
        &work,
        &io,
        &rt.dummy_ro,
        &rt.dummy,
        &rt.dummy,
        &rt.dummy,
    ];
    let entries: Vec<wgpu::BindGroupEntry<'_>> = buffers
        .iter()
        .enumerate()
        .map(|(k, b)| wgpu::BindGroupEntry {
            binding: k as u32,
            resource: b.as_entire_binding(),
        })
        .collect();
    let bind = rt.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some("lpmm probe"),
        layout: &rt.kernels.layout,
        entries: &entries,
    });
    let mut encoder = rt.device.create_command_encoder(&Default::default());
    {
        let mut pass = encoder.begin_compute_pass(&Default::default());
        pass.set_pipeline(&rt.kernels.arith);
        pass.set_bind_group(0, &bind, &[]);
        // One in z: `arith_main` takes the invocation id's z as `mulr`'s zero.
        pass.dispatch_workgroups((triples.len() as u32).div_ceil(64), 1, 1);
    }
    rt.queue.submit([encoder.finish()]);
    let bytes = rt.read_buffer(&io, 0, 4 * (ARITH_STRIDE * triples.len()) as u64)?;
    let words: Vec<u32> = bytemuck::pod_collect_to_vec(&bytes);
    Ok((0..triples.len())
        .map(|k| std::array::from_fn(|j| f32::from_bits(words[ARITH_STRIDE * k + 3 + j])))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::FloatBehaviour;

    /// Everything exact, the driver's fma unfused (lavapipe's probe).
    fn exact() -> FloatBehaviour {
        FloatBehaviour {
            fma_fused: false,
            fma_soft_exact: true,
            div_exact: true,
            sqrt_exact: true,
            div_soft_exact: true,
            sqrt_soft_exact: true,
            subnormals_kept: true,
        }
    }

    #[test]
    fn users_are_warned_exactly_when_results_can_differ_from_the_cpus() {
        let exact = exact();
        assert_eq!(exact.inexact_warning(), None);
        // Inexact division and square root alone are made exact in software: no warning.
        let rounded_off = FloatBehaviour {
            div_exact: false,
            sqrt_exact: false,
            ..exact
        };
        assert!(rounded_off.bit_exact());
        assert_eq!(rounded_off.inexact_warning(), None);
        // What NVIDIA's Vulkan driver reported on an H200 (docs/BACKENDS.md): subnormals flushed.
        let nvidia = FloatBehaviour {
            subnormals_kept: false,
            ..rounded_off
        };
        let w = nvidia.inexact_warning().expect("a warning");
        assert!(w.contains("(subnormal results are flushed to zero)"), "{w}");
        // A software path that fails the probe matters only where the driver's is inexact too.
        let soft_broken = FloatBehaviour {
            sqrt_soft_exact: false,
            ..exact
        };
        assert_eq!(soft_broken.inexact_warning(), None);
        let broken = FloatBehaviour {
            sqrt_exact: false,
            ..soft_broken
        };
        let w = broken.inexact_warning().expect("a warning");
        assert!(
            w.contains("(neither the driver's square root nor the software one is exact)"),
            "{w}"
        );
    }

    /// With `Arithmetic::DriverDivision` an inexact driver division or square root is what the
    /// user is warned of (the software ones do not run); with `Arithmetic::Software` a broken
    /// software one is, even where the driver's is exact.
    #[test]
    fn the_warning_follows_the_chosen_arithmetic() {
        use crate::Arithmetic;
        let exact = exact();
        for a in [
            Arithmetic::Exact,
            Arithmetic::Software,
            Arithmetic::DriverDivision,
        ] {
            assert!(exact.bit_exact_with(a), "{a:?}");
            assert_eq!(exact.inexact_warning_with(a), None, "{a:?}");
        }
        let rounded_off = FloatBehaviour {
            div_exact: false,
            ..exact
        };
        assert!(rounded_off.bit_exact_with(Arithmetic::Exact));
        assert!(rounded_off.bit_exact_with(Arithmetic::Software));
        let w = rounded_off
            .inexact_warning_with(Arithmetic::DriverDivision)
            .expect("a warning");
        assert!(
            w.contains("the driver's division is not correctly rounded"),
            "{w}"
        );
        assert!(!w.contains("square root"), "{w}");
        let soft_broken = FloatBehaviour {
            sqrt_soft_exact: false,
            ..exact
        };
        assert!(soft_broken.bit_exact_with(Arithmetic::Exact));
        assert!(soft_broken.bit_exact_with(Arithmetic::DriverDivision));
        let w = soft_broken
            .inexact_warning_with(Arithmetic::Software)
            .expect("a warning");
        assert!(w.contains("the software square root is not exact"), "{w}");
    }
}
