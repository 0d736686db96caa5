//! The replay's options, checked before any file is read: the device (`--device`, and the
//! fake device's capacity and addresses) and the allocator configurations (`--conf`, else
//! the environment as the facade reads it).
use ferrocuda_types::{AllocatorBackend, AllocatorConfig, ConfigError, EnvError};
use std::path::PathBuf;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// Smallest `--capacity`: one 2 MiB page of the fake device.
pub const MIN_CAPACITY: u64 = 2 * MIB;
/// Largest `--capacity`: 4 TiB (a fake device's address span is 16 TiB, and expandable
/// segments reserve address space beyond the memory they map).
pub const MAX_CAPACITY: u64 = 4 << 40;
/// `--capacity` when not given: 80 GiB, an H100's or A100's memory.
pub const DEFAULT_CAPACITY: u64 = 80 * GIB;

/// Parses `--capacity`: a whole number of GiB (`80`), or a whole number with a binary unit
/// as the allocator configuration writes sizes (`80G`, `512M`, `1T`, also `80GiB`).
pub fn parse_capacity(text: &str) -> Result<u64, String> {
    parse_size("--capacity", text, MIN_CAPACITY..=MAX_CAPACITY).map_err(|e| {
        e.replace(
            "out of range",
            "out of range: the fake device takes 2M to 4T",
        )
    })
}

/// Smallest `--max-bytes`.
pub const MIN_MAX_BYTES: u64 = MIB;
/// Largest `--max-bytes`.
pub const MAX_MAX_BYTES: u64 = 1 << 40;

/// Parses `--max-bytes` (how much pickle the snapshot reader takes), in the grammar of
/// `--capacity`: 1M to 1T.
pub fn parse_max_bytes(text: &str) -> Result<u64, String> {
    parse_size("--max-bytes", text, MIN_MAX_BYTES..=MAX_MAX_BYTES)
        .map_err(|e| e.replace("out of range", "out of range: 1M to 1T"))
}

/// A size option: a whole number of GiB, or with a unit K, M, G or T (`iB` may follow).
fn parse_size(flag: &str, text: &str, range: std::ops::RangeInclusive<u64>) -> Result<u64, String> {
    let bad = |why: &str| format!("{flag} {text:?}: {why}");
    let t = text.trim();
    let digits = t.bytes().take_while(u8::is_ascii_digit).count();
    let (number, unit) = t.split_at(digits);
    if number.is_empty() {
        return Err(bad(
            "expected a whole number with an optional unit K, M, G or T (80G, 512M)",
        ));
    }
    let scale = match unit.strip_suffix("iB").unwrap_or(unit) {
        "" | "G" => GIB,
        "K" => 1 << 10,
        "M" => MIB,
        "T" => 1 << 40,
        _ => return Err(bad("unknown unit (use K, M, G or T; no unit means G)")),
    };
    number
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(scale))
        .filter(|b| range.contains(b))
        .ok_or_else(|| bad("out of range"))
}

/// Where the fake device puts segments (`--addresses`, `--addresses-from`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AddressChoice {
    /// Fresh, increasing addresses (the default).
    Fresh,
    /// The trace's `segment_alloc` addresses, in order (`--addresses recorded`).
    Recorded,
    /// The addresses the driver gave a replay of the same trace, from that replay's
    /// `--json` output (`--addresses-from FILE`).
    From(PathBuf),
}

impl AddressChoice {
    /// The option that chose it, for messages.
    fn flag(&self) -> &'static str {
        match self {
            AddressChoice::From(_) => "--addresses-from",
            _ => "--addresses",
        }
    }
}

/// The device the options chose (`--device`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The fake device (the default): `capacity` bytes (`--capacity`, default 80 GiB), and
    /// segments where `addresses` says.
    Fake {
        /// Bytes of memory.
        capacity: u64,
        /// Where segments go.
        addresses: AddressChoice,
        /// With `--catch-up-every N`, work enqueued on the fake device (the allocator's
        /// events) runs only at every `N`th trace step, as on a GPU that the host runs
        /// ahead of; without it, at once.
        catch_up_every: Option<u64>,
    },
    /// The real driver's device 0 (`--device cuda`).
    Cuda,
}

