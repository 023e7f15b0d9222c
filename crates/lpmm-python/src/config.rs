//! Configurations by name, as the Python classes ask for them: a preset of
//! [`lpmm_optim::presets`] by its function's name, its hyperparameters as a JSON object whose keys
//! are the rule's fields (`lr`, `betas`, `eps`, `weight_decay`, ...: torch's names, the keys of a
//! torch param group), and the parameter's storage chosen from the tensor's dtype.

use lpmm_optim::backend::Dtype;
use lpmm_optim::{ParamConfig, Storage, StoreRounding, presets};
use serde_json::{Map, Value};

use crate::EngineError;

/// Every preset of [`lpmm_optim::presets`] by name, each made with learning rate `lr` (and for
/// the SGD presets momentum 0.9); the Adafactor presets keep their relative step (`lr` unused).
/// Muon's presets step matrices only (a parameter of another rank is refused when it is added,
/// as `torch.optim.Muon` refuses it): give them a model's hidden matrices and another optimizer
/// the rest, as torch's documentation of `Muon` does.
pub const PRESETS: &[&str] = &[
    "sgdm_f32",
    "lpmm_sgdm",
    "adamw_f32",
    "adamw_8bit",
    "adamw_4bit",
    "adamw_8bit_bf16",
    "adamw_8bit_bf16_sr",
    "adamw_8bit_bf16_plus8",
    "adamw_4bit_split",
    "adamw_4bit_bf16_sr_released",
    "lion_f32",
    "lion_8bit",
    "adafactor_f32",
    "adafactor_8bit",
    "adafactor_lpmm",
    "came_f32",
    "came_8bit",
    "came_lpmm",
    "ademamix_f32",
    "ademamix_8bit",
    "schedule_free_adamw_f32",
    "schedule_free_adamw_8bit",
    "rmsprop_f32",
    "rmsprop_8bit",
    "adagrad_f32",
    "adagrad_8bit",
    "lamb_f32",
    "lamb_8bit",
    "muon_f32",
    "muon_bf16",
    "muon_8bit",
    "muon_4bit",
    "muon_8bit_bf16_sr",
    "muon_4bit_bf16_sr",
    "adalomo_f32",
    "adalomo_bf16_sr",
];

/// The preset `name` with learning rate `lr`.
pub fn preset(name: &str, lr: f64) -> Result<ParamConfig, EngineError> {
    use presets as p;
    Ok(match name {
        "sgdm_f32" => p::sgdm_f32(lr, 0.9).build(),
        "lpmm_sgdm" => p::lpmm_sgdm(lr, 0.9).build(),
        "adamw_f32" => p::adamw_f32(lr).build(),
        "adamw_8bit" => p::adamw_8bit(lr).build(),
        "adamw_4bit" => p::adamw_4bit(lr).build(),
        "adamw_8bit_bf16" => p::adamw_8bit_bf16(lr).build(),
        "adamw_8bit_bf16_sr" => p::adamw_8bit_bf16_sr(lr).build(),
        "adamw_8bit_bf16_plus8" => p::adamw_8bit_bf16_plus8(lr).build(),
        "adamw_4bit_split" => p::adamw_4bit_split(lr).build(),
        "adamw_4bit_bf16_sr_released" => p::adamw_4bit_bf16_sr_released(lr).build(),
        "lion_f32" => p::lion_f32(lr).build(),
        "lion_8bit" => p::lion_8bit(lr).build(),
        "adafactor_f32" => p::adafactor_f32().build(),
        "adafactor_8bit" => p::adafactor_8bit().build(),
        "adafactor_lpmm" => p::adafactor_lpmm().build(),
        "came_f32" => p::came_f32(lr).build(),
        "came_8bit" => p::came_8bit(lr).build(),
        "came_lpmm" => p::came_lpmm(lr).build(),
        "ademamix_f32" => p::ademamix_f32(lr).build(),
        "ademamix_8bit" => p::ademamix_8bit(lr).build(),
        "schedule_free_adamw_f32" => p::schedule_free_adamw_f32(lr).build(),
        "schedule_free_adamw_8bit" => p::schedule_free_adamw_8bit(lr).build(),
        "rmsprop_f32" => p::rmsprop_f32(lr).build(),
        "rmsprop_8bit" => p::rmsprop_8bit(lr).build(),
        "adagrad_f32" => p::adagrad_f32(lr).build(),
        "adagrad_8bit" => p::adagrad_8bit(lr).build(),
        "lamb_f32" => p::lamb_f32(lr).build(),
        "lamb_8bit" => p::lamb_8bit(lr).build(),
        "muon_f32" => p::muon_f32(lr).build(),
        "muon_bf16" => p::muon_bf16(lr).build(),
        "muon_8bit" => p::muon_8bit(lr).build(),
        "muon_4bit" => p::muon_4bit(lr).build(),
        "muon_8bit_bf16_sr" => p::muon_8bit_bf16_sr(lr).build(),
        "muon_4bit_bf16_sr" => p::muon_4bit_bf16_sr(lr).build(),
        "adalomo_f32" => p::adalomo_f32(lr).build(),
        "adalomo_bf16_sr" => p::adalomo_bf16_sr(lr).build(),
        other => {
            return Err(EngineError::Config(format!(
                "unknown preset {other:?}; the presets are: {}",
                PRESETS.join(", ")
            )));
        }
    })
}

