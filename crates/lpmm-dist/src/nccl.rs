//! [`Collective`] over NCCL (feature `nccl`): [`Nccl`], one rank per GPU, through cudarc.
//!
//! NCCL and the CUDA driver are loaded at run time: [`Nccl::available`] (called by every
//! constructor before any NCCL or CUDA call) says whether they are there, as an error instead of
//! cudarc's panic.
//!
//! The [`Collective`] methods take host slices, so each call copies its input to the GPU, runs
//! the NCCL collective on this rank's stream and copies the result back (then waits for the
//! stream). Sharded optimizer state that lives on the GPU would skip both copies by calling
//! NCCL on device buffers directly: [`Nccl::comm`] gives the cudarc communicator for that.
//!
//! NCCL's reduce-scatter and all-gather move equal blocks: with unequal `counts` every block is
//! padded to the largest (zeros; the padding is dropped on the way back). The all-to-all is a
//! group of `ncclSend`/`ncclRecv` pairs (this rank's own block is copied on the host).
//!
//! NCCL cannot check that the ranks agree on the counts: each rank checks its own buffers
//! against its `counts` (and returns [`DistError::Collective`] alone, the others then wait for it
//! in NCCL), and mismatched counts across ranks are undefined, as in NCCL.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, DeviceRepr, DriverError, ValidAsZeroBits};
use cudarc::nccl::result::NcclError;
use cudarc::nccl::{Comm, Id, NcclType, ReduceOp};

use crate::DistError;
use crate::collective::Collective;

/// NCCL's unique id (128 bytes): created on one rank ([`NcclId::new`]), sent to the others by
/// any means (MPI, a file, TCP) and passed to [`Nccl::new`] on every rank.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId([u8; 128]);

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NcclId(..)")
    }
}

impl NcclId {
    /// A new unique id (`ncclGetUniqueId`), on one rank.
    pub fn new() -> Result<NcclId, DistError> {
        nccl_present()?;
        let id = Id::new().map_err(|e| nccl_err("ncclGetUniqueId", e))?;
        Ok(NcclId(id.internal().map(|c| c as u8)))
    }

    /// The id's bytes, to send to the other ranks.
    pub fn to_bytes(&self) -> [u8; 128] {
        self.0
    }

    /// The id from the bytes [`NcclId::to_bytes`] gave on the rank that created it.
    pub fn from_bytes(bytes: [u8; 128]) -> NcclId {
        NcclId(bytes)
    }

    fn to_id(self) -> Id {
        Id::uninit(self.0.map(|b| b as std::ffi::c_char))
    }
}

/// This rank of an NCCL communicator, with the stream its collectives run on.
#[derive(Debug)]
pub struct Nccl {
    comm: Comm,
    stream: Arc<CudaStream>,
}

fn nccl_present() -> Result<(), DistError> {
    // SAFETY: only tries to load the library (dlopen) by its usual names; no NCCL call.
    if unsafe { cudarc::nccl::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(DistError::Collective(
            "NCCL is not available: libnccl.so (NCCL 2) was not found on the library path".into(),
        ))
    }
}

fn driver_present() -> Result<(), DistError> {
    // SAFETY: only tries to load the library (dlopen) by its usual names; no CUDA call.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(DistError::Collective(
            "NCCL needs the CUDA driver, and libcuda.so was not found (no NVIDIA driver?)".into(),
        ))
    }
}

/// A context on GPU `device` and a new stream on it, once NCCL and the driver are known to load.
fn open_device(device: usize) -> Result<Arc<CudaStream>, DistError> {
    Nccl::available()?;
    let ctx = CudaContext::new(device).map_err(|e| cuda_err("context creation", e))?;
    ctx.new_stream().map_err(|e| cuda_err("stream creation", e))
}

fn nccl_err(what: &str, e: NcclError) -> DistError {
    DistError::Collective(format!("NCCL {what} failed: {:?}", e.0))
}

