//! cuFFT through cudarc's bindings (`cudarc::cufft::sys`, loaded at run time): plans on the
//! real driver's devices, made without cuFFT's own work-area allocation (the layer above
//! gives each execution a work area from the caching allocator, as PyTorch's
//! `CuFFTConfig` does), and executed on this driver's streams.
//!
//! - **A missing library is data**: [`available`] finds libcufft (its usual names, then
//!   the folders of [`LIBRARY_PATH_VAR`](super::libraries::LIBRARY_PATH_VAR)) and every
//!   symbol used here once; every function returns [`FftError::Unavailable`] instead of
//!   cudarc's panic.
//! - **Half precision through `cufftXt`**: cudarc binds no `cufftXt*` function, so
//!   `cufftXtMakePlanMany` and `cufftXtExec` are looked up by name in the library cudarc
//!   loaded (PyTorch's `CuFFTConfig` makes every plan with `cufftXtMakePlanMany`).
//! - **Policy is above**: which plans are kept (the plan cache), and the work area's memory,
//!   are the math-library crate's.
use super::CudaDriver;
use super::libraries;
use crate::DriverError;
use cudarc::cufft::sys;
use ferrocuda_types::{DeviceIndex, DevicePtr, StreamHandle};
use std::ffi::{c_int, c_longlong, c_void};
use std::sync::{Arc, OnceLock};

/// What can go wrong with cuFFT.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FftError {
    /// libcufft (or a function this crate needs) could not be loaded.
    #[error("cuFFT is not available: {0}")]
    Unavailable(String),
    /// A cuFFT call failed.
    #[error("cuFFT error {code} ({name})")]
    Cufft {
        /// `cufftResult`.
        code: u32,
        /// Its name.
        name: &'static str,
    },
    /// A driver call around cuFFT failed (binding a context, finding a stream).
    #[error("CUDA driver error: {0}")]
    Driver(#[from] DriverError),
    /// A stream of another device than the plan's.
    #[error("the stream is on device {found} but the cuFFT plan on device {expected}")]
    DeviceMismatch {
        /// The plan's device.
        expected: DeviceIndex,
        /// The stream's.
        found: DeviceIndex,
    },
    /// A transform cuFFT cannot describe (no sizes, more than three dimensions).
    #[error("invalid transform: {0}")]
    InvalidArgument(&'static str),
    /// A half-precision transform with a signal size that is not a power of two, which
    /// cuFFT does not compute (PyTorch's message, `CuFFTPlanCache.h`).
    #[error(
        "cuFFT only supports dimensions whose sizes are powers of two when computing in half precision, but got a signal size of{0:?}"
    )]
    HalfSizeNotPowerOfTwo(Vec<i64>),
}

const SYMBOLS: &[&str] = &[
    "cufftCreate",
    "cufftDestroy",
    "cufftSetAutoAllocation",
    "cufftMakePlanMany64",
    "cufftSetStream",
    "cufftSetWorkArea",
    "cufftExecC2C",
    "cufftExecR2C",
    "cufftExecC2R",
    "cufftExecZ2Z",
    "cufftExecD2Z",
    "cufftExecZ2D",
    "cufftGetVersion",
    "cufftXtMakePlanMany",
    "cufftXtExec",
];

/// `cudaDataType_t` values of the half-precision layouts.
const CUDA_R_16F: c_int = 2;
const CUDA_C_16F: c_int = 6;

/// `cufftXtMakePlanMany` (`cufftXt.h`).
type XtMakePlanMany = unsafe extern "C" fn(
    sys::cufftHandle,
    c_int,
    *mut c_longlong,
    *mut c_longlong,
    c_longlong,
    c_longlong,
    c_int,
    *mut c_longlong,
    c_longlong,
    c_longlong,
    c_int,
    c_longlong,
    *mut usize,
    c_int,
) -> sys::cufftResult;
/// `cufftXtExec`.
type XtExec =
    unsafe extern "C" fn(sys::cufftHandle, *mut c_void, *mut c_void, c_int) -> sys::cufftResult;

/// The `cufftXt` functions, from the library cudarc loaded.
fn xt() -> Result<(XtMakePlanMany, XtExec), FftError> {
    available()?;
    static FNS: OnceLock<Result<(XtMakePlanMany, XtExec), FftError>> = OnceLock::new();
    FNS.get_or_init(|| {
        // SAFETY: the library is present (`available`); cudarc's loader opens it once.
        let lib = unsafe { sys::culib() };
        let missing = |e: libloading::Error| FftError::Unavailable(e.to_string());
        // SAFETY: the symbols are cuFFT's functions of these signatures (`cufftXt.h`).
        unsafe {
            let make = *lib
                .get::<XtMakePlanMany>(b"cufftXtMakePlanMany\0")
                .map_err(missing)?;
            let exec = *lib.get::<XtExec>(b"cufftXtExec\0").map_err(missing)?;
            Ok((make, exec))
        }
    })
    .clone()
}