/// The rule's name and its hyperparameters as a JSON object (`{"lr": .., "betas": [..], ..}`).
pub fn hyper_json(config: &ParamConfig) -> Result<(String, Map<String, Value>), EngineError> {
    let internal = |e: String| EngineError::Config(format!("hyperparameters: {e}"));
    let value = serde_json::to_value(config.hyper).map_err(|e| internal(e.to_string()))?;
    let Value::Object(outer) = value else {
        return Err(internal("not an object".into()));
    };
    let mut entries = outer.into_iter();
    match (entries.next(), entries.next()) {
        (Some((rule, Value::Object(fields))), None) => Ok((rule, fields)),
        _ => Err(internal("not one rule".into())),
    }
}

/// `config` with the hyperparameters in `overrides` (a JSON object of the rule's fields) changed.
/// A key the rule does not have is refused, naming the ones it has; the result is validated
/// ([`ParamConfig::validate`]).
pub fn with_hyper(config: &ParamConfig, overrides: &str) -> Result<ParamConfig, EngineError> {
    let overrides: Map<String, Value> = serde_json::from_str(overrides)
        .map_err(|e| EngineError::Config(format!("hyperparameters are not a JSON object: {e}")))?;
    let (rule, mut fields) = hyper_json(config)?;
    for (key, value) in overrides {
        if !fields.contains_key(&key) {
            let known: Vec<&str> = fields.keys().map(String::as_str).collect();
            return Err(EngineError::Config(format!(
                "{rule} has no hyperparameter {key:?}; its hyperparameters are: {}",
                known.join(", ")
            )));
        }
        fields.insert(key, value);
    }
    let hyper: lpmm_optim::Hyper = serde_json::from_value(Value::Object(Map::from_iter([(
        rule.clone(),
        Value::Object(fields),
    )])))
    .map_err(|e| EngineError::Config(format!("{rule}'s hyperparameters: {e}")))?;
    let out = config.with_hyper(hyper);
    out.validate()
        .map_err(|e| EngineError::Config(format!("{rule}: {e}")))?;
    Ok(out)
}

