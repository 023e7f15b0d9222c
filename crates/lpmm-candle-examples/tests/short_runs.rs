//! A short version of the comparison: every preset's training loss falls on both tasks, and the
//! report's JSON has the documented fields. No timing assertions.

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use lpmm_candle_examples::experiments::{self, Budget, CharLm, LmRecipe, RunResult};

fn falls(r: &RunResult) {
    let first = r.curve[0];
    let last = *r.curve.last().unwrap();
    assert!(
        last < 0.9 * first,
        "{} on {}: loss {first} -> {last}",
        r.preset,
        r.task
    );
    assert!(
        r.val_loss.is_finite() && (0.0..=1.0).contains(&r.val_accuracy),
        "{r:?}"
    );
}

#[test]
fn every_preset_learns_on_both_tasks_and_the_json_schema_holds() -> candle_core::Result<()> {
    let digits = experiments::digits()?;
    assert_eq!((digits.train_y.len(), digits.val_y.len()), (1437, 360));
    let text = experiments::shakespeare()?;
    assert_eq!(text.vocab.len(), 76);
    for preset in experiments::presets() {
        let d = experiments::run_digits(
            &digits,
            &preset,
            0,
            Budget {
                steps: 60,
                batch: 64,
            },
            |_| {},
        )?;
        falls(&d);
        // A smaller model than the comparison's, to keep the test short.
        let recipe = LmRecipe {
            width: 32,
            heads: 2,
            layers: 1,
            context: 32,
            budget: Budget {
                steps: 30,
                batch: 16,
            },
            warmup: 5,
            val_windows: Some(16),
            ..LmRecipe::default_run()
        };
        let s = experiments::run_char_lm(&text, &preset, 0, &recipe, |_| {})?;
        falls(&s);
        println!(
            "{}: digits {:.2} ms/step, language model {:.1} ms/step",
            preset.name, d.ms_per_step, s.ms_per_step
        );
        let json = serde_json::to_value(&s).unwrap();
        for field in [
            "task",
            "preset",
            "reference",
            "seed",
            "params",
            "bytes_per_param",
            "final_train_loss",
            "val_loss",
            "val_accuracy",
            "ms_per_step",
            "curve",
            "curve_every",
            "sample",
        ] {
            assert!(json.get(field).is_some(), "missing {field}");
        }
    }
    Ok(())
}

/// Every parameter of the comparison's language model receives a non-zero gradient from the
/// training loss. With candle-nn's fused `LayerNorm` or `ops::softmax_last_dim` in the model,
/// this fails: nothing before the final layer norm gets a gradient (with the fused softmax, no
/// query or key weight does).
#[test]
fn every_parameter_receives_a_gradient() -> candle_core::Result<()> {
    let text = experiments::shakespeare()?;
    let recipe = LmRecipe::default_run();
    let shape = recipe.shape(text.vocab.len());
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let model = CharLm::new(
        shape,
        VarBuilder::from_varmap(&varmap, DType::F32, &dev),
        &dev,
    )?;
    model.init(&varmap, 0, recipe.init_std)?;
    let (b, t) = (4, shape.context);
    let starts = [0, 1000, 20_000, 300_000];
    let x: Vec<u32> = starts
        .iter()
        .flat_map(|&s| text.train[s..s + t].iter().copied())
        .collect();
    let y: Vec<u32> = starts
        .iter()
        .flat_map(|&s| text.train[s + 1..s + t + 1].iter().copied())
        .collect();
    let logits = model
        .forward(&Tensor::from_vec(x, (b, t), &dev)?)?
        .reshape((b * t, shape.vocab))?;
    let loss = candle_nn::loss::cross_entropy(&logits, &Tensor::from_vec(y, b * t, &dev)?)?;
    let grads = loss.backward()?;
    let data = varmap.data().lock().unwrap();
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    // 2 embeddings, 6 matrices or gains per block, the final layer norm's gain and the head.
    assert_eq!(names.len(), 2 + 6 * shape.layers + 2, "{names:?}");
    let nonzero = |g: &Tensor| -> candle_core::Result<bool> {
        Ok(g.abs()?.sum_all()?.to_scalar::<f32>()? > 0.0)
    };
    let mut missing = Vec::new();
    for name in names {
        let Some(g) = grads.get(data[name].as_tensor()) else {
            missing.push(name.clone());
            continue;
        };
        if !nonzero(g)? {
            missing.push(name.clone());
        }
        // The query, key and value projections share one matrix: rows [0, w) make the queries,
        // [w, 2w) the keys, [2w, 3w) the values. Each part must get a gradient of its own (with a
        // softmax that has no backward pass, only the values would). (Not so for the bias: the
        // keys' bias shifts a query's scores all alike, which the softmax ignores, so its
        // gradient is zero in exact arithmetic.)
        if name.ends_with("qkv.weight") {
            for (k, part) in ["query", "key", "value"].iter().enumerate() {
                if !nonzero(&g.narrow(0, k * shape.width, shape.width)?)? {
                    missing.push(format!("{name} ({part} part)"));
                }
            }
        }
    }
    assert!(missing.is_empty(), "no gradient reaches {missing:?}");
    Ok(())
}

