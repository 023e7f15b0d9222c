//! [`Collective`] over MPI (feature `mpi`): [`Mpi`], a communicator of the `mpi` crate (rsmpi)
//! driving `MPI_Allreduce`, `MPI_Reduce_scatter`, `MPI_Allgatherv` and `MPI_Alltoallv`.
//!
//! ```no_run
//! use lpmm_dist::{Collective, Mpi};
//!
//! // MPI_Init; MPI_Finalize when `_universe` is dropped (bind it to a name: `_` drops it at once).
//! let (comm, _universe) = Mpi::init()?;
//! let mut grad = vec![1.0f32; 4];
//! comm.all_reduce_sum_f32(&mut grad)?;
//! assert_eq!(grad[0], comm.world() as f32);
//! # Ok::<(), lpmm_dist::DistError>(())
//! ```
//!
//! Arguments are checked before any data moves. By default ([`Mpi::verify`] on) the ranks also
//! agree on them first, with one small extra `MPI_Allreduce` per call: when any rank's buffers
//! do not match its counts, or the ranks disagree on the counts (or on which collective they are
//! in), every rank returns [`DistError::Collective`] and the group stays usable. Without the
//! agreement step a rank whose own arguments are wrong returns the error alone, and the others
//! wait for it in the collective, as with any mismatched MPI call.
//!
//! MPI counts are C `int`s: buffers beyond `i32::MAX` elements (or smaller, see
//! [`Mpi::max_count`]) are moved in rounds of the same collective, each within the limit.

use std::fmt;

use mpi::collective::SystemOperation;
use mpi::datatype::{Partition, PartitionMut};
use mpi::environment::{Threading, Universe};
use mpi::topology::SimpleCommunicator;
use mpi::traits::{AsRaw, Communicator, CommunicatorCollectives, Equivalence};

use crate::DistError;
use crate::collective::Collective;

/// The most elements one MPI call moves: MPI counts and displacements are C `int`s.
const MPI_MAX_COUNT: usize = i32::MAX as usize;
/// The in-place all-reduce goes through a staging copy (rsmpi exposes no `MPI_IN_PLACE`) of at
/// most this many elements at a time (64 MiB of `f32`).
const STAGE: usize = 1 << 24;

/// A group of MPI ranks: a communicator and the checks around its collectives.
pub struct Mpi {
    comm: SimpleCommunicator,
    rank: usize,
    world: usize,
    verify: bool,
    max_count: usize,
}

impl fmt::Debug for Mpi {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mpi")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("verify", &self.verify)
            .field("max_count", &self.max_count)
            .finish_non_exhaustive()
    }
}

impl Mpi {
    /// Initialises MPI (`MPI_Init_thread`, `MPI_THREAD_FUNNELED`: other threads may exist, but
    /// only the one that initialised MPI calls it) and returns the group of every
    /// process (`MPI_COMM_WORLD`) with the [`Universe`] whose drop calls `MPI_Finalize`. Keep the
    /// universe alive (a named binding such as `_universe`, not `_`) as long as any [`Mpi`] is in
    /// use, and drop it last.
    pub fn init() -> Result<(Mpi, Universe), DistError> {
        let Some((universe, _)) = mpi::initialize_with_threading(Threading::Funneled) else {
            return Err(DistError::Collective(
                "MPI is already initialised (or finalised): use Mpi::from_communicator".into(),
            ));
        };
        let comm = Mpi::from_communicator(universe.world())?;
        Ok((comm, universe))
    }

    /// The group of an existing intra-communicator (e.g. `universe.world()`, or a
    /// `duplicate()` or split of it to keep this group's messages apart from others'). A
    /// user-created communicator is freed when the [`Mpi`] is dropped, which must happen before
    /// `MPI_Finalize`.
    pub fn from_communicator(comm: SimpleCommunicator) -> Result<Mpi, DistError> {
        let rank = usize::try_from(comm.rank()).map_err(|_| {
            DistError::Collective("MPI: this process is not in the communicator".into())
        })?;
        let world = usize::try_from(comm.size())
            .map_err(|_| DistError::Collective("MPI: negative communicator size".into()))?;
        Ok(Mpi {
            comm,
            rank,
            world,
            verify: true,
            max_count: MPI_MAX_COUNT,
        })
    }

    /// Whether every collective first checks, on every rank, that all ranks' arguments are
    /// valid and consistent (one extra all-reduce of three integers; default on). Every rank of
    /// the group must use the same setting.
    pub fn verify(mut self, on: bool) -> Mpi {
        self.verify = on;
        self
    }

