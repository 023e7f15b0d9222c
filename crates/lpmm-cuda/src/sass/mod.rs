//! The static gates of the specialized steps, read from their machine code without a GPU:
//! `ptxas -v` (registers, stack frame, spills) and the SASS `nvdisasm` prints of the cubin ptxas
//! assembles from the committed PTX, both from the pinned wheels ([`crate::kernels::WHEELS`]).
//! `cargo xtask kernels --check` fails when a kernel breaks a gate ([`Figures::violations`]), as
//! does lpmm-cuda's `tests/ptx.rs`, naming the command that prints the table ([`COMMAND`]:
//! [`table`], with where the instructions go, [`lines::breakdown_table`], and the time the
//! issue-rate model gives, [`lines::summary`]).
//!
//! The *fast path* is counted on the control-flow graph of a kernel's SASS: the longest path
//! through one iteration of its tile loop (the loop after the block's barriers, whose iteration
//! is one tile of 16 elements per thread) that enters no *cold* block: one calling a slow-path
//! routine (`CALL` of a `$__internal_` subroutine: IEEE division and square root outside their
//! fast range) or one of kernels/plan.cuh's cold paths, which carry a `PMTRIG` (a
//! performance-monitor event): a thread whose run of 16 is cut by its item's end, or one of whose
//! elements fails the fast checks (non-finite or out of its format's range), a divisor outside
//! the exact shortcuts' range, a tile whose random draws do not pair its threads. Longest, so
//! that every branch on a rule's options counts at its dearer side: an upper bound of what a
//! thread issues per tile. Divided by 16, it is the instructions per element; the longest path
//! with the cold blocks is reported beside it ([`FastPath::cold`]).

use std::collections::BTreeMap;
use std::path::Path;

use lpmm_backend::plans::{GradInput, PlanKernel};

pub mod lines;

/// One kernel's line of `ptxas -v`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Resources {
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of stack frame.
    pub stack_frame: u32,
    /// Bytes of spill stores.
    pub spill_stores: u32,
    /// Bytes of spill loads.
    pub spill_loads: u32,
}

/// Each function's resources in `ptxas -v`'s output.
pub fn resources(ptxas_output: &str) -> BTreeMap<String, Resources> {
    let mut out = BTreeMap::new();
    let mut current: Option<String> = None;
    let number = |line: &str, after: &str| -> Option<u32> {
        let at = line.find(after)?;
        line[..at].split_whitespace().last()?.parse().ok()
    };
    for line in ptxas_output.lines() {
        if let Some(rest) = line.split("Function properties for ").nth(1) {
            current = Some(rest.trim().to_string());
            out.entry(rest.trim().to_string())
                .or_insert_with(Resources::default);
            continue;
        }
        let Some(name) = &current else { continue };
        let r = out.get_mut(name).expect("inserted above");
        if line.contains("bytes stack frame") {
            r.stack_frame = number(line, "bytes stack frame").unwrap_or(0);
            r.spill_stores = number(line, "bytes spill stores").unwrap_or(0);
            r.spill_loads = number(line, "bytes spill loads").unwrap_or(0);
        } else if let Some(rest) = line.split("Used ").nth(1) {
            r.registers = rest
                .split_whitespace()
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            current = None;
        }
    }
    out
}

/// One SASS instruction: its guard (`@P0`), opcode with modifiers, and operands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instruction {
    /// Whether it is predicated.
    pub predicated: bool,
    /// The opcode with its modifiers (`LDG.E.128`).
    pub opcode: String,
    /// The operands as printed.
    pub operands: String,
    /// The source lines it comes from, innermost first (the line of the inlined function, then
    /// each call site out to the kernel's), where the cubin has line information (`ptxas
    /// -lineinfo`, printed by `nvdisasm -gi`); empty otherwise.
    pub lines: Vec<u32>,
}

/// A function's SASS: its instructions and its labels (label to instruction index).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Function {
    /// Every instruction of the function's section, its local subroutines included.
    pub code: Vec<Instruction>,
    /// `.L_x_N` labels and where they point.
    pub labels: BTreeMap<String, usize>,
    /// Where the first local subroutine (`$__internal_...`: division, square root slow paths)
    /// starts: the function's own code ends there.
    pub own: usize,
}

