//! Packing of 1- to 8-bit codes into bytes.
//!
//! Order ([docs/FORMATS.md]): codes form a little-endian bit stream. Code `i` of width `b`
//! occupies bits `i*b .. i*b + b` of the stream, where bit `k` of the stream is bit `k % 8` of byte
//! `k / 8` (least significant bit first). At 4 bits element `2k` is the low nibble of byte `k`
//! (lpmm's order; torchao uses the high nibble). A run of 8 codes always fills exactly `b` bytes,
//! so any block of a multiple of 8 elements starts on a byte boundary and blocks can be packed
//! independently.
//!
//! [docs/FORMATS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/FORMATS.md

use crate::error::FormatError;

/// Bytes needed to hold `n` codes of `bits` bits.
pub const fn packed_len(n: usize, bits: u32) -> usize {
    (n * bits as usize).div_ceil(8)
}

fn check(bits: u32) -> Result<(), FormatError> {
    if (1..=8).contains(&bits) {
        Ok(())
    } else {
        Err(FormatError::BitWidth { bits })
    }
}

/// Packs `codes` (each `< 2^bits`) into `out` (`packed_len(codes.len(), bits)` bytes).
/// Unused high bits of the last byte are zero.
pub fn pack(codes: &[u8], bits: u32, out: &mut [u8]) -> Result<(), FormatError> {
    check(bits)?;
    let expected = packed_len(codes.len(), bits);
    if out.len() != expected {
        return Err(FormatError::LengthMismatch {
            what: "packed codes",
            expected,
            actual: out.len(),
        });
    }
    if bits == 8 {
        // Every byte is an 8-bit code.
        out.copy_from_slice(codes);
        return Ok(());
    }
    if let Some((index, &code)) = first_too_wide(codes, bits) {
        return Err(FormatError::CodeTooWide { index, code, bits });
    }
    if bits == 4 {
        pack_nibbles(codes, out);
        return Ok(());
    }
    out.fill(0);
    let mut acc: u32 = 0;
    let mut filled = 0u32;
    let mut byte = 0usize;
    for &code in codes {
        acc |= u32::from(code) << filled;
        filled += bits;
        while filled >= 8 {
            out[byte] = acc as u8;
            byte += 1;
            acc >>= 8;
            filled -= 8;
        }
    }
    if filled > 0 {
        out[byte] = acc as u8;
    }
    Ok(())
}

/// The first code of `codes` that does not fit `bits` bits, with its index. The common case,
/// every code fits, is one OR over the codes (a loop that vectorizes; the search element by
/// element was a fifth of a 4-bit optimizer step); the index is searched only when one is too
/// wide.
fn first_too_wide(codes: &[u8], bits: u32) -> Option<(usize, &u8)> {
    let any = codes.iter().fold(0u8, |acc, &c| acc | c);
    if u32::from(any) >> bits == 0 {
        return None;
    }
    codes
        .iter()
        .enumerate()
        .find(|(_, c)| u32::from(**c) >> bits != 0)
}

/// Unpacks `codes.len()` codes of `bits` bits from `packed`.
pub fn unpack(packed: &[u8], bits: u32, codes: &mut [u8]) -> Result<(), FormatError> {
    check(bits)?;
    let expected = packed_len(codes.len(), bits);
    if packed.len() != expected {
        return Err(FormatError::LengthMismatch {
            what: "packed codes",
            expected,
            actual: packed.len(),
        });
    }
    if bits == 8 {
        codes.copy_from_slice(packed);
        return Ok(());
    }
    if bits == 4 {
        unpack_nibbles(packed, codes);
        return Ok(());
    }
    let mask = (1u32 << bits) - 1;
    let mut acc: u32 = 0;
    let mut filled = 0u32;
    let mut bytes = packed.iter();
    for code in codes.iter_mut() {
        while filled < bits {
            // The length check above guarantees enough bytes.
            acc |= u32::from(*bytes.next().unwrap_or(&0)) << filled;
            filled += 8;
        }
        *code = (acc & mask) as u8;
        acc >>= bits;
        filled -= bits;
    }
    Ok(())
}

crate::multiversion! {
    /// 4-bit codes (each `< 16`) two to a byte, element `2k` in the low nibble of byte `k`: the
    /// stream order of [`pack`], written so that it vectorizes. `out` holds
    /// `codes.len().div_ceil(2)` bytes.
    fn pack_nibbles(codes: &[u8], out: &mut [u8]) {
        let pairs = codes.chunks_exact(2);
        let tail = pairs.remainder();
        for (o, pair) in out.iter_mut().zip(pairs) {
            *o = pair[0] | pair[1] << 4;
        }
        if let (Some(&last), Some(o)) = (tail.first(), out.last_mut()) {
            *o = last;
        }
    }
}