    /// The most elements one MPI call may move or reduce (default and upper bound `i32::MAX`);
    /// larger collectives are split into rounds (of at least one element per rank). Small values
    /// exercise the rounds in tests.
    /// Every rank of the group must use the same value.
    pub fn max_count(mut self, elements: usize) -> Mpi {
        self.max_count = elements.clamp(1, MPI_MAX_COUNT);
        self
    }

    /// The underlying communicator (for other MPI calls, e.g. broadcasting an NCCL unique id).
    pub fn communicator(&self) -> &SimpleCommunicator {
        &self.comm
    }

    /// Elements per block per round when each of the `world` blocks of a round gets at most this
    /// many: a round then moves at most `max_count` elements in all.
    fn round_len(&self) -> usize {
        (self.max_count / self.world).max(1)
    }

    /// Checks this rank's arguments (`local_ok`) and, with [`Mpi::verify`], agrees with the
    /// other ranks that everyone's are valid and that all describe the same call (`op` and
    /// `shape`, e.g. the counts). On failure every rank returns an error.
    fn agree(
        &self,
        what: &'static str,
        op: u64,
        shape: &[usize],
        local_ok: bool,
    ) -> Result<(), DistError> {
        let own = || {
            DistError::Collective(format!(
                "{what}: buffer lengths do not match the counts (rank {})",
                self.rank
            ))
        };
        if !self.verify {
            return if local_ok { Ok(()) } else { Err(own()) };
        }
        let h = fingerprint(op, shape);
        // MAX of (h, -h) gives (max h, -min h): equal fingerprints iff max h == min h.
        let mine = [h, -h, i64::from(!local_ok)];
        let mut all = [0i64; 3];
        self.comm
            .all_reduce_into(&mine[..], &mut all[..], SystemOperation::max());
        if !local_ok {
            Err(own())
        } else if all[2] != 0 {
            Err(DistError::Collective(format!(
                "{what}: another rank's buffer lengths do not match its counts"
            )))
        } else if all[0] != -all[1] {
            Err(DistError::Collective(format!(
                "{what}: the ranks disagree on the counts (or are in different collectives)"
            )))
        } else {
            Ok(())
        }
    }

    /// `MPI_Allreduce` (sum) of `buf` in place, in staged chunks.
    fn all_reduce_sum<T: Equivalence + Copy>(&self, buf: &mut [T]) {
        let chunk = self.max_count.min(STAGE);
        let mut stage = Vec::with_capacity(buf.len().min(chunk));
        for part in buf.chunks_mut(chunk) {
            stage.clear();
            stage.extend_from_slice(part);
            self.comm
                .all_reduce_into(&stage[..], part, SystemOperation::sum());
        }
    }

    /// One `MPI_Reduce_scatter` (sum) with `counts` within the C `int` range.
    fn reduce_scatter_raw(
        &self,
        send: &[f32],
        recv: &mut [f32],
        counts: &[usize],
    ) -> Result<(), DistError> {
        let counts = ints(counts)?;
        debug_assert_eq!(recv.len(), counts[self.rank] as usize);
        let mut pads = [0.0f32; 2];
        let (send, recv) = not_dangling(send, recv, &mut pads);
        // SAFETY: `send` holds `counts.sum()` f32 and `recv` `counts[rank]` (checked by the
        // callers), both live for the call; `counts` has one entry per rank of `comm`; the
        // datatype is MPI_FLOAT for f32 and the operation the built-in MPI_SUM. MPI reads `send`
        // and writes only `recv`, which do not overlap (`&` and `&mut`).
        let rc = unsafe {
            mpi::ffi::MPI_Reduce_scatter(
                send.as_ptr().cast(),
                recv.as_mut_ptr().cast(),
                counts.as_ptr(),
                f32::equivalent_datatype().as_raw(),
                SystemOperation::sum().as_raw(),
                self.comm.as_raw(),
            )
        };
        if rc == mpi::ffi::MPI_SUCCESS as i32 {
            Ok(())
        } else {
            Err(DistError::Collective(format!(
                "MPI_Reduce_scatter failed (error code {rc})"
            )))
        }
    }

    /// One `MPI_Allgatherv`, counts and displacements within the C `int` range.
    fn gatherv<T: Equivalence + Copy + Default>(
        &self,
        send: &[T],
        recv: &mut [T],
        c: Vec<i32>,
        d: Vec<i32>,
    ) {
        let mut pads = [T::default(); 2];
        let (send, recv) = not_dangling(send, recv, &mut pads);
        self.comm
            .all_gather_varcount_into(send, &mut PartitionMut::new(recv, c, d));
    }

