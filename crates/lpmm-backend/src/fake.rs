//! A runtime for the crate's unit tests: memory on the host, every launch recorded with its
//! descriptors and bindings. No kernel runs; a launch has only the effects a test asks for
//! ([`Host::decode_keys`], [`Host::flag_entry`]), so that what the orchestration does around the
//! kernels — memory, descriptors, batching, checks — is what is under test.

use std::sync::Mutex;

use lpmm_optim::backend::{
    BackendError, Dtype, ParamId, ParamLayout, ParamStep, RuleState, StepFlags, StepPlan,
};
use lpmm_optim::{Optimizer, OptimizerOptions, ParamConfig, presets};

use crate::abi::{Binding, Desc, Entry};
use crate::device::{Device, DeviceOptions};
use crate::runtime::{Io, Launch, Limits, Runtime, Specialized};

/// A caller's buffer: no values, an identity, its element type and count, and the byte its first
/// element is at (a tensor that is a slice of a larger buffer starts anywhere): its address is
/// `id << 48 | at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct View {
    pub(crate) id: u64,
    pub(crate) dtype: Dtype,
    pub(crate) len: usize,
    pub(crate) at: u64,
}

impl View {
    pub(crate) fn new(id: u64, dtype: Dtype, len: usize) -> Self {
        assert!(id > 0, "views are numbered from 1");
        View {
            id,
            dtype,
            len,
            at: 0,
        }
    }
}

/// A buffer: an index into [`Host::memory`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Buf(pub(crate) usize);

/// One recorded launch.
#[derive(Debug, Clone)]
pub(crate) struct Recorded {
    pub(crate) entry: Entry,
    pub(crate) tiles: u32,
    pub(crate) descs: Vec<Desc>,
    /// The bound arena's buffer.
    pub(crate) arena: Option<usize>,
    /// The io binding: `None` for the staging buffer, else the caller's buffer.
    pub(crate) io: Option<View>,
    pub(crate) plan: Option<usize>,
}

/// Host memory and recorded launches.
#[derive(Debug)]
pub(crate) struct Host {
    pub(crate) limits: Limits,
    pub(crate) specialized: Specialized,
    /// Launches of this entry set the flag word `flag_index` of each of their items (a
    /// non-finite value met, a value over the limit).
    pub(crate) flag_entry: Option<Entry>,
    /// `Decode` launches into staging write `key + j` as element `j` of each item.
    pub(crate) decode_keys: bool,
    pub(crate) memory: Mutex<Vec<Vec<u32>>>,
    pub(crate) launches: Mutex<Vec<Recorded>>,
}

impl Host {
    /// Launches that address memory by pointer, one exact allocation per reservation.
    pub(crate) fn bindless() -> Self {
        Self::with_limits(Limits {
            arena_words: None,
            bindless: true,
        })
    }

    /// Launches that bind one arena of each kind, arenas of `words` words.
    pub(crate) fn binding(words: usize) -> Self {
        Self::with_limits(Limits {
            arena_words: Some(words),
            bindless: false,
        })
    }

    fn with_limits(limits: Limits) -> Self {
        Host {
            limits,
            specialized: Specialized::None,
            flag_entry: None,
            decode_keys: false,
            memory: Mutex::new(Vec::new()),
            launches: Mutex::new(Vec::new()),
        }
    }

    /// The launches so far.
    pub(crate) fn launches(&self) -> Vec<Recorded> {
        self.launches.lock().unwrap().clone()
    }

    /// The words of buffer `b`.
    pub(crate) fn words(&self, b: usize) -> Vec<u32> {
        self.memory.lock().unwrap()[b].clone()
    }

    /// Buffer and word of a device address (as [`Runtime::address`] makes them).
    pub(crate) fn at(address: u64) -> (usize, usize) {
        assert!(address >> 48 == 0, "not a buffer address: {address:#x}");
        (
            (address >> 32) as usize - 1,
            (address & 0xffff_ffff) as usize / 4,
        )
    }
}

fn bytes_of(dtype: Dtype) -> u64 {
    match dtype {
        Dtype::F32 | Dtype::U32 => 4,
        Dtype::Bf16 | Dtype::U16 => 2,
        Dtype::U8 => 1,
    }
}

