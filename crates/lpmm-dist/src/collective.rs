//! The collective operations sharding needs, over a group of ranks. Implementations: [`Single`]
//! (one rank, always built), [`Threads`] (ranks as threads of one process: tests and examples
//! without MPI), MPI (feature `mpi`) and NCCL (feature `nccl`).
//!
//! Every method is called by every rank of the group, in the same order (as MPI requires).
//! `counts[r]` is what rank `r` contributes or receives; every rank passes the same `counts`.

use std::sync::{Arc, Barrier, Mutex};

use crate::DistError;

/// Collective communication among the ranks of a data-parallel group.
pub trait Collective {
    /// This rank, `0..world()`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world(&self) -> usize;
    /// Every rank's `buf` becomes the element-wise sum over ranks, in the order the
    /// implementation chooses (not reproducible across world sizes or algorithms).
    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<(), DistError>;
    /// Every rank's `buf` becomes the element-wise sum over ranks (integers: exact, any order).
    fn all_reduce_sum_i64(&self, buf: &mut [i64]) -> Result<(), DistError>;
    /// The element-wise sum over ranks of `send` (`counts.iter().sum()` elements on every rank),
    /// scattered: rank `r` receives the `counts[r]` elements at offset `counts[..r].sum()`, in
    /// `recv`. The summation order is the implementation's.
    fn reduce_scatter_sum_f32(
        &self,
        send: &[f32],
        recv: &mut [f32],
        counts: &[usize],
    ) -> Result<(), DistError>;
    /// Every rank's `send` (`counts[r]` elements from rank `r`) concatenated in rank order, on
    /// every rank.
    fn all_gather_f32(
        &self,
        send: &[f32],
        recv: &mut [f32],
        counts: &[usize],
    ) -> Result<(), DistError>;
    /// [`Collective::all_gather_f32`] for bytes.
    fn all_gather_u8(
        &self,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
    ) -> Result<(), DistError>;
    /// Personalised exchange: rank `r` sends `send[send_offsets(r -> q)]` (`counts[r][q]`
    /// elements, destinations in order) to every `q`, and receives what every `q` sent it,
    /// sources in rank order. `counts` is the full `world x world` matrix, row = sender.
    fn all_to_all_f32(
        &self,
        send: &[f32],
        recv: &mut [f32],
        counts: &[Vec<usize>],
    ) -> Result<(), DistError>;
}

/// A borrowed group is a group (several optimizers can share one communicator).
impl<C: Collective + ?Sized> Collective for &C {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn world(&self) -> usize {
        (**self).world()
    }
    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<(), DistError> {
        (**self).all_reduce_sum_f32(buf)
    }
    fn all_reduce_sum_i64(&self, buf: &mut [i64]) -> Result<(), DistError> {
        (**self).all_reduce_sum_i64(buf)
    }
    fn reduce_scatter_sum_f32(
        &self,
        send: &[f32],
        recv: &mut [f32],
        counts: &[usize],
    ) -> Result<(), DistError> {
        (**self).reduce_scatter_sum_f32(send, recv, counts)
    }
    fn all_gather_f32(
        &self,
        send: &[f32],
        recv: &mut [f32],
        counts: &[usize],
    ) -> Result<(), DistError> {
        (**self).all_gather_f32(send, recv, counts)
    }
    fn all_gather_u8(
        &self,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
    ) -> Result<(), DistError> {
        (**self).all_gather_u8(send, recv, counts)
    }
    fn all_to_all_f32(
        &self,
        send: &[f32],
        recv: &mut [f32],
        counts: &[Vec<usize>],
    ) -> Result<(), DistError> {
        (**self).all_to_all_f32(send, recv, counts)
    }
}

/// One rank: every collective is a copy.
#[derive(Debug, Clone, Copy, Default)]
pub struct Single;

fn check(what: &'static str, ok: bool) -> Result<(), DistError> {
    if ok {
        Ok(())
    } else {
        Err(DistError::Collective(format!(
            "{what}: buffer lengths do not match the counts"
        )))
    }
}

impl Collective for Single {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn all_reduce_sum_f32(&self, _buf: &mut [f32]) -> Result<(), DistError> {
        Ok(())
    }
    fn all_reduce_sum_i64(&self, _buf: &mut [i64]) -> Result<(), DistError> {
        Ok(())
    }
    fn reduce_scatter_sum_f32(
        &self,
        send: &[f32],
        recv: &mut [f32],
        counts: &[usize],
    ) -> Result<(), DistError> {
        check(
            "reduce_scatter",
            counts == [send.len()] && recv.len() == send.len(),
        )?;
        recv.copy_from_slice(send);
        Ok(())
    }
    fn all_gather_f32(
        &self,
        send: &[f32],
        recv: &mut [f32],
        counts: &[usize],
    ) -> Result<(), DistError> {
        check(
            "all_gather",
            counts == [send.len()] && recv.len() == send.len(),
        )?;
        recv.copy_from_slice(send);
        Ok(())
    }
    fn all_gather_u8(
        &self,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
    ) -> Result<(), DistError> {
        check(
            "all_gather",
            counts == [send.len()] && recv.len() == send.len(),
        )?;
        recv.copy_from_slice(send);
        Ok(())
    }
    fn all_to_all_f32(
        &self,
        send: &[f32],
        recv: &mut [f32],
        counts: &[Vec<usize>],
    ) -> Result<(), DistError> {
        check(
            "all_to_all",
            counts.len() == 1 && counts[0] == [send.len()] && recv.len() == send.len(),
        )?;
        recv.copy_from_slice(send);
        Ok(())
    }
}

