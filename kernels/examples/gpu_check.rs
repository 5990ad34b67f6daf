//! The GPU check: what `scripts/gpu-check.sh` runs on a machine with an
//! NVIDIA GPU, its driver and CUDA 13's NVRTC. It brings no model file: it
//! writes a tiny model and a random-weight model of SmolLM2-135M's shape
//! (30 layers, d 576, 9 heads / 3 KV heads, FFN 1536, vocabulary 49152,
//! Q4_1 blocks, Q8_0 embeddings) and reports, as one table:
//!
//! 1. the device-to-device copy bandwidth (bytes read plus written per
//!    second), and the launch floor: the smallest kernel's time a launch,
//!    queued, in a graph, and in a graph of dependent launches (what a
//!    step's launches cost at the least);
//! 2. the tensor cores' start-up probe on every model here (each quantized
//!    weight type's product on them and a warp a row agree), and the
//!    dependent launches' (a chain of dependent copies comes out whole), the
//!    draw's weights (the device's `exp_rn` the host's bits), then
//!    CPU-versus-CUDA agreement on both models: the worst relative logit
//!    error and greedy-token agreement over a few hundred decode tokens, and
//!    each step again with its tokens picked on the device (the argmax of
//!    the rows it gave, with their log probabilities), and again drawn on the device (the host's draw of
//!    the rows it gave: temperature, top-k, top-p and min-p in turn; every
//!    other row adjusted first by penalties, biases and a ban); and
//!    on the tiny model with 12 sequences (a decode step's products on the
//!    tensor cores), and on tiny models of the other families' options and weight types (Llama
//!    3's RoPE table with Q5_K/Q5_0/BF16 matrices, qwen2, qwen3, gemma2 with
//!    a sliding window and soft caps, gemma3), with graphs;
//! 3. a released page reading back scrubbed, and a stale, foreign-pool or
//!    cross-tenant page-table entry refused before any launch; and, in a
//!    process of its own, a kernel fault (a read of an address nothing
//!    holds) seen as a lost context: later calls and reopening refused;
//! 4. where a decode step (batch 1, 32 and 128 at depth 512, batch 1 at 4096) and a 512-token
//!    prefill chunk spend their device time, kernel by kernel (each launch
//!    timed alone by the device's events), so one run says what to speed up;
//! 5. prefill tokens/s at 512 and 4096 positions, at 512 with every
//!    product a warp a row rather than on the tensor cores (what they save),
//!    and at 4096 with attention items of half the queries (twice the
//!    blocks);
//! 6. decode tokens/s at batch 1, 8, 32 and 128, depth 512 and 4096, with
//!    captured graphs (batch 1 also without), each with the fraction of the
//!    measured copy bandwidth its weight and KV bytes reach (the depth's
//!    pages are read as allocated, not prefilled: see `check::decode_rate`).
//!    Tokens are greedy, as a greedy request's are: each step copies back its
//!    tokens' ids, picked on the device, not their rows of logits (25 MB a
//!    step at batch 128); three more rows, batch 128 at depth 512 copying
//!    every row (as a step asking for log probabilities does), drawing its
//!    tokens on the device (as a sampled request's step does), and drawing
//!    them after 600 and 3,000 adjustments a row (penalties over a short
//!    context, a repetition penalty over a long prompt), say what that copy, that
//!    draw and those adjustments cost; one more, batch 128 at depth 512
//!    with its products a warp a row, what the tensor cores save; and batch
//!    1 with a norm launch before each matrix product, with RoPE
//!    and the KV store a launch of their own, and with split attention
//!    merged by a launch of its own: what each fusion saves; and batch 1
//!    with each kernel started once the one before has ended (no dependent
//!    launches);
//! 7. the host's part of each of those decode steps (the backend's packing,
//!    page checks and step buffer, with no kernel run: the emulator's
//!    host-only mode), which adds to every step's time on the GPU.
//!
//! `gpu_check --write-model PATH` writes the SmolLM2-shaped model's GGUF file
//! to PATH and exits (the server's part of `scripts/gpu-check.sh` serves it).
//! `gpu_check --host-part` runs the seventh part alone, on any machine (no
//! GPU needed; `--quick` and `--dry-run` choose its sizes as below).
//! `gpu_check --quick` runs smaller sizes (a smoke test, about a minute);
//! `gpu_check --dry-run` runs every part on the tiny model on the CPU
//! emulator (built with the `emulator` feature), to check the check itself;
//! `--only agreement,isolation,profile,speed` runs those parts alone (a rerun of what
//! failed, on a machine lent for minutes); `--budget SECONDS` lists the rows
//! not yet begun after that many seconds as not measured (neither passed
//! nor failed), so that a run ends on time with a whole table.
//!
//! A GPU is lent for minutes, so one run must say as much as it can: each row
//! is printed as soon as it is measured (a run cut short still shows how far
//! it got), and a part that panics (a kernel fault, a refused launch, a
//! non-finite logit) becomes a failed row with its message while the other
//! parts still run. The table is printed again, whole, at the end.
//! Exit status: 0 when every check passed, 1 when one failed, 2 without a GPU.

use bulkhead_kernels::backend::cuda::check::{self, AgreementRun, DecodeRun, PrefillWay};
use bulkhead_kernels::backend::cuda::launch::{EmbedArgs, KernelArgs};
use bulkhead_kernels::backend::cuda::{
    self as cuda, attention_rows, Cuda, CudaBackend, CudaDevice, CudaOptions, CudaUnavailable,
    DependentLaunches, Device, DeviceBuffer, DeviceError, Fusions, Geometry, TensorCoresProbe,
};
use bulkhead_kernels::backend::{Draw, Pick};
use bulkhead_kernels::gguf::Gguf;
use bulkhead_kernels::kv::KvType;
use bulkhead_kernels::model::Model;
use bulkhead_kernels::quant::{GgmlType, Isa};
use bulkhead_kernels::testing::{tiny_llama, TinySpec};
use std::panic::{self, AssertUnwindSafe};
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

