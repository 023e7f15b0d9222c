//! Counter-based random bits for stochastic rounding.
//!
//! The 32 random bits that element `i` of tensor `t` uses at step `s` under seed `k` are a pure
//! function of `(k, t, s, i)`: word `i` of the ChaCha8 keystream with key
//! `k.to_le_bytes() ++ t.to_le_bytes() ++ [0; 16]` and stream (nonce) `s`. ChaCha is counter-based,
//! so any thread, chunk or GPU kernel computes the same word for the same element without
//! generating the words before it ([docs/FORMATS.md], "Random bits").
//!
//! [docs/FORMATS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/FORMATS.md

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};

/// Identifies one stream of random bits: a user seed, a tensor id and a step counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RandomStream {
    /// The user's seed.
    pub seed: u64,
    /// Which tensor (stable across runs and world sizes: e.g. the parameter's index in the model).
    pub tensor: u64,
    /// Which step (or any other counter that must give fresh bits each time).
    pub step: u64,
}

impl RandomStream {
    /// A stream for `(seed, tensor, step)`.
    pub const fn new(seed: u64, tensor: u64, step: u64) -> Self {
        Self { seed, tensor, step }
    }

    /// The ChaCha8 key: seed and tensor id, little-endian, zero-padded to 32 bytes.
    pub fn key(&self) -> [u8; 32] {
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&self.seed.to_le_bytes());
        key[8..16].copy_from_slice(&self.tensor.to_le_bytes());
        key
    }

    /// A generator positioned at element `index`: successive `next_u32` calls give the bits of
    /// elements `index`, `index + 1`, ...
    pub fn at(&self, index: u64) -> RandomBits {
        let mut rng = ChaCha8Rng::from_seed(self.key());
        rng.set_stream(self.step);
        rng.set_word_pos(u128::from(index));
        RandomBits { rng }
    }

    /// The bits of element `index` alone (slow: sets up a generator; use [`RandomStream::at`] or
    /// [`RandomStream::fill`] for runs of elements).
    pub fn bits(&self, index: u64) -> u32 {
        self.at(index).next()
    }

    /// Fills `out` with the bits of elements `start .. start + out.len()`.
    pub fn fill(&self, start: u64, out: &mut [u32]) {
        self.at(start).fill(out);
    }
}

/// A positioned generator of per-element random bits (see [`RandomStream::at`]).
#[derive(Debug, Clone)]
pub struct RandomBits {
    rng: ChaCha8Rng,
}

impl RandomBits {
    /// The bits of the next element.
    #[inline]
    #[allow(clippy::should_implement_trait)] // an infinite stream: Iterator would only add noise
    pub fn next(&mut self) -> u32 {
        self.rng.next_u32()
    }

    /// The bits of the next `out.len()` elements.
    #[inline]
    pub fn fill(&mut self, out: &mut [u32]) {
        for word in out {
            *word = self.rng.next_u32();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ChaCha block function with `rounds` rounds, written out from RFC 8439 §2.3 with the
    /// original (djb) layout that rand_chacha uses: a 64-bit block counter in words 12-13 and a
    /// 64-bit nonce in words 14-15. This is the definition a GPU kernel implements; the test pins
    /// rand_chacha to it.
    fn chacha_block(key: &[u8; 32], counter: u64, nonce: u64, rounds: usize) -> [u32; 16] {
        let mut s = [0u32; 16];
        s[..4].copy_from_slice(&[0x6170_7865, 0x3320_646e, 0x7962_2d32, 0x6b20_6574]);
        for i in 0..8 {
            s[4 + i] = u32::from_le_bytes(key[4 * i..4 * i + 4].try_into().unwrap());
        }
        s[12] = counter as u32;
        s[13] = (counter >> 32) as u32;
        s[14] = nonce as u32;
        s[15] = (nonce >> 32) as u32;
        let mut x = s;
        let qr = |x: &mut [u32; 16], a: usize, b: usize, c: usize, d: usize| {
            x[a] = x[a].wrapping_add(x[b]);
            x[d] = (x[d] ^ x[a]).rotate_left(16);
            x[c] = x[c].wrapping_add(x[d]);
            x[b] = (x[b] ^ x[c]).rotate_left(12);
            x[a] = x[a].wrapping_add(x[b]);
            x[d] = (x[d] ^ x[a]).rotate_left(8);
            x[c] = x[c].wrapping_add(x[d]);
            x[b] = (x[b] ^ x[c]).rotate_left(7);
        };
        for _ in 0..rounds / 2 {
            qr(&mut x, 0, 4, 8, 12);
            qr(&mut x, 1, 5, 9, 13);
            qr(&mut x, 2, 6, 10, 14);
            qr(&mut x, 3, 7, 11, 15);
            qr(&mut x, 0, 5, 10, 15);
            qr(&mut x, 1, 6, 11, 12);
            qr(&mut x, 2, 7, 8, 13);
            qr(&mut x, 3, 4, 9, 14);
        }
        for i in 0..16 {
            x[i] = x[i].wrapping_add(s[i]);
        }
        x
    }

    #[test]
    fn bits_are_the_documented_chacha8_words() {
        let stream = RandomStream::new(0x0123_4567_89AB_CDEF, 42, 7);
        for index in [0u64, 1, 15, 16, 17, 1000, (1 << 33) + 5] {
            let block = chacha_block(&stream.key(), index / 16, stream.step, 8);
            assert_eq!(
                stream.bits(index),
                block[(index % 16) as usize],
                "index {index}"
            );
        }
    }

    #[test]
    fn bits_do_not_depend_on_how_the_range_is_cut() {
        let stream = RandomStream::new(1, 2, 3);
        let mut whole = vec![0u32; 1000];
        stream.fill(100, &mut whole);
        for (start, len) in [(100u64, 1usize), (117, 33), (500, 500), (999, 101)] {
            let mut part = vec![0u32; len];
            stream.fill(start, &mut part);
            assert_eq!(part[..], whole[(start - 100) as usize..][..len]);
        }
    }

    #[test]
    fn streams_differ_by_seed_tensor_and_step() {
        let base = RandomStream::new(1, 2, 3);
        let others = [
            RandomStream::new(9, 2, 3),
            RandomStream::new(1, 9, 3),
            RandomStream::new(1, 2, 9),
        ];
        for other in others {
            assert_ne!(base.bits(0), other.bits(0), "{other:?}");
        }
    }
}
