//! Shared by the integration tests: where the real models live.
#![allow(dead_code)]

pub mod harness;

use std::path::PathBuf;

/// The repository root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The default model, fetched by `scripts/setup.sh`. `None` (and a "skipped"
/// line) when it is absent, unless `BULKHEAD_REQUIRE_MODEL` is set — as
/// `scripts/test.sh` and CI do — in which case its absence fails the test.
pub fn smollm2_path() -> Option<PathBuf> {
    model_path("SmolLM2-135M-Instruct.Q4_1.gguf", "scripts/setup.sh")
}

/// The default model re-quantized to Q8_0 by `bulkhead quantize`, derived by
/// `scripts/models.sh` (which `scripts/test.sh` runs). Absent: as for
/// [`smollm2_path`].
pub fn smollm2_q8_path() -> Option<PathBuf> {
    model_path(
        "SmolLM2-135M-Instruct.Q8_0.gguf",
        "scripts/models.sh target/debug/bulkhead",
    )
}

fn model_path(file: &str, remedy: &str) -> Option<PathBuf> {
    let path = repo_root().join(".cache/models").join(file);
    if path.exists() {
        return Some(path);
    }
    assert!(
        std::env::var_os("BULKHEAD_REQUIRE_MODEL").is_none(),
        "BULKHEAD_REQUIRE_MODEL is set but {} is missing: run {remedy}",
        path.display()
    );
    eprintln!("skipped: {} is missing; run {remedy}", path.display());
    None
}
