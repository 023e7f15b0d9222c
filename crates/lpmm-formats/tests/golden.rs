//! Casts and maps against torch 2.15 and bitsandbytes 0.50.2 (golden/torch_casts.safetensors,
//! made by golden/gen_torch_casts.py; see golden/README.md for what it holds and why).

use lpmm_formats::{CodeMap, Fp8, Overflow, Rounding, float};
use safetensors::SafeTensors;

const FILE: &[u8] = include_bytes!("golden/torch_casts.safetensors");

fn bytes<'a>(st: &'a SafeTensors<'a>, name: &str) -> &'a [u8] {
    st.tensor(name)
        .unwrap_or_else(|e| panic!("{name}: {e}"))
        .data()
}

fn f32s(st: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    bytes(st, name)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn u16s(st: &SafeTensors<'_>, name: &str) -> Vec<u16> {
    bytes(st, name)
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn load() -> SafeTensors<'static> {
    SafeTensors::deserialize(FILE).expect("golden file parses")
}

/// `got` equals `want` bit for bit; for NaN inputs, where `is_nan` accepts both it is enough that
/// both are NaN (torch's bf16 NaN bits depend on which CPU kernel ran: quirk 3 in golden/README.md).
fn check<T: Copy + PartialEq + std::fmt::Debug>(
    what: &str,
    x: &[f32],
    want: &[T],
    got: impl Fn(f32) -> T,
    is_nan: impl Fn(T) -> bool,
) {
    assert_eq!(x.len(), want.len());
    let mut bad = Vec::new();
    for (&v, &w) in x.iter().zip(want) {
        let g = got(v);
        let ok = if v.is_nan() {
            is_nan(g) && is_nan(w)
        } else {
            g == w
        };
        if !ok {
            bad.push(format!(
                "x={v:e} ({:#010x}): want {w:?} got {g:?}",
                v.to_bits()
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "{what}: {} of {} differ, first: {:?}",
        bad.len(),
        x.len(),
        &bad[..bad.len().min(5)]
    );
}

#[test]
fn bf16_and_f16_nearest_equal_torch() {
    let st = load();
    let x = f32s(&st, "x");
    let bf = u16s(&st, "bf16_rne");
    check(
        "bf16",
        &x,
        &bf,
        |v| float::bf16_nearest(v).to_bits(),
        |b| b & 0x7FFF > 0x7F80,
    );
    let h = u16s(&st, "f16_rne");
    check(
        "f16",
        &x,
        &h,
        |v| float::f16_nearest(v).to_bits(),
        |b| b & 0x7FFF > 0x7C00,
    );
}

#[test]
fn fp8_encode_equals_torch() {
    let st = load();
    let x = f32s(&st, "x");
    // torch's e4m3fn cast saturates (±Inf and everything past 464 give ±448); its e5m2 cast is IEEE.
    // NaN codes too are torch's bit for bit (0x7F with the input's sign).
    let e4 = bytes(&st, "e4m3fn_rne");
    check(
        "e4m3fn",
        &x,
        e4,
        |v| Fp8::E4M3Fn.encode(v, Rounding::NearestEven, Overflow::Saturate),
        |c| Fp8::E4M3Fn.is_nan_code(c),
    );
    let e5 = bytes(&st, "e5m2_rne");
    check(
        "e5m2",
        &x,
        e5,
        |v| Fp8::E5M2.encode(v, Rounding::NearestEven, Overflow::NonSaturating),
        |c| Fp8::E5M2.is_nan_code(c),
    );
}

#[test]
fn fp8_decode_equals_torch_for_all_256_codes() {
    let st = load();
    for (fmt, name) in [(Fp8::E4M3Fn, "e4m3fn_decode"), (Fp8::E5M2, "e5m2_decode")] {
        let want = f32s(&st, name);
        for (code, &w) in want.iter().enumerate() {
            let g = fmt.decode(code as u8);
            assert!(
                g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                "{fmt:?} {code:#04x}: {w} vs {g}"
            );
        }
    }
}

#[test]
fn four_bit_maps_equal_bitsandbytes() {
    let st = load();
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let de4 = CodeMap::dynamic(true, 4).unwrap();
    assert_eq!(bits(de4.values()), bits(&f32s(&st, "map.de4_signed")));
    let nf4 = CodeMap::normal_float(4).unwrap();
    assert_eq!(
        bits(nf4.values()),
        bits(&f32s(&st, "map.nf4")),
        "bitsandbytes' NF4 table"
    );
    assert_eq!(
        bits(nf4.values()),
        bits(&f32s(&st, "map.nf4_constructed")),
        "create_normal_map()"
    );
}