/// The same seed gives the same bits: two runs of each task with a stochastic-rounding preset
/// (whose random streams follow the order of the parameters) agree exactly, and another seed
/// differs. (Each run builds its own `VarMap`, whose hash order differs from the other's.)
#[test]
fn same_seed_same_bits() -> candle_core::Result<()> {
    let digits = experiments::digits()?;
    let text = experiments::shakespeare()?;
    let presets = experiments::presets();
    let lpmm_sgdm = presets.iter().find(|p| p.name == "LPMM-SGDM").unwrap();
    let recipe = LmRecipe {
        budget: Budget { steps: 6, batch: 8 },
        warmup: 2,
        val_windows: Some(8),
        init_std: 0.0, // candle's distributions, drawn by the seeded builder
        ..LmRecipe::default_run()
    };
    let budget = Budget {
        steps: 20,
        batch: 32,
    };
    let lm = |seed| experiments::run_char_lm(&text, lpmm_sgdm, seed, &recipe, |_| {});
    let mlp = |seed| experiments::run_digits(&digits, lpmm_sgdm, seed, budget, |_| {});
    let bits = |r: &RunResult| -> Vec<u64> {
        r.curve
            .iter()
            .chain([&r.val_loss, &r.val_accuracy])
            .map(|v| v.to_bits())
            .collect()
    };
    let (a, b, c) = (lm(0)?, lm(0)?, lm(1)?);
    assert_eq!(bits(&a), bits(&b), "language model, seed 0 twice");
    assert_eq!(a.sample, b.sample);
    assert_ne!(bits(&a), bits(&c), "language model, seeds 0 and 1");
    let (a, b, c) = (mlp(0)?, mlp(0)?, mlp(1)?);
    assert_eq!(bits(&a), bits(&b), "digits, seed 0 twice");
    assert_ne!(bits(&a), bits(&c), "digits, seeds 0 and 1");
    Ok(())
}

/// The held-out splits: the six plays are found in the embedded text, tile it, and each split
/// validates on one whole play and trains on the other five.
#[test]
fn each_play_can_be_held_out() -> candle_core::Result<()> {
    let all = experiments::shakespeare()?;
    let total = all.train.len() + all.val.len();
    for (i, (name, _)) in experiments::PLAYS.iter().enumerate() {
        let t = experiments::shakespeare_held_out(i)?;
        assert_eq!(t.train.len() + t.val.len(), total, "{name}");
        assert_eq!(t.vocab, all.vocab, "{name}");
        assert!(
            (90_000..200_000).contains(&t.val.len()),
            "{name}: {} bytes",
            t.val.len()
        );
        assert_eq!(t.name, format!("shakespeare, {name} held out"));
        assert_eq!(experiments::play_index(&(i + 1).to_string()), Some(i));
        assert_eq!(experiments::play_index(&name.to_lowercase()), Some(i));
    }
    assert_eq!(experiments::play_index("tempest"), Some(4));
    assert_eq!(experiments::play_index("7"), None);
    assert_eq!(experiments::play_index("x"), None);
    assert_eq!(experiments::play_from("macb").ok(), Some(1));
    let err = experiments::play_from("king lear")
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("1 Hamlet, 2 Macbeth"), "{err}");
    // A play alone: its own bytes split 90/10, its own vocabulary.
    let alone = experiments::shakespeare_play(1)?;
    assert_eq!(alone.name, "Macbeth alone");
    let held_out = experiments::shakespeare_held_out(1)?;
    assert_eq!(alone.train.len() + alone.val.len(), held_out.val.len());
    assert_eq!(
        alone.train.len(),
        (alone.train.len() + alone.val.len()) * 9 / 10
    );
    assert!(
        alone
            .decode(&alone.train)
            .starts_with("MACBETH\n\nby William Shakespeare")
    );
    let macbeth = experiments::shakespeare_held_out(1)?;
    assert!(
        macbeth
            .decode(&macbeth.val)
            .starts_with("MACBETH\n\nby William Shakespeare")
    );
    Ok(())
}