/// Why the device options cannot be used.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// `--capacity` does not parse or is out of range.
    #[error("{0}")]
    Capacity(String),
    /// `--catch-up-every 0`.
    #[error("--catch-up-every takes a number of trace steps of at least 1")]
    CatchUp,
    /// An option of the fake device was given with `--device cuda`.
    #[error(
        "{flag} applies to the fake device only: with --device cuda the GPU's own memory and \
         the driver's addresses are used (drop {flag}, or replay with --device fake)"
    )]
    FakeOnly {
        /// The option.
        flag: &'static str,
    },
}

/// The device of `--device` (`cuda` true for `cuda`), with the fake device's `--capacity`,
/// addresses (`--addresses` or `--addresses-from`) and `--catch-up-every` when given: with
/// `cuda` any of them is an error.
pub fn choose_device(
    cuda: bool,
    capacity: Option<&str>,
    addresses: Option<AddressChoice>,
    catch_up_every: Option<u64>,
) -> Result<DeviceChoice, DeviceError> {
    if cuda {
        return match (capacity, addresses, catch_up_every) {
            (Some(_), _, _) => Err(DeviceError::FakeOnly { flag: "--capacity" }),
            (_, Some(a), _) => Err(DeviceError::FakeOnly { flag: a.flag() }),
            (_, _, Some(_)) => Err(DeviceError::FakeOnly {
                flag: "--catch-up-every",
            }),
            (None, None, None) => Ok(DeviceChoice::Cuda),
        };
    }
    if catch_up_every == Some(0) {
        return Err(DeviceError::CatchUp);
    }
    Ok(DeviceChoice::Fake {
        capacity: capacity.map_or(Ok(DEFAULT_CAPACITY), |c| {
            parse_capacity(c).map_err(DeviceError::Capacity)
        })?,
        addresses: addresses.unwrap_or(AddressChoice::Fresh),
        catch_up_every,
    })
}

/// One configuration to replay: its column label and the parsed configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Conf {
    /// `default`, or the string as given.
    pub label: String,
    /// The configuration.
    pub config: AllocatorConfig,
}

/// Why the configurations cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfError {
    /// A `--conf` does not parse.
    #[error("--conf {conf:?}: {source}")]
    Flag {
        /// The string.
        conf: String,
        /// Why.
        source: ConfigError,
    },
    /// The environment's configuration does not parse.
    #[error("{var}={conf:?}: {source}")]
    Env {
        /// The variable.
        var: &'static str,
        /// Its value.
        conf: String,
        /// Why.
        source: ConfigError,
    },
    /// A configuration variable is set but cannot be read (not valid UTF-8).
    #[error(transparent)]
    EnvUnreadable(#[from] EnvError),
    /// A configuration selects `backend:cudaMallocAsync`: the replay drives the caching
    /// allocator block by block, and the driver's stream-ordered pool has no block-level
    /// form to replay (it would fail at the first event, the caching allocator refusing the
    /// backend).
    #[error(
        "{origin}: replay drives the caching allocator (backend:native) block by block; \
         backend:cudaMallocAsync has no block-level replay (the driver's pool places memory), \
         so replay with backend:native or without the backend key"
    )]
    AsyncBackend {
        /// Where it came from: `--conf "…"`, or `VAR="…"`.
        origin: String,
    },
}

fn conf(text: &str) -> Result<Conf, ConfigError> {
    if text.trim().is_empty() || text.trim() == "default" {
        return Ok(Conf {
            label: "default".into(),
            config: AllocatorConfig::default(),
        });
    }
    Ok(Conf {
        label: text.to_owned(),
        config: AllocatorConfig::parse(text)?,
    })
}

/// A configuration the replay can run: not `backend:cudaMallocAsync`.
fn replayable(c: Conf, origin: impl FnOnce() -> String) -> Result<Conf, ConfError> {
    if c.config.backend == AllocatorBackend::CudaMallocAsync {
        return Err(ConfError::AsyncBackend { origin: origin() });
    }
    Ok(c)
}