impl Row {
    fn line(&self) -> String {
        let mark = match self.pass {
            Some(true) => "pass",
            Some(false) => "FAIL",
            None => "",
        };
        format!("| {} | {} | {} |", self.check, self.result, mark)
    }
}

/// A panic's message, fit for one table cell.
fn stopped(payload: &(dyn std::any::Any + Send)) -> String {
    let message = payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied())
        .unwrap_or("a panic without a message");
    format!("stopped: {}", message.replace(['\n', '|'], " "))
}

/// The rows so far: each printed as it comes, and all again by [`Report::table`].
struct Report {
    rows: Vec<Row>,
    /// When rows stop being measured (`--budget`), so that one loan of a
    /// machine brings back a whole table and the server's part after it.
    budget: Option<(Instant, u64)>,
    /// Rows not measured for it.
    unmeasured: usize,
}

impl Report {
    /// A report whose rows stop being measured `budget_s` seconds after
    /// `started` (none where `None`).
    fn new(started: Instant, budget_s: Option<u64>) -> Report {
        Report {
            rows: Vec::new(),
            budget: budget_s.map(|s| (started, s)),
            unmeasured: 0,
        }
    }

    fn push(&mut self, row: Row) {
        println!("{}", row.line());
        self.rows.push(row);
    }

    /// Whether the budget is spent: the row `check` is then listed as not
    /// measured (neither passed nor failed) and `true` returned.
    fn spent(&mut self, check: &str) -> bool {
        let Some((started, budget_s)) = self.budget else {
            return false;
        };
        if started.elapsed().as_secs() < budget_s {
            return false;
        }
        self.unmeasured += 1;
        self.push(Row {
            check: check.to_string(),
            result: format!("not measured: the check's budget of {budget_s} s was spent"),
            pass: None,
        });
        true
    }

    /// Measures the row `check`; a panic in it (a kernel fault, a refused
    /// launch, a non-finite logit) fails the row, with the panic's message,
    /// and the next row runs. Past the budget it is not measured.
    fn row(&mut self, check: String, measure: impl FnOnce() -> (String, Option<bool>)) {
        if self.spent(&check) {
            return;
        }
        let (result, pass) = match panic::catch_unwind(AssertUnwindSafe(measure)) {
            Ok(measured) => measured,
            Err(payload) => (stopped(&*payload), Some(false)),
        };
        self.push(Row {
            check,
            result,
            pass,
        });
    }

    /// The rows of one part, or one failed row `check` where it panics.
    /// Past the budget it is not measured.
    fn rows(&mut self, check: &str, measure: impl FnOnce() -> Vec<Row>) {
        if self.spent(check) {
            return;
        }
        match panic::catch_unwind(AssertUnwindSafe(measure)) {
            Ok(rows) => rows.into_iter().for_each(|row| self.push(row)),
            Err(payload) => self.push(Row {
                check: check.to_string(),
                result: stopped(&*payload),
                pass: Some(false),
            }),
        }
    }