    /// One `MPI_Alltoallv`, counts and displacements within the C `int` range.
    fn alltoallv(
        &self,
        send: &[f32],
        sc: Vec<i32>,
        sd: Vec<i32>,
        recv: &mut [f32],
        rc: Vec<i32>,
        rd: Vec<i32>,
    ) {
        let mut pads = [0.0f32; 2];
        let (send, recv) = not_dangling(send, recv, &mut pads);
        self.comm.all_to_all_varcount_into(
            &Partition::new(send, sc, sd),
            &mut PartitionMut::new(recv, rc, rd),
        );
    }

    /// `MPI_Allgatherv` of this rank's `send` into `recv` (blocks in rank order).
    fn all_gather<T: Equivalence + Copy + Default>(
        &self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
    ) -> Result<(), DistError> {
        let total: usize = counts.iter().sum();
        if total <= self.max_count {
            let c = ints(counts)?;
            let d = ints(&offsets(counts))?;
            self.gatherv(send, recv, c, d);
            return Ok(());
        }
        // Rounds: round k gathers elements [k L, (k + 1) L) of every rank's block.
        let l = self.round_len();
        let offs = offsets(counts);
        let rounds = counts.iter().max().map_or(0, |&m| m.div_ceil(l));
        let mut stage = Vec::new();
        for k in 0..rounds {
            let part: Vec<usize> = counts.iter().map(|&c| piece(c, k, l)).collect();
            let mine = block(send, 0, k * l, part[self.rank]);
            stage.clear();
            stage.resize(part.iter().sum(), T::default());
            let (c, d) = (ints(&part)?, ints(&offsets(&part))?);
            self.gatherv(mine, &mut stage, c, d);
            let mut at = 0;
            for (&o, &n) in offs.iter().zip(&part) {
                block_mut(recv, o, k * l, n).copy_from_slice(&stage[at..at + n]);
                at += n;
            }
        }
        Ok(())
    }
}

/// `send` and `recv`, an empty one replaced by an empty slice of `pads`: the pointer of an empty
/// slice may be any non-null address, e.g. 1 for bytes, which is Open MPI's `MPI_IN_PLACE`.
fn not_dangling<'a, T>(
    send: &'a [T],
    recv: &'a mut [T],
    pads: &'a mut [T; 2],
) -> (&'a [T], &'a mut [T]) {
    let (ps, pr) = pads.split_at_mut(1);
    let send = if send.is_empty() { &ps[..0] } else { send };
    let recv = if recv.is_empty() { &mut pr[..0] } else { recv };
    (send, recv)
}

/// The `n` elements at `start + skip` of `buf` (none when `n` is 0, wherever that is).
fn block<T>(buf: &[T], start: usize, skip: usize, n: usize) -> &[T] {
    if n == 0 {
        &[]
    } else {
        &buf[start + skip..][..n]
    }
}

fn block_mut<T>(buf: &mut [T], start: usize, skip: usize, n: usize) -> &mut [T] {
    if n == 0 {
        &mut []
    } else {
        &mut buf[start + skip..][..n]
    }
}

/// Elements `[k l, (k + 1) l)` of a block of `c`: how many there are.
fn piece(c: usize, k: usize, l: usize) -> usize {
    c.saturating_sub(k * l).min(l)
}

fn offsets(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .scan(0, |at, &c| {
            let o = *at;
            *at += c;
            Some(o)
        })
        .collect()
}

/// Counts (or displacements) as MPI's C `int`s.
fn ints(xs: &[usize]) -> Result<Vec<i32>, DistError> {
    xs.iter()
        .map(|&x| {
            i32::try_from(x)
                .map_err(|_| DistError::Collective(format!("MPI: count {x} exceeds a C int")))
        })
        .collect()
}

/// FNV-1a of the operation and its shape, in `[0, 2^62)` (so that it negates without overflow).
fn fingerprint(op: u64, shape: &[usize]) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for w in [op, shape.len() as u64]
        .into_iter()
        .chain(shape.iter().map(|&x| x as u64))
    {
        for b in w.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    (h >> 2) as i64
}

// Operation tags for the agreement step.
const OP_ALL_REDUCE_F32: u64 = 1;
const OP_ALL_REDUCE_I64: u64 = 2;
const OP_REDUCE_SCATTER_F32: u64 = 3;
const OP_ALL_GATHER_F32: u64 = 4;
const OP_ALL_GATHER_U8: u64 = 5;
const OP_ALL_TO_ALL_F32: u64 = 6;

impl Collective for Mpi {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<(), DistError> {
        self.agree("all_reduce", OP_ALL_REDUCE_F32, &[buf.len()], true)?;
        self.all_reduce_sum(buf);
        Ok(())
    }

    fn all_reduce_sum_i64(&self, buf: &mut [i64]) -> Result<(), DistError> {
        self.agree("all_reduce", OP_ALL_REDUCE_I64, &[buf.len()], true)?;
        self.all_reduce_sum(buf);
        Ok(())
    }

