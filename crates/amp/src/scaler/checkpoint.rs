//! `GradScaler.state_dict()` / `load_state_dict()` (`torch/amp/grad_scaler.py`), with
//! PyTorch's keys, so that a checkpoint reads the same in both.
use super::GradScaler;
use super::error::ScalerError;
use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// A scaler's checkpoint: PyTorch's five keys, every one absent for a disabled scaler (which
/// serializes as `{}`, as PyTorch's empty dict).
///
/// The three floats keep non-finite values through formats without them (JSON, where
/// serde_json would write `null`): a finite float is a number, +inf, -inf and NaN are the
/// strings `"inf"`, `"-inf"` and `"nan"` (Python's `repr`). Reading accepts both forms
/// (any other string is an error), so `{"scale": "inf", "growth_factor": 2.0, ...}`
/// round-trips bit for bit (NaN as a NaN). Reading the strings needs a self-describing
/// format (JSON, YAML, ...).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ScalerStateDict {
    /// `"scale"`.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "lossless")]
    pub scale: Option<f64>,
    /// `"growth_factor"`.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "lossless")]
    pub growth_factor: Option<f64>,
    /// `"backoff_factor"`.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "lossless")]
    pub backoff_factor: Option<f64>,
    /// `"growth_interval"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub growth_interval: Option<i64>,
    /// `"_growth_tracker"`.
    #[serde(
        rename = "_growth_tracker",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub growth_tracker: Option<i64>,
}

impl ScalerStateDict {
    /// Whether no key is present (PyTorch's `{}`).
    pub fn is_empty(&self) -> bool {
        *self == ScalerStateDict::default()
    }
}

/// A float written as a number when finite, else as `"inf"`, `"-inf"` or `"nan"`.
#[derive(Copy, Clone, Debug)]
struct Lossless(f64);

impl Serialize for Lossless {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let x = self.0;
        if x.is_nan() {
            s.serialize_str("nan")
        } else if x == f64::INFINITY {
            s.serialize_str("inf")
        } else if x == f64::NEG_INFINITY {
            s.serialize_str("-inf")
        } else {
            s.serialize_f64(x)
        }
    }
}

impl<'de> Deserialize<'de> for Lossless {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Lossless, D::Error> {
        struct Float;
        impl Visitor<'_> for Float {
            type Value = Lossless;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(r#"a number, or "inf", "-inf" or "nan""#)
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Lossless, E> {
                Ok(Lossless(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Lossless, E> {
                Ok(Lossless(v as f64))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Lossless, E> {
                Ok(Lossless(v as f64))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Lossless, E> {
                match v {
                    "inf" => Ok(Lossless(f64::INFINITY)),
                    "-inf" => Ok(Lossless(f64::NEG_INFINITY)),
                    "nan" => Ok(Lossless(f64::NAN)),
                    _ => Err(E::invalid_value(de::Unexpected::Str(v), &self)),
                }
            }
        }
        d.deserialize_any(Float)
    }
}

/// `#[serde(with)]` for the optional floats of [`ScalerStateDict`].
mod lossless {
    use super::Lossless;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub(super) fn serialize<S: Serializer>(v: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
        v.map(Lossless).serialize(s)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
        Ok(Option::<Lossless>::deserialize(d)?.map(|l| l.0))
    }
}

fn key<T>(v: Option<T>, key: &'static str) -> Result<T, ScalerError> {
    v.ok_or(ScalerError::MissingKey { key })
}

fn int32(v: i64, key: &'static str) -> Result<i32, ScalerError> {
    i32::try_from(v).map_err(|_| ScalerError::OutOfRange { key, value: v })
}

impl GradScaler {
    /// `state_dict()`: empty when disabled; else the scale and tracker (read from the device
    /// once it exists: a host sync, as PyTorch's two `.item()`s) and the factors.
    pub fn state_dict(&self) -> Result<ScalerStateDict, ScalerError> {
        if !self.config.enabled {
            return Ok(ScalerStateDict::default());
        }
        Ok(ScalerStateDict {
            scale: Some(self.scale()?),
            growth_factor: Some(self.config.growth_factor),
            backoff_factor: Some(self.config.backoff_factor),
            growth_interval: Some(i64::from(self.config.growth_interval)),
            growth_tracker: Some(i64::from(self.growth_tracker()?)),
        })
    }

    /// `load_state_dict(sd)`: a no-op when disabled; an empty dict (from a disabled scaler)
    /// is refused; a missing key is PyTorch's `KeyError`. Sets the initial values and, once
    /// the device state exists, the device scale (with its inverse) and tracker. Under a bf16
    /// compute dtype the scale stays 1.0.
    pub fn load_state_dict(&mut self, sd: &ScalerStateDict) -> Result<(), ScalerError> {
        if !self.config.enabled {
            return Ok(());
        }
        if sd.is_empty() {
            return Err(ScalerError::EmptyStateDict);
        }
        let scale = key(sd.scale, "scale")?;
        let growth_factor = key(sd.growth_factor, "growth_factor")?;
        let backoff_factor = key(sd.backoff_factor, "backoff_factor")?;
        let interval = int32(
            key(sd.growth_interval, "growth_interval")?,
            "growth_interval",
        )?;
        let tracker = int32(
            key(sd.growth_tracker, "_growth_tracker")?,
            "_growth_tracker",
        )?;
        self.config.init_scale = scale;
        self.config.growth_factor = growth_factor;
        self.config.backoff_factor = backoff_factor;
        self.config.growth_interval = interval;
        self.init_growth_tracker = tracker;
        let initial = self.initial_scale();
        if let Some(live) = &self.live {
            let stream = self.runtime.current_stream(self.device)?;
            live.state.write_scale(initial, &stream)?;
            live.state.write_growth_tracker(tracker, &stream)?;
        }
        Ok(())
    }
}