/// The functions of `nvdisasm -c`'s output, by name.
pub fn functions(nvdisasm_output: &str) -> BTreeMap<String, Function> {
    let mut out = BTreeMap::new();
    let mut name: Option<String> = None;
    let mut f = Function::default();
    let mut pending: Vec<String> = Vec::new();
    // The current source location (`//## File "...", line N [inlined at ...]` comments, one per
    // inlining level, innermost first) and whether the last line read was one of them.
    let mut lines: Vec<u32> = Vec::new();
    let mut in_group = false;
    let mut finish = |name: &mut Option<String>, f: &mut Function| {
        if let Some(n) = name.take() {
            if f.own == 0 {
                f.own = f.code.len();
            }
            out.insert(n, std::mem::take(f));
        }
    };
    for line in nvdisasm_output.lines() {
        let t = line.trim();
        if let Some(rest) = t.strip_prefix("//--------------------- .text.") {
            finish(&mut name, &mut f);
            name = rest.split_whitespace().next().map(str::to_string);
            pending.clear();
            continue;
        }
        if name.is_none() {
            continue;
        }
        if let Some(rest) = t.strip_prefix("//## File") {
            if !in_group {
                lines.clear();
                in_group = true;
            }
            let line: Option<u32> = rest
                .split("line ")
                .nth(1)
                .and_then(|l| l.split(|c: char| !c.is_ascii_digit()).next())
                .and_then(|n| n.parse().ok());
            lines.extend(line);
            continue;
        }
        in_group = false;
        if let Some(label) = t.strip_suffix(':') {
            if label.starts_with(".L_x_") {
                pending.push(label.to_string());
            } else if label.starts_with('$') && f.own == 0 {
                f.own = f.code.len();
            }
            continue;
        }
        // `/*0230*/  @!P2 LOP3.LUT R7, RZ, R9, RZ, 0x33, !PT ;`
        let Some(body) = t.strip_prefix("/*").and_then(|r| r.split_once("*/")) else {
            continue;
        };
        let text = body.1.trim().trim_end_matches(';').trim();
        if text.is_empty() {
            continue;
        }
        let (predicated, text) = match text.strip_prefix('@') {
            Some(rest) => (true, rest.split_once(' ').map_or("", |x| x.1).trim()),
            None => (false, text),
        };
        let (opcode, operands) = text.split_once(' ').unwrap_or((text, ""));
        for label in pending.drain(..) {
            f.labels.insert(label, f.code.len());
        }
        f.code.push(Instruction {
            predicated,
            opcode: opcode.to_string(),
            operands: operands.trim().to_string(),
            lines: lines.clone(),
        });
    }
    finish(&mut name, &mut f);
    out
}

/// What the fast path of one tile does, per thread.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FastPath {
    /// Instructions on it.
    pub instructions: usize,
    /// Instructions on the shortest such path (every branch at its cheaper side).
    pub shortest: usize,
    /// Its global accesses by width in bits (loads and stores, atomics apart).
    pub loads: BTreeMap<u32, usize>,
    /// As `loads`, for stores.
    pub stores: BTreeMap<u32, usize>,
    /// Barriers (`BAR`) on it.
    pub barriers: usize,
    /// Warp shuffles on it.
    pub shuffles: usize,
    /// Instructions on the longest path through the tile loop with its cold blocks (a thread
    /// that takes every cold path: one instruction for each call of a slow-path routine).
    pub cold: usize,
    /// The fast path's instructions (indices into [`Function::code`]), in program order.
    pub path: Vec<usize>,
}

/// The width in bits of a global access's opcode (`LDG.E.128`: 128; `LDG.E`: 32; `LDG.E.U8`: 8).
fn width(opcode: &str) -> u32 {
    for part in opcode.split('.').rev() {
        match part {
            "128" => return 128,
            "64" => return 64,
            "U8" | "S8" => return 8,
            "U16" | "S16" => return 16,
            _ => {}
        }
    }
    32
}

impl Function {
    fn target(&self, i: usize) -> Option<usize> {
        let ops = &self.code[i].operands;
        let start = ops.find("(.L_x_")? + 1;
        let end = start + ops[start..].find(')')?;
        self.labels.get(&ops[start..end]).copied()
    }

