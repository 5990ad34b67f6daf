//! Writes a random-weight model of a real model's shape, for benchmarks on
//! files too large to commit or download here (BENCHMARKS.md, issue 26).
//!
//!   cargo run --release -p bulkhead-kernels --example random_model -- llama-3.2-1b OUT.gguf
//!
//! Shapes: `llama-3.2-1b` (16 layers, d 2048, 32 heads, 8 KV heads, ffn 8192,
//! a 128,256-token vocabulary, Llama-3's RoPE frequency factors, tied output),
//! its matrices Q4_K and its embedding Q6_K, as in a `Q4_K_M` file.

use bulkhead_kernels::quant::GgmlType;
use bulkhead_kernels::testing::{tiny_llama, TinySpec};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (shape, out) = match (args.next(), args.next()) {
        (Some(shape), Some(out)) => (shape, out),
        _ => return Err("usage: random_model SHAPE OUT.gguf".into()),
    };
    let spec = match shape.as_str() {
        "llama-3.2-1b" => TinySpec {
            seed: 1_230,
            layers: 16,
            embedding_len: 2048,
            heads: 32,
            kv_heads: 8,
            ffn_len: 8192,
            context_len: 8192,
            matrix_type: GgmlType::Q4_K,
            embedding_type: GgmlType::Q6_K,
            filler_tokens: 128_256 - 265,
            rope_freqs: true,
            ..TinySpec::default()
        },
        other => return Err(format!("unknown shape {other:?} (llama-3.2-1b)").into()),
    };
    std::fs::write(&out, tiny_llama(&spec))?;
    eprintln!("wrote {out}");
    Ok(())
}
