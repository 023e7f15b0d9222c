//! Counter-based random bits for stochastic rounding.
//!
//! The 32 random bits that element `i` of tensor `t` uses at step `s` under seed `k` are a pure
//! function of `(k, t, s, i)`: word `i` of the ChaCha8 keystream with key
//! `k.to_le_bytes() ++ t.to_le_bytes() ++ [0; 16]` and stream (nonce) `s`. ChaCha is counter-based,
//! so any thread, chunk or GPU kernel computes the same word for the same element without
//! generating the words before it ([docs/FORMATS.md], "Random bits").
//!
//! On the CPU the words are computed 16 blocks (256 words) at a time, one block per 32-bit vector
//! lane (AVX-512: one register per state word, then a 16 x 16 transposition into keystream
//! order); the words are rand_chacha's `ChaCha8Rng` keystream, which a test checks at every SIMD
//! level.
//!
//! Stochastic rounding needs only 16 of those bits, so lpmm's quantizers and formats round with
//! *draws*: element `i`'s draw is one half of word `floor(i / 2)` (the low half for even `i`, the
//! high half for odd `i`), handed to the rounding as the high half of a `u32` whose low half is
//! zero ([`RandomStream::draws_at`]). One ChaCha8 block serves 32 elements.
//!
//! [docs/FORMATS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/FORMATS.md

/// Blocks one [`chacha8_x16`] call computes (one per 32-bit lane of an AVX-512 register).
const LANES: usize = 16;

/// Words one [`chacha8_x16`] call computes: 16 blocks of 16 words.
const BATCH: usize = 16 * LANES;

/// Block counters are taken mod 2^60, so that element indices (16 per block) are mod 2^64.
const BLOCK_MASK: u64 = (1 << 60) - 1;

/// Draws (two per word, 32 per block) take block counters mod 2^59, so that their element
/// indices are mod 2^64 as well.
const DRAW_BLOCK_MASK: u64 = BLOCK_MASK >> 1;

/// ChaCha's constant words ("expand 32-byte k").
const SIGMA: [u32; 4] = [0x6170_7865, 0x3320_646e, 0x7962_2d32, 0x6b20_6574];

/// One ChaCha quarter round on lanes `a`, `b`, `c`, `d` of 16 independent blocks (word-major:
/// `x[word][block]`), so each operation is one 16-lane vector operation.
#[inline(always)]
fn quarter(x: &mut [[u32; LANES]; 16], a: usize, b: usize, c: usize, d: usize) {
    let (mut va, mut vb, mut vc, mut vd) = (x[a], x[b], x[c], x[d]);
    for l in 0..LANES {
        va[l] = va[l].wrapping_add(vb[l]);
        vd[l] = (vd[l] ^ va[l]).rotate_left(16);
        vc[l] = vc[l].wrapping_add(vd[l]);
        vb[l] = (vb[l] ^ vc[l]).rotate_left(12);
        va[l] = va[l].wrapping_add(vb[l]);
        vd[l] = (vd[l] ^ va[l]).rotate_left(8);
        vc[l] = vc[l].wrapping_add(vd[l]);
        vb[l] = (vb[l] ^ vc[l]).rotate_left(7);
    }
    x[a] = va;
    x[b] = vb;
    x[c] = vc;
    x[d] = vd;
}

/// The 16 blocks' words after the eight rounds and the final addition, word-major:
/// `x[w][j]` is word `w` of block `block + j` (counters `& mask`).
#[inline(always)]
fn chacha8_rows(key: &[u32; 8], block: u64, mask: u64, nonce: u64) -> [[u32; LANES]; 16] {
    let mut init = [[0u32; LANES]; 16];
    for (w, &c) in SIGMA.iter().enumerate() {
        init[w] = [c; LANES];
    }
    for (w, &k) in key.iter().enumerate() {
        init[4 + w] = [k; LANES];
    }
    let counter = |l: usize| block.wrapping_add(l as u64) & mask;
    init[12] = std::array::from_fn(|l| counter(l) as u32);
    init[13] = std::array::from_fn(|l| (counter(l) >> 32) as u32);
    init[14] = [nonce as u32; LANES];
    init[15] = [(nonce >> 32) as u32; LANES];
    let mut x = init;
    // Eight rounds: four double rounds (a column round, then a diagonal round).
    for _ in 0..4 {
        quarter(&mut x, 0, 4, 8, 12);
        quarter(&mut x, 1, 5, 9, 13);
        quarter(&mut x, 2, 6, 10, 14);
        quarter(&mut x, 3, 7, 11, 15);
        quarter(&mut x, 0, 5, 10, 15);
        quarter(&mut x, 1, 6, 11, 12);
        quarter(&mut x, 2, 7, 8, 13);
        quarter(&mut x, 3, 4, 9, 14);
    }
    for w in 0..16 {
        for l in 0..LANES {
            x[w][l] = x[w][l].wrapping_add(init[w][l]);
        }
    }
    x
}

