use super::*;

#[test]
fn defaults_and_a_full_valid_string() {
    let c = AllocatorConfig::parse("").expect("a valid config");
    assert_eq!(c, AllocatorConfig::default());
    let s = "backend:native, expandable_segments:True,max_split_size_mb:512,\
             roundup_power2_divisions:[256:1,>:4],garbage_collection_threshold:0.8,\
             per_process_memory_fraction:0.9, release_lock_on_cudamalloc:True";
    let c = AllocatorConfig::parse(s).expect("a valid config");
    assert!(c.expandable.enabled && c.release_lock_on_cudamalloc);
    assert_eq!(c.sizes.max_split_size, Some(512 * MIB));
    assert_eq!(c.release.garbage_collection_threshold, 0.8);
    assert_eq!(c.release.per_process_memory_fraction, 0.9);
    // 256 MiB is index 8; the first entry fills below it; `>` fills after it.
    let mut want = [1u64; ROUNDUP_INTERVALS];
    want[9..].fill(4);
    assert_eq!(c.sizes.roundup_power2_divisions, want);
}

#[test]
fn roundup_tables_follow_the_code_not_the_docs() {
    let c = AllocatorConfig::parse("roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]")
        .expect("a valid config");
    let t = c.sizes.roundup_power2_divisions;
    assert_eq!(
        &t[..7],
        &[8, 8, 8, 8, 8, 8, 8],
        "64 MiB is index 6 and fills below"
    );
    assert_eq!(&t[7..11], &[2, 2, 2, 1]);
    assert!(t[11..].iter().all(|&d| d == 1));
    assert_eq!(
        AllocatorConfig::parse("roundup_power2_divisions:4")
            .map(|c| c.sizes.roundup_power2_divisions),
        Ok([4; 16])
    );
}

#[test]
fn the_recommended_set_applies_first_and_named_keys_override_it() {
    let c = AllocatorConfig::parse("ferrocuda_recommended:True").unwrap_or_default();
    assert!(c.ferrocuda_recommended && c.expandable.enabled);
    assert!(
        c.expandable.reclaim && c.release.oom_search_after_sync && c.release.oom_release_partial
    );
    assert!(c.expandable.small_page_bound);
    assert_eq!(c.expandable.page, Some(2 * MIB));
    let c = AllocatorConfig::parse(
        "ferrocuda_recommended:True,expandable_segments_small_page_bound:False",
    )
    .unwrap_or_default();
    assert!(!c.expandable.small_page_bound && c.expandable.reclaim);
    assert!(AllocatorConfig::parse("expandable_segments_small_page_bound:1").is_err());
    // Named keys win wherever they stand.
    for s in [
        "expandable_segments_page_mb:4,ferrocuda_recommended:True",
        "ferrocuda_recommended:True,expandable_segments_page_mb:4",
    ] {
        let c = AllocatorConfig::parse(s).unwrap_or_default();
        assert_eq!(c.expandable.page, Some(4 * MIB), "{s}");
        assert!(c.expandable.reclaim, "{s}");
    }
    let c = AllocatorConfig::parse("ferrocuda_recommended:True,large_segment_size_mb:32")
        .unwrap_or_default();
    assert_eq!(c.sizes.large_segment_size, 32 * MIB);
    let off = AllocatorConfig::parse("ferrocuda_recommended:False").unwrap_or_default();
    assert_eq!(off, AllocatorConfig::default());
    assert!(AllocatorConfig::parse("ferrocuda_recommended:yes").is_err());
    // The set itself parses.
    assert!(AllocatorConfig::parse(AllocatorConfig::RECOMMENDED).is_ok());
}

#[test]
fn expandable_page_sizes_are_whole_2_mib_steps() {
    for bad in ["0", "1", "3", "2199023255554"] {
        let s = format!("expandable_segments_page_mb:{bad}");
        let e = AllocatorConfig::parse(&s).err().map(|e| e.to_string());
        assert!(
            e.as_deref().is_some_and(|e| e.contains("multiple of 2")),
            "{s}: {e:?}"
        );
    }
    let c = AllocatorConfig::parse("expandable_segments_page_mb:6").unwrap_or_default();
    assert_eq!(c.expandable.page, Some(6 * MIB));
}

