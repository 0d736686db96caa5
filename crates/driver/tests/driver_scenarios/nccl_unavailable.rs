//! Without libnccl (CI), every NCCL entry point is a typed "unavailable", never a panic:
//! cudarc's loader would panic, so the library and its functions are looked for first.
//! Where libnccl is installed this checks that it loads and reports a version.
use ferrocuda_driver::nccl::{self, NcclError, UniqueId};

#[test]
fn nccl_is_available_or_a_typed_unavailable_everywhere() {
    match nccl::available() {
        Ok(()) => {
            let v = nccl::version();
            assert!(v.as_ref().is_ok_and(|v| *v >= 20000), "{v:?}");
        }
        Err(e) => {
            assert!(matches!(e, NcclError::Unavailable(_)), "{e:?}");
            assert!(e.to_string().starts_with("NCCL is not available"));
            assert_eq!(nccl::version(), Err(e.clone()));
            assert_eq!(UniqueId::new(), Err(e.clone()));
            assert_eq!(nccl::group(|| Ok(())), Err(e));
        }
    }
}
