//! Which rank holds which elements of which parameter.
//!
//! Parameters that can be cut (every storage but rank-1 and factorized second moments, whose
//! statistics span the tensor) are laid end to end in a *flat space*, each starting at a
//! multiple of its alignment (`ParamConfig::shard_alignment`: 256 elements or its largest
//! quantization block, so blocks, packed words, random blocks and the norm's partial sums stay
//! whole on one rank); the flat space is padded to a multiple of `world x A` (A: the largest
//! alignment, at most 4096) and cut into `world` equal ranges, whose boundaries are therefore
//! multiples of every parameter's alignment. The other parameters are placed whole, each
//! on the rank with the least memory so far. Formats are decided on each logical parameter's
//! size before any of this (`PartsMut::add_param_shard`), so the world size never changes them.

use std::ops::Range;

/// The largest alignment a parameter can have (the largest quantization block): a multiple of
/// every alignment.
pub const UNIT: usize = 4096;

/// What the layout needs to know about a parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamSpec {
    /// Elements.
    pub numel: usize,
    /// Whether it may be cut (no state with tensor-wide statistics).
    pub splittable: bool,
    /// Where it may be cut: a power of two from 256 to [`UNIT`].
    pub align: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// At this offset of the flat space.
    Flat(usize),
    /// Whole, on this rank.
    Whole(usize),
}

/// One rank's part of one parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    /// The parameter's index.
    pub param: usize,
    /// Its elements held here.
    pub range: Range<usize>,
}

/// The placement of every parameter on `world` ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardLayout {
    world: usize,
    specs: Vec<ParamSpec>,
    places: Vec<Place>,
    /// Elements of the flat space per rank (a multiple of `UNIT`).
    per_rank: usize,
}

impl ShardLayout {
    /// The layout of `specs` (in registration order) on `world >= 1` ranks.
    pub fn new(specs: &[ParamSpec], world: usize) -> Self {
        let world = world.max(1);
        let mut flat = 0usize;
        let mut places = Vec::with_capacity(specs.len());
        let mut unit = 256usize;
        for s in specs {
            if s.splittable {
                let a = s.align.clamp(1, UNIT);
                flat = flat.div_ceil(a) * a;
                places.push(Place::Flat(flat));
                flat += s.numel;
                unit = unit.max(a);
            } else {
                places.push(Place::Whole(0));
            }
        }
        let per_rank = flat.div_ceil(world * unit) * unit;
        // Whole parameters: each on the least loaded rank (ties: the lowest), in order.
        let mut load: Vec<usize> = (0..world)
            .map(|r| {
                let lo = (r * per_rank).min(flat);
                let hi = ((r + 1) * per_rank).min(flat);
                hi - lo
            })
            .collect();
        for (s, p) in specs.iter().zip(places.iter_mut()) {
            if let Place::Whole(rank) = p {
                let r = (0..world).min_by_key(|&r| (load[r], r)).unwrap_or(0);
                *rank = r;
                load[r] += s.numel;
            }
        }
        ShardLayout {
            world,
            specs: specs.to_vec(),
            places,
            per_rank,
        }
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Elements of the flat space each rank holds (the reduce-scatter's count per rank; a
    /// multiple of every parameter's alignment).
    pub fn per_rank(&self) -> usize {
        self.per_rank
    }

    /// Length of the padded flat space.
    pub fn flat_len(&self) -> usize {
        self.per_rank * self.world
    }

    /// Where parameter `param` starts in the flat space (None: placed whole).
    pub fn flat_offset(&self, param: usize) -> Option<usize> {
        match self.places.get(param)? {
            Place::Flat(o) => Some(*o),
            Place::Whole(_) => None,
        }
    }

    /// The ranks holding parts of `param`, with their ranges, in element order.
    pub fn owners(&self, param: usize) -> Vec<(usize, Range<usize>)> {
        let n = self.specs[param].numel;
        match self.places[param] {
            Place::Whole(r) => vec![(r, 0..n)],
            Place::Flat(o) => (0..self.world)
                .filter_map(|r| {
                    let lo = (r * self.per_rank).max(o);
                    let hi = ((r + 1) * self.per_rank).min(o + n);
                    (lo < hi).then(|| (r, lo - o..hi - o))
                })
                .collect(),
        }
    }

    /// What `rank` holds, in parameter order.
    pub fn shards(&self, rank: usize) -> Vec<Shard> {
        (0..self.specs.len())
            .flat_map(|p| {
                self.owners(p)
                    .into_iter()
                    .filter(move |(r, _)| *r == rank)
                    .map(move |(_, range)| Shard { param: p, range })
            })
            .collect()
    }

    /// Elements `rank` holds over all parameters.
    pub fn elements(&self, rank: usize) -> usize {
        self.shards(rank).iter().map(|s| s.range.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(numel: usize) -> ParamSpec {
        ParamSpec {
            numel,
            splittable: true,
            align: if numel.is_multiple_of(2) { 2048 } else { 256 },
        }
    }

    #[test]
    fn every_element_has_exactly_one_owner_and_boundaries_are_units() {
        let specs = [
            spec(100),
            spec(3 * UNIT + 5),
            ParamSpec {
                numel: 5000,
                splittable: false,
                align: 256,
            },
            spec(UNIT),
            spec(10 * UNIT + 1),
            spec(1),
        ];
        for world in 1..=5 {
            let l = ShardLayout::new(&specs, world);
            for (p, s) in specs.iter().enumerate() {
                let owners = l.owners(p);
                let mut at = 0;
                for (r, range) in &owners {
                    assert!(*r < world);
                    assert_eq!(range.start, at, "world {world} param {p}: ranges tile it");
                    assert_eq!(range.start % s.align, 0, "a shard starts on its alignment");
                    at = range.end;
                }
                assert_eq!(at, s.numel);
                if !s.splittable {
                    assert_eq!(owners.len(), 1);
                }
            }
            let total: usize = (0..world).map(|r| l.elements(r)).sum();
            assert_eq!(total, specs.iter().map(|s| s.numel).sum::<usize>());
        }
    }

    #[test]
    fn ranks_hold_a_world_th_within_a_block_per_parameter() {
        let specs: Vec<ParamSpec> = [50_000, 12_345, 200_000, 64, 7_777, 100_000]
            .into_iter()
            .map(spec)
            .collect();
        let total: usize = specs.iter().map(|s| s.numel).sum();
        for world in 1..=4 {
            let l = ShardLayout::new(&specs, world);
            for r in 0..world {
                let share = total as f64 / world as f64;
                // One alignment per parameter (padding before it) and one per rank boundary.
                let slack = specs.iter().map(|s| s.align).sum::<usize>() as f64 + UNIT as f64;
                let held = l.elements(r) as f64;
                assert!(
                    (held - share).abs() <= slack,
                    "world {world} rank {r}: {held} vs {share}"
                );
            }
        }
    }
}