#[test]
fn pageable_copy_threads_are_a_count_up_to_64_kept_across_reparses_and_shown() {
    assert_eq!(AllocatorConfig::default().pinned.pageable_copy_threads, 0);
    let mut c = AllocatorConfig::parse("pageable_copy_threads:4").unwrap_or_default();
    assert_eq!(c.pinned.pageable_copy_threads, 4);
    assert!(c.to_string().ends_with(",pageable_copy_threads:4"), "{c}");
    assert_eq!(AllocatorConfig::parse(&c.to_string()), Ok(c.clone()));
    c.update("max_split_size_mb:64").unwrap_or_default();
    assert_eq!(c.pinned.pageable_copy_threads, 4, "kept by a re-parse");
    let mut pinned = PinnedConfig::default();
    pinned.update("pageable_copy_threads:2").unwrap_or_default();
    assert_eq!(
        pinned.pageable_copy_threads, 2,
        "the host allocator's part takes it"
    );
    assert_eq!(
        AllocatorConfig::parse("pageable_copy_threads:64").map(|c| c.pinned.pageable_copy_threads),
        Ok(64)
    );
    for (bad, why) in [("65", "at most 64"), ("-1", ""), ("two", ""), ("", "")] {
        let s = format!("pageable_copy_threads:{bad}");
        let e = AllocatorConfig::parse(&s).err().map(|e| e.to_string());
        assert!(e.as_deref().is_some_and(|e| e.contains(why)), "{s}: {e:?}");
    }
    assert!(!AllocatorConfig::default().to_string().contains("pageable"));
}

#[test]
fn large_segment_size_is_applied_first_and_bounds_the_others() {
    let c = AllocatorConfig::parse("max_split_size_mb:40,large_segment_size_mb:32")
        .expect("a valid config");
    assert_eq!(
        (
            c.sizes.large_segment_size,
            c.sizes.max_split_size,
            c.sizes.max_non_split_rounding
        ),
        (32 * MIB, Some(40 * MIB), 32 * MIB)
    );
    let e = AllocatorConfig::parse("max_split_size_mb:30,large_segment_size_mb:32").err();
    assert!(e.is_some_and(|e| e.message.contains("must be >= 32")));
}

#[test]
fn update_resets_only_the_resettable_options_and_is_atomic() {
    let mut c = AllocatorConfig::parse(
        "expandable_segments:True,max_split_size_mb:100,roundup_power2_divisions:2",
    )
    .expect("a valid config");
    assert!(c.update("garbage_collection_threshold:0.5").is_ok());
    assert!(c.expandable.enabled, "kept");
    assert_eq!(
        (c.sizes.max_split_size, c.sizes.roundup_power2_divisions),
        (None, [0; 16]),
        "reset"
    );
    let before = c.clone();
    assert!(c.update("expandable_segments:False,bogus:1").is_err());
    assert_eq!(c, before, "a failed update changes nothing");
}

fn vars(
    set: &'static [(&'static str, &'static str)],
) -> impl Fn(&str) -> Result<String, std::env::VarError> {
    move |k: &str| {
        set.iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.to_string())
            .ok_or(std::env::VarError::NotPresent)
    }
}

#[test]
fn env_precedence() {
    assert_eq!(AllocatorConfig::source(vars(&[])), Ok(None));
    static BOTH: [(&str, &str); 2] = [
        ("PYTORCH_CUDA_ALLOC_CONF", "a:1"),
        ("FERROCUDA_ALLOC_CONF", "b:2"),
    ];
    assert_eq!(
        AllocatorConfig::source(vars(&BOTH)).map(|s| s.map(|(k, _)| k)),
        Ok(Some("FERROCUDA_ALLOC_CONF"))
    );
    static TORCH: [(&str, &str); 2] = [
        ("PYTORCH_ALLOC_CONF", "c:3"),
        ("PYTORCH_CUDA_ALLOC_CONF", "a:1"),
    ];
    assert_eq!(
        AllocatorConfig::source(vars(&TORCH)).map(|s| s.map(|(k, _)| k)),
        Ok(Some("PYTORCH_CUDA_ALLOC_CONF"))
    );
}