/// Whether libcufft and every function used here can be loaded (looked for once).
pub fn available() -> Result<(), FftError> {
    static FOUND: OnceLock<Result<(), FftError>> = OnceLock::new();
    FOUND
        .get_or_init(|| {
            libraries::find(
                "cufft",
                &[],
                // SAFETY: only tries to open the library by its usual names.
                || unsafe { sys::is_culib_present() },
                // SAFETY: called once the library was found, so cudarc's loader opens it.
                || unsafe { sys::culib() },
                SYMBOLS,
            )
            .map_err(FftError::Unavailable)
        })
        .clone()
}

fn check(r: sys::cufftResult) -> Result<(), FftError> {
    use sys::cufftResult as R;
    let name = match r {
        R::CUFFT_SUCCESS => return Ok(()),
        R::CUFFT_INVALID_PLAN => "CUFFT_INVALID_PLAN",
        R::CUFFT_ALLOC_FAILED => "CUFFT_ALLOC_FAILED",
        R::CUFFT_INVALID_TYPE => "CUFFT_INVALID_TYPE",
        R::CUFFT_INVALID_VALUE => "CUFFT_INVALID_VALUE",
        R::CUFFT_INTERNAL_ERROR => "CUFFT_INTERNAL_ERROR",
        R::CUFFT_EXEC_FAILED => "CUFFT_EXEC_FAILED",
        R::CUFFT_SETUP_FAILED => "CUFFT_SETUP_FAILED",
        R::CUFFT_INVALID_SIZE => "CUFFT_INVALID_SIZE",
        R::CUFFT_UNALIGNED_DATA => "CUFFT_UNALIGNED_DATA",
        R::CUFFT_INVALID_DEVICE => "CUFFT_INVALID_DEVICE",
        R::CUFFT_NO_WORKSPACE => "CUFFT_NO_WORKSPACE",
        R::CUFFT_NOT_IMPLEMENTED => "CUFFT_NOT_IMPLEMENTED",
        R::CUFFT_NOT_SUPPORTED => "CUFFT_NOT_SUPPORTED",
        R::CUFFT_MISSING_DEPENDENCY => "CUFFT_MISSING_DEPENDENCY",
        R::CUFFT_NVRTC_FAILURE => "CUFFT_NVRTC_FAILURE",
        R::CUFFT_NVJITLINK_FAILURE => "CUFFT_NVJITLINK_FAILURE",
        R::CUFFT_NVSHMEM_FAILURE => "CUFFT_NVSHMEM_FAILURE",
    };
    Err(FftError::Cufft {
        code: r as u32,
        name,
    })
}

/// The loaded cuFFT's version (`cufftGetVersion`, e.g. 12000).
pub fn version() -> Result<i32, FftError> {
    available()?;
    let mut v = 0;
    // SAFETY: the library is present; writes through a valid pointer.
    check(unsafe { sys::cufftGetVersion(&mut v) })?;
    Ok(v)
}

/// The kind of transform, with its precision.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum FftKind {
    /// Complex to complex, fp32 (`CUFFT_C2C`).
    C2C,
    /// Real to complex, fp32 (`CUFFT_R2C`).
    R2C,
    /// Complex to real, fp32 (`CUFFT_C2R`).
    C2R,
    /// Complex to complex, fp64 (`CUFFT_Z2Z`).
    Z2Z,
    /// Real to complex, fp64 (`CUFFT_D2Z`).
    D2Z,
    /// Complex to real, fp64 (`CUFFT_Z2D`).
    Z2D,
    /// Complex to complex, fp16 (`cufftXt`, `CUDA_C_16F`): power-of-two sizes only.
    C2CHalf,
    /// Real to complex, fp16 (`CUDA_R_16F` to `CUDA_C_16F`): power-of-two sizes only.
    R2CHalf,
    /// Complex to real, fp16 (`CUDA_C_16F` to `CUDA_R_16F`): power-of-two sizes only.
    C2RHalf,
}

