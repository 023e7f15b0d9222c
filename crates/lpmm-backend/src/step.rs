//! A step on the device: the items of the stepping parameters with their plans (and the
//! specialized step each may take), and the step primitives lpmm-optim's executor runs in the
//! shared schedule: each phase's fold passes batched over every stepping parameter, the folds
//! read back for the host combine, the fused pass.

use std::sync::atomic::{AtomicU32, Ordering};

use lpmm_optim::backend::{
    BackendError, Dtype, FoldInput, Folded, ParamLayout, ParamStep, Phase, StepWork,
};

use crate::abi::{
    CONST_WORDS, Entry, F_GIVEN_V, F_GIVEN_W, F_TRANSFORM, F_UPDATE_PARAM, FOLD_MOMENT, FOLD_STATS,
    FOLD_UPDATED, STAT_WORDS,
};
use crate::arena::{DeviceParam, State};
use crate::device::Device;
use crate::launch::Item;
use crate::plans::{self, GradInput};
use crate::runtime::{Io, Runtime, Specialized};
use crate::views::{DeviceInput, DeviceOutput};

/// What the step's items are made of.
struct StepCtx<'a, 'v, R: Runtime> {
    params: &'a [DeviceParam<R>],
    layouts: &'a [ParamLayout],
    stepping: &'a [(usize, ParamStep)],
    released: Option<(usize, DeviceInput<'v, R>)>,
    views: &'a [Option<R::View<'v>>],
    seed: u64,
}

impl<R: Runtime> Device<R> {
    /// The step's items of the stepping parameters `which` selects, with their plans. With
    /// `specialize` (the fused pass), an item whose parameter's plan has a specialized step
    /// ([`crate::plans`]) is marked to run it, where its addresses suit the runtime
    /// ([`Specialized::Aligned`]; the generic step runs it otherwise).
    fn step_items<'v>(
        &self,
        state: &State<R::Buffer>,
        ctx: &StepCtx<'_, 'v, R>,
        which: &dyn Fn(usize) -> bool,
        specialize: bool,
        items: &mut Vec<Item<'v, R>>,
    ) {
        let rt = &self.inner.rt;
        let mode = if specialize && self.inner.options.specialized {
            rt.specialized()
        } else {
            Specialized::None
        };
        for &(i, ref plan) in ctx.stepping {
            let layout = &ctx.layouts[i];
            if !which(i) {
                continue;
            }
            let input = ctx.released.filter(|(r, _)| *r == i).map(|(_, g)| g);
            let flags = layout.step_flags(plan.flags).0;
            // The specialized steps move the parameter by the rule, from gradients.
            let moves =
                flags & F_UPDATE_PARAM != 0 && flags & (F_TRANSFORM | F_GIVEN_V | F_GIVEN_W) == 0;
            let grad = match input {
                None => GradInput::None,
                Some(DeviceInput::Host(_)) => GradInput::F32,
                Some(DeviceInput::Device(v)) => match rt.view_info(&v).0 {
                    Dtype::Bf16 => GradInput::Bf16,
                    _ => GradInput::F32,
                },
            };
            let kernel = match mode {
                Specialized::None => None,
                _ if !moves => None,
                _ => plans::find(layout, &plan.rule, grad),
            };
            let before = items.len();
            self.items(
                state,
                &ctx.params[i],
                layout,
                ctx.seed,
                input,
                ctx.views[i],
                false,
                items,
            );
            for it in &mut items[before..] {
                it.plan = kernel.filter(|_| match mode {
                    // Every region and the io start where the kernel's vector accesses can.
                    Specialized::Aligned { bytes } => {
                        let regions = it.desc.slots.iter().flat_map(|s| s.region);
                        let io = it.view_io.map(|(v, at)| rt.io_address(&Io::View(v), at));
                        regions.chain(io).all(|a| a % bytes == 0)
                    }
                    _ => true,
                });
            }
            let words = plan.rule.words();
            let n = words.len().min(CONST_WORDS);
            for it in &mut items[before..] {
                let d = &mut it.desc;
                d.step = plan.t;
                d.flags |= flags;
                d.flag_index = i as u32;
                d.rule = plan.rule.kernel_id();
                d.clip = plan.clip;
                d.consts[..n].copy_from_slice(&words[..n]);
            }
        }
    }
}