    fn reduce_scatter_sum_f32(
        &self,
        send: &[f32],
        recv: &mut [f32],
        counts: &[usize],
    ) -> Result<(), DistError> {
        let ok = counts.len() == self.world
            && send.len() == counts.iter().sum::<usize>()
            && recv.len() == counts[self.rank];
        self.agree("reduce_scatter", OP_REDUCE_SCATTER_F32, counts, ok)?;
        if send.len() <= self.max_count {
            return self.reduce_scatter_raw(send, recv, counts);
        }
        // Rounds: round k reduces elements [k L, (k + 1) L) of every rank's block.
        let l = self.round_len();
        let offs = offsets(counts);
        let rounds = counts.iter().max().map_or(0, |&m| m.div_ceil(l));
        let mut stage = Vec::new();
        for k in 0..rounds {
            let part: Vec<usize> = counts.iter().map(|&c| piece(c, k, l)).collect();
            stage.clear();
            for (&o, &n) in offs.iter().zip(&part) {
                stage.extend_from_slice(block(send, o, k * l, n));
            }
            self.reduce_scatter_raw(&stage, block_mut(recv, 0, k * l, part[self.rank]), &part)?;
        }
        Ok(())
    }

    fn all_gather_f32(
        &self,
        send: &[f32],
        recv: &mut [f32],
        counts: &[usize],
    ) -> Result<(), DistError> {
        let ok = counts.len() == self.world
            && send.len() == counts[self.rank]
            && recv.len() == counts.iter().sum::<usize>();
        self.agree("all_gather", OP_ALL_GATHER_F32, counts, ok)?;
        self.all_gather(send, recv, counts)
    }

    fn all_gather_u8(
        &self,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
    ) -> Result<(), DistError> {
        let ok = counts.len() == self.world
            && send.len() == counts[self.rank]
            && recv.len() == counts.iter().sum::<usize>();
        self.agree("all_gather", OP_ALL_GATHER_U8, counts, ok)?;
        self.all_gather(send, recv, counts)
    }

    fn all_to_all_f32(
        &self,
        send: &[f32],
        recv: &mut [f32],
        counts: &[Vec<usize>],
    ) -> Result<(), DistError> {
        let w = self.world;
        let square = counts.len() == w && counts.iter().all(|row| row.len() == w);
        let ok = square
            && send.len() == counts[self.rank].iter().sum::<usize>()
            && recv.len() == counts.iter().map(|row| row[self.rank]).sum::<usize>();
        let flat: Vec<usize> = counts.iter().flatten().copied().collect();
        self.agree("all_to_all", OP_ALL_TO_ALL_F32, &flat, ok)?;
        let sc = &counts[self.rank];
        let rc: Vec<usize> = counts.iter().map(|row| row[self.rank]).collect();
        // One call when every rank's send and receive totals fit (the same decision everywhere).
        let fits = (0..w).all(|r| {
            counts[r].iter().sum::<usize>() <= self.max_count
                && counts.iter().map(|row| row[r]).sum::<usize>() <= self.max_count
        });
        if fits {
            let (s, sd) = (ints(sc)?, ints(&offsets(sc))?);
            let (r, rd) = (ints(&rc)?, ints(&offsets(&rc))?);
            self.alltoallv(send, s, sd, recv, r, rd);
            return Ok(());
        }
        // Rounds: round k moves elements [k L, (k + 1) L) of every block (sender, receiver).
        let l = self.round_len();
        let (soffs, roffs) = (offsets(sc), offsets(&rc));
        let rounds = flat.iter().max().map_or(0, |&m| m.div_ceil(l));
        let (mut out, mut inc) = (Vec::new(), Vec::new());
        for k in 0..rounds {
            let sp: Vec<usize> = sc.iter().map(|&c| piece(c, k, l)).collect();
            let rp: Vec<usize> = rc.iter().map(|&c| piece(c, k, l)).collect();
            out.clear();
            for (&o, &n) in soffs.iter().zip(&sp) {
                out.extend_from_slice(block(send, o, k * l, n));
            }
            inc.clear();
            inc.resize(rp.iter().sum(), 0.0f32);
            let (s, sd) = (ints(&sp)?, ints(&offsets(&sp))?);
            let (r, rd) = (ints(&rp)?, ints(&offsets(&rp))?);
            self.alltoallv(&out, s, sd, &mut inc, r, rd);
            let mut at = 0;
            for (&o, &n) in roffs.iter().zip(&rp) {
                block_mut(recv, o, k * l, n).copy_from_slice(&inc[at..at + n]);
                at += n;
            }
        }
        Ok(())
    }
}