/// The ChaCha8 blocks `block, block + 1, ..., block + 15` (counters `& mask`: `BLOCK_MASK` for
/// words, `DRAW_BLOCK_MASK` for draws, so element indices are taken mod 2^64) of `key` and
/// stream `nonce`, 16 at a time (one per vector lane), in keystream order: `out[16 * j + w]` is
/// word `w` of block `block + j`.
fn chacha8_x16(key: &[u32; 8], block: u64, mask: u64, nonce: u64, out: &mut [u32; BATCH]) {
    #[cfg(target_arch = "x86_64")]
    if lpmm_formats::simd::avx512() {
        // SAFETY: `level()` is `Avx512` only after run-time detection of AVX-512 F/BW/VL/DQ,
        // AVX2 and FMA (lpmm_formats::simd), every feature `chacha8_x16_avx512` enables.
        unsafe { chacha8_x16_avx512(key, block, mask, nonce, out) };
        return;
    }
    chacha8_x16_transposed(key, block, mask, nonce, out);
}

lpmm_formats::multiversion! {
    /// [`chacha8_x16`] with the transposition to keystream order left to the compiler (AVX2
    /// and portable builds).
    fn chacha8_x16_transposed(key: &[u32; 8], block: u64, mask: u64, nonce: u64, out: &mut [u32; BATCH]) {
        let x = chacha8_rows(key, block, mask, nonce);
        for w in 0..16 {
            for l in 0..LANES {
                out[16 * l + w] = x[w][l];
            }
        }
    }
}

