//! The global-state guard: the process and thread state a specialisation was made under
//! (`GlobalStateGuard` in `torch/csrc/dynamo/guards.cpp`).
//!
//! Autocast (per device kind: enabled, and its dtype only when enabled; the weight-cast
//! cache flag) is read from this thread's [`AmpState`]; TF32 for CUDA matmuls and the
//! fp16/bf16 reduced-precision reduction options from the process-wide
//! [`PrecisionSettings`]. What the caller's tensor library owns (grad mode, default dtype,
//! deterministic algorithms and warn-only, intra-op threads) comes in as a
//! [`LibraryState`]. PyTorch's torch-function flags guard Python state and are left out.
//!
//! A [`GlobalState`] is a small `Copy` value read once per call and compared whole;
//! [`GlobalState::reason`] names the differing fields as `GlobalStateGuard::reason` does.
use std::cell::Cell;
use std::fmt;

use ferrocuda_amp::autocast::{self, AmpState, DeviceKind};
use ferrocuda_amp::precision::PrecisionSettings;
use ferrocuda_amp::precision::{self, Backend, Fp32Precision, PrecisionOp};
use ferrocuda_types::DType;

thread_local! {
    /// This thread's autocast word, with the autocast state version it was made at.
    static AUTOCAST_WORD: Cell<Option<(u64, u64)>> = const { Cell::new(None) };
    /// The precision part of the second word, with the settings' version it was made at.
    static PRECISION_BITS: Cell<Option<(u64, u64)>> = const { Cell::new(None) };
}

/// `derive(now)` kept in `cell` with the `version` it was made at, made again only when the
/// version moved. Each version is read before what it versions, so a kept value is never
/// older than the version kept with it.
#[inline]
fn kept(
    cell: &'static std::thread::LocalKey<Cell<Option<(u64, u64)>>>,
    version: u64,
    derive: impl FnOnce() -> u64,
) -> u64 {
    cell.with(|kept| match kept.get() {
        Some((v, word)) if v == version => word,
        _ => {
            let word = derive();
            kept.set(Some((version, word)));
            word
        }
    })
}

/// The global state a tensor library owns and the guard cannot read itself.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LibraryState {
    /// `torch.is_grad_enabled()`.
    pub grad_mode: bool,
    /// `torch.get_default_dtype()`.
    pub default_dtype: DType,
    /// `torch.are_deterministic_algorithms_enabled()`.
    pub deterministic_algorithms: bool,
    /// `torch.is_deterministic_algorithms_warn_only_enabled()`.
    pub deterministic_algorithms_warn_only: bool,
    /// `torch.get_num_threads()`.
    pub num_threads: u32,
}

impl Default for LibraryState {
    /// PyTorch's defaults, with one intra-op thread (PyTorch's default is the number of
    /// physical cores: a library that runs ops on the CPU should say how many it uses).
    fn default() -> LibraryState {
        LibraryState {
            grad_mode: true,
            default_dtype: DType::F32,
            deterministic_algorithms: false,
            deterministic_algorithms_warn_only: false,
            num_threads: 1,
        }
    }
}

/// A snapshot of everything the global-state guard compares, packed into two words so that
/// an entry compares it in two instructions.
///
/// Word 0 is autocast as `GlobalStateGuard`'s `AutocastState` compares it: per device kind
/// 6 bits (enabled, and the dtype only while enabled: autocast accepts fp16 and bf16 only,
/// whose codes fit), then the cache flag. Word 1 holds the rest (see the `W1_*` fields).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct GlobalState {
    key: [u64; 2],
}

/// A field's place: which word, which bits.
#[derive(Copy, Clone)]
struct Field {
    word: usize,
    shift: u32,
    bits: u32,
}

impl Field {
    const fn mask(self) -> u64 {
        if self.bits == 64 {
            u64::MAX
        } else {
            ((1u64 << self.bits) - 1) << self.shift
        }
    }
}

const AUTOCAST: Field = Field {
    word: 0,
    shift: 0,
    bits: 64,
};
const W1_NUM_THREADS: Field = Field {
    word: 1,
    shift: 0,
    bits: 32,
};
const W1_DEFAULT_DTYPE: Field = Field {
    word: 1,
    shift: 32,
    bits: 8,
};
const W1_GRAD_MODE: Field = Field {
    word: 1,
    shift: 40,
    bits: 1,
};
const W1_DETERMINISTIC: Field = Field {
    word: 1,
    shift: 41,
    bits: 1,
};
const W1_WARN_ONLY: Field = Field {
    word: 1,
    shift: 42,
    bits: 1,
};
const W1_TF32: Field = Field {
    word: 1,
    shift: 43,
    bits: 1,
};
const W1_FP16_REDUCE: Field = Field {
    word: 1,
    shift: 44,
    bits: 2,
};
const W1_BF16_REDUCE: Field = Field {
    word: 1,
    shift: 46,
    bits: 2,
};