/// Ranks as threads of one process (a shared mailbox and a barrier): the same collectives as
/// MPI's, for tests and single-machine runs. Create the group with [`Threads::group`] and move
/// one handle into each thread.
#[derive(Debug, Clone)]
pub struct Threads {
    rank: usize,
    hub: Arc<Hub>,
}

#[derive(Debug)]
struct Hub {
    world: usize,
    barrier: Barrier,
    /// Each rank's contribution to the current collective, as raw 64-bit words.
    posts: Mutex<Vec<Vec<u64>>>,
}

impl Threads {
    /// `world` handles, one per rank.
    pub fn group(world: usize) -> Vec<Threads> {
        let hub = Arc::new(Hub {
            world,
            barrier: Barrier::new(world),
            posts: Mutex::new(vec![Vec::new(); world]),
        });
        (0..world)
            .map(|rank| Threads {
                rank,
                hub: hub.clone(),
            })
            .collect()
    }

    /// Posts this rank's words, waits for every rank's, and returns them all (rank order).
    fn exchange(&self, words: Vec<u64>) -> Vec<Vec<u64>> {
        self.hub.posts.lock().unwrap_or_else(|e| e.into_inner())[self.rank] = words;
        self.hub.barrier.wait();
        let all = self
            .hub
            .posts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        // Nobody overwrites a post before every rank has read them all.
        self.hub.barrier.wait();
        all
    }
}

fn f32s(w: &[u64]) -> impl Iterator<Item = f32> + '_ {
    w.iter().map(|&x| f32::from_bits(x as u32))
}

fn offsets(counts: &[usize]) -> Vec<usize> {
    let mut at = 0;
    counts
        .iter()
        .map(|&c| {
            let o = at;
            at += c;
            o
        })
        .collect()
}

impl Collective for Threads {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.hub.world
    }
    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<(), DistError> {
        let all = self.exchange(buf.iter().map(|x| u64::from(x.to_bits())).collect());
        check("all_reduce", all.iter().all(|w| w.len() == buf.len()))?;
        for (i, out) in buf.iter_mut().enumerate() {
            // Rank order: 0 + x0 + x1 + ... (a threaded group has one fixed order).
            *out = all
                .iter()
                .fold(0.0f32, |s, w| s + f32::from_bits(w[i] as u32));
        }
        Ok(())
    }
    fn all_reduce_sum_i64(&self, buf: &mut [i64]) -> Result<(), DistError> {
        let all = self.exchange(buf.iter().map(|&x| x as u64).collect());
        check("all_reduce", all.iter().all(|w| w.len() == buf.len()))?;
        for (i, out) in buf.iter_mut().enumerate() {
            *out = all.iter().fold(0i64, |s, w| s.wrapping_add(w[i] as i64));
        }
        Ok(())
    }
    fn reduce_scatter_sum_f32(
        &self,
        send: &[f32],
        recv: &mut [f32],
        counts: &[usize],
    ) -> Result<(), DistError> {
        let total: usize = counts.iter().sum();
        check(
            "reduce_scatter",
            counts.len() == self.world() && send.len() == total && recv.len() == counts[self.rank],
        )?;
        let all = self.exchange(send.iter().map(|x| u64::from(x.to_bits())).collect());
        let at = offsets(counts)[self.rank];
        for (i, out) in recv.iter_mut().enumerate() {
            *out = all
                .iter()
                .fold(0.0f32, |s, w| s + f32::from_bits(w[at + i] as u32));
        }
        Ok(())
    }
    fn all_gather_f32(
        &self,
        send: &[f32],
        recv: &mut [f32],
        counts: &[usize],
    ) -> Result<(), DistError> {
        check(
            "all_gather",
            counts.len() == self.world()
                && send.len() == counts[self.rank]
                && recv.len() == counts.iter().sum::<usize>(),
        )?;
        let all = self.exchange(send.iter().map(|x| u64::from(x.to_bits())).collect());
        for ((w, o), &c) in all.iter().zip(offsets(counts)).zip(counts) {
            check("all_gather", w.len() == c)?;
            for (d, x) in recv[o..o + c].iter_mut().zip(f32s(w)) {
                *d = x;
            }
        }
        Ok(())
    }
    fn all_gather_u8(
        &self,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
    ) -> Result<(), DistError> {
        check(
            "all_gather",
            counts.len() == self.world()
                && send.len() == counts[self.rank]
                && recv.len() == counts.iter().sum::<usize>(),
        )?;
        let all = self.exchange(send.iter().map(|&x| u64::from(x)).collect());
        for ((w, o), &c) in all.iter().zip(offsets(counts)).zip(counts) {
            check("all_gather", w.len() == c)?;
            for (d, &x) in recv[o..o + c].iter_mut().zip(w) {
                *d = x as u8;
            }
        }
        Ok(())
    }
    fn all_to_all_f32(
        &self,
        send: &[f32],
        recv: &mut [f32],
        counts: &[Vec<usize>],
    ) -> Result<(), DistError> {
        let w = self.world();
        check(
            "all_to_all",
            counts.len() == w
                && counts.iter().all(|row| row.len() == w)
                && send.len() == counts[self.rank].iter().sum::<usize>()
                && recv.len() == counts.iter().map(|row| row[self.rank]).sum::<usize>(),
        )?;
        let all = self.exchange(send.iter().map(|x| u64::from(x.to_bits())).collect());
        let mut at = 0;
        for (q, words) in all.iter().enumerate() {
            let from = offsets(&counts[q])[self.rank];
            let n = counts[q][self.rank];
            for (d, x) in recv[at..at + n]
                .iter_mut()
                .zip(f32s(&words[from..from + n]))
            {
                *d = x;
            }
            at += n;
        }
        Ok(())
    }
}