/// Where a parameter's value lives: `"auto"` (the tensor's own dtype: f32 for float32 tensors,
/// bf16 with stochastic rounding for bfloat16 ones), `"preset"` (the preset's storage), or a
/// storage by name.
pub fn param_storage(choice: &str, preset: Storage, dtype: Dtype) -> Result<Storage, EngineError> {
    Ok(match choice {
        "auto" => match dtype {
            Dtype::Bf16 => Storage::Bf16(StoreRounding::Stochastic),
            _ => Storage::F32,
        },
        "preset" => preset,
        "f32" => Storage::F32,
        "bf16" => Storage::Bf16(StoreRounding::Nearest),
        "bf16_sr" => Storage::Bf16(StoreRounding::Stochastic),
        "bf16_kahan" => Storage::Bf16Kahan,
        "split_f32" => Storage::SplitF32,
        "bf16_plus8" => Storage::Bf16Plus8(StoreRounding::Nearest),
        "bf16_plus8_sr" => Storage::Bf16Plus8(StoreRounding::Stochastic),
        "linear8_sr" => Storage::LINEAR8_GROUP64_SR,
        other => {
            return Err(EngineError::Config(format!(
                "unknown param_storage {other:?}; one of: {}",
                PARAM_STORAGES.join(", ")
            )));
        }
    })
}

/// The names [`param_storage`] takes.
pub const PARAM_STORAGES: &[&str] = &[
    "auto",
    "preset",
    "f32",
    "bf16",
    "bf16_sr",
    "bf16_kahan",
    "split_f32",
    "bf16_plus8",
    "bf16_plus8_sr",
    "linear8_sr",
];

/// Whether a parameter stored as `storage` can be a tensor of `dtype` (lent: stepped in place).
pub fn lendable(storage: Storage, dtype: Dtype) -> bool {
    storage.format().and_then(|f| f.lendable()) == Some(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_builds_and_round_trips_its_hyperparameters() {
        for name in PRESETS {
            let c = preset(name, 1e-3).unwrap();
            c.validate().unwrap();
            let (_, fields) = hyper_json(&c).unwrap();
            let same = with_hyper(&c, &Value::Object(fields).to_string()).unwrap();
            assert_eq!(same, c, "{name}");
        }
        assert!(preset("adamw_9bit", 1e-3).is_err());
    }

    #[test]
    fn overrides_change_only_what_they_name() {
        let c = preset("adamw_8bit", 1e-3).unwrap();
        let d = with_hyper(&c, r#"{"lr": 0.1, "betas": [0.8, 0.95]}"#).unwrap();
        let (_, f) = hyper_json(&d).unwrap();
        assert_eq!(f["lr"], 0.1);
        assert_eq!(f["betas"], serde_json::json!([0.8, 0.95]));
        assert_eq!(f["eps"], 1e-8);
        assert_eq!(d.state1, c.state1);
        let e = with_hyper(&c, r#"{"momentum": 0.9}"#)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no hyperparameter \"momentum\"") && e.contains("betas"),
            "{e}"
        );
        let e = with_hyper(&c, r#"{"lr": -1.0}"#).unwrap_err().to_string();
        assert!(e.contains("lr"), "{e}");
        // Exact: the shortest representation of an f64 comes back as the same bits.
        let lr = 0.1f64 + 0.2;
        let d = with_hyper(&c, &format!(r#"{{"lr": {lr:?}}}"#)).unwrap();
        assert_eq!(d.hyper.lr().to_bits(), lr.to_bits());
    }

    #[test]
    fn storages_follow_the_tensor() {
        let s = param_storage("auto", Storage::F32, Dtype::Bf16).unwrap();
        assert!(lendable(s, Dtype::Bf16) && !lendable(s, Dtype::F32));
        let s = param_storage("auto", Storage::F32, Dtype::F32).unwrap();
        assert!(lendable(s, Dtype::F32));
        let s = param_storage("preset", Storage::LINEAR8_GROUP64_SR, Dtype::F32).unwrap();
        assert!(!lendable(s, Dtype::F32) && !lendable(s, Dtype::Bf16));
        assert!(lendable(
            param_storage("bf16_kahan", Storage::F32, Dtype::Bf16).unwrap(),
            Dtype::Bf16
        ));
        assert!(param_storage("fp8", Storage::F32, Dtype::F32).is_err());
    }
}
