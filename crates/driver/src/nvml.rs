//! NVML, asked how many GPUs the machine has without initialising CUDA: what PyTorch's
//! `_raw_device_count_nvml` does for `PYTORCH_NVML_BASED_CUDA_CHECK=1`.
//!
//! Also the compute processes on a GPU and their memory, which PyTorch's out-of-memory
//! message lists (`reportProcessMemoryInfo` in c10/cuda/CUDACachingAllocator.cpp).
//!
//! libnvidia-ml is loaded at run time with `libloading` (`libnvidia-ml.so.1`, else
//! `libnvidia-ml.so`): cudarc has no NVML bindings, and six functions are all we call,
//! `nvmlInit_v2`, `nvmlDeviceGetCount_v2`, `nvmlShutdown`, `nvmlErrorString` (to name a
//! failure), `nvmlDeviceGetHandleByPciBusId_v2` and `nvmlDeviceGetComputeRunningProcesses`
//! (the last two optional: a library without them still counts devices). A machine without
//! the library is data ([`NvmlError::LibraryNotFound`]), never a panic. NVML is not CUDA: asking it neither initialises CUDA nor makes a later fork unsafe.
use libloading::Library;
use std::ffi::{CStr, CString, OsStr, c_char, c_int, c_uint, c_ulonglong, c_void};
use std::sync::OnceLock;

/// The library names [`device_count`] tries, in order.
pub const LIBRARY_NAMES: [&str; 2] = ["libnvidia-ml.so.1", "libnvidia-ml.so"];

/// Why NVML could not count the devices.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NvmlError {
    /// No NVML library could be loaded (no NVIDIA driver on this machine): the loader's
    /// message for each name tried.
    #[error("NVML is not available: {0}")]
    LibraryNotFound(String),
    /// A library loaded but lacks one of NVML's functions (it is not NVML).
    #[error("NVML is not available: the library has no {0}")]
    MissingFunction(&'static str),
    /// An NVML call failed.
    #[error("{function} failed: {message} (NVML error {code})")]
    Call {
        /// The NVML function.
        function: &'static str,
        /// Its `nvmlReturn_t`.
        code: i32,
        /// NVML's description of the code (`nvmlErrorString`).
        message: String,
    },
}

/// `nvmlReturn_t`: 0 is success.
type Status = c_int;

/// `NVML_ERROR_INSUFFICIENT_SIZE`: the array was too small; the count says how many.
const INSUFFICIENT_SIZE: Status = 7;

/// `nvmlDevice_t`.
type Device = *mut c_void;

/// `nvmlProcessInfo_v1_t`, what the unversioned `nvmlDeviceGetComputeRunningProcesses`
/// fills (PyTorch calls that one).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct ProcessInfoV1 {
    pid: c_uint,
    used_gpu_memory: c_ulonglong,
}

/// A compute process on a GPU and the device memory it uses, as NVML reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuProcess {
    /// Its process id.
    pub pid: u32,
    /// Device memory it uses, in bytes.
    pub used: u64,
}

/// A loaded NVML library and the functions ferrocuda calls in it.
pub struct Nvml {
    init: unsafe extern "C" fn() -> Status,
    device_get_count: unsafe extern "C" fn(*mut c_uint) -> Status,
    shutdown: unsafe extern "C" fn() -> Status,
    error_string: Option<unsafe extern "C" fn(Status) -> *const c_char>,
    handle_by_pci_bus_id: Option<unsafe extern "C" fn(*const c_char, *mut Device) -> Status>,
    compute_processes:
        Option<unsafe extern "C" fn(Device, *mut c_uint, *mut ProcessInfoV1) -> Status>,
    /// Keeps the functions above loaded: dropped only with them.
    _library: Library,
}

impl std::fmt::Debug for Nvml {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvml").finish_non_exhaustive()
    }
}

/// Looks up `name` in `library` as a `T`.
///
/// # Safety
/// `T` must be the C type of the function `name` (from `nvml.h`), and the result must not be
/// called after `library` is dropped.
unsafe fn function<T: Copy>(library: &Library, name: &'static str) -> Result<T, NvmlError> {
    // SAFETY: the caller guarantees `T` is the function's type.
    match unsafe { library.get::<T>(name) } {
        Ok(symbol) => Ok(*symbol),
        Err(_) => Err(NvmlError::MissingFunction(name)),
    }
}

