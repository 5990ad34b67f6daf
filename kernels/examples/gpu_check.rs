//! The GPU check: what `scripts/gpu-check.sh` runs on a machine with an
//! NVIDIA GPU, its driver and CUDA 13's NVRTC. It brings no model file: it
//! writes a tiny model and a random-weight model of SmolLM2-135M's shape
//! (30 layers, d 576, 9 heads / 3 KV heads, FFN 1536, vocabulary 49152,
//! Q4_1 blocks, Q8_0 embeddings) and reports, as one table:
//!
//! 1. the device-to-device copy bandwidth (bytes read plus written per second);
//! 2. CPU-versus-CUDA agreement on both models: the worst relative logit
//!    error and greedy-token agreement over a few hundred decode tokens;
//! 3. a released page reading back scrubbed, and a stale, foreign-pool or
//!    cross-tenant page-table entry refused before any launch;
//! 4. prefill tokens/s at 512 and 4096 positions;
//! 5. decode tokens/s at batch 1, 8, 32 and 128, depth 512 and 4096, with
//!    captured graphs (batch 1 also without), each with the fraction of the
//!    measured copy bandwidth its weight and KV bytes reach.
//!
//! `gpu_check --quick` runs smaller sizes (a smoke test, about a minute).
//! Exit status: 0 when every check passed, 1 when one failed, 2 without a GPU.

use bulkhead_kernels::backend::cuda::check::{self, AgreementRun};
use bulkhead_kernels::backend::cuda::{Cuda, CudaDevice, Device, DeviceBuffer};
use bulkhead_kernels::gguf::Gguf;
use bulkhead_kernels::kv::KvType;
use bulkhead_kernels::model::Model;
use bulkhead_kernels::quant::GgmlType;
use bulkhead_kernels::testing::{tiny_llama, TinySpec};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

/// One row of the report.
struct Row {
    check: String,
    result: String,
    /// Some(true) passed, Some(false) failed, None a measurement with no target.
    pass: Option<bool>,
}

fn model_of(spec: &TinySpec) -> Arc<Model> {
    let gguf = Gguf::from_bytes(tiny_llama(spec)).expect("the generated file parses");
    Arc::new(Model::load(Arc::new(gguf)).expect("the generated model loads"))
}

/// SmolLM2-135M's shape with random weights.
fn smollm2_shape() -> TinySpec {
    TinySpec {
        seed: 135,
        layers: 30,
        embedding_len: 576,
        heads: 9,
        kv_heads: 3,
        ffn_len: 1536,
        context_len: 8192,
        matrix_type: GgmlType::Q4_1,
        embedding_type: GgmlType::Q8_0,
        separate_output: false,
        extra_tokens: 0,
        filler_tokens: 49152 - 265,
    }
}

/// Device-to-device copies of `bytes`, best of `rounds`: bytes read plus written per second.
fn copy_bandwidth(device: &Arc<dyn Device>, bytes: u64, rounds: usize) -> f64 {
    let a = DeviceBuffer::zeroed(device, bytes).expect("device memory");
    let b = DeviceBuffer::zeroed(device, bytes).expect("device memory");
    let mut best = f64::MAX;
    for round in 0..=rounds {
        device.synchronize().expect("sync");
        let start = Instant::now();
        b.copy_from(&a, bytes).expect("copy");
        device.synchronize().expect("sync");
        if round > 0 {
            best = best.min(start.elapsed().as_secs_f64());
        }
    }
    2.0 * bytes as f64 / best
}

fn agreement_rows(
    rows: &mut Vec<Row>,
    name: &str,
    model: &Arc<Model>,
    device: &Arc<dyn Device>,
    prompts: &[usize],
    decode: usize,
) {
    for graphs in [false, true] {
        let run = AgreementRun {
            kv_type: KvType::F16,
            page_tokens: 16,
            prompts,
            decode_steps: decode,
            graphs,
            cpu_threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu_isa: None,
            seed: 7,
            tolerance: 1e-3,
        };
        let start = Instant::now();
        let a = check::agreement(model, device, &run);
        // Greedy tokens may part only at near ties; logits within 1e-2 of the
        // CPU's largest (a Q8 rounding that flips moves them ~1e-3).
        let pass = a.greedy_agree + a.near_ties == a.rows && a.worst_relative <= 1e-2;
        rows.push(Row {
            check: format!("{name}: CPU vs CUDA{}", if graphs { " (graphs)" } else { "" }),
            result: format!(
                "max rel err {:.2e}; greedy {}/{} agree, {} near ties ({} seqs, {} decode tokens; {:.1} s)",
                a.worst_relative,
                a.greedy_agree,
                a.rows,
                a.near_ties,
                prompts.len(),
                decode,
                start.elapsed().as_secs_f64()
            ),
            pass: Some(pass),
        });
    }
}