impl FftKind {
    /// Whether the input and the output are complex.
    pub fn complex_sides(self) -> (bool, bool) {
        use FftKind as K;
        match self {
            K::C2C | K::Z2Z | K::C2CHalf => (true, true),
            K::R2C | K::D2Z | K::R2CHalf => (false, true),
            K::C2R | K::Z2D | K::C2RHalf => (true, false),
        }
    }

    /// Bytes of one real number (of a complex one's halves).
    pub fn real_bytes(self) -> usize {
        use FftKind as K;
        match self {
            K::C2CHalf | K::R2CHalf | K::C2RHalf => 2,
            K::C2C | K::R2C | K::C2R => 4,
            K::Z2Z | K::D2Z | K::Z2D => 8,
        }
    }

    /// The classic API's type, or `None` for a half-precision kind (`cufftXt` only).
    fn raw(self) -> Option<sys::cufftType> {
        use sys::cufftType as T;
        Some(match self {
            FftKind::C2C => T::CUFFT_C2C,
            FftKind::R2C => T::CUFFT_R2C,
            FftKind::C2R => T::CUFFT_C2R,
            FftKind::Z2Z => T::CUFFT_Z2Z,
            FftKind::D2Z => T::CUFFT_D2Z,
            FftKind::Z2D => T::CUFFT_Z2D,
            FftKind::C2CHalf | FftKind::R2CHalf | FftKind::C2RHalf => return None,
        })
    }

    /// `cufftXtMakePlanMany`'s input, output and execution types of a half kind.
    fn xt_types(self) -> (c_int, c_int, c_int) {
        let (cin, cout) = self.complex_sides();
        let t = |complex: bool| if complex { CUDA_C_16F } else { CUDA_R_16F };
        (t(cin), t(cout), CUDA_C_16F)
    }
}

/// One data layout of a batched transform (cuFFT's advanced layout): element `x` of
/// signal `b` at `b * dist + x` (row-major over `embed`, times `stride`), in elements.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FftLayout {
    /// The storage's shape, outermost first (at least the signal's).
    pub embed: Vec<i64>,
    /// Elements between consecutive elements of a signal's innermost dimension.
    pub stride: i64,
    /// Elements between consecutive signals.
    pub dist: i64,
}

/// A transform: its kind, the signal's sizes (outermost first, 1 to 3 dimensions), the
/// batch, and the input and output layouts.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FftDesc {
    /// Kind and precision.
    pub kind: FftKind,
    /// The logical signal sizes (for C2R, of the real output).
    pub sizes: Vec<i64>,
    /// Signals in the batch.
    pub batch: i64,
    /// The input's layout.
    pub input: FftLayout,
    /// The output's layout.
    pub output: FftLayout,
}

/// A cuFFT plan on one device, made without cuFFT's own work area. Destroyed
/// (`cufftDestroy`) when dropped. Not for two streams at once: the layer above sets the
/// stream and work area before each execution, under its own lock.
pub struct FftPlan {
    driver: Arc<CudaDriver>,
    plan: c_int,
    device: DeviceIndex,
    kind: FftKind,
    work_size: u64,
}

impl std::fmt::Debug for FftPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FftPlan")
            .field("device", &self.device)
            .field("kind", &self.kind)
            .field("work_size", &self.work_size)
            .finish_non_exhaustive()
    }
}

