//! Configuration read from the environment. A variable that is set is either read or an
//! error naming it: one whose value is not valid UTF-8 is never taken for unset (which
//! would let the next variable in an order such as `FERROCUDA_ALLOC_CONF`,
//! `PYTORCH_CUDA_ALLOC_CONF`, `PYTORCH_ALLOC_CONF` win without a word).
//!
//! PyTorch reads its variables as C strings (`c10::utils::get_env`), bytes as they are; a
//! Rust `String` cannot hold bytes that are not UTF-8, so refusing them is the only way not
//! to guess.
use std::env::VarError;

/// A configuration variable that is set but cannot be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EnvError {
    /// The value is not valid UTF-8.
    #[error(
        "environment variable {name} is set but its value is not valid UTF-8 ({value}): \
         set it to valid UTF-8 or unset it"
    )]
    NotUnicode {
        /// The variable.
        name: String,
        /// The value, with bytes that are not UTF-8 escaped (`"\xFF"`).
        value: String,
    },
}

/// What `std::env::var(name)` gave, as configuration reads it: `Ok(None)` when the variable
/// is unset, its value when set, and an error naming it when the value is not valid UTF-8.
pub fn env_value(name: &str, got: Result<String, VarError>) -> Result<Option<String>, EnvError> {
    match got {
        Ok(value) => Ok(Some(value)),
        Err(VarError::NotPresent) => Ok(None),
        Err(VarError::NotUnicode(raw)) => Err(EnvError::NotUnicode {
            name: name.to_owned(),
            value: format!("{raw:?}"),
        }),
    }
}

/// The variable `name` of this process's environment ([`env_value`] of `std::env::var`).
pub fn env_var(name: &str) -> Result<Option<String>, EnvError> {
    env_value(name, std::env::var(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_unset_and_not_unicode() {
        assert_eq!(env_value("A", Ok("x".into())), Ok(Some("x".into())));
        assert_eq!(env_value("A", Err(VarError::NotPresent)), Ok(None));
        #[cfg(unix)]
        {
            use std::os::unix::ffi::OsStringExt;
            let raw = std::ffi::OsString::from_vec(b"max\xffsplit".to_vec());
            let e = env_value("FERROCUDA_ALLOC_CONF", Err(VarError::NotUnicode(raw)));
            let text = e.err().map(|e| e.to_string()).unwrap_or_default();
            assert!(
                text.starts_with(
                    "environment variable FERROCUDA_ALLOC_CONF is set but its value is not valid UTF-8"
                ) && text.contains(r"\xFF"),
                "{text}"
            );
        }
    }
}