/// A variable set to bytes that are not UTF-8 is an error naming it; the variables
/// after it in the order are not read in its place (they used to win).
#[cfg(unix)]
#[test]
fn a_variable_that_is_not_utf8_is_an_error_naming_it() {
    use std::os::unix::ffi::OsStringExt;
    for bad in AllocatorConfig::SOURCES {
        let var = move |k: &str| {
            if k == bad {
                Err(std::env::VarError::NotUnicode(
                    std::ffi::OsString::from_vec(b"expandable_segments:\xff".to_vec()),
                ))
            } else {
                Ok("max_split_size_mb:100".to_owned())
            }
        };
        let before: Vec<_> = AllocatorConfig::SOURCES
            .into_iter()
            .take_while(|k| *k != bad)
            .collect();
        let got = AllocatorConfig::source(var);
        if let Some(first) = before.first() {
            // A variable before it is set and valid: it wins, the bad one is not read.
            assert_eq!(got.map(|s| s.map(|(k, _)| k)), Ok(Some(*first)), "{bad}");
            continue;
        }
        match got {
            Err(EnvError::NotUnicode { name, value }) => {
                assert_eq!(name, bad);
                assert!(value.contains(r"\xFF"), "{value}");
            }
            other => panic!("{bad}: {other:?}"),
        }
    }
    // Unset before it: the bad one is the first set, so the error.
    let var = |k: &str| match k {
        "PYTORCH_CUDA_ALLOC_CONF" => Err(std::env::VarError::NotUnicode(
            std::ffi::OsString::from_vec(vec![0xfe]),
        )),
        "PYTORCH_ALLOC_CONF" => Ok("max_split_size_mb:100".to_owned()),
        _ => Err(std::env::VarError::NotPresent),
    };
    let e = AllocatorConfig::source(var).err().map(|e| e.to_string());
    assert!(
        e.as_deref().is_some_and(|e| e.starts_with(
            "environment variable PYTORCH_CUDA_ALLOC_CONF is set but its value is not valid UTF-8"
        )),
        "{e:?}"
    );
}

#[test]
fn a_reserve_of_zero_is_refused_in_every_form() {
    for (input, token) in [
        ("expandable_segments_reserve:0", "0"),
        ("expandable_segments_reserve:0.0", "0.0"),
        ("expandable_segments_reserve:0G", "0G"),
        ("expandable_segments_reserve:-0.5", "-0.5"),
        ("expandable_segments_reserve:1e-400", "1e-400"),
        ("expandable_segments_reserve_by_class:[decode:0G]", "0G"),
    ] {
        let e = AllocatorConfig::parse(input).err();
        let key = input.split(':').next().unwrap_or_default();
        assert!(
            e.as_ref().is_some_and(|e| e.token == token
                && e.message
                    .starts_with(&format!("{key} must be > 0: a positive fraction"))),
            "{input}: {e:?}"
        );
    }
    for (input, want) in [
        (
            "expandable_segments_reserve:0.5",
            ReserveSize::Fraction(0.5),
        ),
        (
            "expandable_segments_reserve:1G",
            ReserveSize::Bytes(1 << 30),
        ),
    ] {
        let c = AllocatorConfig::parse(input).map(|c| c.expandable.reserve);
        assert_eq!(c, Ok(Some(want)), "{input}");
    }
}