/// [`chacha8_x16`] with AVX-512: the rounds on 16-lane registers (one block per lane), then a
/// 16 x 16 transposition of 32-bit words in four shuffle stages (64 shuffles).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
fn chacha8_x16_avx512(key: &[u32; 8], block: u64, mask: u64, nonce: u64, out: &mut [u32; BATCH]) {
    use std::arch::x86_64::*;
    let counter = |l: usize| block.wrapping_add(l as u64) & mask;
    let counters: [[u32; LANES]; 2] = [
        std::array::from_fn(|l| counter(l) as u32),
        std::array::from_fn(|l| (counter(l) >> 32) as u32),
    ];
    let splat = |w: u32| _mm512_set1_epi32(w as i32);
    // SAFETY: each `counters[k]` is 16 u32, the 64 bytes an unaligned 512-bit load reads.
    let [lo, hi] = counters.map(|c| unsafe { _mm512_loadu_si512(c.as_ptr().cast()) });
    let init: [__m512i; 16] = [
        splat(SIGMA[0]),
        splat(SIGMA[1]),
        splat(SIGMA[2]),
        splat(SIGMA[3]),
        splat(key[0]),
        splat(key[1]),
        splat(key[2]),
        splat(key[3]),
        splat(key[4]),
        splat(key[5]),
        splat(key[6]),
        splat(key[7]),
        lo,
        hi,
        splat(nonce as u32),
        splat((nonce >> 32) as u32),
    ];
    let mut x = init;
    let quarter = |x: &mut [__m512i; 16], a: usize, b: usize, c: usize, d: usize| {
        x[a] = _mm512_add_epi32(x[a], x[b]);
        x[d] = _mm512_rol_epi32::<16>(_mm512_xor_si512(x[d], x[a]));
        x[c] = _mm512_add_epi32(x[c], x[d]);
        x[b] = _mm512_rol_epi32::<12>(_mm512_xor_si512(x[b], x[c]));
        x[a] = _mm512_add_epi32(x[a], x[b]);
        x[d] = _mm512_rol_epi32::<8>(_mm512_xor_si512(x[d], x[a]));
        x[c] = _mm512_add_epi32(x[c], x[d]);
        x[b] = _mm512_rol_epi32::<7>(_mm512_xor_si512(x[b], x[c]));
    };
    for _ in 0..4 {
        quarter(&mut x, 0, 4, 8, 12);
        quarter(&mut x, 1, 5, 9, 13);
        quarter(&mut x, 2, 6, 10, 14);
        quarter(&mut x, 3, 7, 11, 15);
        quarter(&mut x, 0, 5, 10, 15);
        quarter(&mut x, 1, 6, 11, 12);
        quarter(&mut x, 2, 7, 8, 13);
        quarter(&mut x, 3, 4, 9, 14);
    }
    let r: [__m512i; 16] = std::array::from_fn(|w| _mm512_add_epi32(x[w], init[w]));
    // Stage 1 and 2, per group g of four rows: `s[g][j]`'s 128-bit lane k holds column 4k + j
    // of rows 4g .. 4g + 3.
    let s: [[__m512i; 4]; 4] = std::array::from_fn(|g| {
        let (r0, r1, r2, r3) = (r[4 * g], r[4 * g + 1], r[4 * g + 2], r[4 * g + 3]);
        let (t0, t1) = (_mm512_unpacklo_epi32(r0, r1), _mm512_unpackhi_epi32(r0, r1));
        let (t2, t3) = (_mm512_unpacklo_epi32(r2, r3), _mm512_unpackhi_epi32(r2, r3));
        [
            _mm512_unpacklo_epi64(t0, t2),
            _mm512_unpackhi_epi64(t0, t2),
            _mm512_unpacklo_epi64(t1, t3),
            _mm512_unpackhi_epi64(t1, t3),
        ]
    });
    // Stage 3 and 4: column 4k + j (block 4k + j, keystream words 16 (4k + j) ..) is lane k of
    // s[0][j], s[1][j], s[2][j], s[3][j].
    #[allow(clippy::needless_range_loop)] // `j` picks the same register of all four groups
    for j in 0..4 {
        let (a, b, c, d) = (s[0][j], s[1][j], s[2][j], s[3][j]);
        let p = _mm512_shuffle_i32x4::<0x44>(a, b); // a0 a1 b0 b1
        let q = _mm512_shuffle_i32x4::<0x44>(c, d); // c0 c1 d0 d1
        let r = _mm512_shuffle_i32x4::<0xEE>(a, b); // a2 a3 b2 b3
        let t = _mm512_shuffle_i32x4::<0xEE>(c, d); // c2 c3 d2 d3
        let columns = [
            _mm512_shuffle_i32x4::<0x88>(p, q), // a0 b0 c0 d0
            _mm512_shuffle_i32x4::<0xDD>(p, q), // a1 b1 c1 d1
            _mm512_shuffle_i32x4::<0x88>(r, t), // a2 b2 c2 d2
            _mm512_shuffle_i32x4::<0xDD>(r, t), // a3 b3 c3 d3
        ];
        for (k, column) in columns.into_iter().enumerate() {
            let at = 16 * (4 * k + j);
            // SAFETY: `at + 16 <= BATCH` (k, j < 4); the store is unaligned.
            unsafe { _mm512_storeu_si512(out[at..at + 16].as_mut_ptr().cast(), column) };
        }
    }
}

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

    /// A generator positioned at element `index`: successive `next` calls give the bits of
    /// elements `index`, `index + 1`, ... (mod 2^64). It computes 16 ChaCha8 blocks at a time.
    pub fn at(&self, index: u64) -> RandomBits {
        self.words_at(index, BLOCK_MASK)
    }

    /// A generator positioned at word `index`, with block counters `& mask`.
    fn words_at(&self, index: u64, mask: u64) -> RandomBits {
        let key = [
            self.seed as u32,
            (self.seed >> 32) as u32,
            self.tensor as u32,
            (self.tensor >> 32) as u32,
            0,
            0,
            0,
            0,
        ];
        let mut bits = RandomBits {
            key,
            nonce: self.step,
            block: (index >> 4) & mask,
            mask,
            words: [0; BATCH],
            pos: (index & 15) as usize,
        };
        chacha8_x16(
            &bits.key,
            bits.block,
            bits.mask,
            bits.nonce,
            &mut bits.words,
        );
        bits
    }

    /// The bits of element `index` alone (slow: computes a batch of blocks; use
    /// [`RandomStream::at`] or [`RandomStream::fill`] for runs of elements).
    pub fn bits(&self, index: u64) -> u32 {
        self.at(index).next()
    }

    /// Fills `out` with the bits of elements `start .. start + out.len()`.
    pub fn fill(&self, start: u64, out: &mut [u32]) {
        self.at(start).fill(out);
    }

    /// A generator of stochastic-rounding draws positioned at element `index`: successive
    /// `next` calls give the draws of elements `index`, `index + 1`, ... (mod 2^64). Element
    /// `i`'s draw is the low half of word `floor(i / 2)` if `i` is even, its high half if `i` is
    /// odd, returned in the high half of the `u32` (the low 16 bits are zero), so one word serves
    /// two elements ([docs/FORMATS.md] §9, "Draws").
    ///
    /// [docs/FORMATS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/FORMATS.md
    pub fn draws_at(&self, index: u64) -> RandomDraws {
        RandomDraws {
            bits: self.words_at(index >> 1, DRAW_BLOCK_MASK),
            high: index & 1 == 1,
        }
    }

    /// The draw of element `index` alone (slow: computes a batch of blocks; use
    /// [`RandomStream::draws_at`] or [`RandomStream::fill_draws`] for runs of elements).
    pub fn draw(&self, index: u64) -> u32 {
        self.draws_at(index).next()
    }

    /// Fills `out` with the draws of elements `start .. start + out.len()`.
    pub fn fill_draws(&self, start: u64, out: &mut [u32]) {
        self.draws_at(start).fill(out);
    }
}

