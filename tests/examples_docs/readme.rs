//! README.md's library example is `examples/quickstart.rs`: `cargo test` runs it here, on the
//! fake device, and checks that the README shows that very file.
include!("../../examples/quickstart.rs");

#[test]
fn the_readme_example_runs() -> Result<(), Box<dyn std::error::Error>> {
    main()
}

#[test]
fn the_readme_shows_the_example_as_it_is() {
    let readme = include_str!("../../README.md");
    let example = include_str!("../../examples/quickstart.rs");
    assert!(
        readme.contains(&format!("```rust\n{example}```\n")),
        "README.md's rust block differs from examples/quickstart.rs: copy the file into it"
    );
}