crate::multiversion! {
    /// The inverse of [`pack_nibbles`]: `codes.len()` 4-bit codes from
    /// `codes.len().div_ceil(2)` bytes.
    fn unpack_nibbles(packed: &[u8], codes: &mut [u8]) {
        let mut pairs = codes.chunks_exact_mut(2);
        for (pair, &b) in (&mut pairs).zip(packed) {
            pair[0] = b & 0x0F;
            pair[1] = b >> 4;
        }
        if let (Some(last), Some(&b)) = (pairs.into_remainder().first_mut(), packed.last()) {
            *last = b & 0x0F;
        }
    }
}

/// Reads code `i` from a packed stream of `bits`-bit codes; `None` if `bits` is not 1..=8 or the
/// code lies beyond `packed`.
#[inline]
pub fn get(packed: &[u8], bits: u32, i: usize) -> Option<u8> {
    if !(1..=8).contains(&bits) {
        return None;
    }
    let bit = i.checked_mul(bits as usize)?;
    let (byte, shift) = (bit / 8, bit % 8);
    let lo = u16::from(*packed.get(byte)?);
    let hi = if shift + bits as usize > 8 {
        u16::from(*packed.get(byte + 1)?)
    } else {
        0
    };
    Some((((lo | hi << 8) >> shift) & ((1u16 << bits) - 1)) as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documented_order() {
        let mut out = [0u8; 1];
        pack(&[0x3, 0xA], 4, &mut out).unwrap();
        assert_eq!(out, [0xA3]); // element 0 in the low nibble
        let mut out = [0u8; 2];
        pack(&[0b101, 0b011, 0b110], 3, &mut out).unwrap();
        // stream (LSB first): 101 | 011<<3 | 110<<6 = 0b1_1001_1101 = 0x19D
        assert_eq!(out, [0x9D, 0x01]);
        assert_eq!(get(&out, 3, 2), Some(0b110));
        assert_eq!(get(&out, 3, 6), None);
        assert_eq!(get(&out, 9, 0), None);
    }

    /// The 4-bit fast paths give the bit stream of the generic loop (written out here), at
    /// every SIMD level and every length parity.
    #[test]
    fn nibbles_are_the_generic_bit_stream() {
        use crate::simd::{Level, force};
        for n in [0usize, 1, 2, 3, 31, 64, 65, 1001] {
            let codes: Vec<u8> = (0..n).map(|i| ((i * 7 + i / 16) % 16) as u8).collect();
            let mut want = vec![0u8; packed_len(n, 4)];
            for (i, &c) in codes.iter().enumerate() {
                want[i * 4 / 8] |= c << (i * 4 % 8);
            }
            for level in Level::ALL {
                force(Some(level));
                let mut out = vec![0xFFu8; packed_len(n, 4)];
                pack(&codes, 4, &mut out).unwrap();
                assert_eq!(out, want, "pack n={n} {level:?}");
                let mut back = vec![0xFFu8; n];
                unpack(&out, 4, &mut back).unwrap();
                assert_eq!(back, codes, "unpack n={n} {level:?}");
            }
        }
        force(None);
    }

    #[test]
    fn bad_input_is_a_typed_error() {
        let mut out = [0u8; 1];
        assert_eq!(
            pack(&[16], 4, &mut out),
            Err(FormatError::CodeTooWide {
                index: 0,
                code: 16,
                bits: 4
            })
        );
        assert!(matches!(
            pack(&[1, 2, 3], 4, &mut out),
            Err(FormatError::LengthMismatch { .. })
        ));
        assert_eq!(
            pack(&[1], 0, &mut out),
            Err(FormatError::BitWidth { bits: 0 })
        );
        // The first code that is too wide, far into a long run of codes that fit.
        let mut codes = vec![0b101u8; 4096];
        codes[777] = 0b1000;
        codes[900] = 0xFF;
        let mut out3 = vec![0u8; packed_len(codes.len(), 3)];
        assert_eq!(
            pack(&codes, 3, &mut out3),
            Err(FormatError::CodeTooWide {
                index: 777,
                code: 0b1000,
                bits: 3
            })
        );
        codes[777] = 0b111;
        assert!(matches!(
            pack(&codes, 3, &mut out3),
            Err(FormatError::CodeTooWide { index: 900, .. })
        ));
        let mut out8 = vec![0u8; codes.len()];
        pack(&codes, 8, &mut out8).unwrap();
        assert_eq!(out8, codes);
        let mut codes = [0u8; 3];
        assert!(matches!(
            unpack(&out, 4, &mut codes),
            Err(FormatError::LengthMismatch { .. })
        ));
    }
}