/// A positioned generator of per-element random bits (see [`RandomStream::at`]).
#[derive(Clone)]
pub struct RandomBits {
    /// The key as words (seed, tensor, zeros).
    key: [u32; 8],
    /// The stream: the step.
    nonce: u64,
    /// The first of the 16 blocks `words` holds.
    block: u64,
    /// Block counters are taken `& mask` (`BLOCK_MASK`, or `DRAW_BLOCK_MASK` for draws).
    mask: u64,
    /// Words of blocks `block .. block + 16`.
    words: [u32; BATCH],
    /// The next word of `words` to hand out (`BATCH`: all handed out).
    pos: usize,
}

impl std::fmt::Debug for RandomBits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key is the user's seed and the words follow from it: neither is printed.
        f.debug_struct("RandomBits")
            .field("nonce", &self.nonce)
            .field(
                "next_index",
                &((self.block << 4).wrapping_add(self.pos as u64)),
            )
            .finish_non_exhaustive()
    }
}

impl RandomBits {
    /// Moves to the next 16 blocks.
    fn advance(&mut self) {
        self.block = self.block.wrapping_add(LANES as u64) & self.mask;
    }

    /// The bits of the next element.
    #[inline]
    #[allow(clippy::should_implement_trait)] // an infinite stream: Iterator would only add noise
    pub fn next(&mut self) -> u32 {
        if self.pos == BATCH {
            self.advance();
            chacha8_x16(
                &self.key,
                self.block,
                self.mask,
                self.nonce,
                &mut self.words,
            );
            self.pos = 0;
        }
        let word = self.words[self.pos];
        self.pos += 1;
        word
    }

    /// The bits of the next `out.len()` elements.
    pub fn fill(&mut self, mut out: &mut [u32]) {
        while !out.is_empty() {
            if self.pos == BATCH {
                self.advance();
                if out.len() >= BATCH {
                    // Straight into the output; the buffer stays spent (and `block` names the
                    // blocks just written, so the next refill moves past them).
                    let (whole, rest) = std::mem::take(&mut out).split_at_mut(BATCH);
                    if let Ok(whole) = <&mut [u32; BATCH]>::try_from(whole) {
                        chacha8_x16(&self.key, self.block, self.mask, self.nonce, whole);
                    }
                    out = rest;
                    continue;
                }
                chacha8_x16(
                    &self.key,
                    self.block,
                    self.mask,
                    self.nonce,
                    &mut self.words,
                );
                self.pos = 0;
            }
            let n = out.len().min(BATCH - self.pos);
            let (head, rest) = out.split_at_mut(n);
            head.copy_from_slice(&self.words[self.pos..self.pos + n]);
            self.pos += n;
            out = rest;
        }
    }
}