    /// Local memory instructions (`LDL`, `STL`) anywhere in the function.
    pub fn local_accesses(&self) -> usize {
        self.code
            .iter()
            .filter(|i| i.opcode.starts_with("LDL") || i.opcode.starts_with("STL"))
            .count()
    }

    /// Barriers (`BAR`) anywhere in the function.
    pub fn barriers(&self) -> usize {
        self.code
            .iter()
            .filter(|i| i.opcode.starts_with("BAR"))
            .count()
    }

    /// The fast path of one tile iteration (see the module's documentation).
    pub fn fast_path(&self) -> Result<FastPath, String> {
        let n = self.own;
        let code = &self.code[..n];
        let is_branch = |op: &str| op.starts_with("BRA");
        let is_end = |op: &str| op.starts_with("EXIT") || op.starts_with("RET");
        // Basic blocks.
        let mut leaders = std::collections::BTreeSet::from([0usize]);
        for (i, ins) in code.iter().enumerate() {
            if is_branch(&ins.opcode) || is_end(&ins.opcode) {
                leaders.insert(i + 1);
            }
            if let Some(t) = self.target(i) {
                leaders.insert(t);
            }
        }
        leaders.extend(self.labels.values().copied());
        let starts: Vec<usize> = leaders.into_iter().filter(|&s| s < n).collect();
        let blocks: Vec<(usize, usize)> = starts
            .iter()
            .enumerate()
            .map(|(k, &s)| (s, starts.get(k + 1).copied().unwrap_or(n)))
            .collect();
        let block_of = |i: usize| blocks.partition_point(|&(s, _)| s <= i) - 1;
        let succ: Vec<Vec<usize>> = blocks
            .iter()
            .enumerate()
            .map(|(k, &(_, e))| {
                let last = &code[e - 1];
                let next = (k + 1 < blocks.len()).then_some(k + 1);
                if is_branch(&last.opcode) {
                    let mut s: Vec<usize> = self.target(e - 1).map(block_of).into_iter().collect();
                    if last.predicated {
                        s.extend(next);
                    }
                    s
                } else if is_end(&last.opcode) {
                    if last.predicated {
                        next.into_iter().collect()
                    } else {
                        Vec::new()
                    }
                } else {
                    next.into_iter().collect()
                }
            })
            .collect();
        let cold: Vec<bool> = blocks
            .iter()
            .map(|&(s, e)| {
                code[s..e].iter().any(|i| {
                    (i.opcode.starts_with("CALL") && i.operands.contains("$__internal"))
                        || i.opcode.starts_with("PMTRIG")
                })
            })
            .collect();
        let size = |k: usize| blocks[k].1 - blocks[k].0;
        // The back edges of a depth-first search from the entry (edges to a block on the
        // search's stack): ptxas lays blocks out in any order, so addresses do not tell.
        let back_edges = |from: usize, inside: &dyn Fn(usize) -> bool| {
            let mut state = vec![0u8; blocks.len()];
            let mut back = Vec::new();
            let mut order = Vec::new();
            let mut stack = vec![(from, 0usize)];
            state[from] = 1;
            while let Some((k, i)) = stack.pop() {
                if let Some(&t) = succ[k].get(i) {
                    stack.push((k, i + 1));
                    if !inside(t) {
                        continue;
                    }
                    match state[t] {
                        0 => {
                            state[t] = 1;
                            stack.push((t, 0));
                        }
                        1 => back.push((k, t)),
                        _ => {}
                    }
                } else {
                    state[k] = 2;
                    order.push(k);
                }
            }
            order.reverse();
            (back, order)
        };
        // A loop's blocks: the head and every block that reaches the latch without it.
        let natural = |latch: usize, head: usize| {
            let mut preds: Vec<Vec<usize>> = vec![Vec::new(); blocks.len()];
            for (k, s) in succ.iter().enumerate() {
                for &t in s {
                    preds[t].push(k);
                }
            }
            let mut member = vec![false; blocks.len()];
            member[head] = true;
            let mut todo = vec![latch];
            while let Some(k) = todo.pop() {
                if !member[k] {
                    member[k] = true;
                    todo.extend(preds[k].iter().copied());
                }
            }
            member
        };
        // The tile loop: the loop with the most instructions, after the block's barrier (the
        // maps' load).
        let barrier = code
            .iter()
            .position(|i| i.opcode.starts_with("BAR"))
            .ok_or("no barrier (the maps' load) in the kernel")?;
        let (back, _) = back_edges(0, &|_| true);
        let (latch, head, member) = back
            .iter()
            .filter(|&&(_, h)| blocks[h].0 > barrier)
            .map(|&(l, h)| {
                let member = natural(l, h);
                let weight: usize = (0..blocks.len()).filter(|&k| member[k]).map(size).sum();
                (weight, l, h, member)
            })
            .max_by_key(|x| x.0)
            .map(|(_, l, h, m)| (l, h, m))
            .ok_or("no tile loop after the barrier")?;
        // Its body without cold blocks and without back edges (inner loops: the descriptor
        // search), in topological order; then the longest and shortest paths head -> latch.
        // The longest and shortest paths head -> latch through the blocks `inside` admits,
        // and the predecessor of each block on the longest one.
        type Paths = (Vec<Option<usize>>, Vec<Option<usize>>, Vec<Option<usize>>);
        let paths = |inside: &dyn Fn(usize) -> bool| -> Paths {
            let (inner, order) = back_edges(head, inside);
            let mut long: Vec<Option<usize>> = vec![None; blocks.len()];
            let mut short: Vec<Option<usize>> = vec![None; blocks.len()];
            let mut via: Vec<Option<usize>> = vec![None; blocks.len()];
            long[head] = Some(size(head));
            short[head] = Some(size(head));
            for &k in &order {
                let (Some(l), Some(sh)) = (long[k], short[k]) else {
                    continue;
                };
                if k == latch {
                    continue;
                }
                for &t in &succ[k] {
                    if !inside(t) || t == head || inner.contains(&(k, t)) {
                        continue;
                    }
                    if long[t].is_none_or(|x| x < l + size(t)) {
                        long[t] = Some(l + size(t));
                        via[t] = Some(k);
                    }
                    if short[t].is_none_or(|x| x > sh + size(t)) {
                        short[t] = Some(sh + size(t));
                    }
                }
            }
            (long, short, via)
        };
        let (long, short, via) = paths(&|k: usize| member[k] && !cold[k]);
        let (Some(instructions), Some(shortest)) = (long[latch], short[latch]) else {
            return Err("no fast path through the tile loop".into());
        };
        let (with_cold, _, _) = paths(&|k: usize| member[k]);
        let mut path = FastPath {
            instructions,
            shortest,
            cold: with_cold[latch].unwrap_or(instructions),
            ..FastPath::default()
        };
        let mut k = latch;
        loop {
            path.path.splice(0..0, blocks[k].0..blocks[k].1);
            for ins in &code[blocks[k].0..blocks[k].1] {
                let op = ins.opcode.as_str();
                if op.starts_with("LDG") {
                    *path.loads.entry(width(op)).or_default() += 1;
                } else if op.starts_with("STG") {
                    *path.stores.entry(width(op)).or_default() += 1;
                } else if op.starts_with("BAR") {
                    path.barriers += 1;
                } else if op.starts_with("SHFL") {
                    path.shuffles += 1;
                }
            }
            match via[k] {
                Some(p) => k = p,
                None => break,
            }
        }
        Ok(path)
    }
}