impl Nvml {
    /// Loads the first of `names` that loads: a file name the system loader searches for,
    /// or a path. None loading is [`NvmlError::LibraryNotFound`].
    pub fn open<S: AsRef<OsStr>>(names: &[S]) -> Result<Nvml, NvmlError> {
        let mut reasons = Vec::new();
        for name in names {
            // SAFETY: loading runs the library's initialisers. libnvidia-ml is made to be
            // loaded this way (nvidia-smi, pynvml and PyTorch do); any other path is the
            // caller's choice of code to run, as with any plug-in.
            match unsafe { Library::new(name.as_ref()) } {
                Ok(library) => return Nvml::bind(library),
                // The loader's own message (`dlerror`) names the file; libloading's does not.
                Err(e) => reasons.push(match std::error::Error::source(&e) {
                    Some(detail) => detail.to_string(),
                    None => format!("{}: {e}", name.as_ref().to_string_lossy()),
                }),
            }
        }
        Err(NvmlError::LibraryNotFound(reasons.join("; ")))
    }

    fn bind(library: Library) -> Result<Nvml, NvmlError> {
        // SAFETY: each type is the function's signature in nvml.h (`nvmlReturn_t` is a C
        // enum, an int); the pointers live in the result beside `library`, which keeps
        // them loaded.
        unsafe {
            Ok(Nvml {
                init: function(&library, "nvmlInit_v2")?,
                device_get_count: function(&library, "nvmlDeviceGetCount_v2")?,
                shutdown: function(&library, "nvmlShutdown")?,
                error_string: function(&library, "nvmlErrorString").ok(),
                handle_by_pci_bus_id: function(&library, "nvmlDeviceGetHandleByPciBusId_v2").ok(),
                compute_processes: function(&library, "nvmlDeviceGetComputeRunningProcesses").ok(),
                _library: library,
            })
        }
    }

    /// The number of GPUs NVML sees (`nvmlInit_v2`, `nvmlDeviceGetCount_v2`, then
    /// `nvmlShutdown`: NVML counts its initialisations, so other users are not disturbed).
    pub fn device_count(&self) -> Result<usize, NvmlError> {
        // SAFETY: takes no argument; paired with the nvmlShutdown below.
        self.check("nvmlInit_v2", unsafe { (self.init)() })?;
        let mut count: c_uint = 0;
        // SAFETY: NVML is initialised; writes one unsigned int through a valid pointer.
        let counted = self.check("nvmlDeviceGetCount_v2", unsafe {
            (self.device_get_count)(&mut count)
        });
        // SAFETY: balances the successful nvmlInit_v2 above. Its failure would not change
        // the count, which is what was asked, so it is not reported.
        let _ = unsafe { (self.shutdown)() };
        counted.map(|()| count as usize)
    }

    /// The compute processes on the GPU whose PCI bus id is `pci_bus_id`
    /// (`"%08X:%02X:%02X.0"`, domain, bus, device), in NVML's order, with the memory each
    /// uses. NVML is initialised for the call and shut down after it.
    pub fn compute_processes(&self, pci_bus_id: &str) -> Result<Vec<GpuProcess>, NvmlError> {
        let by_pci = self.handle_by_pci_bus_id.ok_or(NvmlError::MissingFunction(
            "nvmlDeviceGetHandleByPciBusId_v2",
        ))?;
        let running = self.compute_processes.ok_or(NvmlError::MissingFunction(
            "nvmlDeviceGetComputeRunningProcesses",
        ))?;
        let id = CString::new(pci_bus_id).map_err(|_| NvmlError::Call {
            function: "nvmlDeviceGetHandleByPciBusId_v2",
            code: 2,
            message: "a PCI bus id with a NUL byte".into(),
        })?;
        // SAFETY: takes no argument; paired with the nvmlShutdown below.
        self.check("nvmlInit_v2", unsafe { (self.init)() })?;
        let listed = (|| {
            let mut device: Device = std::ptr::null_mut();
            // SAFETY: NVML is initialised; `id` is NUL-terminated and outlives the call;
            // one handle is written through a valid pointer.
            self.check("nvmlDeviceGetHandleByPciBusId_v2", unsafe {
                by_pci(id.as_ptr(), &mut device)
            })?;
            let mut procs = vec![ProcessInfoV1::default(); 8];
            // A process starting between two calls can make the array short again: a few
            // tries, as PyTorch's loop would (it has no bound).
            for _ in 0..8 {
                let mut count = procs.len() as c_uint;
                // SAFETY: `procs` holds `count` entries of the struct the function fills;
                // it writes at most that many and the count through valid pointers.
                let status = unsafe { running(device, &mut count, procs.as_mut_ptr()) };
                if status == INSUFFICIENT_SIZE {
                    procs.resize(
                        (count as usize).max(procs.len() * 2),
                        ProcessInfoV1::default(),
                    );
                    continue;
                }
                self.check("nvmlDeviceGetComputeRunningProcesses", status)?;
                procs.truncate(count as usize);
                return Ok(procs
                    .iter()
                    .map(|p| GpuProcess {
                        pid: p.pid,
                        used: p.used_gpu_memory,
                    })
                    .collect());
            }
            Err(NvmlError::Call {
                function: "nvmlDeviceGetComputeRunningProcesses",
                code: INSUFFICIENT_SIZE,
                message: "the process list kept growing".into(),
            })
        })();
        // SAFETY: balances the successful nvmlInit_v2 above.
        let _ = unsafe { (self.shutdown)() };
        listed
    }