/// A positioned generator of stochastic-rounding draws, 16 bits per element (see
/// [`RandomStream::draws_at`]).
#[derive(Clone)]
pub struct RandomDraws {
    /// The words, positioned at the word that holds the next draw.
    bits: RandomBits,
    /// Whether the next draw is the high half of that word (the low half was handed out).
    high: bool,
}

impl std::fmt::Debug for RandomDraws {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let word = (self.bits.block << 4).wrapping_add(self.bits.pos as u64);
        f.debug_struct("RandomDraws")
            .field("nonce", &self.bits.nonce)
            .field("next_index", &(word << 1 | u64::from(self.high)))
            .finish_non_exhaustive()
    }
}

/// The draw of an even element: the low half of its word, moved to the high half.
#[inline(always)]
fn low_draw(word: u32) -> u32 {
    word << 16
}

/// The draw of an odd element: the high half of its word.
#[inline(always)]
fn high_draw(word: u32) -> u32 {
    word & 0xFFFF_0000
}

lpmm_formats::multiversion! {
    /// The two draws of each word: `out[2k]` and `out[2k + 1]` from `words[k]`.
    fn split_words(words: &[u32], out: &mut [u32]) {
        for (pair, &word) in out.chunks_exact_mut(2).zip(words) {
            pair[0] = low_draw(word);
            pair[1] = high_draw(word);
        }
    }
}

impl RandomDraws {
    /// Makes sure the buffer holds the next word (computes the next 16 blocks if it is spent).
    #[inline]
    fn refill(&mut self) {
        let bits = &mut self.bits;
        if bits.pos == BATCH {
            bits.advance();
            chacha8_x16(
                &bits.key,
                bits.block,
                bits.mask,
                bits.nonce,
                &mut bits.words,
            );
            bits.pos = 0;
        }
    }

    /// The draw of the next element.
    #[inline]
    #[allow(clippy::should_implement_trait)] // an infinite stream: Iterator would only add noise
    pub fn next(&mut self) -> u32 {
        self.refill();
        let word = self.bits.words[self.bits.pos];
        if self.high {
            self.bits.pos += 1;
            self.high = false;
            high_draw(word)
        } else {
            self.high = true;
            low_draw(word)
        }
    }