/// Under `backend:cudaMallocAsync` every key PyTorch accepts parses (what is not built
/// for the caching allocator yet included: the backend ignores it), and each is read as
/// PyTorch's backend reads it.
#[test]
fn keys_beside_the_async_backend() {
    let keys = |s: &str| AllocatorConfig::parse(s).map(|c| c.async_backend_keys());
    assert_eq!(
        keys("backend:cudaMallocAsync"),
        Ok(AsyncBackendKeys::default())
    );
    let all = "backend:cudaMallocAsync,max_split_size_mb:100,garbage_collection_threshold:0.5,\
               roundup_power2_divisions:4,release_lock_on_cudamalloc:True,\
               max_non_split_rounding_mb:64,expandable_segments:True,\
               large_segment_size_mb:32,per_process_memory_fraction:0.5,\
               graph_capture_record_stream_reuse:True,throw_on_cudamalloc_oom:True,\
               expandable_segments_reserve:0.5,expandable_segments_reserve_by_class:[a:1G],\
               pinned_use_cuda_host_register:True,pinned_num_register_threads:4,\
               pinned_reserve_segment_size_mb:8,pinned_free_catch_all:True,\
               pinned_use_background_threads:True,pinned_max_round_threshold_mb:16,\
               pinned_max_cached_size_mb:64";
    let k = keys(all).unwrap_or_default();
    assert_eq!(
        k.ignored,
        [
            "max_split_size_mb",
            "garbage_collection_threshold",
            "roundup_power2_divisions",
            "release_lock_on_cudamalloc",
            "max_non_split_rounding_mb",
            "expandable_segments",
            "large_segment_size_mb",
            "per_process_memory_fraction",
            "graph_capture_record_stream_reuse",
            "throw_on_cudamalloc_oom",
            "expandable_segments_reserve",
            "expandable_segments_reserve_by_class",
        ]
    );
    assert_eq!(
        k.pinned_warned,
        [
            "pinned_use_cuda_host_register",
            "pinned_num_register_threads",
            "pinned_reserve_segment_size_mb",
            "pinned_free_catch_all",
        ]
    );
    assert!(k.ferrocuda_only.is_empty() && k.warns());
    // A key named with its default value counts (PyTorch's parser flags the key).
    let k = keys("release_lock_on_hipmalloc:False,backend:cudaMallocAsync");
    assert_eq!(
        k.map(|k| k.ignored),
        Ok(vec!["release_lock_on_hipmalloc".to_owned()])
    );
    // The pinned keys PyTorch's generic parser reads: no warning.
    let k = keys("backend:cudaMallocAsync,pinned_use_background_threads:True").unwrap_or_default();
    assert!(!k.warns());
    // Staged pageable copies serve both backends: no warning, no refusal.
    let k = keys("backend:cudaMallocAsync,pageable_copy_threads:4").unwrap_or_default();
    assert_eq!(k, AsyncBackendKeys::default());
    // ferrocuda's own keys.
    let k = keys("backend:cudaMallocAsync,thread_cache:False,ferrocuda_recommended:True")
        .unwrap_or_default();
    assert_eq!(
        k.ferrocuda_only,
        [
            "thread_cache",
            "ferrocuda_recommended",
            "expandable_segments_reclaim",
            "expandable_segments_small_page_bound",
            "oom_release_partial",
            "oom_search_after_sync",
            "expandable_segments_page_mb"
        ]
    );
    // A configuration built in code: what differs from the defaults.
    let mut c = AllocatorConfig {
        backend: Backend::CudaMallocAsync,
        ..AllocatorConfig::default()
    };
    c.sizes.max_split_size = Some(64 * MIB);
    c.reuse.cross_stream_reuse = true;
    let k = c.async_backend_keys();
    assert_eq!(
        (k.ignored, k.ferrocuda_only),
        (
            vec!["max_split_size_mb".to_owned()],
            vec!["cross_stream_reuse".to_owned()]
        )
    );
}

/// What is not built yet is an error with the caching allocator only.
#[test]
fn unbuilt_options_are_errors_with_the_native_backend_only() {
    for s in [
        "graph_capture_record_stream_reuse:True",
        "expandable_segments_reserve_by_class:[a:1G]",
    ] {
        let e = AllocatorConfig::parse(s).err();
        assert!(
            e.is_some_and(|e| e.message.contains("is not supported by ferrocuda yet")),
            "{s}"
        );
        let native = format!("backend:native,{s}");
        assert!(AllocatorConfig::parse(&native).is_err(), "{native}");
        let with_async = format!("{s},backend:cudaMallocAsync");
        assert!(AllocatorConfig::parse(&with_async).is_ok(), "{with_async}");
    }
    assert!(
        AllocatorConfig::parse(
            "graph_capture_record_stream_reuse:True,graph_capture_record_stream_reuse:False"
        )
        .is_ok()
    );
}

#[test]
fn display_round_trips() {
    let c = AllocatorConfig::parse("max_split_size_mb:64,roundup_power2_divisions:[32:4,>:2],garbage_collection_threshold:0.25").expect("a valid config");
    assert_eq!(AllocatorConfig::parse(&c.to_string()), Ok(c));
    // ferrocuda's own keys show where they differ from their defaults.
    let mut r = AllocatorConfig::parse("ferrocuda_recommended:True,thread_cache:False")
        .expect("a valid config");
    let text = r.to_string();
    for key in [
        "expandable_segments:True",
        "expandable_segments_reclaim:True",
        "expandable_segments_page_mb:2",
        "oom_search_after_sync:True",
        "oom_release_partial:True",
        "thread_cache:False",
    ] {
        assert!(text.contains(key), "{key} in {text}");
    }
    let back = AllocatorConfig::parse(&text).expect("its own text parses");
    // The umbrella flag itself is not shown: the keys it set are.
    r.ferrocuda_recommended = false;
    assert_eq!(back, r);
    assert!(
        !AllocatorConfig::default()
            .to_string()
            .contains("thread_cache")
    );
}

