//! The anchors' maps, built as they build them (bitsandbytes' dynamic and NormalFloat maps,
//! lpmm's linear maps), with the f32 arithmetic they do (torch's `linspace` included).

use super::{CodeMap, check_bits};
use crate::error::FormatError;

impl CodeMap {
    /// bitsandbytes' dynamic (tree) map, `create_dynamic_map(signed, total_bits - 1, total_bits)`:
    /// the 8-bit signed map is bitsandbytes' first-moment map, the unsigned one its second-moment
    /// map, and `dynamic(true, 4)` the signed dynamic-exponent 4-bit map of lpmm and torchao.
    pub fn dynamic(signed: bool, total_bits: u32) -> Result<Self, FormatError> {
        check_bits(total_bits)?;
        Self::dynamic_with_exponent_bits(signed, total_bits - 1, total_bits)
    }

    /// bitsandbytes' `create_dynamic_map(signed, max_exponent_bits, total_bits)`.
    ///
    /// For each decade `i < max_exponent_bits` the map holds the midpoints of an f32
    /// `linspace(0.1, 1, k + 1)` scaled by `10^(i - max_exponent_bits + 1)`, with
    /// `k = 2^(i + total_bits - 1 - max_exponent_bits)` (twice that, unsigned), negated copies if
    /// signed, then `2^(total_bits - 1 - max_exponent_bits) - 1` linear fraction items at the last
    /// decade's scale, then 0 and 1. Unsigned maps need `max_exponent_bits = total_bits - 1`
    /// (otherwise bitsandbytes' construction does not give 2^bits values).
    pub fn dynamic_with_exponent_bits(
        signed: bool,
        max_exponent_bits: u32,
        total_bits: u32,
    ) -> Result<Self, FormatError> {
        check_bits(total_bits)?;
        let non_sign_bits = total_bits - 1;
        let valid = max_exponent_bits <= non_sign_bits
            && (signed || max_exponent_bits == non_sign_bits)
            && (max_exponent_bits > 0 || non_sign_bits == 0);
        if !valid {
            return Err(FormatError::NoMapAtWidth {
                what: "dynamic",
                bits: total_bits,
            });
        }
        let mut data: Vec<f32> = Vec::with_capacity(1 << total_bits);
        let mut push_decade = |items: usize, decade: i32| {
            let points = torch_linspace_f32(0.1, 1.0, items + 1);
            // torch multiplies an f32 tensor by a Python float scalar in f32.
            // `10 ** decade` is a correctly rounded f64 in Python; parsing gives the same value.
            let scale = format!("1e{decade}").parse::<f64>().unwrap_or(1.0) as f32;
            let means: Vec<f32> = points.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect();
            data.extend(means.iter().map(|m| scale * m));
            if signed {
                data.extend(means.iter().map(|m| -scale * m));
            }
        };
        let first_decade = 1 - max_exponent_bits as i32;
        for i in 0..max_exponent_bits {
            let exponent = i + non_sign_bits - max_exponent_bits + u32::from(!signed);
            push_decade(1 << exponent, first_decade + i as i32);
        }
        let additional = (1usize << (non_sign_bits - max_exponent_bits)) - 1;
        if additional > 0 {
            push_decade(additional, 0);
        }
        data.push(0.0);
        data.push(1.0);
        data.sort_by(f32::total_cmp);
        Self::from_values(total_bits, &data)
    }

    /// The symmetric linear map `k / L`, `k = -L..=L`, `L = 2^(bits-1) - 1` (2^bits - 1 codes,
    /// zero included): the LPMM parameter format at 8 bits (int8 in [-127, 127], code = k + 127).
    pub fn linear_signed(bits: u32) -> Result<Self, FormatError> {
        check_bits(bits)?;
        if bits < 2 {
            return Err(FormatError::NoMapAtWidth {
                what: "linear signed",
                bits,
            });
        }
        let l = (1i32 << (bits - 1)) - 1;
        let values: Vec<f32> = (-l..=l).map(|k| k as f32 / l as f32).collect();
        Self::from_values(bits, &values)
    }