/// The static figures of one specialized step.
#[derive(Debug, Clone, PartialEq)]
pub struct Figures {
    /// The kernel.
    pub name: String,
    /// The architecture it was assembled for.
    pub arch: String,
    /// `ptxas -v`.
    pub resources: Resources,
    /// SASS instructions of the whole kernel.
    pub instructions: usize,
    /// `LDL`/`STL` anywhere in it.
    pub local_accesses: usize,
    /// Barriers anywhere in it.
    pub barriers: usize,
    /// Its fast path per tile.
    pub path: FastPath,
    /// The 128-bit (and, for 4-bit codes, 64-bit) accesses a thread's 16 elements need:
    /// (loads, stores) of 128 bits, (loads, stores) of 64 bits.
    pub vector: ((usize, usize), (usize, usize)),
    /// Quantization blocks per tile (of its smallest block; 1 without any).
    pub blocks_per_tile: usize,
    /// Its budget of fast-path instructions per element ([`budget`]).
    pub budget: f64,
}

/// Elements per thread and tile.
const PER: usize = lpmm_backend::abi::PER as usize;

impl Figures {
    /// Fast-path instructions per element.
    pub fn per_element(&self) -> f64 {
        self.path.instructions as f64 / PER as f64
    }

    /// Instructions per element on the longest path with the cold blocks ([`FastPath::cold`]).
    pub fn cold_per_element(&self) -> f64 {
        self.path.cold as f64 / PER as f64
    }