/// At least 30 malformed inputs, each with the token and position its error names.
#[test]
fn malformed_inputs_name_the_token_and_position() {
    let cases: &[(&str, &str, usize, &str)] = &[
        ("foo:1,bar:2", "foo", 0, "Unrecognized key 'foo'"),
        (
            "expandable_segments:True,bar:2",
            "bar",
            25,
            "Unrecognized key 'bar'",
        ),
        ("garbage_collection_threshold:1.2", "1.2", 29, "(0.0, 1.0)"),
        ("garbage_collection_threshold:0", "0", 29, "(0.0, 1.0)"),
        (
            "garbage_collection_threshold:-0.5",
            "-0.5",
            29,
            "(0.0, 1.0)",
        ),
        (
            "garbage_collection_threshold:abc",
            "abc",
            29,
            "expected a number",
        ),
        ("garbage_collection_threshold:nan", "nan", 29, "finite"),
        ("max_split_size_mb:2", "2", 18, "too small, must be >= 20"),
        ("max_split_size_mb:40MB", "40MB", 18, "whole number"),
        ("max_split_size_mb:-40", "-40", 18, "whole number"),
        (
            "max_split_size_mb:99999999999999999999999",
            "99999999999999999999999",
            18,
            "too large",
        ),
        (
            "max_non_split_rounding_mb:10",
            "10",
            26,
            "max_non_split_rounding_mb too small",
        ),
        ("large_segment_size_mb:10", "10", 22, "must be > 10 MB"),
        (
            "expandable_segments:true",
            "true",
            20,
            "Expected 'True' or 'False'",
        ),
        (
            "expandable_segments:1",
            "1",
            20,
            "Expected 'True' or 'False'",
        ),
        (
            "release_lock_on_cudamalloc:yes",
            "yes",
            27,
            "Expected 'True' or 'False'",
        ),
        (
            "pinned_num_register_threads:1024",
            "1024",
            28,
            "less than or equal to 128",
        ),
        ("pinned_num_register_threads:3", "3", 28, "power of 2"),
        (
            "pinned_reserve_segment_size_mb:0",
            "0",
            31,
            "greater than 0",
        ),
        (
            "roundup_power2_divisions:3",
            "3",
            25,
            "divisions has to be power of 2",
        ),
        (
            "roundup_power2_divisions:0",
            "0",
            25,
            "divisions has to be power of 2",
        ),
        (
            "roundup_power2_divisions:[64:3]",
            "3",
            29,
            "power of 2 or 0",
        ),
        (
            "roundup_power2_divisions:[96:4]",
            "96",
            26,
            "intervals have to be power of 2",
        ),
        (
            "roundup_power2_divisions:[64:8,>:1",
            "",
            34,
            "reached the end",
        ),
        (
            "roundup_power2_divisions:[64:8;>:1]",
            ":",
            32,
            "closing bracket",
        ),
        ("roundup_power2_divisions:[64]", "]", 28, "expected ':'"),
        (
            "backend:cudaMallocSync",
            "cudaMallocSync",
            8,
            "Unknown allocator backend",
        ),
        ("per_process_memory_fraction:1.5", "1.5", 28, "[0.0, 1.0]"),
        ("per_process_memory_fraction:-0.1", "-0.1", 28, "[0.0, 1.0]"),
        ("expandable_segments", "", 19, "expected ':'"),
        ("expandable_segments:", "", 20, "expected a value"),
        (":True", ":", 0, "expected a value"),
        ("expandable_segments:True,", "", 25, "expected a key"),
        (
            "expandable_segments:True expandable_segments:False",
            ":",
            44,
            "expected ','",
        ),
        (
            "expandable_segments:[a:True]",
            "expandable_segments",
            0,
            "single value",
        ),
        (
            "expandable_segments_reserve:0",
            "0",
            28,
            "positive fraction",
        ),
        (
            "expandable_segments_reserve_by_class:4",
            "expandable_segments_reserve_by_class",
            0,
            "bracketed list",
        ),
        (
            "max_split_size_mb:[1:2]",
            "max_split_size_mb",
            0,
            "single value",
        ),
    ];
    assert!(cases.len() >= 30);
    for (input, token, position, message) in cases {
        match AllocatorConfig::parse(input) {
            Ok(c) => panic!("{input:?} parsed as {c:?}"),
            Err(e) => {
                assert_eq!(
                    (e.token.as_str(), e.position),
                    (*token, *position),
                    "{input:?}: {e}"
                );
                assert!(e.message.contains(message), "{input:?}: {e}");
                assert!(e.to_string().contains(&format!("character {position}")));
            }
        }
    }
}

