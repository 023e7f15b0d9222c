//! Device errors through the device-runtime trait: a runtime that fails where a test says comes
//! back as a typed error from the optimizer's calls, a lost device fails every later call the
//! same way, and nothing panics. The runtime here holds memory on the host and runs no kernels:
//! only the orchestration's error paths are under test (numerics: the conformance suites of
//! lpmm-wgpu and lpmm-cuda).

use lpmm_optim::Checkpoint;
use lpmm_optim::{Parts, SlotKind};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use lpmm_backend::abi::{Binding, Entry};
use lpmm_backend::{Device, DeviceOptions, Io, Launch, Limits, Runtime};
use lpmm_optim::backend::Dtype;
use lpmm_optim::{OptimError, Optimizer, OptimizerOptions, backend::BackendError, presets};

/// Host memory and launches that do nothing, failing on request.
#[derive(Debug, Default)]
struct Faulty {
    /// Launches of this entry fail with a lost device from the `after`-th on.
    lose_at: Option<(Entry, usize)>,
    /// Allocations above this many words fail for lack of memory.
    max_words: Option<usize>,
    launches: AtomicUsize,
    memory: Mutex<Vec<Vec<u32>>>,
}

#[derive(Debug)]
struct Buf(usize);

impl Runtime for Faulty {
    type Buffer = Buf;
    type View<'a> = &'a [f32];

    fn name(&self) -> &'static str {
        "faulty"
    }

    fn limits(&self) -> Limits {
        Limits {
            arena_words: None,
            bindless: true,
        }
    }

    fn alloc(&self, words: usize) -> Result<Buf, BackendError> {
        if self.max_words.is_some_and(|m| words > m) {
            return Err(BackendError::OutOfMemory {
                backend: "faulty",
                bytes: 4 * words as u64,
            });
        }
        let mut m = self.memory.lock().unwrap();
        m.push(vec![0; words]);
        Ok(Buf(m.len() - 1))
    }

    fn len(&self, b: &Buf) -> usize {
        self.memory.lock().unwrap()[b.0].len()
    }

    fn write(&self, b: &Buf, at: usize, data: &[u32]) -> Result<(), BackendError> {
        self.memory.lock().unwrap()[b.0][at..at + data.len()].copy_from_slice(data);
        Ok(())
    }

    fn read(&self, b: &Buf, at: usize, len: usize) -> Result<Vec<u32>, BackendError> {
        Ok(self.memory.lock().unwrap()[b.0][at..at + len].to_vec())
    }

    fn address(&self, _: Binding, b: &Buf, word: usize) -> u64 {
        (b.0 as u64) << 40 | word as u64
    }

    fn view_info(&self, v: &&[f32]) -> (Dtype, usize) {
        (Dtype::F32, v.len())
    }

    fn shorten<'a, 'b: 'a>(v: &'b [f32]) -> &'a [f32] {
        v
    }

    fn lent_address(&self, _: &&[f32], word: usize) -> u64 {
        word as u64
    }

    fn io_address(&self, _: &Io<'_, '_, Self>, element: usize) -> u64 {
        element as u64
    }

    fn read_view(&self, v: &&[f32]) -> Result<Vec<u8>, BackendError> {
        Ok(bytemuck::cast_slice(v).to_vec())
    }

    fn write_view(&self, _: &&[f32], _: &[u8]) -> Result<(), BackendError> {
        Ok(())
    }

    fn launch(&self, entry: Entry, _: &Launch<'_, '_, Self>) -> Result<(), BackendError> {
        let n = self.launches.fetch_add(1, Ordering::Relaxed);
        match self.lose_at {
            Some((e, after)) if e == entry && n >= after => Err(BackendError::DeviceLost {
                backend: "faulty",
                reason: "injected".into(),
            }),
            _ => Ok(()),
        }
    }
}

fn optimizer(runtime: Faulty) -> Optimizer<Device<Faulty>> {
    let options = DeviceOptions::default()
        .with_piece_elements(1 << 20)
        .with_io_floats(1 << 20);
    let device = Device::new(runtime, options).unwrap();
    let mut opt = Optimizer::with_backend(device, OptimizerOptions::default()).unwrap();
    opt.add_group(presets::adamw_8bit_bf16(1e-3)).unwrap();
    opt
}

fn lost(e: &OptimError) -> bool {
    matches!(e, OptimError::Backend(BackendError::DeviceLost { reason, .. }) if reason == "injected")
}

#[test]
fn a_device_lost_in_a_step_is_a_typed_error_and_stays_lost() {
    let mut opt = optimizer(Faulty {
        lose_at: Some((Entry::Step, 0)),
        ..Faulty::default()
    });
    let w = opt.add_param("w", &[5000], &vec![0.1; 5000], 0).unwrap();
    opt.accumulate(w, &vec![0.01; 5000]).unwrap();
    let err = opt.step(lpmm_optim::Accumulated).unwrap_err();
    assert!(lost(&err), "{err}");
    // Every later call fails the same way, and none panics.
    assert!(lost(&opt.accumulate(w, &vec![0.01; 5000]).unwrap_err()));
    assert!(lost(&opt.step(lpmm_optim::Accumulated).unwrap_err()));
    assert!(lost(
        &opt.read(w, SlotKind::Param, &mut vec![0.0; 5000])
            .unwrap_err()
    ));
    assert!(lost(
        &opt.step(lpmm_optim::Step::param(w, &vec![0.01; 5000]))
            .unwrap_err()
    ));
    assert!(lost(&Parts::of(&opt).canonical(None).unwrap_err()));
    assert!(lost(&opt.add_param("v", &[10], &[0.0; 10], 0).unwrap_err()));
    let tmp = lpmm_optim::testing::temp_dir("lpmm-backend-errors-");
    let dir = tmp.path();
    assert!(lost(
        &opt.save(dir.join("c.safetensors"), Checkpoint::new())
            .unwrap_err()
    ));
    assert!(
        !dir.join("c.safetensors").exists(),
        "no file from a failed save"
    );
}

#[test]
fn running_out_of_memory_names_the_size() {
    let mut opt = optimizer(Faulty {
        max_words: Some(1 << 20),
        ..Faulty::default()
    });
    // Fits.
    opt.add_param("small", &[1000], &vec![0.1; 1000], 0)
        .unwrap();
    // A piece of 2^20 elements of bf16 parameters, gradients and 8-bit states: over 2^20 words.
    let n = 1 << 21;
    let err = opt.add_param("big", &[n], &vec![0.1; n], 0).unwrap_err();
    assert!(
        matches!(err, OptimError::Backend(BackendError::OutOfMemory { bytes, .. }) if bytes > 4 << 20),
        "{err}"
    );
    // Not lost: the optimizer goes on.
    let id = opt.param("small").map(|p| p.id).unwrap();
    opt.accumulate(id, &[0.01; 1000]).unwrap();
    opt.step(lpmm_optim::Accumulated).unwrap();
}