fn cuda_err(what: &str, e: DriverError) -> DistError {
    DistError::Collective(format!("CUDA {what} failed: {e}"))
}

fn check(what: &'static str, ok: bool) -> Result<(), DistError> {
    if ok {
        Ok(())
    } else {
        Err(DistError::Collective(format!(
            "{what}: buffer lengths do not match the counts"
        )))
    }
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

impl Nccl {
    /// Whether NCCL and the CUDA driver can be loaded (checked before any NCCL or CUDA call).
    pub fn available() -> Result<(), DistError> {
        driver_present()?;
        nccl_present()
    }

    /// Rank `rank` of `world` (`ncclCommInitRank`, collective: every rank calls it with the same
    /// `id`), on GPU `device` (one rank per GPU), with a new stream for its collectives.
    pub fn new(device: usize, rank: usize, world: usize, id: &NcclId) -> Result<Nccl, DistError> {
        let stream = open_device(device)?;
        Nccl::join(stream, rank, world, id)
    }

    /// `ncclCommInitRank` on `stream`'s device.
    fn join(
        stream: Arc<CudaStream>,
        rank: usize,
        world: usize,
        id: &NcclId,
    ) -> Result<Nccl, DistError> {
        if rank >= world || i32::try_from(world).is_err() {
            return Err(DistError::Collective(format!(
                "NCCL: rank {rank} of a world of {world}"
            )));
        }
        let comm = Comm::from_rank(stream.clone(), rank, world, id.to_id())
            .map_err(|e| nccl_err("ncclCommInitRank", e))?;
        Ok(Nccl { comm, stream })
    }

    /// An existing cudarc communicator (its stream runs the collectives).
    pub fn from_comm(comm: Comm) -> Nccl {
        let stream = comm.stream();
        Nccl { comm, stream }
    }

    /// The cudarc communicator: collectives on device buffers, without the host copies.
    pub fn comm(&self) -> &Comm {
        &self.comm
    }

    /// The stream the collectives run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The ranks of an MPI group as an NCCL communicator: every rank checks that NCCL and the
    /// driver load (all fail together if one cannot), rank 0 creates the unique id and
    /// broadcasts it, and every rank joins on GPU `device`, by default its rank among the
    /// group's ranks on the same node, modulo the node's GPU count.
    #[cfg(feature = "mpi")]
    pub fn from_mpi(mpi: &crate::Mpi, device: Option<usize>) -> Result<Nccl, DistError> {
        use ::mpi::traits::{Communicator, Root};

        // Every rank opens its GPU first; all fail together if one cannot (no rank is left
        // waiting in the broadcast or in ncclCommInitRank).
        let local = Nccl::available().and_then(|()| {
            let device = match device {
                Some(d) => d,
                None => {
                    let node = mpi.communicator().split_shared(mpi.rank() as i32);
                    let gpus =
                        CudaContext::device_count().map_err(|e| cuda_err("device count", e))?;
                    let gpus = usize::try_from(gpus).unwrap_or(0).max(1);
                    node.rank() as usize % gpus
                }
            };
            open_device(device)
        });
        let mut failed = [i64::from(local.is_err())];
        mpi.all_reduce_sum_i64(&mut failed)?;
        let stream = local?;
        if failed[0] != 0 {
            return Err(DistError::Collective(format!(
                "NCCL: {} rank(s) could not open their GPU (or load NCCL or the CUDA driver)",
                failed[0]
            )));
        }
        // [created?, id...]: a failure on rank 0 reaches every rank instead of a hang.
        let mut msg = [0u8; 129];
        let mut made = Ok(());
        if mpi.rank() == 0 {
            match NcclId::new() {
                Ok(id) => {
                    msg[0] = 1;
                    msg[1..].copy_from_slice(&id.to_bytes());
                }
                Err(e) => made = Err(e),
            }
        }
        mpi.communicator()
            .process_at_rank(0)
            .broadcast_into(&mut msg[..]);
        made?;
        if msg[0] != 1 {
            return Err(DistError::Collective(
                "rank 0 could not create the NCCL unique id".into(),
            ));
        }
        let mut id = [0u8; 128];
        id.copy_from_slice(&msg[1..]);
        Nccl::join(stream, mpi.rank(), mpi.world(), &NcclId::from_bytes(id))
    }

    /// Waits for the stream: the copies back to the host are complete.
    fn sync(&self) -> Result<(), DistError> {
        self.stream
            .synchronize()
            .map_err(|e| cuda_err("stream synchronize", e))
    }

    /// Sum over ranks of `buf`, in place (`ncclAllReduce`).
    fn all_reduce<T: NcclType + DeviceRepr>(&self, buf: &mut [T]) -> Result<(), DistError> {
        if buf.is_empty() {
            return Ok(());
        }
        let s = &self.stream;
        let mut d = s
            .clone_htod(buf)
            .map_err(|e| cuda_err("copy to device", e))?;
        self.comm
            .all_reduce_in_place(&mut d, &ReduceOp::Sum)
            .map_err(|e| nccl_err("ncclAllReduce", e))?;
        s.memcpy_dtoh(&d, buf)
            .map_err(|e| cuda_err("copy to host", e))?;
        self.sync()
    }

    /// `ncclAllGather` of blocks padded to the largest count.
    fn all_gather<T: NcclType + DeviceRepr + ValidAsZeroBits + Copy + Default>(
        &self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
    ) -> Result<(), DistError> {
        let w = self.comm.world_size();
        check(
            "all_gather",
            counts.len() == w
                && send.len() == counts[self.comm.rank()]
                && recv.len() == counts.iter().sum::<usize>(),
        )?;
        let m = counts.iter().copied().max().unwrap_or(0);
        if m == 0 {
            return Ok(());
        }
        let s = &self.stream;
        let mut block = send.to_vec();
        block.resize(m, T::default());
        let d_send = s
            .clone_htod(&block)
            .map_err(|e| cuda_err("copy to device", e))?;
        let mut d_recv = s
            .alloc_zeros::<T>(w * m)
            .map_err(|e| cuda_err("allocation", e))?;
        self.comm
            .all_gather(&d_send, &mut d_recv)
            .map_err(|e| nccl_err("ncclAllGather", e))?;
        if counts.iter().all(|&c| c == m) {
            s.memcpy_dtoh(&d_recv, recv)
                .map_err(|e| cuda_err("copy to host", e))?;
            return self.sync();
        }
        let mut all = vec![T::default(); w * m];
        s.memcpy_dtoh(&d_recv, &mut all)
            .map_err(|e| cuda_err("copy to host", e))?;
        self.sync()?;
        for ((r, &c), o) in counts.iter().enumerate().zip(offsets(counts)) {
            recv[o..o + c].copy_from_slice(&all[r * m..r * m + c]);
        }
        Ok(())
    }
}

impl Collective for Nccl {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world(&self) -> usize {
        self.comm.world_size()
    }

    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<(), DistError> {
        self.all_reduce(buf)
    }

    fn all_reduce_sum_i64(&self, buf: &mut [i64]) -> Result<(), DistError> {
        self.all_reduce(buf)
    }

    fn reduce_scatter_sum_f32(
        &self,
        send: &[f32],
        recv: &mut [f32],
        counts: &[usize],
    ) -> Result<(), DistError> {
        let (w, me) = (self.world(), self.rank());
        check(
            "reduce_scatter",
            counts.len() == w
                && send.len() == counts.iter().sum::<usize>()
                && recv.len() == counts[me],
        )?;
        let m = counts.iter().copied().max().unwrap_or(0);
        if m == 0 {
            return Ok(());
        }
        let s = &self.stream;
        let d_send = if counts.iter().all(|&c| c == m) {
            s.clone_htod(send)
        } else {
            let mut padded = vec![0.0f32; w * m];
            for ((r, &c), o) in counts.iter().enumerate().zip(offsets(counts)) {
                padded[r * m..r * m + c].copy_from_slice(&send[o..o + c]);
            }
            s.clone_htod(&padded)
        }
        .map_err(|e| cuda_err("copy to device", e))?;
        let mut d_recv = s
            .alloc_zeros::<f32>(m)
            .map_err(|e| cuda_err("allocation", e))?;
        self.comm
            .reduce_scatter(&d_send, &mut d_recv, &ReduceOp::Sum)
            .map_err(|e| nccl_err("ncclReduceScatter", e))?;
        let mut mine = vec![0.0f32; m];
        s.memcpy_dtoh(&d_recv, &mut mine)
            .map_err(|e| cuda_err("copy to host", e))?;
        self.sync()?;
        recv.copy_from_slice(&mine[..counts[me]]);
        Ok(())
    }

    fn all_gather_f32(
        &self,
        send: &[f32],
        recv: &mut [f32],
        counts: &[usize],
    ) -> Result<(), DistError> {
        self.all_gather(send, recv, counts)
    }

    fn all_gather_u8(
        &self,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
    ) -> Result<(), DistError> {
        self.all_gather(send, recv, counts)
    }

    fn all_to_all_f32(
        &self,
        send: &[f32],
        recv: &mut [f32],
        counts: &[Vec<usize>],
    ) -> Result<(), DistError> {
        let (w, me) = (self.world(), self.rank());
        check(
            "all_to_all",
            counts.len() == w
                && counts.iter().all(|row| row.len() == w)
                && send.len() == counts[me].iter().sum::<usize>()
                && recv.len() == counts.iter().map(|row| row[me]).sum::<usize>(),
        )?;
        let sc = &counts[me];
        let rc: Vec<usize> = counts.iter().map(|row| row[me]).collect();
        let (soffs, roffs) = (offsets(sc), offsets(&rc));
        let moves = |c: &[usize]| c.iter().enumerate().any(|(q, &n)| q != me && n > 0);
        let (sends, recvs) = (moves(sc), moves(&rc));
        if sends || recvs {
            let s = &self.stream;
            let d_send = if sends {
                Some(
                    s.clone_htod(send)
                        .map_err(|e| cuda_err("copy to device", e))?,
                )
            } else {
                None
            };
            let mut d_recv = if recvs {
                Some(
                    s.alloc_zeros::<f32>(recv.len())
                        .map_err(|e| cuda_err("allocation", e))?,
                )
            } else {
                None
            };
            // One group of point-to-point calls (no deadlock whatever the order); the group is
            // always closed, also after a failed call.
            cudarc::nccl::group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
            let mut failed = None;
            for q in (0..w).filter(|&q| q != me) {
                let peer = q as i32;
                if let Some(d) = d_send.as_ref().filter(|_| sc[q] > 0) {
                    let view = d.slice(soffs[q]..soffs[q] + sc[q]);
                    if let Err(e) = self.comm.send(&view, peer) {
                        failed.get_or_insert(nccl_err("ncclSend", e));
                    }
                }
                if let Some(d) = d_recv.as_mut().filter(|_| rc[q] > 0) {
                    let mut view = d.slice_mut(roffs[q]..roffs[q] + rc[q]);
                    if let Err(e) = self.comm.recv(&mut view, peer) {
                        failed.get_or_insert(nccl_err("ncclRecv", e));
                    }
                }
            }
            let ended = cudarc::nccl::group_end().map_err(|e| nccl_err("ncclGroupEnd", e));
            if let Some(e) = failed {
                return Err(e);
            }
            ended?;
            if let Some(d) = &d_recv {
                s.memcpy_dtoh(d, recv)
                    .map_err(|e| cuda_err("copy to host", e))?;
            }
            self.sync()?;
        }
        // This rank's own block, on the host (after the copy back, which wrote the whole buffer).
        let n = sc[me];
        recv[roffs[me]..roffs[me] + n].copy_from_slice(&send[soffs[me]..soffs[me] + n]);
        Ok(())
    }
}