#[test]
fn pinned_keys_parse_and_keep_their_values_across_reparses() {
    let mut c = AllocatorConfig::parse(
        "pinned_use_cuda_host_register:True,pinned_num_register_threads:8,\
         pinned_use_background_threads:True,pinned_reserve_segment_size_mb:16,\
         pinned_max_round_threshold_mb:64,pinned_max_cached_size_mb:128,\
         pinned_free_catch_all:True",
    )
    .expect("the pinned keys are supported");
    assert!(c.pinned.use_cuda_host_register && c.pinned.use_background_threads);
    assert!(c.pinned.free_catch_all);
    assert_eq!(c.pinned.num_register_threads, 8);
    assert_eq!(c.pinned.reserve_segment_size, 16 * MIB);
    assert_eq!(c.pinned.max_round_threshold, Some(64 * MIB));
    assert_eq!(c.pinned.max_cached_size, Some(128 * MIB));
    // A re-parse resets only the device rounding options (allocator spec §1.3).
    c.update("pinned_use_hip_host_register:False")
        .expect("the alias");
    assert!(!c.pinned.use_cuda_host_register);
    assert_eq!(c.pinned.num_register_threads, 8);
    assert_eq!(c.pinned.max_cached_size, Some(128 * MIB));
}

/// The groups are a Rust-side structure: serialized, a configuration stays one flat record
/// with a field per key, named as before the grouping, and reads back equal.
#[test]
fn serialized_configuration_is_flat_and_round_trips() -> Result<(), Box<dyn std::error::Error>> {
    let mut c = AllocatorConfig::parse(
        "expandable_segments:True,pinned_num_register_threads:4,max_split_size_mb:64,\
         oom_release_partial:True,thread_cache:False",
    )?;
    c.expandable.reserve = Some(ReserveSize::Bytes(12 << 30));
    let value = serde_pickle::to_value(&c)?;
    let serde_pickle::Value::Dict(fields) = &value else {
        panic!("not a record: {value:?}");
    };
    let mut names: Vec<String> = fields
        .keys()
        .map(|k| match k {
            serde_pickle::HashableValue::String(s) => s.clone(),
            other => panic!("key {other:?}"),
        })
        .collect();
    names.sort();
    let mut expected = vec![
        "backend",
        "cross_stream_reuse",
        "expandable_segments",
        "expandable_segments_page",
        "expandable_segments_reclaim",
        "expandable_segments_reserve",
        "expandable_segments_reserve_by_class",
        "expandable_segments_small_page_bound",
        "ferrocuda_recommended",
        "garbage_collection_threshold",
        "garbage_collection_without_fraction",
        "graph_capture_record_stream_reuse",
        "large_segment_size",
        "max_non_split_rounding",
        "max_split_size",
        "oom_forensics",
        "oom_release_partial",
        "oom_search_after_sync",
        "pageable_copy_threads",
        "per_process_memory_fraction",
        "pinned_free_catch_all",
        "pinned_max_cached_size",
        "pinned_max_round_threshold",
        "pinned_num_register_threads",
        "pinned_reserve_segment_size",
        "pinned_use_background_threads",
        "pinned_use_cuda_host_register",
        "release_lock_on_cudamalloc",
        "roundup_power2_divisions",
        "throw_on_cudamalloc_oom",
        "thread_cache",
    ];
    expected.sort_unstable();
    assert_eq!(names, expected);
    let back: AllocatorConfig = serde_pickle::from_value(value)?;
    assert_eq!(back, c);
    Ok(())
}

#[test]
fn oom_forensics_takes_a_path_or_false() {
    let c = AllocatorConfig::parse("oom_forensics:/tmp/run-1/oom.pickle").expect("a path");
    assert_eq!(
        c.release.oom_forensics.as_deref(),
        Some("/tmp/run-1/oom.pickle")
    );
    assert_eq!(c.async_backend_keys().ferrocuda_only, ["oom_forensics"]);
    let off = AllocatorConfig::parse("oom_forensics:False").expect("off");
    assert_eq!(off.release.oom_forensics, None);
    for bad in [
        "oom_forensics:True",
        "oom_forensics:",
        "oom_forensics:[a:b]",
    ] {
        assert!(AllocatorConfig::parse(bad).is_err(), "{bad}");
    }
    // A re-parse that does not name it keeps it, as for the other keys.
    let mut c = c;
    c.update("expandable_segments:True").expect("valid");
    assert!(c.release.oom_forensics.is_some());
}