impl Runtime for Host {
    type Buffer = Buf;
    type View<'a> = View;

    fn name(&self) -> &'static str {
        "host"
    }

    fn limits(&self) -> Limits {
        self.limits
    }

    fn alloc(&self, words: usize) -> Result<Buf, BackendError> {
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

    /// Buffer `b` at `(b + 1) << 32`, in bytes.
    fn address(&self, _: Binding, b: &Buf, word: usize) -> u64 {
        ((b.0 as u64 + 1) << 32) | (4 * word as u64)
    }

    fn view_info(&self, v: &View) -> (Dtype, usize) {
        (v.dtype, v.len)
    }

    fn shorten<'a, 'b: 'a>(v: View) -> View {
        v
    }

    /// View `id` at `id << 48 | at`, in bytes.
    fn lent_address(&self, v: &View, word: usize) -> u64 {
        (v.id << 48) + v.at + 4 * word as u64
    }

    fn io_address(&self, io: &Io<'_, '_, Self>, element: usize) -> u64 {
        match io {
            Io::Staging(b) => self.address(Binding::Arena, b, element),
            Io::View(v) => (v.id << 48) + v.at + bytes_of(v.dtype) * element as u64,
        }
    }

    fn read_view(&self, v: &View) -> Result<Vec<u8>, BackendError> {
        Ok(vec![0; (bytes_of(v.dtype) as usize) * v.len])
    }

    fn write_view(&self, _: &View, _: &[u8]) -> Result<(), BackendError> {
        Ok(())
    }

    fn launch(&self, entry: Entry, launch: &Launch<'_, '_, Self>) -> Result<(), BackendError> {
        let io = match launch.io {
            Io::Staging(b) => {
                if entry == Entry::Decode && self.decode_keys {
                    let mut m = self.memory.lock().unwrap();
                    for d in launch.descs {
                        let (buf, word) = Host::at(d.io);
                        assert_eq!(buf, b.0, "the item's io is in the bound staging buffer");
                        for j in 0..d.len as usize {
                            m[buf][word + j] = ((d.key as usize + j) as f32).to_bits();
                        }
                    }
                }
                None
            }
            Io::View(v) => Some(v),
        };
        if self.flag_entry == Some(entry) {
            let mut m = self.memory.lock().unwrap();
            for d in launch.descs {
                m[launch.flags.0][d.flag_index as usize] = 1;
            }
        }
        self.launches.lock().unwrap().push(Recorded {
            entry,
            tiles: launch.tiles,
            descs: launch.descs.to_vec(),
            arena: launch.arena.map(|b| b.0),
            io,
            plan: launch.plan,
        });
        Ok(())
    }

    fn specialized(&self) -> Specialized {
        self.specialized
    }
}

/// A device on `host` with `piece` elements per piece and `io` floats of staging.
pub(crate) fn device(host: Host, piece: usize, io: usize) -> Device<Host> {
    Device::new(host, DeviceOptions::new(piece, io)).unwrap()
}

/// The layout of a parameter of `shape` with `config` (as the optimizer resolves it).
pub(crate) fn layout(config: ParamConfig, shape: &[usize], lent: bool) -> ParamLayout {
    let numel = shape.iter().product();
    ParamLayout {
        shape: shape.to_vec(),
        numel,
        formats: config.resolve(numel, shape).formats(),
        stream: 3,
        offset: 0,
        lent,
    }
}

/// The plan of the first step of a parameter of `layout` with `config` (moving the parameter).
pub(crate) fn plan(config: &ParamConfig, layout: &ParamLayout) -> ParamStep {
    let hyper = config.resolve(layout.numel, &layout.shape).hyper;
    let rule = hyper.consts(1, &RuleState::default());
    ParamStep {
        plan: StepPlan::new(layout, &rule),
        t: 1,
        flags: StepFlags(StepFlags::FIRST | StepFlags::UPDATE_PARAM),
        rule,
        clip: 1.0,
    }
}

/// The ids of parameters `0 .. n` (only an optimizer makes them).
pub(crate) fn ids(n: usize) -> Vec<ParamId> {
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    opt.add_group(presets::adamw_f32(1e-3)).unwrap();
    (0..n)
        .map(|k| opt.add_param(&format!("p{k}"), &[1], &[0.0], 0).unwrap())
        .collect()
}
