//! Finding CUDA's math libraries at run time. cudarc opens each by its usual names
//! (`libcublas.so`, `libcublas.so.13`, …) through the loader's search path
//! (`LD_LIBRARY_PATH`, the system's folders). Where it is not found there, the folders
//! listed in [`LIBRARY_PATH_VAR`] are searched: a file named after the library there is
//! opened by its full path, and stays loaded, so the loader then finds it by its name
//! (glibc matches a name against the `SONAME` of libraries already loaded). PyTorch's wheels
//! keep their copies in `site-packages/nvidia/*/lib`, outside the loader's path: naming that
//! folder is enough.
use std::path::Path;

/// Folders, separated by `:`, searched for CUDA's math libraries not found by their usual
/// names.
pub const LIBRARY_PATH_VAR: &str = "FERROCUDA_CUDA_LIBRARY_PATH";

/// Makes library `stem` (`"cublas"` for `libcublas.so*`) findable by its usual names:
/// `present` (cudarc's `is_culib_present`) first; else every file `lib<stem>.so*` in the
/// folders of [`LIBRARY_PATH_VAR`] is opened until one loads, `dependencies` (stems, in
/// order) first, and `present` is asked again. Returns why not, for an error message.
pub(crate) fn make_present(
    stem: &str,
    dependencies: &[&str],
    present: fn() -> bool,
) -> Result<(), String> {
    make_present_from(
        stem,
        dependencies,
        present,
        std::env::var_os(LIBRARY_PATH_VAR),
    )
}

/// [`make_present`] with the folders given (the variable's value).
fn make_present_from(
    stem: &str,
    dependencies: &[&str],
    present: fn() -> bool,
    folders: Option<std::ffi::OsString>,
) -> Result<(), String> {
    if present() {
        return Ok(());
    }
    for folder in folders.iter().flat_map(std::env::split_paths) {
        for dep in dependencies {
            load_from(&folder, dep);
        }
        if load_from(&folder, stem) && present() {
            return Ok(());
        }
    }
    let searched = match &folders {
        Some(f) => format!("nor in {LIBRARY_PATH_VAR}={}", f.to_string_lossy()),
        None => format!("and {LIBRARY_PATH_VAR} is not set"),
    };
    Err(format!(
        "lib{stem} was not found by its usual names on the loader's path ({searched}): set \
         {LIBRARY_PATH_VAR} (or LD_LIBRARY_PATH) to the folder that holds it, e.g. PyTorch's \
         site-packages/nvidia/cu13/lib"
    ))
}

/// [`make_present`], then every one of `symbols` looked up (without being called) in the
/// library `lib` opens: cudarc's loader panics on a missing library or symbol, so each
/// library is checked this way once, before any call reaches cudarc.
pub(crate) fn find(
    stem: &str,
    dependencies: &[&str],
    present: fn() -> bool,
    lib: fn() -> &'static libloading::Library,
    symbols: &[&str],
) -> Result<(), String> {
    make_present(stem, dependencies, present)?;
    let lib = lib();
    for name in symbols {
        // SAFETY: looks a symbol up without calling it.
        if unsafe { lib.get::<*const std::ffi::c_void>(name.as_bytes()) }.is_err() {
            return Err(format!("lib{stem} has no {name}"));
        }
    }
    Ok(())
}

/// Opens the first file of `folder` named `lib<stem>.so` or `lib<stem>.so.*` that loads,
/// and keeps it loaded for the life of the process.
fn load_from(folder: &Path, stem: &str) -> bool {
    let prefix = format!("lib{stem}.so");
    let Ok(entries) = std::fs::read_dir(folder) else {
        return false;
    };
    let mut names: Vec<_> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n == prefix || n.starts_with(&format!("{prefix}.")))
        })
        .collect();
    names.sort();
    names.into_iter().any(|path| {
        // SAFETY: loading a shared library runs its initialisers; these are CUDA's own
        // libraries, named by the user for this purpose, as the loader would run them.
        match unsafe { libloading::Library::new(&path) } {
            Ok(lib) => {
                // Kept loaded: cudarc opens it again by its name, and must find this copy.
                std::mem::forget(lib);
                true
            }
            Err(_) => false,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn found_by_its_usual_name_needs_no_folder() {
        assert_eq!(make_present_from("cublas", &[], || true, None), Ok(()));
    }

    #[test]
    fn not_found_says_where_it_looked_and_what_to_set() {
        let err = make_present_from("cublas", &["cublasLt"], || false, None).err();
        let err = err.unwrap_or_default();
        assert!(err.contains("libcublas was not found"), "{err}");
        assert!(
            err.contains("FERROCUDA_CUDA_LIBRARY_PATH is not set"),
            "{err}"
        );
        let dir = std::env::temp_dir().join(format!("ferrocuda-libs-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        // A file by the library's name that is no library: not loaded, still not found.
        let _ = std::fs::write(dir.join("libcublas.so.13"), b"not an ELF file");
        let err = make_present_from("cublas", &[], || false, Some(dir.clone().into_os_string()));
        let err = err.err().unwrap_or_default();
        assert!(
            err.contains(&format!(
                "nor in FERROCUDA_CUDA_LIBRARY_PATH={}",
                dir.display()
            )),
            "{err}"
        );
        assert!(!load_from(&dir, "cublas"));
        assert!(!load_from(&dir.join("missing"), "cublas"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
