//! The device-runtime trait: the little a device must offer (memory, copies, launching an entry
//! point over descriptors) for [`crate::Device`] to run every optimizer operation on it.

use lpmm_optim::backend::BackendError;
use lpmm_optim::backend::Dtype;

use crate::abi::{Binding, Desc, Entry};

/// What the orchestration needs to know about a runtime's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Words of an arena (the buffers pieces are carved from): bounded by the largest buffer a
    /// launch can bind (wgpu's storage-binding limit); `None`: one exact allocation per piece
    /// group (CUDA, where launches address memory by pointer).
    pub arena_words: Option<usize>,
    /// Whether one launch may address several arenas (pointers) or binds one of each kind
    /// (wgpu): items that need different bindings then go in different launches.
    pub bindless: bool,
}

/// Which of the specialized steps ([`crate::plans`]) a runtime launches, and on what items.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Specialized {
    /// None: every step is the generic kernel's.
    None,
    /// Any item of a plan's parameters (its kernel handles partial threads and blocks).
    Any,
    /// Items whose every region and io address is a multiple of `bytes` (CUDA's 16-byte
    /// accesses). The device pads each element region of a piece to start at such an address;
    /// items of a caller's buffers that do not are stepped by the generic kernel.
    Aligned {
        /// The alignment in bytes.
        bytes: u64,
    },
}

/// Where a launch reads its inputs from and writes its outputs to.
#[derive(Debug)]
pub enum Io<'a, 'v, R: Runtime + ?Sized> {
    /// The runtime's staging buffer (host values uploaded into it, or read back from it), as f32.
    Staging(&'a R::Buffer),
    /// A caller's device buffer.
    View(R::View<'v>),
}

impl<R: Runtime + ?Sized> Clone for Io<'_, '_, R> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<R: Runtime + ?Sized> Copy for Io<'_, '_, R> {}

/// One launch: an entry over `descs`, with the buffers it binds (`'a`: the runtime's and the
/// orchestration's; `'v`: the caller's lent buffers).
#[derive(Debug)]
pub struct Launch<'a, 'v, R: Runtime + ?Sized> {
    /// Tiles (workgroups) in all.
    pub tiles: u32,
    /// The items (already in device layout; the runtime uploads them).
    pub descs: &'a [Desc],
    /// The arena the items' element regions are in (for runtimes that bind).
    pub arena: Option<&'a R::Buffer>,
    /// The arena of their tensor-wide regions (for runtimes that bind).
    pub wide: Option<&'a R::Buffer>,
    /// A lent parameter's buffer (for runtimes that bind).
    pub lent: Option<R::View<'v>>,
    /// Where inputs come from and outputs go.
    pub io: Io<'a, 'v, R>,
    /// The code-map table ([`crate::abi::map_table`]).
    pub maps: &'a R::Buffer,
    /// One word per parameter, set by the step where a non-finite value was met.
    pub flags: &'a R::Buffer,
    /// For [`Entry::Step`]: the specialized step to launch instead of the generic one (an index
    /// into [`crate::plans::plans`]; every item is of that plan). `None` for every other entry.
    pub plan: Option<usize>,
}

/// A device: memory in 32-bit words and kernel launches, in order (one stream or queue). Every
/// call may fail with a [`BackendError`]; [`BackendError::DeviceLost`] makes the backend refuse
/// every later call with the same error.
pub trait Runtime: Send + Sync + 'static {
    /// Device memory.
    type Buffer: Send + Sync + std::fmt::Debug;
    /// A caller's buffer (a framework's tensor), lent for one call.
    type View<'a>: Copy + Send + Sync + std::fmt::Debug;

    /// The backend's name ("wgpu", "cuda").
    fn name(&self) -> &'static str;
    /// Memory limits and addressing.
    fn limits(&self) -> Limits;
    /// `words` zeroed words.
    fn alloc(&self, words: usize) -> Result<Self::Buffer, BackendError>;
    /// The buffer's length in words.
    fn len(&self, buffer: &Self::Buffer) -> usize;
    /// Copies `data` to words `at ..` (enqueued in order with launches).
    fn write(&self, buffer: &Self::Buffer, at: usize, data: &[u32]) -> Result<(), BackendError>;
    /// Words `at .. at + len` (waits for everything enqueued before).
    fn read(&self, buffer: &Self::Buffer, at: usize, len: usize) -> Result<Vec<u32>, BackendError>;
    /// The address of word `word` of `buffer`, bound as `binding`, as descriptors carry it.
    fn address(&self, binding: Binding, buffer: &Self::Buffer, word: usize) -> u64;
    /// The element type and count of a caller's buffer.
    fn view_info(&self, view: &Self::View<'_>) -> (Dtype, usize);
    /// The same view for a shorter time (implementations return `view`: views are borrows).
    fn shorten<'a, 'b: 'a>(view: Self::View<'b>) -> Self::View<'a>;
    /// The address of word `word` of a lent parameter's buffer, as descriptors carry it.
    fn lent_address(&self, view: &Self::View<'_>, word: usize) -> u64;
    /// Where element `element` of the io binding is, as [`crate::abi::Desc::io`] carries it
    /// (staging holds f32; a view its own dtype).
    fn io_address(&self, io: &Io<'_, '_, Self>, element: usize) -> u64;
    /// The bytes of a caller's buffer (a lent parameter's values, for a checkpoint).
    fn read_view(&self, view: &Self::View<'_>) -> Result<Vec<u8>, BackendError>;
    /// Writes a caller's buffer (a lent parameter's values, from a checkpoint).
    fn write_view(&self, view: &Self::View<'_>, bytes: &[u8]) -> Result<(), BackendError>;
    /// Runs `entry` over the launch's items.
    fn launch(&self, entry: Entry, launch: &Launch<'_, '_, Self>) -> Result<(), BackendError>;
    /// Which specialized steps the runtime launches ([`Launch::plan`]); none unless it says so.
    fn specialized(&self) -> Specialized {
        Specialized::None
    }
}
