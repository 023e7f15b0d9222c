//! The memory example's training, short: every optimizer trains on every backend (ndarray; burn's
//! wgpu device on lavapipe) and the report is complete. The measured table is the example's.

#[path = "../examples/memory.rs"]
#[allow(dead_code)]
mod memory;

#[test]
fn the_memory_example_trains_every_optimizer_on_every_backend() {
    for backend in ["ndarray", "wgpu"] {
        if let Err(e) = memory::device(backend) {
            if std::env::var("LPMM_REQUIRE_WGPU").is_ok_and(|v| v == "1") {
                panic!("LPMM_REQUIRE_WGPU=1 but {e}");
            }
            eprintln!("skipping {backend}: {e}");
            continue;
        }
        for opt in memory::OPTIMIZERS {
            let r = memory::train(backend, opt, 8, 64).unwrap();
            assert!(r.first_loss.is_finite() && r.last_loss.is_finite(), "{r:?}");
            if opt != "none" {
                assert!(r.last_loss < r.first_loss, "{r:?}");
            }
            assert_eq!(r.lpmm_bytes > 0, opt.starts_with("lpmm"), "{r:?}");
            assert!(r.peak_kib >= r.steady_kib && r.steady_kib > 0, "{r:?}");
        }
    }
}