    /// The whole table; returns how many checks failed.
    fn table(&self) -> usize {
        println!();
        println!("| check | result | |");
        println!("|---|---|---|");
        for row in &self.rows {
            println!("{}", row.line());
        }
        self.rows.iter().filter(|r| r.pass == Some(false)).count()
    }
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
        ..TinySpec::default()
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

/// The time of one launch of the smallest kernel (`pick` of a one-value
/// row, its argmax, one block of one warp), median of `rounds` runs of
/// `launches` launches: queued
/// one by one, and replayed as one captured graph. What a step of that many
/// launches takes at the least, whatever its kernels do.
fn launch_floor(device: &Arc<dyn Device>, launches: usize, rounds: usize) -> (f64, f64, f64) {
    use bulkhead_kernels::backend::cuda::launch::{KernelArgs, PickArgs};
    use bulkhead_kernels::backend::cuda::Geometry;
    let logits = DeviceBuffer::zeroed(device, 4).expect("device memory");
    let out = DeviceBuffer::zeroed(device, 4).expect("device memory");
    let args = PickArgs {
        logits: logits.at(0),
        out: out.at(0),
        draws: 0,
        adjusts: 0,
        scores: 0,
        originals: 0,
        vocab: 1,
        unused: 0,
    };
    let geometry = Geometry {
        grid: 1,
        block: 32,
        shared_bytes: 0,
    };
    // SAFETY: the kernel reads one float of `logits` and writes one word of
    // `out`; a dependent follows a launch (`queue` makes the first plain).
    let launch = |dependent: bool| unsafe {
        match dependent {
            true => device.launch_dependent(PickArgs::KERNEL, geometry, args.bytes()),
            false => device.launch(PickArgs::KERNEL, geometry, args.bytes()),
        }
    };
    let queue_as = |dependents: bool| -> Result<(), DeviceError> {
        for i in 0..launches {
            launch(dependents && i > 0)?;
        }
        Ok(())
    };
    let queue = || queue_as(false);
    let graph = device.capture(&mut || queue()).expect("a captured graph");
    let chained = device
        .capture(&mut || queue_as(true))
        .expect("a captured graph of dependent launches");
    let median = |run: &dyn Fn()| {
        let mut times: Vec<f64> = (0..=rounds)
            .map(|_| {
                device.synchronize().expect("sync");
                let start = Instant::now();
                run();
                device.synchronize().expect("sync");
                start.elapsed().as_secs_f64() / launches as f64
            })
            .skip(1)
            .collect();
        times.sort_by(f64::total_cmp);
        times[times.len() / 2]
    };
    let queued = median(&|| queue().expect("launches"));
    let replayed = median(&|| graph.replay().expect("a replay"));
    let dependents = median(&|| chained.replay().expect("a replay"));
    (queued, replayed, dependents)
}

/// Tiny models of each family's options the CUDA kernels run beyond plain
/// llama, and of the weight types the SmolLM2-shaped model does not use.
fn families() -> Vec<(&'static str, TinySpec)> {
    use bulkhead_kernels::model::Architecture;
    let k_shape = TinySpec {
        embedding_len: 256,
        heads: 4,
        kv_heads: 1,
        ffn_len: 512,
        ..TinySpec::default()
    };
    vec![
        (
            "tiny llama 3 (RoPE table, Q5_K, Q5_0 up, BF16 head)",
            TinySpec {
                seed: 51,
                rope_freqs: true,
                rope_base: 500_000.0,
                matrix_type: GgmlType::Q5_K,
                ffn_up_type: Some(GgmlType::Q5_0),
                embedding_type: GgmlType::BF16,
                ..k_shape.clone()
            },
        ),
        (
            "tiny qwen2 (biases, RoPE on halves)",
            TinySpec {
                seed: 52,
                architecture: Architecture::Qwen2,
                ..TinySpec::default()
            },
        ),
        (
            "tiny qwen3 (head norms, q wider than d)",
            TinySpec {
                seed: 53,
                architecture: Architecture::Qwen3,
                head_dim: Some(32),
                ..TinySpec::default()
            },
        ),
        (
            "tiny gemma2 (GELU, post-norms, soft caps, window 6)",
            TinySpec {
                seed: 54,
                architecture: Architecture::Gemma2,
                sliding_window: Some((6, 2)),
                softcaps: (Some(1.5), Some(3.0)),
                ..TinySpec::default()
            },
        ),
        (
            "tiny gemma3 (head norms, local RoPE base, window 5)",
            TinySpec {
                seed: 55,
                architecture: Architecture::Gemma3,
                sliding_window: Some((5, 2)),
                rope_base: 1_000_000.0,
                ..TinySpec::default()
            },
        ),
    ]
}

/// How far a logit may part from the CPU's, relative to the row's largest.
const AGREEMENT_BOUND: f32 = 1e-2;

/// How an agreement row runs its decode steps.
#[derive(Clone, Copy)]
struct Mode {
    /// As captured graphs, or launch by launch.
    graphs: bool,
    /// Attention by warps (as the server runs), or by tiles.
    by_warps: bool,
}

const LAUNCHES: Mode = Mode {
    graphs: false,
    by_warps: true,
};
const GRAPHS: Mode = Mode {
    graphs: true,
    by_warps: true,
};
const TILES: Mode = Mode {
    graphs: true,
    by_warps: false,
};

/// The options every agreement run here shares.
fn agreement_run(prompts: &[usize], decode: usize, mode: Mode) -> AgreementRun<'_> {
    AgreementRun {
        kv_type: KvType::F16,
        page_tokens: 16,
        prompts,
        decode_steps: decode,
        graphs: mode.graphs,
        cpu_threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        cpu_isa: None,
        seed: 7,
        tolerance: 1e-3,
        decode_by_warps: mode.by_warps,
        tensor_cores: true,
    }
}

/// Rows of CPU-versus-CUDA agreement, with and without graphs as `modes`
/// says. Logits pass within a bound of the CPU's largest: 1e-2 (a Q8
/// rounding that flips moves them ~1e-3) plus the CPU's own drift between
/// its portable path, which the kernels follow, and its fastest, which they
/// are compared with, on the same prompts (a deep model of random weights
/// drifts by a few percent; a tiny model on some hosts too: gemma3's by
/// 1.5e-2 on the development VM's AVX2, 5.7e-7 on the H100's host).
fn agreement_rows(
    report: &mut Report,
    name: &str,
    model: &Arc<Model>,
    device: &Arc<dyn Device>,
    prompts: &[usize],
    decode: usize,
    modes: &[Mode],
) {
    if report.spent(&format!("{name}: CPU vs CUDA")) {
        return;
    }
    let drift = check::cpu_drift(model, &agreement_run(prompts, 0, LAUNCHES));
    let bound = AGREEMENT_BOUND + drift;
    for &mode in modes {
        let check = format!(
            "{name}: CPU vs CUDA{}{}",
            if mode.graphs { " (graphs)" } else { "" },
            if mode.by_warps {
                ""
            } else {
                " (attention by tiles)"
            }
        );
        report.row(check, || {
            let run = agreement_run(prompts, decode, mode);
            let start = Instant::now();
            let a = check::agreement(model, device, &run);
            // Greedy tokens may part only at near ties.
            let pass = a.greedy_agree + a.near_ties == a.rows
                && a.picks_agree == a.rows
                && a.draws_agree == a.rows
                && a.prompt_scores_agree == a.scored_rows
                && a.worst_relative.max(a.worst_relative_scored) <= bound;
            let result = format!(
                "max rel err {:.2e} ({} earlier prompt rows {:.2e}; bound {:.1e}, the CPU's own drift {:.1e}, {:?} vs portable); greedy {}/{} agree, {} near ties; device picks with log probabilities {}/{}, draws {}/{}, prompt rows scored {}/{} ({} seqs, {} decode tokens; {:.1} s)",
                a.worst_relative,
                a.scored_rows,
                a.worst_relative_scored,
                bound,
                drift,
                Isa::detect(),
                a.greedy_agree,
                a.rows,
                a.near_ties,
                a.picks_agree,
                a.rows,
                a.draws_agree,
                a.rows,
                a.prompt_scores_agree,
                a.scored_rows,
                prompts.len(),
                decode,
                start.elapsed().as_secs_f64()
            );
            (result, Some(pass))
        });
    }
}