    fn check(&self, function: &'static str, status: Status) -> Result<(), NvmlError> {
        if status == 0 {
            return Ok(());
        }
        let message = match self.error_string {
            // SAFETY: nvmlErrorString takes any code and returns a static NUL-terminated
            // string (or null, checked below).
            Some(describe) => match unsafe { describe(status) } {
                p if p.is_null() => None,
                // SAFETY: non-null, NUL-terminated and static, as NVML documents.
                p => Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()),
            },
            None => None,
        };
        Err(NvmlError::Call {
            function,
            code: status,
            message: message.unwrap_or_else(|| "unknown NVML error".into()),
        })
    }
}

/// The machine's NVML ([`LIBRARY_NAMES`]), loaded once and kept loaded.
fn system() -> Result<&'static Nvml, NvmlError> {
    static SYSTEM: OnceLock<Result<Nvml, NvmlError>> = OnceLock::new();
    SYSTEM
        .get_or_init(|| Nvml::open(&LIBRARY_NAMES))
        .as_ref()
        .map_err(Clone::clone)
}

/// The number of GPUs the machine's NVML sees. Never initialises CUDA.
pub fn device_count() -> Result<usize, NvmlError> {
    system()?.device_count()
}

/// The compute processes on the GPU at `pci_bus_id`, from the machine's NVML
/// ([`Nvml::compute_processes`]).
pub fn compute_processes(pci_bus_id: &str) -> Result<Vec<GpuProcess>, NvmlError> {
    system()?.compute_processes(pci_bus_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_data_naming_each_name_tried() {
        let err = Nvml::open(&["/nonexistent/libnvidia-ml.so.1", "/nonexistent/libnvml.so"])
            .err()
            .unwrap();
        let NvmlError::LibraryNotFound(reasons) = &err else {
            panic!("{err:?}")
        };
        assert!(
            reasons.contains("/nonexistent/libnvidia-ml.so.1")
                && reasons.contains("/nonexistent/libnvml.so"),
            "{reasons}"
        );
        assert!(err.to_string().starts_with("NVML is not available: "));
    }

    #[test]
    fn a_file_that_is_not_a_library_is_not_nvml() {
        let not_a_library = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
        assert!(matches!(
            Nvml::open(&[not_a_library]),
            Err(NvmlError::LibraryNotFound(_))
        ));
    }

    /// The C library loads on every Linux machine and has no NVML function: the next name is
    /// tried after a failure, and a library that is not NVML is refused by its symbols.
    #[test]
    fn a_library_without_nvml_functions_is_refused_after_trying_the_next_name() {
        let err = Nvml::open(&["/nonexistent/libnvidia-ml.so.1", "libc.so.6"])
            .err()
            .unwrap();
        assert_eq!(err, NvmlError::MissingFunction("nvmlInit_v2"));
        assert_eq!(
            err.to_string(),
            "NVML is not available: the library has no nvmlInit_v2"
        );
    }

    #[test]
    fn a_failed_call_names_the_function_and_the_code() {
        let err = NvmlError::Call {
            function: "nvmlInit_v2",
            code: 9,
            message: "Driver Not Loaded".into(),
        };
        assert_eq!(
            err.to_string(),
            "nvmlInit_v2 failed: Driver Not Loaded (NVML error 9)"
        );
    }
}