/// The device's step primitives ([`Backend`](lpmm_optim::backend::Backend)'s `prepare`,
/// `begin_phase`, `fold`, `folded`, `fused`, `swap_wide`), each batched over every stepping
/// parameter of the batch into as few launches as the bindings allow. lpmm-optim's step
/// executor runs them in the shared schedule and combines the folds on the host.
impl<R: Runtime> Device<R> {
    /// The batch's lent buffers as views, by parameter index, and its released gradient, each
    /// checked as a device takes them (a lent parameter's buffer is a device buffer of its size).
    #[allow(clippy::type_complexity)]
    fn step_views<'w>(
        &self,
        work: &'w StepWork<'_, '_, '_, Self>,
    ) -> Result<
        (
            Vec<Option<R::View<'w>>>,
            Option<(usize, DeviceInput<'w, R>)>,
        ),
        BackendError,
    > {
        // One lifetime for the caller's lent and released buffers (both outlive the batch).
        let released = work.released.map(|(i, g)| {
            let g = match g {
                DeviceInput::Host(v) => DeviceInput::Host(v),
                DeviceInput::Device(v) => DeviceInput::Device(R::shorten(v)),
            };
            (i, g)
        });
        let mut views: Vec<Option<R::View<'w>>> = vec![None; work.params.len()];
        for (id, out) in work.lent.iter() {
            let DeviceOutput::Device(view) = out else {
                return Err(BackendError::Buffer {
                    what: "a lent parameter on a device is a device buffer".into(),
                });
            };
            let i = id.index();
            views[i] = self.lent_view(&work.layouts[i], Some(R::shorten(*view)))?;
        }
        if let Some((i, g)) = &released {
            self.check_input(g, work.layouts[*i].numel)?;
        }
        Ok((views, released))
    }

    /// The stepping parameters of a batch and their plans.
    fn stepping(work: &StepWork<'_, '_, '_, Self>) -> Vec<(usize, ParamStep)> {
        work.plans
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.map(|p| (i, p)))
            .collect()
    }

    /// Checks the batch's buffers and zeroes the flag buffer: one flag per parameter, then each
    /// parameter's block of the rule's fold words.
    pub(crate) fn step_prepare(
        &self,
        work: &mut StepWork<'_, '_, '_, Self>,
    ) -> Result<(), BackendError> {
        self.check()?;
        self.step_views(work)?;
        let mut state = self.inner.lock();
        self.ensure_flags(&mut state, work.params.len() * (1 + STAT_WORDS as usize))
    }

    /// Zeroes a slot phase's fold targets (the rule's fold words were zeroed by
    /// [`Device::step_prepare`]).
    pub(crate) fn step_begin(
        &self,
        work: &mut StepWork<'_, '_, '_, Self>,
        phase: Phase,
    ) -> Result<(), BackendError> {
        self.check()?;
        let Phase::Slot(slot) = phase else {
            return Ok(());
        };
        let state = self.inner.lock();
        for (i, p) in Self::stepping(work) {
            if p.plan.passes(phase, p.flags) == 0 {
                continue;
            }
            let Some(f) = work.layouts[i].format(slot) else {
                continue;
            };
            let targets = f.fold_targets();
            let regions = work.params[i].wide_regions[slot as usize].clone();
            self.write_wide(&state, &work.params[i], slot as usize, &mut |r| {
                targets.contains(&r).then(|| vec![0u32; regions[r].1])
            })?;
        }
        Ok(())
    }

    /// Fold pass `pass` of `phase`, for every parameter whose plan takes it, in one batch of
    /// launches.
    pub(crate) fn step_fold(
        &self,
        work: &mut StepWork<'_, '_, '_, Self>,
        phase: Phase,
        pass: usize,
    ) -> Result<(), BackendError> {
        self.check()?;
        let n = work.params.len();
        let (views, released) = self.step_views(work)?;
        let stepping = Self::stepping(work);
        let mut state = self.inner.lock();
        let mut items = Vec::new();
        let ctx = StepCtx {
            params: work.params,
            layouts: work.layouts,
            stepping: &stepping,
            released,
            views: &views,
            seed: work.seed,
        };
        let takes = |i: usize| work.plans[i].is_some_and(|p| pass < p.plan.passes(phase, p.flags));
        self.step_items(&state, &ctx, &takes, false, &mut items);
        for it in &mut items {
            // `pass | target << 8 | input << 16` (entries' `lpmm_fold`).
            let i = it.desc.flag_index as usize;
            let Some(step) = work.plans[i] else { continue };
            it.desc.mode = match phase {
                Phase::Stats => {
                    // The sums' count, as fractional bits, and how many.
                    let frac = lpmm_optim::backend::fixed_frac_bits(work.layouts[i].numel) as u32;
                    let stats = step.rule.stats() as u32;
                    // The fold writes no flag: its words are the parameter's block.
                    it.desc.flag_index = (n + i * STAT_WORDS as usize) as u32;
                    pass as u32 | FOLD_STATS << 8 | frac << 16 | stats << 24
                }
                Phase::Slot(slot) => {
                    let input = match step.plan.fold_input(phase, pass) {
                        Some(FoldInput::MomentGradient) => FOLD_MOMENT,
                        _ => FOLD_UPDATED,
                    };
                    pass as u32 | (slot as u32) << 8 | input << 16
                }
            };
        }
        self.run(&mut state, Entry::Fold, &mut items)?;
        Ok(())
    }

    /// What `phase` folded, read back for the host combine (`combine`), and what the combine
    /// wrote into a slot's tensor-wide regions written back.
    pub(crate) fn step_folded(
        &self,
        params: &mut [DeviceParam<R>],
        ran: &[bool],
        phase: Phase,
        combine: &mut dyn FnMut(usize, Folded<'_>),
    ) -> Result<(), BackendError> {
        self.check()?;
        let n = params.len();
        let state = self.inner.lock();
        match phase {
            Phase::Stats => {
                let flags = state.flags.as_ref().expect("allocated");
                let stat_words = STAT_WORDS as usize;
                let rt = &self.inner.rt;
                let words = self.guard(rt.read(flags, n, n * stat_words))?;
                let words: Vec<AtomicU32> = words.into_iter().map(AtomicU32::new).collect();
                for (i, _) in ran.iter().enumerate().filter(|(_, r)| **r) {
                    combine(i, Folded::Stats(&words[i * stat_words..][..stat_words]));
                }
            }
            Phase::Slot(slot) => {
                for (i, _) in ran.iter().enumerate().filter(|(_, r)| **r) {
                    let wide = self.wide_words(&state, &params[i], slot as usize)?;
                    combine(i, Folded::Wide(&wide));
                    self.write_wide(&state, &params[i], slot as usize, &mut |r| {
                        Some(wide[r].iter().map(|w| w.load(Ordering::Relaxed)).collect())
                    })?;
                }
            }
        }
        Ok(())
    }

    /// The fused pass of every stepping parameter (specialized steps where they apply), then
    /// the non-finite flags read back.
    pub(crate) fn step_fused(
        &self,
        work: &mut StepWork<'_, '_, '_, Self>,
        non_finite: &mut [bool],
    ) -> Result<(), BackendError> {
        self.check()?;
        let n = work.params.len();
        let (views, released) = self.step_views(work)?;
        let stepping = Self::stepping(work);
        let mut state = self.inner.lock();
        let mut items = Vec::new();
        let ctx = StepCtx {
            params: work.params,
            layouts: work.layouts,
            stepping: &stepping,
            released,
            views: &views,
            seed: work.seed,
        };
        self.step_items(&state, &ctx, &|_| true, true, &mut items);
        self.run(&mut state, Entry::Step, &mut items)?;
        let flags = state.flags.as_ref().expect("allocated");
        let rt = &self.inner.rt;
        let words = self.guard(rt.read(flags, 0, n.max(1)))?;
        for ((f, w), p) in non_finite.iter_mut().zip(words).zip(work.plans) {
            *f = p.is_some() && w != 0;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use lpmm_optim::backend::{Backend, Init, ParamId, StepWork, run_batch};
    use lpmm_optim::{ParamConfig, presets};

    use super::*;
    use crate::device::DeviceOptions;
    use crate::fake::{self, Host, View};
    use crate::views::DeviceOutput;

    /// Parameters of `shapes` registered with `config` on a device, each with its first step's
    /// plan.
    struct Setup {
        device: Device<Host>,
        layouts: Vec<ParamLayout>,
        params: Vec<DeviceParam<Host>>,
        plans: Vec<Option<ParamStep>>,
    }

    fn setup(
        host: Host,
        options: DeviceOptions,
        config: ParamConfig,
        shapes: &[usize],
        lent: bool,
    ) -> Setup {
        let device = Device::new(host, options).unwrap();
        let layouts: Vec<_> = shapes
            .iter()
            .map(|&n| fake::layout(config, &[n], lent))
            .collect();
        let init = || if lent { Init::Lent } else { Init::Fresh };
        let params = layouts
            .iter()
            .map(|l| device.allocate(l, init(), 0).unwrap())
            .collect();
        let plans = layouts
            .iter()
            .map(|l| Some(fake::plan(&config, l)))
            .collect();
        Setup {
            device,
            layouts,
            params,
            plans,
        }
    }

    /// Runs the step; each parameter's non-finite report.
    fn step(s: &mut Setup, lent: &mut [(ParamId, DeviceOutput<'_, Host>)]) -> Vec<bool> {
        let mut non_finite = vec![true; s.params.len()];
        let work = StepWork {
            params: &mut s.params,
            layouts: &s.layouts,
            plans: &s.plans,
            released: None,
            lent,
            seed: 9,
        };
        run_batch(&s.device, work, &mut non_finite).unwrap();
        non_finite
    }

    fn options() -> DeviceOptions {
        DeviceOptions::new(4096, 1 << 16)
    }

    #[test]
    fn the_fused_pass_steps_every_stepping_parameter_in_one_launch() {
        let config = presets::adamw_8bit_bf16(1e-3).build();
        let mut s = setup(Host::bindless(), options(), config, &[5000, 3000], false);
        assert_eq!(step(&mut s, &mut []), [false, false]);
        let launches = s.device.runtime().launches();
        assert_eq!(launches.len(), 1, "no fold phase: one fused launch");
        let l = &launches[0];
        assert_eq!((l.entry, l.plan, l.tiles), (Entry::Step, None, 3));
        let owners: Vec<u32> = l.descs.iter().map(|d| d.flag_index).collect();
        assert_eq!(owners, [0, 0, 1]);
        for d in &l.descs {
            let plan = s.plans[d.flag_index as usize].as_ref().unwrap();
            let words = plan.rule.words();
            assert_eq!((d.step, d.seed, d.rule), (1, 9, plan.rule.kernel_id()));
            assert_ne!(d.flags & F_UPDATE_PARAM, 0);
            assert_eq!(d.consts[..words.len()], words[..]);
        }
        // A parameter without a plan is not stepped.
        s.plans[0] = None;
        assert_eq!(step(&mut s, &mut []), [false, false]);
        let launches = s.device.runtime().launches();
        let owners: Vec<u32> = launches[1].descs.iter().map(|d| d.flag_index).collect();
        assert_eq!(owners, [1]);
    }

    #[test]
    fn a_parameter_is_reported_non_finite_where_its_flag_was_set() {
        let mut host = Host::bindless();
        host.flag_entry = Some(Entry::Step);
        let config = presets::adamw_8bit_bf16(1e-3).build();
        let mut s = setup(host, options(), config, &[5000, 3000, 10], false);
        s.plans[0] = None;
        assert_eq!(step(&mut s, &mut []), [false, true, true]);
    }

    #[test]
    fn specialized_steps_take_the_items_whose_addresses_suit_the_runtime() {
        let config = presets::adamw_8bit_bf16(1e-3).build();
        let shapes = [5000, 3 * 4096];
        let kernel = |s: &Setup| {
            let plan = s.plans[0].as_ref().unwrap();
            plans::find(&s.layouts[0], &plan.rule, GradInput::None).expect("a hot preset")
        };
        // Any item, where the options allow.
        for on in [true, false] {
            let mut host = Host::bindless();
            host.specialized = Specialized::Any;
            let options = options().with_specialized(on);
            let mut s = setup(host, options, config, &shapes, false);
            step(&mut s, &mut []);
            let launches = s.device.runtime().launches();
            assert_eq!(launches.len(), 1);
            assert_eq!(launches[0].plan, on.then(|| kernel(&s)));
            assert_eq!(s.device.plan_launches(), u64::from(on));
        }
        // Items at 16-byte addresses: a caller's buffer at byte 2 is stepped by the generic kernel.
        let mut host = Host::bindless();
        host.specialized = Specialized::Aligned { bytes: 16 };
        let mut s = setup(host, options(), config, &shapes, true);
        let aligned = View::new(1, Dtype::Bf16, shapes[0]);
        let shifted = View {
            at: 2,
            ..View::new(2, Dtype::Bf16, shapes[1])
        };
        let ids = fake::ids(2);
        let mut lent = [
            (ids[0], DeviceOutput::Device(aligned)),
            (ids[1], DeviceOutput::Device(shifted)),
        ];
        step(&mut s, &mut lent);
        let mut launches: Vec<_> = s
            .device
            .runtime()
            .launches()
            .into_iter()
            .map(|l| {
                (
                    l.plan,
                    l.descs.iter().map(|d| d.flag_index).collect::<Vec<_>>(),
                )
            })
            .collect();
        launches.sort();
        assert_eq!(
            launches,
            [(None, vec![1, 1, 1]), (Some(kernel(&s)), vec![0, 0])]
        );
    }

    #[test]
    fn fold_passes_come_first_each_batched_over_every_parameter_that_folds() {
        let config = presets::came_f32(1e-3).build();
        let mut s = Setup {
            layouts: Vec::new(),
            params: Vec::new(),
            ..setup(Host::bindless(), options(), config, &[], false)
        };
        for _ in 0..2 {
            let layout = fake::layout(config, &[64, 64], false);
            s.params
                .push(s.device.allocate(&layout, Init::Fresh, 0).unwrap());
            s.plans.push(Some(fake::plan(&config, &layout)));
            s.layouts.push(layout);
        }
        assert_eq!(step(&mut s, &mut []), [false, false]);
        let launches = s.device.runtime().launches();
        let (last, folds) = launches.split_last().unwrap();
        assert_eq!(last.entry, Entry::Step);
        assert!(folds.iter().all(|l| l.entry == Entry::Fold));
        let (mut stats, mut slots) = (0, 0);
        for l in folds {
            let mut owners: Vec<u32> = l.descs.iter().map(|d| d.flag_index).collect();
            owners.dedup();
            if (l.descs[0].mode >> 8) & 0xff == FOLD_STATS {
                // The sums go to each parameter's block after the flags.
                assert_eq!(owners, [2, 2 + STAT_WORDS]);
                stats += 1;
            } else {
                assert_eq!(owners, [0, 1]);
                slots += 1;
            }
        }
        assert!(
            stats > 0 && slots > 0,
            "{stats} statistics folds, {slots} slot folds"
        );
    }
}