/// What each model's backend's start-up probe found of the tensor cores:
/// passes where every one agreed (or, on a device without them, none
/// used them). A refusal means the tensor-core rows below timed products
/// a warp a row.
fn probe_row(device: &Arc<dyn Device>, models: &[(&str, Arc<Model>)]) -> (String, Option<bool>) {
    let options = CudaOptions {
        step_tokens_max: 64,
        step_seqs_max: 1,
        graphs: false,
        tensor_cores: true,
        dependent_launches: true,
    };
    let mut pass = true;
    let mut cells = Vec::new();
    for (name, model) in models {
        let cell = match CudaBackend::new(Arc::clone(model), Arc::clone(device), options.clone()) {
            Ok(backend) => {
                let probe = backend.tensor_cores_probe();
                pass &= match probe {
                    TensorCoresProbe::Agreed { .. } => true,
                    TensorCoresProbe::Unused => !device.tensor_cores(),
                    // Not asked for here: the options turn them on.
                    TensorCoresProbe::Refused { .. } | TensorCoresProbe::Off => false,
                };
                match probe {
                    TensorCoresProbe::Agreed { types, worst } => {
                        let names: Vec<&str> = types.iter().map(|t| t.name()).collect();
                        format!("{name}: {} agree ({worst:.1e})", names.join(", "))
                    }
                    other => format!("{name}: {other}"),
                }
            }
            Err(e) => {
                pass = false;
                format!("{name}: {e}")
            }
        };
        cells.push(cell);
    }
    (cells.join("; "), Some(pass))
}

/// The dependent launches' start-up probe on `model`'s backend: on wherever
/// the device has them (compute capability 9.0 and later), else the rows
/// timing them would time plain launches.
fn dependent_probe_row(device: &Arc<dyn Device>, model: &Arc<Model>) -> (String, Option<bool>) {
    let options = CudaOptions {
        step_tokens_max: 8,
        step_seqs_max: 1,
        graphs: true,
        tensor_cores: true,
        dependent_launches: true,
    };
    match CudaBackend::new(Arc::clone(model), Arc::clone(device), options) {
        Ok(backend) => {
            let probe = backend.dependent_launches();
            let pass = match probe {
                DependentLaunches::Agreed => true,
                DependentLaunches::Unsupported => !device.dependent_launches(),
                DependentLaunches::Refused { .. } | DependentLaunches::Off => false,
            };
            (probe.to_string(), Some(pass))
        }
        Err(e) => (e.to_string(), Some(false)),
    }
}

/// The `pick` kernel's weights against the host's, bit for bit
/// (`check::draw_weights`): a draw on the device is the host's only where
/// they agree.
fn draw_weights_row(device: &Arc<dyn Device>) -> (String, Option<bool>) {
    match check::draw_weights(device) {
        Ok(report) => {
            let mut result = format!(
                "{}/{} values of [-87, 0] weigh the host's bits",
                report.equal, report.values
            );
            if let Some((x, got, want)) = report.first_apart {
                result += &format!(
                    "; first apart: exp_rn({x:e}) = {got:e} ({:#010x}) on the device, {want:e} ({:#010x}) on the host",
                    got.to_bits(),
                    want.to_bits()
                );
            }
            (result, Some(report.equal == report.values))
        }
        Err(e) => (e.to_string(), Some(false)),
    }
}

