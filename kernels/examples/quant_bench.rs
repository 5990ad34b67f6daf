//! Single-thread matmul throughput per ISA for the default model's shapes.
//!
//! `cargo run -p bulkhead-kernels --release --example quant_bench [filter] [tokens]`
//! (filter `x16`, or a type's name then `x16` such as `Q5_0x16`: the repacked
//! 16-row kernels against the row kernels)
//!
//! Decode shapes report weight-streaming GB/s (hot: the matrix fits L2 and is reused;
//! cold: a rotation of copies larger than L3); prefill shapes report G MAC/s
//! (rows x k x tokens multiply-accumulates per second). Batched decode (2 to
//! `COLD_TOKENS_MAX` tokens) reports both hot and cold G MAC/s, since in the engine
//! each step's weights come cold from DRAM. Timings are best-of-N, since other builds
//! share the machine.

use std::time::{Duration, Instant};

use bulkhead_kernels::quant::{matmul, quantize_row, GgmlType, Isa, QuantizedActivations};

/// Bytes of weight copies for the cold (DRAM-streaming) decode figure: above L3.
const COLD_BYTES_MIN: usize = 96 << 20;
/// Up to this many tokens a case is batched decode and is also timed cold.
const COLD_TOKENS_MAX: usize = 64;
/// Time spent per measurement.
const MEASURE: Duration = Duration::from_millis(400);

fn weights(ty: GgmlType, rows: usize, k: usize, seed: u32) -> Vec<u8> {
    let row_bytes = k / ty.block_len() * ty.block_bytes();
    let mut w = vec![0u8; rows * row_bytes];
    let mut state = seed.wrapping_mul(2654435761).max(1);
    let mut x = vec![0.0f32; k];
    for row in w.chunks_exact_mut(row_bytes) {
        for v in x.iter_mut() {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            *v = (state as f32 / u32::MAX as f32 - 0.5) * 0.1;
        }
        quantize_row(ty, &x, row).expect("whole blocks by construction");
    }
    w
}

