//! Code maps against the reference table and against their own snapshots.

use lpmm_formats::CodeMap;

/// `shared/spec/dynamic-map-8bit.tsv`: bitsandbytes 0.50.2's 8-bit dynamic maps as torch computes
/// them, with their f32 bit patterns.
const TABLE: &str = include_str!("data/dynamic-map-8bit.tsv");

fn reference_column(column: usize) -> Vec<u32> {
    TABLE
        .lines()
        .filter(|l| !l.starts_with('#') && !l.starts_with("index"))
        .map(|l| {
            let hex = l.split('\t').nth(column).expect("column");
            u32::from_str_radix(hex, 16).expect("hex")
        })
        .collect()
}

#[test]
fn dynamic_8bit_maps_equal_the_reference_table_bit_for_bit() {
    for (signed, column) in [(true, 2), (false, 4)] {
        let want = reference_column(column);
        assert_eq!(want.len(), 256);
        let got: Vec<u32> = CodeMap::dynamic(signed, 8)
            .unwrap()
            .values()
            .iter()
            .map(|v| v.to_bits())
            .collect();
        let diffs: Vec<String> = want
            .iter()
            .zip(&got)
            .enumerate()
            .filter(|(_, (w, g))| w != g)
            .map(|(i, (w, g))| format!("{i}: want {w:08x} got {g:08x}"))
            .collect();
        assert!(
            diffs.is_empty(),
            "signed={signed}: {} differ:\n{}",
            diffs.len(),
            diffs.join("\n")
        );
    }
}

fn hex_listing(map: &CodeMap) -> String {
    map.values()
        .iter()
        .enumerate()
        .map(|(i, v)| format!("{i:3} {:08x} {v:e}\n", v.to_bits()))
        .collect()
}

/// Every map at every width its construction allows, as f32 bit patterns. A change to any
/// construction shows up as a snapshot diff (`cargo insta review`).
#[test]
fn every_code_map_snapshot() {
    type Build = fn(u32) -> Result<CodeMap, lpmm_formats::FormatError>;
    let constructions: [(&str, Build); 6] = [
        ("dynamic_signed", |b| CodeMap::dynamic(true, b)),
        ("dynamic_unsigned", |b| CodeMap::dynamic(false, b)),
        ("linear_signed", CodeMap::linear_signed),
        ("linear_unsigned", CodeMap::linear_unsigned),
        ("linear_without_zero", CodeMap::linear_without_zero),
        ("normal_float", CodeMap::normal_float),
    ];
    for (name, build) in constructions {
        for bits in 1..=8 {
            match build(bits) {
                Ok(map) => {
                    assert_eq!(map.bits(), bits);
                    insta::assert_snapshot!(format!("{name}_{bits}"), hex_listing(&map));
                }
                // Only the signed linear map has no 1-bit form.
                Err(e) => assert!(name == "linear_signed" && bits == 1, "{name} {bits}: {e}"),
            }
        }
    }
}

#[test]
fn full_width_maps_use_every_code() {
    for bits in 1..=8 {
        assert_eq!(CodeMap::dynamic(true, bits).unwrap().len(), 1 << bits);
        assert_eq!(CodeMap::dynamic(false, bits).unwrap().len(), 1 << bits);
        assert_eq!(CodeMap::normal_float(bits).unwrap().len(), 1 << bits);
        assert_eq!(CodeMap::linear_without_zero(bits).unwrap().len(), 1 << bits);
    }
}