/// The isolation checks of `check::isolation`, as rows.
fn isolation_rows(model: &Arc<Model>, device: &Arc<dyn Device>) -> Vec<Row> {
    // The cross-tenant check panics on purpose (the page book stops the
    // engine): that panic is kept quiet; any other still reaches the usual
    // hook, so a row that fails says why. The usual hook is back before a
    // panic goes on (a hook cannot be set while a thread panics).
    type Hook = Box<dyn Fn(&panic::PanicHookInfo<'_>) + Sync + Send>;
    let usual: Arc<Hook> = Arc::new(panic::take_hook());
    let loud = Arc::clone(&usual);
    panic::set_hook(Box::new(move |info| {
        if !info
            .payload_as_str()
            .is_some_and(|m| m.contains("cross-tenant access"))
        {
            loud(info);
        }
    }));
    let outcomes = panic::catch_unwind(AssertUnwindSafe(|| check::isolation(model, device)));
    panic::set_hook(Box::new(move |info| usual(info)));
    let outcomes = outcomes.unwrap_or_else(|payload| panic::resume_unwind(payload));
    outcomes
        .into_iter()
        .map(|outcome| Row {
            check: outcome.name.to_string(),
            result: outcome.detail,
            pass: Some(outcome.pass),
        })
        .collect()
}

/// The sizes of one run.
struct Plan {
    copy_bytes: u64,
    tiny_decode: usize,
    /// The model of the agreement, isolation and speed checks, and its decode tokens.
    big: Option<(TinySpec, usize)>,
    prefill: Vec<usize>,
    depths: Vec<usize>,
    batches: Vec<usize>,
    decode_steps: usize,
    chunk: usize,
}

impl Plan {
    fn of(args: &[String]) -> Plan {
        let has = |flag: &str| args.iter().any(|a| a == flag);
        if has("--dry-run") {
            // Every part of the check on the tiny model, at sizes the
            // emulator runs in a minute: the check itself, checked.
            return Plan {
                copy_bytes: 1 << 20,
                tiny_decode: 4,
                big: None,
                prefill: vec![64],
                depths: vec![40],
                batches: vec![1, 2],
                decode_steps: 2,
                chunk: 32,
            };
        }
        let quick = has("--quick");
        Plan {
            copy_bytes: if quick { 256 << 20 } else { 2 << 30 },
            tiny_decode: if quick { 16 } else { 64 },
            big: Some((smollm2_shape(), if quick { 32 } else { 300 })),
            prefill: if quick { vec![512] } else { vec![512, 4096] },
            depths: if quick { vec![512] } else { vec![512, 4096] },
            batches: if quick {
                vec![1, 8]
            } else {
                vec![1, 8, 32, 128]
            },
            decode_steps: if quick { 8 } else { 32 },
            chunk: 512,
        }
    }
}

/// The device: GPU 0, or (`--dry-run`, with the `emulator` feature) the CPU emulator.
fn device(args: &[String]) -> Result<Arc<dyn Device>, String> {
    if args.iter().any(|a| a == "--dry-run") {
        #[cfg(feature = "emulator")]
        return Ok(bulkhead_kernels::backend::cuda::emulator::Emulator::new(1));
        #[cfg(not(feature = "emulator"))]
        return Err("--dry-run needs the emulator feature".into());
    }
    match CudaDevice::open(0) {
        Ok(device) => Ok(Arc::new(Cuda(device))),
        Err(why) => Err(why.to_string()),
    }
}

fn decode_rows(
    report: &mut Report,
    plan: &Plan,
    model: &Arc<Model>,
    device: &Arc<dyn Device>,
    bandwidth: f64,
) {
    let largest = plan.batches.iter().copied().max().unwrap_or(1);
    for &depth in &plan.depths {
        for &batch in &plan.batches {
            // Greedy tokens (the device's argmax copied back, not the rows)
            // with graphs for every batch; batch 1 without graphs too, and
            // with a norm launch before each product (the products of a
            // step of at most 8 tokens make their own activations), and
            // with RoPE and the KV store a launch of their own (the Q/K/V
            // product does them), and with split attention merged by a
            // launch of its own (attention's last split folds them), and
            // with each kernel started once the one before has ended (no
            // dependent launches); the
            // largest batch at the shallowest depth copying every row of
            // logits to the host (as a step of requests asking for log
            // probabilities does), and drawing each token on the device, as
            // a sampled request's step does (temperature 0.8, top-p 0.95:
            // its selections are passes over the row), and with its
            // products a warp a row, not on the tensor cores. Batch 1 and the
            // largest with attention by tiles too (a decode token's is by
            // warps), at every depth; batch 1 in a backend sized for steps
            // of 128 sequences, as a server's is (a larger step buffer, of
            // which a step copies what it uses).
            let run = DecodeRun::new(batch, depth, plan.decode_steps, true, plan.chunk);
            let mut variants = vec![("", run)];
            if batch == 1 || batch == largest {
                variants.push((
                    " (attention by tiles)",
                    DecodeRun {
                        by_warps: false,
                        ..run
                    },
                ));
            }
            if batch == 1 {
                variants.push((
                    " (sized for 128 sequences)",
                    DecodeRun {
                        seqs_max: 128,
                        ..run
                    },
                ));
                variants.push((
                    " (no graphs)",
                    DecodeRun {
                        graphs: false,
                        ..run
                    },
                ));
                variants.push((
                    " (no dependent launches)",
                    DecodeRun {
                        dependent_launches: false,
                        ..run
                    },
                ));
                variants.push((
                    " (norm launches)",
                    DecodeRun {
                        fusions: Fusions {
                            norms: false,
                            ..run.fusions
                        },
                        ..run
                    },
                ));
                variants.push((
                    " (rope launches)",
                    DecodeRun {
                        fusions: Fusions {
                            rope: false,
                            ..run.fusions
                        },
                        ..run
                    },
                ));
                variants.push((
                    " (merge launches)",
                    DecodeRun {
                        fusions: Fusions {
                            merge: false,
                            ..run.fusions
                        },
                        ..run
                    },
                ));
            }
            if batch == largest && depth == plan.depths[0] {
                variants.push((
                    " (no tensor cores)",
                    DecodeRun {
                        tensor_cores: false,
                        ..run
                    },
                ));
                variants.push((
                    " (full logits)",
                    DecodeRun {
                        pick: Pick::Row,
                        ..run
                    },
                ));
                let drawn = Pick::Draw(Draw {
                    inv_t: 1.0 / 0.8,
                    top_k: 0,
                    top_p: 0.95,
                    min_p: 0.0,
                    u: 0.5,
                });
                variants.push((" (drawn on the device)", DecodeRun { pick: drawn, ..run }));
                // Penalties over a short context, and a repetition penalty
                // over a long prompt's tokens (past the 1,024 entries of
                // their own a row's share holds).
                for (variant, adjusts) in [
                    (" (drawn on the device, 600 adjustments a row)", 600),
                    (" (drawn on the device, 3000 adjustments a row)", 3000),
                ] {
                    variants.push((
                        variant,
                        DecodeRun {
                            pick: drawn,
                            adjusts,
                            ..run
                        },
                    ));
                }
            }
            for (variant, run) in variants {
                let check = format!("decode batch {batch} depth {depth}{variant}");
                report.row(check, || {
                    let rate = check::decode_rate(model, device, &run);
                    let fraction = rate.bytes_per_step as f64 / rate.step_secs / bandwidth;
                    let (pass, target) = match (batch, variant) {
                        (1, "") => (
                            Some(rate.tokens_per_s >= 1500.0),
                            " [target >= 1500 tokens/s]",
                        ),
                        (128, "") => (Some(fraction >= 0.40), " [target >= 40 %]"),
                        _ => (None, ""),
                    };
                    let result = format!(
                        "{:.0} tokens/s, {:.3} ms/step, {:.1} % of copy bandwidth ({:.1} MB/step){target}",
                        rate.tokens_per_s,
                        rate.step_secs * 1e3,
                        100.0 * fraction,
                        rate.bytes_per_step as f64 / 1e6,
                    );
                    (result, pass)
                });
            }
        }
    }
}

/// Rows of the host's own part of a decode step: the speed rows' steps (with
/// graphs) on the emulator in its host-only mode, whose launches are checked,
/// counted and captured as on a GPU but run no kernel, and whose copies are
/// `memcpy`. What is left is the backend's work on the host: page tables
/// checked by the page book and packed, the step buffer written, rows and
/// tokens read back; not the driver's calls. A decode step's next inputs
/// wait for its tokens, so this time adds to each step's on a GPU.
fn host_part_rows(report: &mut Report, plan: &Plan, model: &Arc<Model>) {
    #[cfg(feature = "emulator")]
    let device: Arc<dyn Device> = bulkhead_kernels::backend::cuda::emulator::Emulator::host_only(1);
    for &depth in &plan.depths {
        for &batch in &plan.batches {
            let check = format!("decode batch {batch} depth {depth}: the host's part");
            report.row(check, || {
                #[cfg(feature = "emulator")]
                {
                    let run = DecodeRun::new(batch, depth, plan.decode_steps, true, plan.chunk);
                    let rate = check::decode_rate(model, &device, &run);
                    let result = format!(
                        "{:.1} us a step (page tables checked and packed, the step buffer, \
                         tokens read back; no kernel, no driver call)",
                        rate.step_secs * 1e6
                    );
                    (result, None)
                }
                #[cfg(not(feature = "emulator"))]
                {
                    let _ = (model, batch, depth);
                    ("needs the emulator feature".into(), None)
                }
            });
        }
    }
}

/// Rows of where a step's device time goes, kernel by kernel: decode at
/// batch 1 and a middling batch, and a prefill chunk.
fn profile_rows(report: &mut Report, plan: &Plan, model: &Arc<Model>, device: &Arc<dyn Device>) {
    // Batch 1 at the shallowest and deepest depths (what grows with depth),
    // a middling batch, and the largest (the 40 % target's: attention's
    // share of its step against the products').
    let (shallow, deep) = (plan.depths[0], plan.depths[plan.depths.len() - 1]);
    let middling = plan.batches[plan.batches.len().min(3) - 1];
    let largest = plan.batches[plan.batches.len() - 1];
    let mut runs = vec![(1, shallow), (middling, shallow)];
    if largest != middling {
        runs.push((largest, shallow));
    }
    if deep != shallow {
        runs.push((1, deep));
    }
    for (batch, depth) in runs {
        report.row(
            format!("profile: decode batch {batch} depth {depth}"),
            || {
                let run = DecodeRun::new(batch, depth, plan.decode_steps.min(8), false, plan.chunk);
                let profile = check::decode_profile(model, device, &run);
                (profile_cell(&profile), None)
            },
        );
    }
    let len = plan.prefill[0];
    report.row(
        format!("profile: prefill {len} (chunks of {})", plan.chunk),
        || {
            let profile = check::prefill_profile(model, device, len, plan.chunk);
            (profile_cell(&profile), None)
        },
    );
}

/// A profile in one cell: the step, its kernels' sum, and the costliest
/// kernels (`name/grid`: device time a step, launches a step).
fn profile_cell(profile: &check::StepProfile) -> String {
    let parts: Vec<String> = profile
        .kernels
        .iter()
        .take(8)
        .map(|k| {
            format!(
                "{}/{} {:.0} us ({:.0}x, {:.0} %)",
                k.kernel,
                k.grid,
                k.secs * 1e6,
                k.launches,
                100.0 * k.secs / profile.kernel_secs().max(f64::MIN_POSITIVE)
            )
        })
        .collect();
    format!(
        "step {:.3} ms (each launch waited for), kernels {:.3} ms in {:.0} launches: {}",
        profile.step_secs * 1e3,
        profile.kernel_secs() * 1e3,
        profile.launches(),
        parts.join("; ")
    )
}

/// The parts `--only` names (every part without it), in the order they run.
const PARTS: [&str; 4] = ["agreement", "isolation", "profile", "speed"];

fn parts(args: &[String]) -> Result<Vec<&'static str>, String> {
    let Some(at) = args.iter().position(|a| a == "--only") else {
        return Ok(PARTS.to_vec());
    };
    let names = args.get(at + 1).ok_or("--only needs a list of parts")?;
    names
        .split(',')
        // The server's part is scripts/gpu-check.sh's, not this binary's.
        .filter(|&name| name != "server")
        .map(|name| {
            PARTS.into_iter().find(|p| *p == name).ok_or(format!(
                "--only: no part {name:?} (parts: {})",
                PARTS.join(", ")
            ))
        })
        .collect()
}