/// Best seconds per call of `f` over repeated runs.
fn best_seconds(mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    let mut best = f64::MAX;
    while start.elapsed() < MEASURE {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

/// `n_tokens` rows of `k` fixed activations, quantized for `ty` weights.
fn activations(ty: GgmlType, n_tokens: usize, k: usize) -> QuantizedActivations {
    let x: Vec<f32> = (0..n_tokens * k)
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let mut xq = QuantizedActivations::new();
    xq.quantize(ty, &x, n_tokens, k)
        .expect("whole blocks by construction");
    xq
}

fn bench(isa: Isa, ty: GgmlType, rows: usize, k: usize, n_tokens: usize) {
    let xq = activations(ty, n_tokens, k);
    let mut out = vec![0.0f32; n_tokens * rows];
    let w = weights(ty, rows, k, 1);
    let secs = best_seconds(|| matmul(isa, ty, &w, k, 0..rows, &xq, &mut out));
    let macs = (rows * k * n_tokens) as f64;
    let line = format!(
        "{:7} {:5} rows={rows:6} k={k:5} tokens={n_tokens:4}",
        isa.name(),
        ty.name()
    );
    if n_tokens == 1 {
        let cold_secs = cold_seconds(isa, ty, rows, k, &xq, &mut out);
        println!(
            "{line}  {:8.1} us  hot {:6.1} GB/s  cold {:6.1} GB/s  ({:.1} G MAC/s hot)",
            secs * 1e6,
            w.len() as f64 / secs / 1e9,
            w.len() as f64 / cold_secs / 1e9,
            macs / secs / 1e9
        );
    } else if n_tokens <= COLD_TOKENS_MAX {
        let cold_secs = cold_seconds(isa, ty, rows, k, &xq, &mut out);
        println!(
            "{line}  {:8.1} us  hot {:6.1} G MAC/s  cold {:8.1} us {:6.1} G MAC/s {:6.1} GB/s",
            secs * 1e6,
            macs / secs / 1e9,
            cold_secs * 1e6,
            macs / cold_secs / 1e9,
            w.len() as f64 / cold_secs / 1e9
        );
    } else {
        println!(
            "{line}  {:8.1} us  {:6.1} G MAC/s",
            secs * 1e6,
            macs / secs / 1e9
        );
    }
}

/// Best seconds per call with the weights cold: each call takes the next of a
/// rotation of copies larger than L3.
fn cold_seconds(
    isa: Isa,
    ty: GgmlType,
    rows: usize,
    k: usize,
    xq: &QuantizedActivations,
    out: &mut [f32],
) -> f64 {
    let bytes = k / ty.block_len() * ty.block_bytes() * rows;
    let copies = COLD_BYTES_MIN.div_ceil(bytes).max(2);
    let cold: Vec<Vec<u8>> = (0..copies)
        .map(|c| weights(ty, rows, k, c as u32 + 2))
        .collect();
    let mut next = 0;
    best_seconds(|| {
        matmul(isa, ty, &cold[next], k, 0..rows, xq, out);
        next = (next + 1) % copies;
    })
}

/// A repacked 16-row kernel (`quant::repack`) against the AVX-512 row kernel
/// on the same weights, alternated.
#[cfg(target_arch = "x86_64")]
fn bench_x16(ty: GgmlType, rows: usize, k: usize, n_tokens: usize) {
    use bulkhead_kernels::quant::repack::{matmul_repacked, repack, Packed};
    let xq = activations(ty, n_tokens, k);
    let mut out = vec![0.0f32; n_tokens * rows];
    let w = weights(ty, rows, k, 1);
    let packed = repack(ty, &w, rows, k, 1).expect("a 16-row layout");
    let macs = (rows * k * n_tokens) as f64;
    let (mut row, mut x16) = (f64::MAX, f64::MAX);
    for _ in 0..3 {
        row = row.min(best_seconds(|| {
            matmul(Isa::Avx512, ty, &w, k, 0..rows, &xq, &mut out)
        }));
        x16 = x16.min(best_seconds(|| {
            matmul_repacked(ty, packed.bytes(), k, 0..rows, &xq, &mut out)
        }));
    }
    if n_tokens == 1 {
        // Cold: a rotation of copies larger than L3, as a decode step reads them.
        let copies = COLD_BYTES_MIN.div_ceil(w.len()).max(2);
        let cold: Vec<Vec<u8>> = (0..copies)
            .map(|c| weights(ty, rows, k, c as u32 + 2))
            .collect();
        let cold_packed: Vec<Packed> = cold
            .iter()
            .map(|w| repack(ty, w, rows, k, 1).expect("a 16-row layout"))
            .collect();
        let (mut next, mut row_cold, mut x16_cold) = (0, f64::MAX, f64::MAX);
        for _ in 0..3 {
            row_cold = row_cold.min(best_seconds(|| {
                matmul(Isa::Avx512, ty, &cold[next], k, 0..rows, &xq, &mut out);
                next = (next + 1) % copies;
            }));
            x16_cold = x16_cold.min(best_seconds(|| {
                let packed = cold_packed[next].bytes();
                matmul_repacked(ty, packed, k, 0..rows, &xq, &mut out);
                next = (next + 1) % copies;
            }));
        }
        println!(
            "{:4} rows={rows:6} k={k:5} tokens=   1  cold: row kernel {:8.1} us {:5.1} GB/s  \
             16-row repack {:8.1} us {:5.1} GB/s (of the file's bytes)",
            ty.name(),
            row_cold * 1e6,
            w.len() as f64 / row_cold / 1e9,
            x16_cold * 1e6,
            w.len() as f64 / x16_cold / 1e9
        );
    }
    println!(
        "{:4} rows={rows:6} k={k:5} tokens={n_tokens:4}  row kernel {:8.1} us {:6.1} G MAC/s  \
         16-row repack {:8.1} us {:6.1} G MAC/s  ({:.2}x)",
        ty.name(),
        row * 1e6,
        macs / row / 1e9,
        x16 * 1e6,
        macs / x16 / 1e9,
        row / x16
    );
}

fn main() {
    let filter = std::env::args().nth(1).unwrap_or_default();
    let only_tokens: Option<usize> = std::env::args().nth(2).and_then(|n| n.parse().ok());
    #[cfg(target_arch = "x86_64")]
    if let Some(only_type) = filter.strip_suffix("x16") {
        if !Isa::Avx512.is_available() {
            println!("skipped: no AVX-512 VNNI here");
            return;
        }
        for (ty, rows, k, tokens) in [
            (GgmlType::Q4_K, 1536, 768, &[1, 8, 64][..]),
            (GgmlType::Q4_K, 8192, 2048, &[1, 512][..]),
            (GgmlType::Q4_K, 2048, 8192, &[1, 512][..]),
            // SmolLM2's feed-forward output (Q6_K in both K files), then its
            // input matrices (Q4_K_M: Q5_0; Q6_K: Q8_0).
            (GgmlType::Q6_K, 576, 1536, &[1, 8, 512][..]),
            (GgmlType::Q5_0, 1536, 576, &[1, 8, 512][..]),
            (GgmlType::Q8_0, 1536, 576, &[1, 8, 512][..]),
            (GgmlType::Q4_1, 1536, 576, &[1, 8, 512][..]),
            (GgmlType::Q4_0, 1536, 576, &[1, 512][..]),
            (GgmlType::Q5_1, 1536, 576, &[1, 512][..]),
        ] {
            if !only_type.is_empty() && ty.name() != only_type {
                continue;
            }
            for &n in tokens {
                if only_tokens.is_none_or(|o| o == n) {
                    bench_x16(ty, rows, k, n);
                }
            }
        }
        return;
    }
    let shapes: &[(GgmlType, usize, usize, &[usize])] = &[
        (GgmlType::Q4_1, 1536, 576, &[1, 2, 4, 8, 16, 32, 64, 512]),
        (GgmlType::Q4_1, 576, 1536, &[1, 512]),
        (GgmlType::Q8_0, 24576, 576, &[1, 2, 4, 8, 16, 32, 64]),
        (GgmlType::Q8_0, 1536, 576, &[1, 512]),
        (GgmlType::Q4_0, 1536, 576, &[1, 512]),
        (GgmlType::Q4_K, 1536, 768, &[1, 8, 64]),
        // Llama-3.2-1B's feed-forward matrices over a 512-token prefill.
        (GgmlType::Q4_K, 8192, 2048, &[512]),
        (GgmlType::Q4_K, 2048, 8192, &[512]),
        (GgmlType::Q5_K, 1536, 768, &[1, 8, 64]),
        (GgmlType::Q6_K, 1536, 768, &[1, 8, 64]),
        (GgmlType::Q5_0, 1536, 576, &[1, 8, 512]),
        (GgmlType::F32, 576, 576, &[1, 16]),
        (GgmlType::F16, 576, 576, &[1, 16]),
    ];
    for isa in Isa::available() {
        if !isa.name().contains(&filter) && !filter.starts_with('Q') && !filter.starts_with('F') {
            continue;
        }
        for &(ty, rows, k, tokens) in shapes {
            if filter.starts_with(['Q', 'F']) && ty.name() != filter {
                continue;
            }
            for &n in tokens {
                if (isa == Isa::Scalar && n > 64) || only_tokens.is_some_and(|o| o != n) {
                    continue;
                }
                bench(isa, ty, rows, k, n);
            }
        }
    }
}
