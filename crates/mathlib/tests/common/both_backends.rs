/// Declares, for each named `fn(&Setup) -> TestResult` of the calling test file, a
/// `fake::<name>` test over `fake_setup()` (CI) and a `cuda::<name>` test over
/// `cuda_setup()`, ignored with `$reason` where there is no GPU and run by the GPU bundle
/// (where a skip counts as a failure).
macro_rules! both_backends {
    ($reason:literal, $($name:ident),* $(,)?) => {
        mod fake {
            $(#[test] fn $name() -> super::TestResult { super::$name(&super::fake_setup()) })*
        }
        mod cuda {
            $(
                #[test]
                #[ignore = $reason]
                fn $name() -> super::TestResult { super::$name(&super::cuda_setup()) }
            )*
        }
    };
}