/// The isolation checks of `check::isolation`, as rows.
fn isolation_rows(rows: &mut Vec<Row>, model: &Arc<Model>, device: &Arc<dyn Device>) {
    // The cross-tenant check panics on purpose (the page book stops the engine): quietly.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let outcomes = check::isolation(model, device);
    std::panic::set_hook(hook);
    for outcome in outcomes {
        rows.push(Row {
            check: outcome.name.to_string(),
            result: outcome.detail,
            pass: Some(outcome.pass),
        });
    }
}

fn main() -> ExitCode {
    let quick = std::env::args().any(|a| a == "--quick");
    let device: Arc<dyn Device> = match CudaDevice::open(0) {
        Ok(device) => Arc::new(Cuda(device)),
        Err(why) => {
            println!("gpu-check: skipped: {why}");
            return ExitCode::from(2);
        }
    };
    let started = Instant::now();
    println!(
        "gpu-check on {} ({} GiB)",
        device.describe(),
        device.memory_bytes() >> 30
    );
    let mut rows = Vec::new();
    let copy_bytes = if quick { 256 << 20 } else { 2 << 30 };
    let bandwidth = copy_bandwidth(&device, copy_bytes, 5);
    rows.push(Row {
        check: "device-to-device copy".into(),
        result: format!(
            "{:.0} GB/s (read + write, {} MiB)",
            bandwidth / 1e9,
            copy_bytes >> 20
        ),
        pass: None,
    });
    let tiny = model_of(&TinySpec::default());
    agreement_rows(
        &mut rows,
        "tiny model",
        &tiny,
        &device,
        &[5, 40, 1],
        if quick { 16 } else { 64 },
    );
    let smollm = model_of(&smollm2_shape());
    eprintln!("models written ({:.1} s)", started.elapsed().as_secs_f64());
    agreement_rows(
        &mut rows,
        "SmolLM2-135M shape",
        &smollm,
        &device,
        &[40, 300],
        if quick { 32 } else { 300 },
    );
    isolation_rows(&mut rows, &smollm, &device);
    let weights = check::weight_bytes(&smollm);
    for len in if quick { vec![512] } else { vec![512, 4096] } {
        let rate = check::prefill_rate(&smollm, &device, len, 512, 3);
        rows.push(Row {
            check: format!("prefill {len} (chunks of 512)"),
            result: format!("{:.0} tokens/s", rate.tokens_per_s),
            pass: None,
        });
    }
    let depths = if quick { vec![512] } else { vec![512, 4096] };
    let batches = if quick {
        vec![1, 8]
    } else {
        vec![1, 8, 32, 128]
    };
    for &depth in &depths {
        for &batch in &batches {
            for graphs in [true, false] {
                if !graphs && batch != 1 {
                    continue;
                }
                let rate = check::decode_rate(
                    &smollm,
                    &device,
                    batch,
                    depth,
                    if quick { 8 } else { 32 },
                    graphs,
                    512,
                );
                let fraction = rate.bytes_per_step as f64 / rate.step_secs / bandwidth;
                let target = match (batch, graphs) {
                    (1, true) => Some(rate.tokens_per_s >= 1500.0),
                    (128, true) => Some(fraction >= 0.40),
                    _ => None,
                };
                rows.push(Row {
                    check: format!("decode batch {batch} depth {depth}{}", if graphs { "" } else { " (no graphs)" }),
                    result: format!(
                        "{:.0} tokens/s, {:.3} ms/step, {:.1} % of copy bandwidth ({:.1} MB/step){}",
                        rate.tokens_per_s,
                        rate.step_secs * 1e3,
                        100.0 * fraction,
                        rate.bytes_per_step as f64 / 1e6,
                        match (batch, graphs) {
                            (1, true) => " [target >= 1500 tokens/s]",
                            (128, true) => " [target >= 40 %]",
                            _ => "",
                        }
                    ),
                    pass: target,
                });
            }
        }
    }
    println!(
        "weights read per decode step: {:.1} MB",
        weights as f64 / 1e6
    );
    println!();
    println!("| check | result | |");
    println!("|---|---|---|");
    let mut failed = 0;
    for row in &rows {
        let mark = match row.pass {
            Some(true) => "pass",
            Some(false) => {
                failed += 1;
                "FAIL"
            }
            None => "",
        };
        println!("| {} | {} | {} |", row.check, row.result, mark);
    }
    println!();
    println!(
        "{} checks failed; {:.0} s",
        failed,
        started.elapsed().as_secs_f64()
    );
    if failed > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