    /// The gates this kernel breaks, in words (empty: it passes): a 0-byte stack frame, no
    /// spills, no local memory, every element moved in 128-bit accesses (64-bit for a thread's
    /// 4-bit codes), at most one barrier per quantization block in the tile loop (and two before
    /// it: the maps' load and their bucket tables), its instruction budget.
    pub fn violations(&self) -> Vec<String> {
        let mut v = Vec::new();
        let r = self.resources;
        if r.stack_frame != 0 || r.spill_stores != 0 || r.spill_loads != 0 {
            v.push(format!(
                "a {}-byte stack frame, {} + {} bytes of spills",
                r.stack_frame, r.spill_stores, r.spill_loads
            ));
        }
        if self.local_accesses != 0 {
            v.push(format!("{} LDL/STL instructions", self.local_accesses));
        }
        let ((l128, s128), (l64, s64)) = self.vector;
        let got = |m: &BTreeMap<u32, usize>, w| m.get(&w).copied().unwrap_or(0);
        if got(&self.path.loads, 128) < l128
            || got(&self.path.stores, 128) < s128
            || got(&self.path.loads, 64) < l64
            || got(&self.path.stores, 64) < s64
        {
            v.push(format!(
                "its fast path has loads {:?} and stores {:?} (bits: count), where its elements need {l128} + {s128} 128-bit and {l64} + {s64} 64-bit ones",
                self.path.loads, self.path.stores
            ));
        }
        if self.path.barriers > self.blocks_per_tile || self.barriers > 2 + self.blocks_per_tile {
            v.push(format!(
                "{} barriers per tile ({} in all) for {} quantization blocks",
                self.path.barriers, self.barriers, self.blocks_per_tile
            ));
        }
        if self.per_element() > self.budget {
            v.push(format!(
                "{:.1} fast-path instructions per element, over its budget of {}",
                self.per_element(),
                self.budget
            ));
        }
        v
    }
}

/// The budget of fast-path SASS instructions per element of a plan's kernel (issue 57): AdamW
/// with block-wise 8- or 4-bit states 100, and 15 more for a stochastically rounded parameter
/// (its random draws: a ChaCha8 block per two threads); f32 AdamW 75 (it moves 28 B/param and is
/// memory-bound below that); LPMM-SGDM 120; 8-bit Lion 80. A rule not among these gets AdamW's.
pub fn budget(plan: &PlanKernel) -> f64 {
    // Stochastically rounded slots that store (an accumulator is only cleared).
    let stochastic = plan
        .formats
        .iter()
        .enumerate()
        .filter(|&(k, f)| k != 1 && f.is_some_and(|f| f.stochastic()))
        .count() as f64;
    let quantized = plan
        .formats
        .iter()
        .flatten()
        .any(|f| f.name() == "blockwise");
    match (plan.rule_name(), quantized) {
        ("adam", false) => 75.0 + 15.0 * stochastic,
        ("sgd", _) => 120.0,
        ("lion", _) => 80.0 + 15.0 * stochastic,
        _ => 100.0 + 15.0 * stochastic,
    }
}