/// The fields in `GlobalStateGuard::reason`'s order.
const REASON_ORDER: [Field; 9] = [
    W1_GRAD_MODE,
    AUTOCAST,
    W1_DETERMINISTIC,
    W1_WARN_ONLY,
    W1_TF32,
    W1_FP16_REDUCE,
    W1_BF16_REDUCE,
    W1_NUM_THREADS,
    W1_DEFAULT_DTYPE,
];

#[inline]
fn autocast_word(amp: &AmpState) -> u64 {
    let per_device = DeviceKind::ALL.iter().enumerate().fold(0u64, |w, (i, d)| {
        let code = if amp.is_enabled(*d) {
            0x20 | u64::from(amp.dtype(*d) as u8 & 0x1f)
        } else {
            0
        };
        w | code << (6 * i)
    });
    per_device | u64::from(amp.cache_enabled()) << (6 * DeviceKind::COUNT)
}

#[inline]
fn put(f: Field, v: u64) -> u64 {
    (v << f.shift) & f.mask()
}

/// The caller's fields of the second word.
#[inline]
fn library_bits(library: LibraryState) -> u64 {
    put(W1_NUM_THREADS, u64::from(library.num_threads))
        | put(W1_DEFAULT_DTYPE, u64::from(library.default_dtype as u8))
        | put(W1_GRAD_MODE, u64::from(library.grad_mode))
        | put(
            W1_DETERMINISTIC,
            u64::from(library.deterministic_algorithms),
        )
        | put(
            W1_WARN_ONLY,
            u64::from(library.deterministic_algorithms_warn_only),
        )
}

/// The precision flags' fields of the second word.
fn precision_bits(precision: &PrecisionSettings) -> u64 {
    // `allowTF32CuBLAS`: whether CUDA matmuls resolve to tf32.
    let tf32 = precision.resolve(Backend::Cuda, PrecisionOp::Matmul) == Fp32Precision::Tf32;
    put(W1_TF32, u64::from(tf32))
        | put(W1_FP16_REDUCE, precision.fp16_reduction() as u64)
        | put(W1_BF16_REDUCE, precision.bf16_reduction() as u64)
}

impl GlobalState {
    /// The current state: this thread's autocast state, the process's precision settings
    /// (read again only when they changed since this thread last read them) and the
    /// caller's `library` fields.
    #[inline]
    pub fn current(library: LibraryState) -> GlobalState {
        let autocast = kept(&AUTOCAST_WORD, autocast::thread_state_version(), || {
            autocast_word(&AmpState::current())
        });
        let precision = kept(&PRECISION_BITS, precision::global_version(), || {
            precision_bits(&precision::global())
        });
        GlobalState {
            key: [autocast, library_bits(library) | precision],
        }
    }

    /// The state made of explicit parts (for a caller that already holds them).
    #[inline]
    pub fn from_parts(
        library: LibraryState,
        amp: &AmpState,
        precision: &PrecisionSettings,
    ) -> GlobalState {
        GlobalState {
            key: [
                autocast_word(amp),
                library_bits(library) | precision_bits(precision),
            ],
        }
    }

    /// The fields of `self` (the guarded state) that differ in `now`, in
    /// `GlobalStateGuard::reason`'s order.
    pub fn diff(&self, now: &GlobalState) -> GlobalStateDiff {
        let bits = REASON_ORDER.iter().enumerate().fold(0u16, |bits, (i, f)| {
            let differs = (self.key[f.word] ^ now.key[f.word]) & f.mask() != 0;
            bits | (u16::from(differs) << i)
        });
        GlobalStateDiff { bits }
    }

    /// `GlobalStateGuard::reason`: each differing field's name followed by a space
    /// (`"grad_mode autocast "`), empty when `now` passes.
    pub fn reason(&self, now: &GlobalState) -> String {
        self.diff(now).to_string()
    }
}

/// Which global-state fields differ. `Display` is PyTorch's `reason()` text.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub struct GlobalStateDiff {
    bits: u16,
}

impl GlobalStateDiff {
    /// PyTorch's field names, in `reason()`'s order.
    pub const FIELDS: [&'static str; 9] = [
        "grad_mode",
        "autocast",
        "deterministic_algorithms",
        "deterministic_algorithms_warn_only",
        "allow_tf32",
        "allow_fp16_reduce",
        "allow_bf16_reduce",
        "num_threads",
        "default_dtype",
    ];

