//! Writes the conformance models (`testing::conformance_models`) into a
//! directory, one `NAME.gguf` each, and prints `NAME FINGERPRINT` lines: what
//! `scripts/llama_fixtures.py` runs llama.cpp on.
//!
//!   cargo run --release -p bulkhead-kernels --example conformance_models -- DIR

use bulkhead_kernels::gguf::Gguf;
use bulkhead_kernels::testing::{conformance_models, tiny_llama};
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from(
        std::env::args()
            .nth(1)
            .ok_or("usage: conformance_models DIR")?,
    );
    std::fs::create_dir_all(&dir)?;
    for (name, spec) in conformance_models() {
        let bytes = tiny_llama(&spec);
        let fingerprint = Gguf::from_bytes(bytes.clone())?.fingerprint();
        std::fs::write(dir.join(format!("{name}.gguf")), bytes)?;
        println!("{name} {fingerprint:016x}");
    }
    Ok(())
}