/// The configurations to replay, every one parsed and checked before any replay (and before
/// the trace is read): the `--conf` flags (`default` and the empty string are the default
/// configuration), else the environment's (`FERROCUDA_ALLOC_CONF`,
/// `PYTORCH_CUDA_ALLOC_CONF`, `PYTORCH_ALLOC_CONF`, read through `var`, which is
/// `std::env::var`: a variable set to a value that is not valid UTF-8 is an error naming
/// it, even beside `--conf`), else the default. `backend:cudaMallocAsync` is refused. The
/// note says which ran.
pub fn resolve_confs(
    flags: &[String],
    var: impl Fn(&str) -> Result<String, std::env::VarError>,
) -> Result<(Vec<Conf>, String), ConfError> {
    let env = AllocatorConfig::source(var)?;
    if !flags.is_empty() {
        let confs = flags
            .iter()
            .map(|f| {
                let c = conf(f).map_err(|source| ConfError::Flag {
                    conf: f.clone(),
                    source,
                })?;
                replayable(c, || format!("--conf {f:?}"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let note = match env {
            Some((var, _)) => format!("configurations from --conf ({var} is not used)"),
            None => "configurations from --conf".into(),
        };
        return Ok((confs, note));
    }
    match env {
        Some((var, value)) => {
            let c = conf(&value).map_err(|source| ConfError::Env {
                var,
                conf: value.clone(),
                source,
            })?;
            let c = replayable(c, || format!("{var}={value:?}"))?;
            Ok((vec![c], format!("configuration from {var}={value}")))
        }
        None => Ok((
            vec![conf("").map_err(|source| ConfError::Flag {
                conf: String::new(),
                source,
            })?],
            "default configuration (no --conf; FERROCUDA_ALLOC_CONF, PYTORCH_CUDA_ALLOC_CONF \
             and PYTORCH_ALLOC_CONF unset)"
                .into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacities() {
        assert_eq!(parse_capacity("80"), Ok(80 * GIB));
        assert_eq!(parse_capacity("80G"), Ok(80 * GIB));
        assert_eq!(parse_capacity("80GiB"), Ok(80 * GIB));
        assert_eq!(parse_capacity("512M"), Ok(512 * MIB));
        assert_eq!(parse_capacity("4T"), Ok(MAX_CAPACITY));
        assert_eq!(parse_capacity("2048K"), Ok(MIN_CAPACITY));
        for bad in [
            "0",
            "17179869184",
            "17179869189",
            "18446744073709551616",
            "1K",
            "5T",
            "80g",
            "1.5G",
            "-1",
            "",
            "G",
            "80 G B",
        ] {
            assert!(parse_capacity(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_fake_devices_options_are_refused_with_cuda() {
        assert_eq!(
            choose_device(false, None, None, None),
            Ok(DeviceChoice::Fake {
                capacity: DEFAULT_CAPACITY,
                addresses: AddressChoice::Fresh,
                catch_up_every: None,
            })
        );
        assert_eq!(
            choose_device(false, Some("2G"), Some(AddressChoice::Recorded), Some(500)),
            Ok(DeviceChoice::Fake {
                capacity: 2 * GIB,
                addresses: AddressChoice::Recorded,
                catch_up_every: Some(500),
            })
        );
        assert_eq!(
            choose_device(false, None, None, Some(0)),
            Err(DeviceError::CatchUp)
        );
        assert!(matches!(
            choose_device(false, Some("1.5G"), None, None),
            Err(DeviceError::Capacity(m)) if m.contains("--capacity \"1.5G\"")
        ));
        assert_eq!(
            choose_device(true, None, None, None),
            Ok(DeviceChoice::Cuda)
        );
        for (capacity, addresses, catch_up, flag) in [
            (Some("80G"), None, None, "--capacity"),
            (Some("bogus"), None, None, "--capacity"),
            (None, Some(AddressChoice::Recorded), None, "--addresses"),
            (None, Some(AddressChoice::Fresh), None, "--addresses"),
            (
                None,
                Some(AddressChoice::From(PathBuf::from("gpu.json"))),
                None,
                "--addresses-from",
            ),
            (None, None, Some(100), "--catch-up-every"),
        ] {
            let err = choose_device(true, capacity, addresses, catch_up);
            assert_eq!(err, Err(DeviceError::FakeOnly { flag }));
            let text = err.err().map(|e| e.to_string()).unwrap_or_default();
            assert!(
                text.contains(flag) && text.contains("fake device only"),
                "{text}"
            );
        }
    }

    #[test]
    fn confs_come_from_flags_then_the_environment() {
        let none = |_: &str| Err(std::env::VarError::NotPresent);
        let (c, note) = resolve_confs(&[], none)
            .map_err(|e| e.to_string())
            .unwrap_or_default();
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].label, "default");
        assert!(note.contains("unset"));
        let env = |k: &str| {
            (k == "PYTORCH_CUDA_ALLOC_CONF")
                .then(|| "expandable_segments:True".into())
                .ok_or(std::env::VarError::NotPresent)
        };
        let r = resolve_confs(&[], env).ok();
        assert!(
            r.as_ref()
                .is_some_and(|(c, _)| c[0].config.expandable.enabled)
        );
        let flags = vec!["default".to_owned(), String::new()];
        let r = resolve_confs(&flags, env).ok();
        assert!(
            r.is_some_and(|(c, n)| c.iter().all(|c| c.label == "default")
                && n.contains("PYTORCH_CUDA_ALLOC_CONF is not used"))
        );
        let flags = vec![String::new(), "bogus:1".to_owned()];
        assert!(resolve_confs(&flags, none).is_err());
    }

    /// `backend:cudaMallocAsync` is refused before anything is replayed, from a flag or from
    /// the environment, naming where it came from.
    #[test]
    fn the_async_backend_is_refused() {
        let none = |_: &str| Err(std::env::VarError::NotPresent);
        let flags = vec!["default".to_owned(), "backend:cudaMallocAsync".to_owned()];
        let e = resolve_confs(&flags, none).err().map(|e| e.to_string());
        assert_eq!(
            e.as_deref(),
            Some(
                "--conf \"backend:cudaMallocAsync\": replay drives the caching allocator \
                 (backend:native) block by block; backend:cudaMallocAsync has no block-level \
                 replay (the driver's pool places memory), so replay with backend:native or \
                 without the backend key"
            )
        );
        let env = |k: &str| {
            (k == "PYTORCH_ALLOC_CONF")
                .then(|| "backend:cudaMallocAsync,max_split_size_mb:100".into())
                .ok_or(std::env::VarError::NotPresent)
        };
        let e = resolve_confs(&[], env).err().map(|e| e.to_string());
        assert!(
            e.as_deref().is_some_and(|e| e.starts_with(
                "PYTORCH_ALLOC_CONF=\"backend:cudaMallocAsync,max_split_size_mb:100\": replay drives"
            )),
            "{e:?}"
        );
        // Beside --conf, the environment's is not used: no error from it.
        let flags = vec!["backend:native".to_owned()];
        assert!(resolve_confs(&flags, env).is_ok());
    }

    /// A configuration variable that is not UTF-8 is an error naming it, with or without
    /// `--conf`; the next variable does not take its place.
    #[cfg(unix)]
    #[test]
    fn a_variable_that_is_not_utf8_is_an_error() {
        use std::os::unix::ffi::OsStringExt;
        let env = |k: &str| match k {
            "FERROCUDA_ALLOC_CONF" => Err(std::env::VarError::NotUnicode(
                std::ffi::OsString::from_vec(b"max_split_size_mb:\xff".to_vec()),
            )),
            _ => Ok("expandable_segments:True".to_owned()),
        };
        for flags in [vec![], vec!["default".to_owned()]] {
            match resolve_confs(&flags, env) {
                Err(ConfError::EnvUnreadable(EnvError::NotUnicode { name, .. })) => {
                    assert_eq!(name, "FERROCUDA_ALLOC_CONF")
                }
                other => panic!("{flags:?}: {other:?}"),
            }
        }
    }
}
