//! Loading a pluggable allocator library and calling its functions (PyTorch's
//! `CUDAPluggableAllocator` interface), against the fixture library built by cargo beside
//! this test: every argument reaches the library as passed, every hook runs only when given,
//! and a missing file or function is a typed error with Python's text.
use ferrocuda_driver::{Hook, PluggableError, PluggableLibrary};
use ferrocuda_pluggable_fixture::{Event, HOOK_FUNCTIONS, Probe, path};
use ferrocuda_types::{DeviceIndex, PoolId, StreamHandle};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const D1: DeviceIndex = DeviceIndex(1);
const S: StreamHandle = StreamHandle {
    device: D1,
    raw: 0x5eed,
};

fn host() -> Result<PluggableLibrary, PluggableError> {
    PluggableLibrary::load(path(), "fixture_host_alloc", "fixture_host_free")
}

fn with_every_hook(lib: PluggableLibrary) -> Result<PluggableLibrary, PluggableError> {
    Hook::ALL
        .into_iter()
        .zip(HOOK_FUNCTIONS)
        .try_fold(lib, |lib, (hook, function)| lib.with_hook(hook, function))
}

#[test]
fn alloc_and_free_receive_size_device_and_stream() -> TestResult {
    let probe = Probe::open()?;
    let lib = host()?;
    let ptr = lib.alloc(3000, D1, S);
    assert_ne!(ptr, 0);
    assert_eq!(ptr % 512, 0, "the fixture aligns to 512 bytes");
    assert_eq!(probe.live(), 1);
    lib.free(ptr, 3000, D1, S);
    assert_eq!(probe.live(), 0);
    assert_eq!(
        probe.events(),
        [
            Event::Alloc {
                size: 3000,
                device: 1,
                stream: 0x5eed,
                ptr
            },
            Event::Free {
                ptr,
                size: 3000,
                device: 1,
                stream: 0x5eed
            }
        ]
    );
    Ok(())
}

#[test]
fn a_null_allocation_is_returned_as_zero() -> TestResult {
    let probe = Probe::open()?;
    let lib = PluggableLibrary::load(path(), "fixture_null_alloc", "fixture_host_free")?;
    assert_eq!(lib.alloc(1 << 20, D1, S), 0);
    assert_eq!(probe.live(), 0);
    Ok(())
}

#[test]
fn hooks_run_only_when_given_and_receive_their_arguments() -> TestResult {
    let probe = Probe::open()?;
    let bare = host()?;
    for hook in Hook::ALL {
        assert!(!bare.has_hook(hook), "{hook:?}");
    }
    let pool = PoolId(0, 7);
    assert!(!bare.init(4) && !bare.reset() && !bare.memory_fraction(0.5, D1));
    assert!(!bare.record_stream(0x1000, S));
    assert_eq!(bare.base_alloc(0x1000, 8), None);
    assert!(!bare.pool_hook(Hook::BeginAllocateToPool, D1, pool));
    assert!(probe.events().is_empty(), "no hook, no call");

    let lib = with_every_hook(host()?)?;
    assert!(lib.init(4) && lib.reset() && lib.memory_fraction(0.25, D1));
    assert!(lib.record_stream(0x1000, S));
    for hook in [
        Hook::BeginAllocateToPool,
        Hook::EndAllocateToPool,
        Hook::ReleasePool,
    ] {
        assert!(lib.pool_hook(hook, D1, pool));
    }
    assert!(!lib.pool_hook(Hook::Init, D1, pool), "not a pool hook");
    let ptr = lib.alloc(4096, D1, S);
    assert_eq!(
        lib.base_alloc(ptr + 100, 1),
        Some((ptr, 4096)),
        "the base and size of the allocation holding an interior pointer"
    );
    assert_eq!(lib.base_alloc(8, 1), Some((8, 1)), "unknown: unchanged");
    lib.free(ptr, 4096, D1, S);
    let events = probe.events();
    assert_eq!(
        events[..8],
        [
            Event::Init(4),
            Event::Reset,
            Event::MemoryFraction {
                fraction: 0.25,
                device: 1
            },
            Event::RecordStream {
                ptr: 0x1000,
                stream: 0x5eed
            },
            Event::BeginAllocateToPool {
                device: 1,
                pool: (0, 7)
            },
            Event::EndAllocateToPool {
                device: 1,
                pool: (0, 7)
            },
            Event::ReleasePool {
                device: 1,
                pool: (0, 7)
            },
            Event::Alloc {
                size: 4096,
                device: 1,
                stream: 0x5eed,
                ptr
            },
        ]
    );
    assert_eq!(
        events[8..10],
        [
            Event::BaseAlloc { ptr: ptr + 100 },
            Event::BaseAlloc { ptr: 8 }
        ]
    );
    Ok(())
}

#[test]
fn a_missing_library_is_pythons_oserror_text() {
    let missing = path().with_file_name("libno_such_allocator.so");
    let err = PluggableLibrary::load(&missing, "a", "f").map(drop);
    let Err(PluggableError::Load(text)) = err else {
        panic!("expected a load error, got {err:?}");
    };
    assert_eq!(
        text,
        format!(
            "{}: cannot open shared object file: No such file or directory",
            missing.display()
        )
    );
}

#[test]
fn a_missing_function_is_pythons_attributeerror_text() {
    for (alloc, free) in [
        ("no_alloc", "fixture_host_free"),
        ("fixture_host_alloc", "no_free"),
    ] {
        let missing = if alloc == "no_alloc" { alloc } else { free };
        match PluggableLibrary::load(path(), alloc, free) {
            Err(PluggableError::MissingFunction { name, message }) => {
                assert_eq!(name, missing);
                assert_eq!(
                    message,
                    format!("{}: undefined symbol: {missing}", path().display())
                );
            }
            other => panic!("expected a missing function, got {other:?}"),
        }
    }
    let hooked = host().and_then(|l| l.with_hook(Hook::Reset, "no_reset"));
    assert!(
        matches!(&hooked, Err(PluggableError::MissingFunction { name, .. }) if name == "no_reset"),
        "{hooked:?}"
    );
}