/// `--lose-device`: on GPU 0, in this process alone (its context is lost
/// after it), a kernel reads an address nothing holds. Prints what came of
/// it, one line, and exits 0 where Bulkhead saw the loss as it must: the
/// error a sticky one ([`DeviceError::Lost`]), the loss recorded
/// ([`cuda::lost`]), a later call refused the same way, and the device not
/// opened again.
fn lose_device() -> ExitCode {
    let device: Arc<dyn Device> = match CudaDevice::open(0) {
        Ok(device) => Arc::new(Cuda(device)),
        Err(why) => {
            println!("the device did not open: {why}");
            return ExitCode::FAILURE;
        }
    };
    let out = DeviceBuffer::zeroed(&device, 4 * 64).expect("64 floats");
    let args = EmbedArgs {
        table: 8,
        tokens: 8,
        out: out.at(0),
        ty: GgmlType::F32 as u32,
        width: 16,
        row_bytes: 64,
        rows: 1,
        scale: 1.0,
        unused: 0,
    };
    let geometry = Geometry {
        grid: 1,
        block: 32,
        shared_bytes: 0,
    };
    // SAFETY: not safe, on purpose: `tokens` and `table` are addresses no
    // allocation holds. The process ends after this.
    let launched = unsafe { device.launch(EmbedArgs::KERNEL, geometry, args.bytes()) };
    let fault = launched.and_then(|()| device.synchronize());
    let later = out.read(0, &mut [0u8; 4]);
    let reopened = CudaDevice::open(0);
    let lost_fault = matches!(fault, Err(DeviceError::Lost { .. }));
    let lost_later = matches!(later, Err(DeviceError::Lost { .. }));
    let refused = matches!(reopened, Err(CudaUnavailable::Lost(_)));
    let recorded = cuda::lost();
    println!(
        "fault: {}; recorded: {}; a later read: {}; reopening: {}",
        fault.err().map_or("none".to_string(), |e| e.to_string()),
        recorded.unwrap_or("nothing"),
        if lost_later {
            "refused, lost"
        } else {
            "not refused as lost"
        },
        if refused { "refused" } else { "not refused" },
    );
    if lost_fault && lost_later && refused && recorded.is_some() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The `--lose-device` row: this binary again, in a process of its own,
/// stopped if it has not ended within a minute (a loan is minutes long).
fn lost_device_row() -> (String, Option<bool>) {
    use std::io::Read;
    use std::process::{Command, Stdio};
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return (format!("this binary's path: {e}"), Some(false)),
    };
    let mut child = match Command::new(exe)
        .arg("--lose-device")
        .stdout(Stdio::piped())
        .spawn()
    {
        Ok(child) => child,
        Err(e) => return (format!("did not start: {e}"), Some(false)),
    };
    let deadline = Instant::now() + std::time::Duration::from_secs(60);
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(100))
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return ("did not end within 60 s: stopped".into(), Some(false));
            }
            Err(e) => return (format!("could not wait for it: {e}"), Some(false)),
        }
    };
    let mut said = String::new();
    if let Some(mut out) = child.stdout.take() {
        let _ = out.read_to_string(&mut said);
    }
    let line = said.lines().last().unwrap_or("nothing printed");
    (line.replace('|', "/"), Some(status.success()))
}

