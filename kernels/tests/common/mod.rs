//! Shared by the integration tests: where the default model lives.
#![allow(dead_code)]

use std::path::PathBuf;

/// The repository root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The default model, fetched by `scripts/setup.sh`. `None` (and a "skipped"
/// line) when it is absent, unless `BULKHEAD_REQUIRE_MODEL` is set — as
/// `scripts/test.sh` and CI do — in which case its absence fails the test.
pub fn smollm2_path() -> Option<PathBuf> {
    let path = repo_root().join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.exists() {
        return Some(path);
    }
    assert!(
        std::env::var_os("BULKHEAD_REQUIRE_MODEL").is_none(),
        "BULKHEAD_REQUIRE_MODEL is set but {} is missing: run scripts/setup.sh",
        path.display()
    );
    eprintln!(
        "skipped: {} is missing; run scripts/setup.sh",
        path.display()
    );
    None
}