    /// The linear map `k / (2^bits - 1)`, `k = 0..2^bits`.
    pub fn linear_unsigned(bits: u32) -> Result<Self, FormatError> {
        check_bits(bits)?;
        let l = (1u32 << bits) - 1;
        let values: Vec<f32> = (0..=l).map(|k| k as f32 / l as f32).collect();
        Self::from_values(bits, &values)
    }

    /// The linear map without zero, `(i + 1) / 2^bits`, `i = 0..2^bits`: lpmm's 4-bit
    /// second-moment map (a second moment never decodes to 0, so `1/sqrt(v)` stays finite).
    pub fn linear_without_zero(bits: u32) -> Result<Self, FormatError> {
        check_bits(bits)?;
        let n = 1u32 << bits;
        let values: Vec<f32> = (1..=n).map(|k| k as f32 / n as f32).collect();
        Self::from_values(bits, &values)
    }

    /// The NormalFloat map (QLoRA's NF4 at 4 bits), bitsandbytes' `create_normal_map`
    /// generalised: `2^(bits-1)` positive values `ppf(linspace(offset, 0.5, 2^(bits-1) + 1))`
    /// (last point dropped), `2^(bits-1) - 1` negative ones `-ppf(linspace(offset, 0.5,
    /// 2^(bits-1)))` (last dropped), and 0, divided by the largest in f32. The offset is the mean
    /// of `1 - 1/(2(2^bits - 1))` and `1 - 1/2^(bits+1)`, rounded to 7 decimals (bitsandbytes'
    /// literal `0.9677083` at 4 bits).
    pub fn normal_float(bits: u32) -> Result<Self, FormatError> {
        check_bits(bits)?;
        let n = f64::from(1u32 << bits);
        let offset =
            ((1.0 - 1.0 / (2.0 * (n - 1.0)) + 1.0 - 1.0 / (2.0 * n)) / 2.0 * 1e7).round() / 1e7;
        let half = 1usize << (bits - 1);
        let ppf = |p: f32| -> f32 {
            // Normal quantile via the inverse complementary error function, in f64, rounded
            // to f32 once (scipy's `ndtri` float32 loop does the same).
            (-std::f64::consts::SQRT_2 * statrs::function::erf::erfc_inv(2.0 * f64::from(p))) as f32
        };
        let positive = torch_linspace_f32(offset, 0.5, half + 1);
        let negative = torch_linspace_f32(offset, 0.5, half);
        let mut values: Vec<f32> = positive[..half].iter().map(|&p| ppf(p)).collect();
        values.extend(negative[..half - 1].iter().map(|&p| -ppf(p)));
        values.push(0.0);
        values.sort_by(f32::total_cmp);
        let max = values[values.len() - 1];
        values.iter_mut().for_each(|v| *v /= max);
        Self::from_values(bits, &values)
    }
}

/// `torch.linspace(start, end, steps, dtype=torch.float32)` as torch 2.15's CPU kernel computes
/// it (aten/src/ATen/native/cpu/RangeFactoriesKernel.cpp, AVX2/AVX-512 build): `step = (end -
/// start) / (steps - 1)` in f32; element `i < steps / 2` is `fma(step, i, start)`, the others
/// `fma(-step, steps - 1 - i, end)`, each with a single rounding (the compiler contracts the
/// multiply-add). Checked against torch's output and against all 512 values of the reference table.
fn torch_linspace_f32(start: f64, end: f64, steps: usize) -> Vec<f32> {
    let (start, end) = (start as f32, end as f32);
    if steps == 1 {
        return vec![start];
    }
    let step = (end - start) / (steps - 1) as f32;
    let halfway = steps / 2;
    (0..steps)
        .map(|i| {
            if i < halfway {
                step.mul_add(i as f32, start)
            } else {
                (-step).mul_add((steps - 1 - i) as f32, end)
            }
        })
        .collect()
}