impl FftPlan {
    /// Makes the plan for `desc` on `dev` (`cufftCreate`, `cufftSetAutoAllocation(0)`,
    /// `cufftMakePlanMany64`).
    pub fn create(
        driver: &Arc<CudaDriver>,
        dev: DeviceIndex,
        desc: &FftDesc,
    ) -> Result<FftPlan, FftError> {
        available()?;
        let rank = desc.sizes.len();
        if !(1..=3).contains(&rank) {
            return Err(FftError::InvalidArgument(
                "a transform has 1 to 3 dimensions",
            ));
        }
        if desc.input.embed.len() != rank || desc.output.embed.len() != rank {
            return Err(FftError::InvalidArgument(
                "the layouts' shapes have the signal's rank",
            ));
        }
        driver.bind(dev)?;
        let mut plan: c_int = 0;
        // SAFETY: the library is present; `dev`'s context is current; writes through a
        // valid pointer.
        check(unsafe { sys::cufftCreate(&mut plan) })?;
        let mut made = FftPlan {
            driver: driver.clone(),
            plan,
            device: dev,
            kind: desc.kind,
            work_size: 0,
        };
        // SAFETY: a plan just created.
        check(unsafe { sys::cufftSetAutoAllocation(plan, 0) })?;
        let (mut n, mut inembed, mut onembed) = (
            desc.sizes.clone(),
            desc.input.embed.clone(),
            desc.output.embed.clone(),
        );
        let mut work: usize = 0;
        let (n, inembed, onembed) = (n.as_mut_ptr(), inembed.as_mut_ptr(), onembed.as_mut_ptr());
        let (i, o) = (&desc.input, &desc.output);
        match desc.kind.raw() {
            // SAFETY: the arrays hold `rank` elements each and live through the call; cuFFT
            // only reads them; writes the work size through a valid pointer.
            Some(kind) => check(unsafe {
                sys::cufftMakePlanMany64(
                    plan,
                    rank as c_int,
                    n,
                    inembed,
                    i.stride,
                    i.dist,
                    onembed,
                    o.stride,
                    o.dist,
                    kind,
                    desc.batch,
                    &mut work,
                )
            })?,
            None => {
                let (make, _) = xt()?;
                let (itype, otype, exec) = desc.kind.xt_types();
                // SAFETY: as above; `make` is cuFFT's `cufftXtMakePlanMany`.
                check(unsafe {
                    make(
                        plan,
                        rank as c_int,
                        n,
                        inembed,
                        i.stride,
                        i.dist,
                        itype,
                        onembed,
                        o.stride,
                        o.dist,
                        otype,
                        desc.batch,
                        &mut work,
                        exec,
                    )
                })?
            }
        }
        made.work_size = work as u64;
        Ok(made)
    }

    /// Bytes of work area an execution needs.
    pub fn work_size(&self) -> u64 {
        self.work_size
    }

    /// The device it was made on.
    pub fn device(&self) -> DeviceIndex {
        self.device
    }

    /// Enqueues the transform on `stream` with `work` as its work area (at least
    /// [`FftPlan::work_size`] bytes the caller keeps for it until the stream has run it):
    /// `cufftSetStream`, `cufftSetWorkArea`, then `cufftExec*` (`inverse` picks the direction
    /// of complex-to-complex transforms).
    pub fn execute(
        &self,
        stream: StreamHandle,
        work: DevicePtr,
        input: DevicePtr,
        output: DevicePtr,
        inverse: bool,
    ) -> Result<(), FftError> {
        if stream.device != self.device {
            return Err(FftError::DeviceMismatch {
                expected: self.device,
                found: stream.device,
            });
        }
        let s = self.driver.stream(stream)?;
        let p = self.plan;
        // SAFETY: a live plan and a registered stream of its device.
        check(unsafe { sys::cufftSetStream(p, s as sys::cudaStream_t) })?;
        // SAFETY: a live plan; the address is only used on the device.
        check(unsafe { sys::cufftSetWorkArea(p, work.0 as *mut c_void) })?;
        let (i, o) = (input.0 as *mut c_void, output.0 as *mut c_void);
        let dir = if inverse { 1 } else { -1 };
        if self.kind.raw().is_none() {
            let (_, exec) = xt()?;
            // Real to complex is forward and complex to real inverse, as cuFFT requires.
            let dir = match self.kind.complex_sides() {
                (true, true) => dir,
                (false, true) => -1,
                _ => 1,
            };
            // SAFETY: a live plan of this kind; device addresses are only used on the
            // device; `exec` is cuFFT's `cufftXtExec`.
            return check(unsafe { exec(p, i, o, dir) });
        }
        // SAFETY: a live plan of this kind; device addresses are only used on the device.
        check(unsafe {
            match self.kind {
                FftKind::C2C => sys::cufftExecC2C(p, i.cast(), o.cast(), dir),
                FftKind::R2C => sys::cufftExecR2C(p, i.cast(), o.cast()),
                FftKind::C2R => sys::cufftExecC2R(p, i.cast(), o.cast()),
                FftKind::Z2Z => sys::cufftExecZ2Z(p, i.cast(), o.cast(), dir),
                FftKind::D2Z => sys::cufftExecD2Z(p, i.cast(), o.cast()),
                FftKind::Z2D => sys::cufftExecZ2D(p, i.cast(), o.cast()),
                // Executed through `cufftXt` above.
                FftKind::C2CHalf | FftKind::R2CHalf | FftKind::C2RHalf => {
                    sys::cufftResult::CUFFT_INVALID_TYPE
                }
            }
        })
    }
}

impl Drop for FftPlan {
    fn drop(&mut self) {
        if self.driver.bind(self.device).is_err() {
            return;
        }
        // SAFETY: the plan was created by cuFFT and is destroyed once, here.
        let _ = unsafe { sys::cufftDestroy(self.plan) };
    }
}
