//! Kernels compiled from CUDA C++ source at run time, with an on-disk cache.
//!
//! The cache key is a SHA-256 of the compiler target (NVRTC version and architecture, from
//! the driver), the kernel name and the source. An entry is `MAGIC`, the SHA-256 of the
//! image, then the image; an entry that fails that check, or that the driver refuses to
//! load, is compiled again and rewritten, never fatal. Writes go to a temporary file that is
//! renamed into place, so concurrent processes never see half an entry.
use crate::{Result, Runtime, StreamError};
use ferrocuda_driver::{Driver, DriverError};
use ferrocuda_types::{DeviceIndex, FunctionHandle, ModuleHandle};
use parking_lot::Mutex;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

const MAGIC: &[u8; 8] = b"FCKERN01";

/// Where compiled kernels are cached, if anywhere.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelCache {
    dir: Option<PathBuf>,
}

/// How a module's image was obtained.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum CacheOutcome {
    /// Loaded from the cache.
    Hit,
    /// Compiled and written to the cache.
    Miss,
    /// The cached entry was damaged or refused by the driver; compiled and rewritten.
    Repaired,
    /// Compiled; no cache is configured (or the driver gives no cache key).
    Disabled,
}

impl KernelCache {
    /// A cache in `dir`, or none.
    pub fn at(dir: Option<PathBuf>) -> KernelCache {
        KernelCache { dir }
    }

    /// The cache torch.cuda's users expect: off with `FERROCUDA_KERNEL_CACHE=0`, in
    /// `FERROCUDA_KERNEL_CACHE_PATH` if set, else `$XDG_CACHE_HOME/ferrocuda/kernels`, else
    /// `$HOME/.cache/ferrocuda/kernels`.
    pub fn from_env() -> KernelCache {
        KernelCache::from_vars(|k| std::env::var(k).ok())
    }

