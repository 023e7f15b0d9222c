//! Block-wise quantization against golden/bnb_blockwise.safetensors: bitsandbytes 0.50.2's 8-bit
//! dynamic maps, inputs of six distributions, and for every block size 64..=4096 the exact
//! nearest codes and absmax (made by golden/gen_bnb_blockwise.py, which also shows that every
//! disagreement of bitsandbytes' own inexact CPU quantizer lies within 2^-16 of a code midpoint).

use lpmm_formats::CodeMap;
use lpmm_quant::{BlockSize, Blockwise, QuantRounding};
use safetensors::SafeTensors;

const FILE: &[u8] = include_bytes!("golden/bnb_blockwise.safetensors");
const INPUTS: [&str; 6] = ["normal", "heavy", "tiny", "zeros", "ragged", "ties"];

fn f32s(st: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    t.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn codes_and_absmax_equal_the_golden_files() {
    let st = SafeTensors::deserialize(FILE).expect("golden file parses");
    let mut cases = 0;
    for (signed, m) in [(true, "signed"), (false, "unsigned")] {
        let map = CodeMap::dynamic(signed, 8).unwrap();
        let golden_map: Vec<u32> = f32s(&st, &format!("map.{m}"))
            .iter()
            .map(|v| v.to_bits())
            .collect();
        let ours: Vec<u32> = map.values().iter().map(|v| v.to_bits()).collect();
        assert_eq!(ours, golden_map, "{m} map");
        for d in INPUTS {
            let mut x = f32s(&st, &format!("input.{d}"));
            if !signed {
                x.iter_mut().for_each(|v| *v = v.abs());
            }
            for block in [64usize, 128, 256, 512, 1024, 2048, 4096] {
                let key = format!("{d}.{m}.{block}");
                let q = Blockwise::new(&map, BlockSize::new(block).unwrap());
                let mut codes = vec![0u8; q.codes_len(x.len())];
                let mut absmax = vec![0f32; q.scales_len(x.len())];
                q.quantize(&x, &mut codes, &mut absmax, QuantRounding::Nearest)
                    .unwrap();
                let want_codes = st.tensor(&format!("codes.{key}")).unwrap().data().to_vec();
                let want_absmax = f32s(&st, &format!("absmax.{key}"));
                let bad: Vec<usize> = (0..x.len())
                    .filter(|&i| codes[i] != want_codes[i])
                    .collect();
                assert!(
                    bad.is_empty(),
                    "{key}: {} codes differ, first at {} (x={:e}): want {} got {}",
                    bad.len(),
                    bad[0],
                    x[bad[0]],
                    want_codes[bad[0]],
                    codes[bad[0]]
                );
                let ab: Vec<u32> = absmax.iter().map(|v| v.to_bits()).collect();
                let wb: Vec<u32> = want_absmax.iter().map(|v| v.to_bits()).collect();
                assert_eq!(ab, wb, "{key} absmax");
                cases += 1;
            }
        }
    }
    assert_eq!(cases, 2 * INPUTS.len() * 7);
}
