//! The process-memory probe of the README's main command, on a tiny model: every arm trains, and
//! what it accounts is what its storage says.

use lpmm_candle_examples::footprint::{self, ArmKind, ProbeShape};

#[test]
fn every_arm_trains_and_accounts_its_storage() {
    let shape = ProbeShape {
        width: 64,
        depth: 3,
        batch: 8,
        steps: 3,
    };
    let params = shape.params();
    assert_eq!(params, 3 * (64 * 64 + 64));
    for arm in footprint::arms() {
        let p = footprint::probe(&arm, &shape).unwrap();
        let name = arm.name;
        assert!(
            p.first_loss.is_finite() && p.last_loss.is_finite(),
            "{name}"
        );
        let (vars, optimizer) = match arm.kind {
            ArmKind::Floor => (0, 0),
            ArmKind::NoOptimizer | ArmKind::CandleSgd => (4 * params, 0),
            ArmKind::CandleAdamW => (4 * params, 8 * params),
            ArmKind::Lpmm(..) | ArmKind::LpmmLayers(..) => (p.candle_var_bytes, p.optimizer_bytes),
        };
        assert_eq!(
            (p.candle_var_bytes, p.optimizer_bytes),
            (vars, optimizer),
            "{name}"
        );
        match name {
            // bf16 Vars lent to lpmm: 2 bytes a parameter in candle, none in lpmm's parameter slot.
            "lpmm 8-bit AdamW, bf16 SR" | "lpmm 4-bit AdamW, bf16 SR, released" => {
                assert_eq!(p.candle_var_bytes, 2 * params, "{name}")
            }
            "lpmm f32 AdamW" => {
                assert_eq!(p.candle_var_bytes, 4 * params);
                // Two f32 moments; no parameter copy, no gradient accumulator.
                assert_eq!(p.optimizer_bytes, 8 * params);
            }
            "lpmm 4-bit AdamW, bf16 SR, released (lpmm layers)" => {
                // Each gradient is stepped in the backward pass: no accumulator, no Var.
                assert_eq!(p.candle_var_bytes, 0);
                // bf16 parameters (2 bytes) and 4-bit states (f32 for the small biases): under
                // 4 bytes a parameter, where a bf16 accumulator would add 2 more.
                assert!(p.optimizer_bytes > 2 * params && p.optimizer_bytes < 4 * params);
            }
            "LPMM-SGDM (lpmm layers)" => {
                assert_eq!(p.candle_var_bytes, 0);
                // Parameter, accumulator and momentum in 8 bits with a scale per 64.
                assert_eq!(p.optimizer_bytes, 3 * (params + 4 * params / 64));
            }
            _ => {}
        }
        if cfg!(target_os = "linux") {
            assert!(p.peak_rss >= p.steady_rss && p.steady_rss > 0, "{name}");
            assert!(p.live_rss > 0 && p.live_rss <= p.peak_rss, "{name}");
        }
    }
}