/// The 128-bit and 64-bit accesses one thread's 16 elements of `plan` take: ((loads, stores)
/// of 128 bits, (loads, stores) of 64 bits).
pub fn vector_accesses(plan: &PlanKernel) -> ((usize, usize), (usize, usize)) {
    let (mut l128, mut s128, mut l64, mut s64) = (0, 0, 0, 0);
    for (slot, f) in plan.formats.iter().enumerate() {
        let Some(f) = f else { continue };
        let (wide, narrow) = match f.name() {
            "f32" | "split_f32" => (4, 0),
            "bf16" => (2, 0),
            _ if f.kernel_aux() >> 24 == 8 => (1, 0),
            _ => (0, 1),
        };
        l128 += wide;
        l64 += narrow;
        // The accumulator is cleared: 4-bit codes are left as they are.
        if slot == 1 {
            s128 += wide;
        } else {
            s128 += wide;
            s64 += narrow;
        }
    }
    l128 += match plan.input {
        GradInput::None => 0,
        GradInput::F32 => 4,
        GradInput::Bf16 => 2,
    };
    ((l128, s128), (l64, s64))
}

/// The bytes one element of `plan` moves in global memory per step: every slot read and written
/// (the accumulator cleared), a block-wise slot's codes and its absmax per block, and the io
/// gradient read.
pub fn bytes_per_element(plan: &PlanKernel) -> f64 {
    let mut bytes = 0.0;
    for f in plan.formats.iter().flatten() {
        let one = match f.name() {
            "f32" | "split_f32" => 4.0,
            "bf16" => 2.0,
            _ => {
                let aux = f.kernel_aux();
                f64::from(aux >> 24) / 8.0 + 4.0 / f64::from(1u32 << ((aux >> 8) & 0xFF))
            }
        };
        bytes += 2.0 * one;
    }
    bytes
        + match plan.input {
            GradInput::None => 0.0,
            GradInput::F32 => 4.0,
            GradInput::Bf16 => 2.0,
        }
}

/// Quantization blocks per tile of `plan` (its smallest block's; 1 without a quantized slot).
pub fn blocks_per_tile(plan: &PlanKernel) -> usize {
    let tile = lpmm_backend::abi::TILE as usize;
    plan.formats
        .iter()
        .flatten()
        .filter(|f| f.name() == "blockwise")
        .map(|f| tile >> ((f.kernel_aux() >> 8) & 0xFF))
        .max()
        .unwrap_or(1)
}