    /// Whether nothing differs.
    pub fn is_empty(&self) -> bool {
        self.bits == 0
    }

    /// The differing fields' names, in order.
    pub fn fields(&self) -> impl Iterator<Item = &'static str> + '_ {
        GlobalStateDiff::FIELDS
            .iter()
            .enumerate()
            .filter(|(i, _)| self.bits & (1 << i) != 0)
            .map(|(_, name)| *name)
    }
}

impl fmt::Display for GlobalStateDiff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.fields().try_for_each(|name| write!(f, "{name} "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(library: LibraryState, amp: AmpState, p: &PrecisionSettings) -> GlobalState {
        GlobalState::from_parts(library, &amp, p)
    }

    #[test]
    fn each_field_is_named_in_reason() -> Result<(), Box<dyn std::error::Error>> {
        let lib = LibraryState::default();
        let amp = AmpState::default();
        let p = PrecisionSettings::PYTORCH_DEFAULT;
        let base = state(lib, amp, &p);
        assert_eq!(base.reason(&base), "");
        let mut tf32 = p;
        tf32.set_allow_tf32_matmul(true);
        let mut fp16 = p;
        fp16.set_allow_fp16_reduced_precision_reduction(false, None)?;
        let mut bf16 = p;
        bf16.set_allow_bf16_reduced_precision_reduction(false, Some(false))?;
        let cases = [
            (
                state(
                    LibraryState {
                        grad_mode: false,
                        ..lib
                    },
                    amp,
                    &p,
                ),
                "grad_mode ",
            ),
            (
                state(lib, amp.enable(DeviceKind::Cuda, DType::F16)?, &p),
                "autocast ",
            ),
            (state(lib, amp.with_cache_enabled(false), &p), "autocast "),
            (
                state(
                    LibraryState {
                        deterministic_algorithms: true,
                        ..lib
                    },
                    amp,
                    &p,
                ),
                "deterministic_algorithms ",
            ),
            (
                state(
                    LibraryState {
                        deterministic_algorithms_warn_only: true,
                        ..lib
                    },
                    amp,
                    &p,
                ),
                "deterministic_algorithms_warn_only ",
            ),
            (state(lib, amp, &tf32), "allow_tf32 "),
            (state(lib, amp, &fp16), "allow_fp16_reduce "),
            (state(lib, amp, &bf16), "allow_bf16_reduce "),
            (
                state(
                    LibraryState {
                        num_threads: 8,
                        ..lib
                    },
                    amp,
                    &p,
                ),
                "num_threads ",
            ),
            (
                state(
                    LibraryState {
                        default_dtype: DType::F64,
                        ..lib
                    },
                    amp,
                    &p,
                ),
                "default_dtype ",
            ),
        ];
        for (now, reason) in cases {
            assert_ne!(base, now);
            assert_eq!(base.reason(&now), reason);
        }
        let two = state(
            LibraryState {
                grad_mode: false,
                num_threads: 4,
                ..lib
            },
            amp,
            &tf32,
        );
        assert_eq!(base.reason(&two), "grad_mode allow_tf32 num_threads ");
        assert_eq!(
            base.diff(&two).fields().collect::<Vec<_>>(),
            ["grad_mode", "allow_tf32", "num_threads"]
        );
        Ok(())
    }

    #[test]
    fn autocast_dtype_counts_only_while_enabled() -> Result<(), Box<dyn std::error::Error>> {
        let lib = LibraryState::default();
        let p = PrecisionSettings::PYTORCH_DEFAULT;
        let off_f16 = AmpState::default();
        // A disabled region still sets the dtype (PyTorch does too): not a difference.
        let off_bf16 = off_f16
            .enable(DeviceKind::Cuda, DType::BF16)?
            .disable(DeviceKind::Cuda);
        assert_eq!(state(lib, off_f16, &p), state(lib, off_bf16, &p));
        let on_f16 = off_f16.enable(DeviceKind::Cuda, DType::F16)?;
        let on_bf16 = off_f16.enable(DeviceKind::Cuda, DType::BF16)?;
        let a = state(lib, on_f16, &p);
        assert_eq!(a.reason(&state(lib, on_bf16, &p)), "autocast ");
        Ok(())
    }

    #[test]
    fn current_reads_this_threads_autocast() -> Result<(), Box<dyn std::error::Error>> {
        use ferrocuda_amp::autocast::Autocast;
        let lib = LibraryState::default();
        let outside = GlobalState::current(lib);
        let inside = {
            let _region = Autocast::new(DeviceKind::Cuda).enter()?;
            GlobalState::current(lib)
        };
        assert_eq!(outside.reason(&inside), "autocast ");
        assert_eq!(outside, GlobalState::current(lib));
        Ok(())
    }
}
