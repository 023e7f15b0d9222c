//! The code-map table the kernels read (`abi::map_table`) gives, searched as the kernels search
//! it (kernels/maps.{cuh,wgsl} `map_nearest`: the bucket's count, then the scan), the CPU's
//! `CodeMap::nearest` for every map.

use lpmm_backend::abi::{
    MAP_BUCKET_WORDS, MAP_BUCKETS, MAP_KEY_WORDS, MAP_KEYS, MAP_LENS, MAP_SCANS, MAP_STRIDE,
    map_table,
};
use lpmm_optim::MapKind;

/// `map_nearest` of the kernels, step for step, over the table.
fn kernel_nearest(table: &[u32], map: u32, y: f32) -> u32 {
    if y.is_nan() {
        return 0;
    }
    let b = y.to_bits() >> lpmm_formats::CodeMap::BUCKET_SHIFT;
    let word = table[(MAP_BUCKETS + MAP_BUCKET_WORDS * map + b / 4) as usize];
    let mut c = (word >> (8 * (b % 4))) & 0xFF;
    let last = table[(MAP_LENS + map) as usize] - 1;
    let base = MAP_STRIDE * map + 256;
    for _ in 0..table[(MAP_SCANS + map) as usize] {
        if c < last && f32::from_bits(table[(base + c) as usize]) <= y {
            c += 1;
        }
    }
    c
}

#[test]
fn the_kernels_search_of_the_table_is_the_cpus_nearest() {
    let table = map_table();
    // The bucket tables, then the key tables (the specialized steps' search).
    assert_eq!(
        MAP_KEYS,
        MAP_BUCKETS + MapKind::ALL.len() as u32 * MAP_BUCKET_WORDS
    );
    assert_eq!(
        table.len(),
        (MAP_KEYS + MapKind::ALL.len() as u32 * MAP_KEY_WORDS) as usize
    );
    use rand_core::{Rng as _, SeedableRng};
    let mut rng = rand_xoshiro::SplitMix64::seed_from_u64(0x9E37_79B9_7F4A_7C15);
    let mut next = move || rng.next_u64();
    for kind in MapKind::ALL {
        let map = kind.shared();
        let id = kind.id();
        assert!(table[(MAP_SCANS + id) as usize] >= 1, "{kind:?}: a scan");
        // Every threshold, its neighbours and the values; then random bit patterns and
        // random values inside [-1, 1].
        let mut ys: Vec<f32> = Vec::new();
        for &t in map.thresholds().iter().chain(map.values()) {
            let b = t.to_bits();
            ys.extend([
                t,
                f32::from_bits(b.wrapping_sub(1)),
                f32::from_bits(b + 1),
                -t,
            ]);
        }
        ys.extend([
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MIN_POSITIVE,
        ]);
        for _ in 0..200_000 {
            let r = next();
            ys.push(f32::from_bits(r as u32));
            ys.push((r >> 40) as f32 / (1u64 << 23) as f32 - 1.0);
        }
        for y in ys {
            assert_eq!(
                kernel_nearest(&table, id, y),
                u32::from(map.nearest(y)),
                "{kind:?}: y = {y:e} ({:#010x})",
                y.to_bits()
            );
        }
    }
}