    /// [`KernelCache::from_env`] over any variable lookup (for tests).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> KernelCache {
        let set = |k: &str| var(k).filter(|v| !v.is_empty());
        if set("FERROCUDA_KERNEL_CACHE").is_some_and(|v| v == "0") {
            return KernelCache { dir: None };
        }
        let dir = set("FERROCUDA_KERNEL_CACHE_PATH")
            .map(PathBuf::from)
            .or_else(|| set("XDG_CACHE_HOME").map(|x| Path::new(&x).join("ferrocuda/kernels")))
            .or_else(|| set("HOME").map(|h| Path::new(&h).join(".cache/ferrocuda/kernels")));
        KernelCache { dir }
    }

    /// The cache folder, if any.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    fn entry_path(&self, target: &str, name: &str, source: &str) -> Option<PathBuf> {
        let dir = self.dir.as_ref()?;
        let mut h = Sha256::new();
        for part in [target, name, source] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
        let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        Some(dir.join(format!("{hex}.kernel")))
    }

    fn read(path: &Path) -> Option<Vec<u8>> {
        let bytes = std::fs::read(path).ok()?;
        let rest = bytes.strip_prefix(MAGIC.as_slice())?;
        let (sum, image) = rest.split_at_checked(32)?;
        (Sha256::digest(image).as_slice() == sum).then(|| image.to_vec())
    }

    fn write(path: &Path, image: &[u8]) {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let Some(dir) = path.parent() else { return };
        let tmp = dir.join(format!(
            ".tmp-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let entry = [MAGIC.as_slice(), Sha256::digest(image).as_slice(), image].concat();
        // Best effort: a cache that cannot be written only costs a compile next time.
        let ok = std::fs::create_dir_all(dir).is_ok() && std::fs::write(&tmp, entry).is_ok();
        if !ok || std::fs::rename(&tmp, path).is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }
}

#[derive(Debug)]
struct ModuleInner {
    driver: Arc<dyn Driver>,
    /// [`Runtime::id`] of the runtime that loaded it.
    runtime: u64,
    handle: ModuleHandle,
    functions: Mutex<HashMap<String, FunctionHandle>>,
}

impl Drop for ModuleInner {
    fn drop(&mut self) {
        let _ = self.driver.module_unload(self.handle);
    }
}

/// Compiled CUDA code loaded on one device.
#[derive(Clone, Debug)]
pub struct Module {
    inner: Arc<ModuleInner>,
    outcome: CacheOutcome,
}

/// One kernel of a [`Module`]; keeps its module loaded.
#[derive(Clone, Debug)]
pub struct Function {
    handle: FunctionHandle,
    name: Arc<str>,
    _module: Arc<ModuleInner>,
}

impl Function {
    /// The driver handle.
    pub fn handle(&self) -> FunctionHandle {
        self.handle
    }
    /// The device it runs on.
    pub fn device(&self) -> DeviceIndex {
        self.handle.device
    }
    /// The kernel's name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// [`Runtime::id`] of the runtime that loaded it: only that runtime's streams launch it.
    pub fn runtime_id(&self) -> u64 {
        self._module.runtime
    }
}

impl Module {
    /// Compiles CUDA C++ `source` for `dev` (NVRTC on the real driver) and loads it, through
    /// the runtime's kernel cache. `name` names the program in compiler messages.
    pub fn from_cuda_source(
        rt: &Runtime,
        dev: DeviceIndex,
        name: &str,
        source: &str,
    ) -> Result<Module> {
        rt.check_device(dev)?;
        let driver = rt.driver();
        let target = driver.compile_target(dev)?;
        let path = target.and_then(|t| rt.kernel_cache.entry_path(&t, name, source));
        let mut outcome = if path.is_some() {
            CacheOutcome::Miss
        } else {
            CacheOutcome::Disabled
        };
        if let Some(path) = &path
            && path.exists()
        {
            match KernelCache::read(path).map(|image| driver.module_load(dev, &image)) {
                Some(Ok(handle)) => {
                    return Ok(Module::wrap(rt, handle, CacheOutcome::Hit));
                }
                _ => outcome = CacheOutcome::Repaired,
            }
        }
        let image = driver.compile_source(dev, source, name)?;
        let handle = driver.module_load(dev, &image)?;
        if let Some(path) = &path {
            KernelCache::write(path, &image);
        }
        Ok(Module::wrap(rt, handle, outcome))
    }

    fn wrap(rt: &Runtime, handle: ModuleHandle, outcome: CacheOutcome) -> Module {
        Module {
            inner: Arc::new(ModuleInner {
                driver: rt.driver().clone(),
                runtime: rt.id(),
                handle,
                functions: Mutex::new(HashMap::new()),
            }),
            outcome,
        }
    }

    /// How the image was obtained (cache hit, miss, repair, or no cache).
    pub fn cache_outcome(&self) -> CacheOutcome {
        self.outcome
    }

    /// The device the module is loaded on.
    pub fn device(&self) -> DeviceIndex {
        self.inner.handle.device
    }

    /// The kernel called `name` (an `extern "C"` name). On the fake device, a kernel with
    /// no host function registered is [`StreamError::KernelNotRegistered`], naming it.
    pub fn function(&self, name: &str) -> Result<Function> {
        let mut functions = self.inner.functions.lock();
        let handle = match functions.get(name) {
            Some(h) => *h,
            None => {
                let h = self
                    .inner
                    .driver
                    .module_function(self.inner.handle, name)
                    .map_err(|e| match e {
                        DriverError::KERNEL_NOT_REGISTERED => StreamError::KernelNotRegistered {
                            name: name.to_owned(),
                        },
                        e => e.into(),
                    })?;
                *functions.entry(name.to_owned()).or_insert(h)
            }
        };
        Ok(Function {
            handle,
            name: name.into(),
            _module: self.inner.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_folder_follows_the_environment_rules() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let dir = |c: KernelCache| c.dir().map(|p| p.to_string_lossy().into_owned());
        assert_eq!(
            dir(KernelCache::from_vars(vars(&[("HOME", "/h")]))),
            Some("/h/.cache/ferrocuda/kernels".into())
        );
        assert_eq!(
            dir(KernelCache::from_vars(vars(&[
                ("HOME", "/h"),
                ("XDG_CACHE_HOME", "/x")
            ]))),
            Some("/x/ferrocuda/kernels".into())
        );
        assert_eq!(
            dir(KernelCache::from_vars(vars(&[
                ("XDG_CACHE_HOME", "/x"),
                ("FERROCUDA_KERNEL_CACHE_PATH", "/k")
            ]))),
            Some("/k".into())
        );
        assert_eq!(
            dir(KernelCache::from_vars(vars(&[
                ("HOME", "/h"),
                ("FERROCUDA_KERNEL_CACHE", "0")
            ]))),
            None
        );
        assert_eq!(dir(KernelCache::from_vars(vars(&[]))), None);
    }
}