/// `--budget SECONDS`: rows begun after that many seconds are listed as not
/// measured (a row begun before it runs to its end).
fn budget(args: &[String]) -> Result<Option<u64>, String> {
    let Some(at) = args.iter().position(|a| a == "--budget") else {
        return Ok(None);
    };
    let seconds = args
        .get(at + 1)
        .ok_or("--budget needs a number of seconds")?;
    seconds
        .parse()
        .map(Some)
        .map_err(|_| format!("--budget: {seconds:?} is not a number of seconds"))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // The SmolLM2-shaped model as a file, for the server's check on the GPU
    // machine (scripts/gpu-check.sh): no device needed.
    if let Some(at) = args.iter().position(|a| a == "--write-model") {
        let Some(path) = args.get(at + 1) else {
            eprintln!("gpu-check: --write-model needs a path");
            return ExitCode::from(2);
        };
        return match std::fs::write(path, tiny_llama(&smollm2_shape())) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("gpu-check: writing {path}: {e}");
                ExitCode::from(2)
            }
        };
    }
    if args.iter().any(|a| a == "--lose-device") {
        return lose_device();
    }
    let plan = Plan::of(&args);
    // The host's part of the speed rows' decode steps alone: no device needed.
    if args.iter().any(|a| a == "--host-part") {
        let started = Instant::now();
        let model = match &plan.big {
            Some((spec, _)) => model_of(spec),
            None => model_of(&TinySpec::default()),
        };
        println!("gpu-check: the host's part of a decode step, on this machine's CPU");
        let mut report = Report::new(started, None);
        host_part_rows(&mut report, &plan, &model);
        report.table();
        return ExitCode::SUCCESS;
    }
    let budget = match budget(&args) {
        Ok(budget) => budget,
        Err(why) => {
            eprintln!("gpu-check: {why}");
            return ExitCode::from(2);
        }
    };
    let parts = match parts(&args) {
        Ok(parts) => parts,
        Err(why) => {
            eprintln!("gpu-check: {why}");
            return ExitCode::from(2);
        }
    };
    let device = match device(&args) {
        Ok(device) => device,
        Err(why) => {
            println!("gpu-check: skipped: {why}");
            return ExitCode::from(2);
        }
    };
    let started = Instant::now();
    println!(
        "gpu-check on {} ({} GiB): {}",
        device.describe(),
        device.memory_bytes() >> 30,
        parts.join(", ")
    );
    let mut report = Report::new(started, budget);
    let mut bandwidth = f64::NAN;
    report.row("device-to-device copy".into(), || {
        bandwidth = copy_bandwidth(&device, plan.copy_bytes, 5);
        let result = format!(
            "{:.1} GB/s (read + write, {} MiB)",
            bandwidth / 1e9,
            plan.copy_bytes >> 20
        );
        (result, None)
    });
    report.row("launch floor".into(), || {
        // As many launches as a SmolLM2 decode step makes: 5 a layer (the
        // Q/K/V product with its RoPE and KV store, attention with its
        // merge, Wo, gate and up, down), the embedding, the head's norm
        // (its 12,288 blocks do not each make their own), the head and
        // the pick.
        let launches = 30 * 5 + 4;
        let (queued, replayed, dependents) = launch_floor(&device, launches, 5);
        let n = launches as f64;
        let result = format!(
            "the smallest kernel: {:.2} us a launch queued one by one, {:.2} us in a graph, {:.2} us in a graph of dependent launches ({launches} launches: {:.3}, {:.3} and {:.3} ms; a step of batch 1 at 1500 tokens/s has 0.667 ms)",
            queued * 1e6,
            replayed * 1e6,
            dependents * 1e6,
            queued * n * 1e3,
            replayed * n * 1e3,
            dependents * n * 1e3,
        );
        (result, None)
    });
    let tiny = model_of(&TinySpec::default());
    let model = match &plan.big {
        Some((spec, _)) => {
            let model = model_of(spec);
            eprintln!(
                "SmolLM2-shaped model written ({:.1} s)",
                started.elapsed().as_secs_f64()
            );
            model
        }
        None => Arc::clone(&tiny),
    };
    if parts.contains(&"agreement") {
        report.row("tensor cores: start-up probe".into(), || {
            let mut models = vec![("tiny", Arc::clone(&tiny))];
            models.extend(families().into_iter().map(|(n, s)| (n, model_of(&s))));
            // The K-quants' products, Q6_K's halves scaled apart.
            let k_quants = TinySpec {
                embedding_len: 256,
                ffn_len: 512,
                matrix_type: GgmlType::Q4_K,
                ffn_up_type: Some(GgmlType::Q6_K),
                ..TinySpec::default()
            };
            models.push(("tiny Q4_K, Q6_K up", model_of(&k_quants)));
            if plan.big.is_some() {
                models.push(("SmolLM2-135M shape", Arc::clone(&model)));
            }
            probe_row(&device, &models)
        });
        report.row("dependent launches: start-up probe".into(), || {
            dependent_probe_row(&device, &tiny)
        });
        report.row("draw weights: the device's exp_rn".into(), || {
            draw_weights_row(&device)
        });
        agreement_rows(
            &mut report,
            "tiny model",
            &tiny,
            &device,
            &[5, 40, 1],
            plan.tiny_decode,
            &[LAUNCHES, GRAPHS, TILES],
        );
        // Twelve sequences: past 8 tokens a decode step's products run on
        // the tensor cores, in the captured graphs too.
        agreement_rows(
            &mut report,
            "tiny model, 12 sequences",
            &tiny,
            &device,
            &[3, 9, 1, 4, 2, 7, 1, 5, 2, 6, 1, 3],
            plan.tiny_decode,
            &[GRAPHS],
        );
        for (name, spec) in families() {
            let model = model_of(&spec);
            agreement_rows(
                &mut report,
                name,
                &model,
                &device,
                &[5, 40, 1],
                plan.tiny_decode,
                &[GRAPHS],
            );
        }
        if let Some((_, decode)) = &plan.big {
            agreement_rows(
                &mut report,
                "SmolLM2-135M shape",
                &model,
                &device,
                &[40, 300],
                *decode,
                &[LAUNCHES, GRAPHS],
            );
        }
    }
    if parts.contains(&"isolation") {
        report.rows("isolation", || isolation_rows(&model, &device));
        // Last of the part, in a process of its own: the fault loses that
        // process's context.
        let check = "a kernel fault loses the context (another process): seen as lost, later calls and reopening refused";
        if args.iter().any(|a| a == "--dry-run") {
            report.row(check.into(), || {
                let why = "not on the emulator (its device memory is this process's)";
                (why.into(), None)
            });
        } else {
            report.row(check.into(), lost_device_row);
        }
    }
    if parts.contains(&"profile") {
        profile_rows(&mut report, &plan, &model, &device);
    }
    if parts.contains(&"speed") {
        // The shortest prefill without the tensor cores too, and the
        // longest with its attention in items of half the queries (twice
        // the blocks, each reading K and V again).
        let c = &model.config;
        let group = c.kv_group() as u32;
        let rows = attention_rows(c.head_dim as u32, group, device.shared_bytes_max());
        let half = rows.map_or(1, |rows| (rows / group / 2).max(1));
        let server = PrefillWay::SERVER;
        let mut prefills: Vec<(usize, String, PrefillWay)> = plan
            .prefill
            .iter()
            .map(|&len| (len, String::new(), server))
            .collect();
        if let (Some(&first), Some(&last)) = (plan.prefill.first(), plan.prefill.last()) {
            let no_cores = PrefillWay {
                tensor_cores: false,
                ..server
            };
            prefills.push((first, ", no tensor cores".into(), no_cores));
            let smaller = PrefillWay {
                item_queries: Some(half),
                ..server
            };
            prefills.push((
                last,
                format!(", attention items of {half} queries"),
                smaller,
            ));
        }
        for (len, variant, way) in prefills {
            let check = format!("prefill {len} (chunks of {}{variant})", plan.chunk);
            report.row(check, || {
                let rate = check::prefill_rate(&model, &device, len, plan.chunk, 3, way);
                (format!("{:.0} tokens/s", rate.tokens_per_s), None)
            });
        }
        decode_rows(&mut report, &plan, &model, &device, bandwidth);
        host_part_rows(&mut report, &plan, &model);
        println!(
            "weights read per decode step: {:.1} MB",
            check::weight_bytes(&model) as f64 / 1e6
        );
    }
    let failed = report.table();
    println!();
    if report.unmeasured > 0 {
        println!(
            "{} rows not measured: the budget was spent (--budget; rerun them with --only)",
            report.unmeasured
        );
    }
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
