//! The count models a character model must beat: unigram and bigram cross-entropy.

use serde::Serialize;

use super::Text;

/// Cross-entropy (nats per character) on the validation split of count models fitted to the
/// training split: the floor a character model must clearly beat.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Baselines {
    /// Unigram: each byte's training frequency, add-one smoothed.
    pub unigram: f64,
    /// Bigram: the next byte's training frequency after the current one, add-one smoothed
    /// (a model of character pairs).
    pub bigram: f64,
}

/// The unigram and bigram baselines of `text` (add-one smoothing over the vocabulary); the bigram
/// scores every validation byte after the first.
pub fn baselines(text: &Text) -> Baselines {
    let v = text.vocab.len();
    let mut uni = vec![0f64; v];
    let mut bi = vec![0f64; v * v];
    for &t in &text.train {
        uni[t as usize] += 1.0;
    }
    for w in text.train.windows(2) {
        bi[w[0] as usize * v + w[1] as usize] += 1.0;
    }
    let total = text.train.len() as f64;
    let unigram = text
        .val
        .iter()
        .map(|&t| -((uni[t as usize] + 1.0) / (total + v as f64)).ln())
        .sum::<f64>()
        / text.val.len() as f64;
    let mut from = vec![0f64; v];
    for a in 0..v {
        from[a] = bi[a * v..(a + 1) * v].iter().sum();
    }
    let bigram = text
        .val
        .windows(2)
        .map(|w| {
            let (a, b) = (w[0] as usize, w[1] as usize);
            -((bi[a * v + b] + 1.0) / (from[a] + v as f64)).ln()
        })
        .sum::<f64>()
        / (text.val.len() - 1) as f64;
    Baselines { unigram, bigram }
}