    /// The draws of the next `out.len()` elements.
    pub fn fill(&mut self, mut out: &mut [u32]) {
        if self.high && !out.is_empty() {
            let (first, rest) = std::mem::take(&mut out).split_at_mut(1);
            first[0] = self.next();
            out = rest;
        }
        // Now at a word boundary: whole words give two draws each.
        while out.len() >= 2 {
            self.refill();
            let bits = &mut self.bits;
            let pairs = (out.len() / 2).min(BATCH - bits.pos);
            let (head, rest) = std::mem::take(&mut out).split_at_mut(2 * pairs);
            split_words(&bits.words[bits.pos..bits.pos + pairs], head);
            bits.pos += pairs;
            out = rest;
        }
        if let [last] = out {
            *last = self.next();
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

    /// The 16-wide generator gives rand_chacha's `ChaCha8Rng` keystream word for word (the
    /// generator lpmm used before, and the one GPU kernels were checked against), at every SIMD
    /// level, from any start and for any length, through `next` and `fill`.
    #[test]
    fn words_equal_rand_chacha_at_every_level() {
        use lpmm_formats::simd::{Level, force};
        use rand_chacha::ChaCha8Rng;
        use rand_core::{Rng, SeedableRng};
        let stream = RandomStream::new(0xDEAD_BEEF_0123_4567, u64::MAX - 3, 1 << 40);
        let mut rng = ChaCha8Rng::from_seed(stream.key());
        rng.set_stream(stream.step);
        rng.set_word_pos(1000 * 16 - 37);
        let want: Vec<u32> = (0..3000).map(|_| rng.next_u32()).collect();
        for level in Level::ALL {
            force(Some(level));
            for (skip, len) in [
                (0usize, 3000usize),
                (1, 1),
                (37, 300),
                (37, 256),
                (293, 2707),
                (5, 520),
            ] {
                let start = 1000 * 16 - 37 + skip as u64;
                let mut got = vec![0u32; len];
                stream.fill(start, &mut got);
                assert_eq!(got, want[skip..skip + len], "{level:?} fill {skip} {len}");
                let mut bits = stream.at(start);
                let one: Vec<u32> = (0..len).map(|_| bits.next()).collect();
                assert_eq!(one, got, "{level:?} next {skip} {len}");
            }
            // Mixed calls continue the same keystream.
            let mut bits = stream.at(1000 * 16 - 37);
            let mut got = vec![0u32; 3000];
            let (a, rest) = got.split_at_mut(300);
            bits.fill(a);
            let (b, c) = rest.split_at_mut(1);
            b[0] = bits.next();
            bits.fill(c);
            assert_eq!(got, want, "{level:?} mixed");
        }
        force(None);
    }

    /// Element indices are taken mod 2^64: the words after element 2^64 - 1 are those of
    /// elements 0, 1, ... (blocks mod 2^60), as the quantizers' `offset.wrapping_add` says.
    #[test]
    fn indices_wrap_mod_2_64() {
        let stream = RandomStream::new(3, 4, 5);
        let mut across = vec![0u32; 40];
        stream.fill(u64::MAX - 19, &mut across);
        let mut low = vec![0u32; 20];
        stream.fill(0, &mut low);
        assert_eq!(across[20..], low[..]);
        assert_eq!(across[19], stream.bits(u64::MAX));
    }

    /// Element `i`'s draw is the low half of word `i / 2` (even `i`) or its high half (odd `i`),
    /// in the high half of the result: the definition GPU kernels implement.
    #[test]
    fn draws_are_the_documented_halves_of_the_words() {
        let stream = RandomStream::new(0x0123_4567_89AB_CDEF, 42, 7);
        for index in [
            0u64,
            1,
            2,
            31,
            32,
            33,
            1000,
            (1 << 33) + 5,
            u64::MAX - 1,
            u64::MAX,
        ] {
            let block = chacha_block(&stream.key(), (index >> 1) / 16, stream.step, 8);
            let word = block[((index >> 1) % 16) as usize];
            let half = if index % 2 == 0 {
                word & 0xFFFF
            } else {
                word >> 16
            };
            assert_eq!(stream.draw(index), half << 16, "index {index}");
        }
    }

    /// Runs of draws equal the draws one element at a time, at every SIMD level, from odd and
    /// even starts, for any length, across batches, through `next` and `fill` mixed.
    #[test]
    fn draws_do_not_depend_on_how_the_range_is_cut() {
        use lpmm_formats::simd::{Level, force};
        let stream = RandomStream::new(5, 6, 7);
        let base = 2 * BATCH as u64 * 3 - 41;
        let want: Vec<u32> = (0..2000).map(|i| stream.draw(base + i)).collect();
        for level in Level::ALL {
            force(Some(level));
            for (skip, len) in [
                (0usize, 2000usize),
                (1, 1),
                (1, 2),
                (2, 1),
                (3, 600),
                (4, 513),
                (41, 1959),
            ] {
                let mut got = vec![0u32; len];
                stream.fill_draws(base + skip as u64, &mut got);
                assert_eq!(got, want[skip..skip + len], "{level:?} fill {skip} {len}");
            }
            let mut draws = stream.draws_at(base);
            let mut got = vec![0u32; 2000];
            let (a, rest) = got.split_at_mut(3);
            draws.fill(a);
            let (b, rest) = rest.split_at_mut(1);
            b[0] = draws.next();
            let (c, d) = rest.split_at_mut(777);
            draws.fill(c);
            draws.fill(d);
            assert_eq!(got, want, "{level:?} mixed");
        }
        force(None);
    }

    /// Draws' element indices wrap mod 2^64 too: after element 2^64 - 1 (the high half of word
    /// 2^63 - 1) come elements 0, 1, ... (word 0).
    #[test]
    fn draw_indices_wrap_mod_2_64() {
        let stream = RandomStream::new(3, 4, 5);
        let mut across = vec![0u32; 1000];
        stream.fill_draws(u64::MAX - 599, &mut across);
        let mut low = vec![0u32; 400];
        stream.fill_draws(0, &mut low);
        assert_eq!(across[600..], low[..]);
        assert_eq!(across[599], stream.draw(u64::MAX));
        assert_eq!(across[599] >> 16, stream.bits((1 << 63) - 1) >> 16);
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
