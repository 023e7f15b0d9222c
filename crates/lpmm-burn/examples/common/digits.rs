//! The handwritten digits (1797 8x8 images, the UCI set scikit-learn ships), gzipped in
//! lpmm-candle-examples' data, split as lpmm-candle splits them: sample `i` validates iff
//! `i % 5 == 0` (1437 to train, 360 to validate).

use std::io::Read;

const DIGITS_GZ: &[u8] = include_bytes!("../../../lpmm-candle-examples/data/digits.csv.gz");

/// The digits (pixels in [0, 1], labels 0..9).
#[derive(Debug, Clone)]
pub struct Digits {
    pub train_x: Vec<f32>,
    pub train_y: Vec<i64>,
    pub val_x: Vec<f32>,
    pub val_y: Vec<i64>,
}

pub fn digits() -> Digits {
    let mut text = String::new();
    flate2::read::GzDecoder::new(DIGITS_GZ)
        .read_to_string(&mut text)
        .expect("the embedded digits decompress");
    let mut d = Digits {
        train_x: Vec::new(),
        train_y: Vec::new(),
        val_x: Vec::new(),
        val_y: Vec::new(),
    };
    for (i, line) in text.lines().filter(|l| !l.is_empty()).enumerate() {
        let v: Vec<u32> = line
            .split(',')
            .map(|f| f.trim().parse().expect("a number"))
            .collect();
        let (x, y) = if i % 5 == 0 {
            (&mut d.val_x, &mut d.val_y)
        } else {
            (&mut d.train_x, &mut d.train_y)
        };
        x.extend(v[..64].iter().map(|&p| p as f32 / 16.0));
        y.push(v[64] as i64);
    }
    d
}

/// Peak (`VmHWM`) or current (`VmRSS`) resident memory of this process, KiB.
pub fn status_kib(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}