/// Runs `ptxas -v` (and `extra` options) on `ptx` for `arch`, writing the cubin to `cubin`, then
/// `nvdisasm -c` (and `disasm` options) on it: ptxas's output and the SASS.
fn disassemble(
    ptxas: &Path,
    nvdisasm: &Path,
    arch: &str,
    ptx: &Path,
    cubin: &Path,
    extra: &[&str],
    disasm: &[&str],
) -> Result<(String, String), String> {
    let out = std::process::Command::new(ptxas)
        .arg(format!("-arch={arch}"))
        .arg("-v")
        .args(extra)
        .arg(ptx)
        .arg("-o")
        .arg(cubin)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", ptxas.display()))?;
    if !out.status.success() {
        return Err(format!(
            "ptxas -arch={arch} -v failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let info = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let out = std::process::Command::new(nvdisasm)
        .arg("-c")
        .args(disasm)
        .arg(cubin)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", nvdisasm.display()))?;
    if !out.status.success() {
        return Err(format!(
            "nvdisasm -c {} failed: {}",
            cubin.display(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok((info, String::from_utf8_lossy(&out.stdout).into_owned()))
}

/// Runs `ptxas -v` on `ptx` for `arch` (writing the cubin to `dir`) and `nvdisasm` on the cubin,
/// and returns every plan's figures (lpmm-backend's `plans` order).
pub fn figures(
    ptxas: &Path,
    nvdisasm: &Path,
    arch: &str,
    ptx: &Path,
    dir: &Path,
) -> Result<Vec<Figures>, String> {
    let cubin = dir.join(format!("lpmm.{arch}.cubin"));
    let (info, sass) = disassemble(ptxas, nvdisasm, arch, ptx, &cubin, &[], &[])?;
    let res = resources(&info);
    let sass = functions(&sass);
    lpmm_backend::plans::plans()
        .iter()
        .map(|plan| {
            let f = sass
                .get(&plan.name)
                .ok_or_else(|| format!("{}: not in the cubin's SASS", plan.name))?;
            Ok(Figures {
                name: plan.name.clone(),
                arch: arch.to_string(),
                resources: res
                    .get(&plan.name)
                    .copied()
                    .ok_or_else(|| format!("{}: not in ptxas -v's output", plan.name))?,
                instructions: f.code.len(),
                local_accesses: f.local_accesses(),
                barriers: f.barriers(),
                path: f.fast_path().map_err(|e| format!("{}: {e}", plan.name))?,
                vector: vector_accesses(plan),
                blocks_per_tile: blocks_per_tile(plan),
                budget: budget(plan),
            })
        })
        .collect()
}

/// Every plan's fast path by category ([`lines::breakdown`]) for `arch`, from `ptx`: the program
/// `source` compiled with line information (NVRTC's `-lineinfo`), assembled with `ptxas
/// -lineinfo` into `dir` and disassembled with `nvdisasm -gi`. Each row's per-element count is
/// this build's; the report checks it against the committed build's.
pub fn breakdowns(
    ptxas: &Path,
    nvdisasm: &Path,
    arch: &str,
    ptx: &Path,
    dir: &Path,
    source: &str,
) -> Result<Vec<lines::Breakdown>, String> {
    let categories = lines::line_categories(source)?;
    let cubin = dir.join(format!("lpmm.{arch}.lineinfo.cubin"));
    let (_, sass) = disassemble(ptxas, nvdisasm, arch, ptx, &cubin, &["-lineinfo"], &["-gi"])?;
    let sass = functions(&sass);
    lpmm_backend::plans::plans()
        .iter()
        .map(|plan| {
            let f = sass
                .get(&plan.name)
                .ok_or_else(|| format!("{}: not in the cubin's SASS", plan.name))?;
            let path = f.fast_path().map_err(|e| format!("{}: {e}", plan.name))?;
            Ok((
                plan.name.clone(),
                arch.to_string(),
                path.instructions as f64 / PER as f64,
                lines::breakdown(f, &path, &categories),
            ))
        })
        .collect()
}

/// The figures as a markdown table.
pub fn table(figures: &[Figures]) -> String {
    let mut o = String::from(
        "| kernel | arch | fast path per element (shortest) | budget | with cold paths | registers | stack frame | spills | SASS instructions | LDL/STL | 128-bit loads / stores | 64-bit loads / stores | barriers per tile (in all) | shuffles per tile |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for f in figures {
        let r = f.resources;
        let got = |m: &BTreeMap<u32, usize>, w| m.get(&w).copied().unwrap_or(0);
        o += &format!(
            "| {} | {} | {:.1} ({:.1}) | {} | {:.1} | {} | {} B | {} B | {} | {} | {} / {} | {} / {} | {} ({}) | {} |\n",
            f.name.trim_start_matches("lpmm_plan_"),
            f.arch,
            f.per_element(),
            f.path.shortest as f64 / PER as f64,
            f.budget,
            f.cold_per_element(),
            r.registers,
            r.stack_frame,
            r.spill_stores + r.spill_loads,
            f.instructions,
            f.local_accesses,
            got(&f.path.loads, 128),
            got(&f.path.stores, 128),
            got(&f.path.loads, 64),
            got(&f.path.stores, 64),
            f.path.barriers,
            f.barriers,
            f.path.shuffles,
        );
    }
    o
}

/// The command that prints the table.
pub const COMMAND: &str = "cargo xtask kernels --report";

#[cfg(test)]
mod tests {
    use super::*;

    const SASS: &str = "\
//--------------------- .text.k --------------------------
k:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
.L_x_1:
        /*0020*/                   LDG.E.128 R4, desc[UR8][R2.64] ;
        /*0030*/               @P0 BRA `(.L_x_2) ;
        /*0040*/                   FADD R5, R5, R6 ;
        /*0050*/                   FADD R5, R5, R6 ;
.L_x_2:
        /*0060*/               @P1 BRA `(.L_x_3) ;
        /*0070*/                   CALL.REL.NOINC `($__internal_0_slowpath) ;
.L_x_3:
        /*0080*/                   STG.E.128 desc[UR8][R2.64], R4 ;
        /*0090*/               @P2 BRA `(.L_x_1) ;
        /*00a0*/                   EXIT ;
$__internal_0_slowpath:
        /*00b0*/                   RET.REL.NODEC R4 `(k) ;
";

    #[test]
    fn the_fast_path_skips_slow_calls_and_takes_the_dearer_branch() {
        let fs = functions(SASS);
        let f = &fs["k"];
        assert_eq!(f.code.len(), 12);
        assert_eq!(f.own, 11);
        let p = f.fast_path().unwrap();
        // LDG, BRA, FADD, FADD, BRA, STG, BRA: the call's block is cold.
        assert_eq!(p.instructions, 7);
        assert_eq!(p.shortest, 5);
        assert_eq!(p.loads[&128], 1);
        assert_eq!(p.stores[&128], 1);
        // With the call's block: one more.
        assert_eq!(p.cold, 8);
        assert_eq!(p.path.len(), 7);
    }

    #[test]
    fn the_budgets_are_issue_57s() {
        // 8-bit AdamW bf16 (nearest) 100, with stochastic rounding 115; 4-bit AdamW 100 (115
        // with a stochastically rounded parameter); LPMM-SGDM 120; Lion 8-bit 80; f32 AdamW 75.
        let want = [
            ("adamw_f32", 75.0),
            ("adamw_8bit", 100.0),
            ("adamw_8bit_bf16", 100.0),
            ("adamw_8bit_bf16_sr", 115.0),
            ("adamw_4bit", 100.0),
            ("adamw_4bit_bf16", 100.0),
            ("adamw_4bit_bf16_sr_released", 115.0),
            ("lpmm_sgdm", 120.0),
            ("lion_8bit", 80.0),
        ];
        let plans = lpmm_backend::plans::plans();
        for (preset, b) in want {
            let of: Vec<f64> = plans
                .iter()
                .filter(|p| p.preset == preset)
                .map(budget)
                .collect();
            assert!(!of.is_empty(), "{preset} has plans");
            assert!(of.iter().all(|&x| x == b), "{preset}: {of:?}, want {b}");
        }
        assert_eq!(
            plans
                .iter()
                .filter(|p| !want.iter().any(|w| w.0 == p.preset))
                .count(),
            0,
            "every plan's preset has a budget above"
        );
    }

    #[test]
    fn bytes_per_element_are_the_benchmarks() {
        // docs/BENCHMARKS.md: 8-bit AdamW with bf16 parameter and accumulator 12.06 B/param; f32
        // AdamW with an f32 accumulator 32, and 2 more for a bf16 gradient read.
        let of = |name: &str| {
            let p = lpmm_backend::plans::plans()
                .iter()
                .find(|p| p.name == name)
                .unwrap();
            bytes_per_element(p)
        };
        assert!((of("lpmm_plan_adamw_8bit_bf16_acc") - 12.0625).abs() < 1e-9);
        assert!((of("lpmm_plan_adamw_f32_acc") - 32.0).abs() < 1e-9);
        assert!((of("lpmm_plan_adamw_f32_acc_bf16") - 34.0).abs() < 1e-9);
    }

    #[test]
    fn line_information_is_read() {
        let sass = "//--------------------- .text.k --------------------------\n\t//## File \"a.cu\", line 20 inlined at \"a.cu\", line 7\n\t//## File \"a.cu\", line 7\n        /*0000*/                   FADD R1, R2, R3 ;\n        /*0010*/                   FMUL R1, R2, R3 ;\n\t//## File \"a.cu\", line 9\n        /*0020*/                   EXIT ;\n";
        let f = &functions(sass)["k"];
        assert_eq!(f.code[0].lines, [20, 7]);
        assert_eq!(f.code[1].lines, [20, 7]);
        assert_eq!(f.code[2].lines, [9]);
    }

    #[test]
    fn ptxas_lines_are_read() {
        let out = "ptxas info    : Compiling entry function 'k' for 'sm_90'\nptxas info    : Function properties for k\n    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\nptxas info    : Used 96 registers, 384 bytes cmem[0]\n";
        let r = resources(out)["k"];
        assert_eq!(
            r,
            Resources {
                registers: 96,
                stack_frame: 0,
                spill_stores: 8,
                spill_loads: 4
            }
        );
    }
}
