//! The measurements of the GPU check, as library code: the emulator tests run
//! them here on tiny models, and `examples/gpu_check.rs` (what
//! `scripts/gpu-check.sh` runs on a machine with an NVIDIA GPU) runs them on
//! a real device and models of real shapes.
//!
//! - [`agreement`]: the CPU and CUDA backends in lockstep over the same
//!   prompts and the same (teacher-forced) decode tokens: the worst relative
//!   logit error, and how often their greedy tokens agree;
//! - `isolation` (with `fault-injection`): the page book's checks hold on
//!   the device (scrub, and hostile page tables refused before any launch);
//! - [`prefill_rate`] and [`decode_rate`]: tokens per second through the
//!   backend's `step`, as the scheduler calls it (inputs packed and copied,
//!   logits read back), with the bytes of weights and KV a decode step reads.

use super::device::{Device, LaunchTime};
use super::storage::DeviceStorage;
use super::{CudaBackend, CudaOptions, Fusions};
use crate::backend::adjust::adjust;
use crate::backend::cpu::{CpuBackend, CpuOptions};
use crate::backend::{Adjust, Backend, Draw, Logprobs, Pick, PromptScores, SeqStep};
use crate::kv::{KvType, OwnerTag, PageTable, PartitionConfig, Pool, PoolOptions, SeqId};
use crate::model::Model;
use crate::rng::SplitMix64;
use std::sync::Arc;
use std::time::Instant;

/// The tenant of every page these checks lease.
pub const OWNER: OwnerTag = OwnerTag(1);

/// A pool for `model` (in `device`'s memory, or the host's without one) with
/// one partition and `seqs` tables of `per_seq` pages each. Released pages
/// are poisoned and every scrub verified (`PoolOptions::paranoid`) when
/// `paranoid`.
pub fn pool_with_tables(
    model: &Model,
    kv_type: KvType,
    page_tokens: u32,
    seqs: u32,
    per_seq: u32,
    device: Option<&Arc<dyn Device>>,
    paranoid: bool,
) -> (Pool, Vec<PageTable>) {
    let pages = seqs * per_seq + 2;
    let geometry = model.config.pool_geometry(pages, page_tokens, kv_type);
    let layout = geometry.layout().expect("a pool of the checks' sizes");
    let partition = PartitionConfig {
        owner: OWNER,
        pages_reserved: pages,
        pages_max: pages,
    };
    let options = PoolOptions {
        poison_released: paranoid,
        paranoid,
    };
    let mut pool = match device {
        Some(device) => {
            let storage = DeviceStorage::new(device, layout).expect("device memory for the pool");
            Pool::with_storage(layout, &[partition], options, Box::new(storage))
        }
        None => Pool::new(geometry, &[partition], options),
    }
    .expect("one partition of the whole pool");
    let tables = (0..seqs)
        .map(|seq| {
            let mut reservation = pool.reserve(OWNER, per_seq).expect("pages reserved");
            let mut table = pool.page_table(&reservation, SeqId(u64::from(seq) + 1));
            for _ in 0..per_seq {
                pool.acquire(&mut reservation, &mut table)
                    .expect("pages booked");
            }
            pool.release_reservation(reservation);
            table
        })
        .collect();
    (pool, tables)
}

/// How closely the CUDA backend follows the CPU backend.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Agreement {
    /// The worst |cpu - cuda| / max |cpu| over the rows a token is sampled
    /// from: each prompt's last and each decode token's.
    pub worst_relative: f32,
    /// The same over the other prompt positions' rows (a prompt's log
    /// probabilities), held to the looser bound the GPU check uses (1e-2):
    /// nothing after them depends on them, and the emulated device parts
    /// from the CPU there by up to 9e-3 (the tiny Gemma 2 model's
    /// split-window prompt; one Q8 rounding that flips moves a row ~1e-3),
    /// where its last rows agree to 1e-5 (not yet explained).
    pub worst_relative_scored: f32,
    /// Those other prompt rows compared.
    pub scored_rows: usize,
    /// Those rows whose step, run again with each scored for the prompt's
    /// next token with 5 alternatives ([`SeqStep::scores`]), gave as its
    /// scores alone that token and the log probabilities the host finds in
    /// the row the device gave in full ([`Logprobs::of`], each within
    /// 1e-4).
    pub prompt_scores_agree: usize,
    /// Rows a token is sampled from compared (each prompt's last position
    /// and each decode token's); the counts below are of these.
    pub rows: usize,
    /// Rows whose greedy (argmax) tokens agree.
    pub greedy_agree: usize,
    /// Rows that disagree where the CPU's top two are within `tolerance`
    /// of each other (a near tie either backend may break).
    pub near_ties: usize,
    /// Rows whose step, run again with the row greedy (see
    /// [`Pick::Argmax`]) and its log probabilities asked for (5
    /// alternatives), gave as its id alone the argmax of the row the device
    /// gave in full, with that row's log probabilities ([`Logprobs::of`]:
    /// the same alternatives in order, each within 1e-4), every other row
    /// of the step unchanged.
    pub picks_agree: usize,
    /// Rows whose step, run again with the row drawn ([`Pick::Draw`]: a
    /// different draw a row, see [`check_draw`]; every other row adjusted
    /// first, see [`check_adjust`]) and its log probabilities asked for (3
    /// alternatives), gave as its id alone the token [`Draw::pick`] finds
    /// on the host in the row the device gave, adjusted there by the same
    /// entries, with the log probabilities of that row before them.
    pub draws_agree: usize,
}

/// Options of an [`agreement`] run.
#[derive(Clone, Debug)]
pub struct AgreementRun<'a> {
    /// Pool value type.
    pub kv_type: KvType,
    /// Positions per page.
    pub page_tokens: u32,
    /// Prompt lengths, one sequence each (random tokens).
    pub prompts: &'a [usize],
    /// Decode steps after the prompts.
    pub decode_steps: usize,
    /// Whether decode steps run as captured graphs.
    pub graphs: bool,
    /// CPU backend threads.
    pub cpu_threads: usize,
    /// CPU kernel instruction set (`None`: the best this CPU has).
    pub cpu_isa: Option<crate::quant::Isa>,
    /// Seed of the prompts.
    pub seed: u64,
    /// What counts as a near tie (relative to the row's largest logit).
    pub tolerance: f32,
    /// Decode tokens' attention by warps, or by tiles
    /// ([`CudaBackend::set_decode_attention_by_warps`]).
    pub decode_by_warps: bool,
    /// Products of steps past 8 tokens on the tensor cores, or a warp a row
    /// ([`CudaBackend::set_tensor_cores`]).
    pub tensor_cores: bool,
}

fn argmax(row: &[f32]) -> usize {
    crate::backend::argmax(row) as usize
}

/// What [`lockstep`] asks of each sequence's rows beyond their logits.
#[derive(Clone, Copy)]
struct Asks<'a> {
    /// How sequence i's last row is wanted.
    pick: &'a dyn Fn(usize) -> Pick,
    /// Each sequence's adjustments of that row (none past the list).
    adjusts: &'a [Vec<Adjust>],
    /// That row's log probabilities, with this many alternatives.
    logprobs: Option<u8>,
    /// Every row before it scored for the token after its position, with
    /// this many alternatives (as a prompt's log probabilities ask).
    scores: Option<u8>,
}

/// Every row in full, nothing else asked.
const FULL_ROWS: Asks<'static> = Asks {
    pick: &|_| Pick::Row,
    adjusts: &[],
    logprobs: None,
    scores: None,
};

/// Each sequence's tokens from its position on: the prompt first, then its
/// last token; `rows[i]` of its last tokens want logits, as `asks` says.
fn lockstep<'a>(
    tables: &'a [PageTable],
    inputs: &'a [Vec<u32>],
    positions: &[usize],
    rows: &[usize],
    asks: Asks<'a>,
) -> Vec<SeqStep<'a>> {
    (0..inputs.len())
        .map(|i| SeqStep {
            pages: &tables[i],
            pos_start: positions[i],
            tokens: &inputs[i][positions[i]..],
            logits: rows[i],
            pick: (asks.pick)(i),
            adjust: asks.adjusts.get(i).map_or(&[], Vec::as_slice),
            logprobs: asks.logprobs,
            scores: match asks.scores {
                // Rows at the last rows[i] positions; each but the last
                // scores the next position's token.
                Some(top) if rows[i] > 1 => PromptScores {
                    targets: &inputs[i][inputs[i].len() + 1 - rows[i]..],
                    top,
                },
                _ => PromptScores::NONE,
            },
        })
        .collect()
}

/// The adjustments the agreement's third pass asks of sequence `seq` at
/// `step` (`input` its tokens so far), as a sampler under every option
/// would make them: on odd sequences, a repetition penalty of 1.3 over the
/// tokens so far, a penalty on four ids, a bias on two, and the last
/// token banned (the likeliest next, as often as not); none on even ones.
pub fn check_adjust(seq: usize, step: usize, input: &[u32], vocab: usize) -> Vec<Adjust> {
    if seq.is_multiple_of(2) {
        return Vec::new();
    }
    let vocab = vocab as u32;
    let mut by_id = std::collections::BTreeMap::new();
    fn entry(by_id: &mut std::collections::BTreeMap<u32, Adjust>, id: u32) -> &mut Adjust {
        by_id.entry(id).or_insert(Adjust::none(id))
    }
    for &id in input {
        entry(&mut by_id, id % vocab).repetition = 1.3;
    }
    for k in 0..4 {
        entry(&mut by_id, (step as u32 * 7 + k * 13) % vocab).penalty = 0.4 * (k + 1) as f32;
    }
    entry(&mut by_id, seq as u32 * 31 % vocab).bias = 2.0;
    entry(&mut by_id, (step as u32 * 101 + 3) % vocab).bias -= 1.5;
    if let Some(&last) = input.last() {
        entry(&mut by_id, last % vocab).ban = true;
    }
    by_id.into_values().collect()
}

/// Whether `got` (the device's) is `want` (the host's from the same row):
/// the same token and alternatives in order, each log probability within
/// 1e-4 of the host's (relative where it is larger than 1).
fn logprobs_close(got: &Logprobs, want: &Logprobs) -> bool {
    let close = |a: f32, b: f32| a == b || (a - b).abs() <= 1e-4 * b.abs().max(1.0);
    got.token == want.token
        && close(got.logprob, want.logprob)
        && got.top.len() == want.top.len()
        && (got.top.iter().zip(&want.top)).all(|(g, w)| g.0 == w.0 && close(g.1, w.1))
}

/// The draw the agreement's third pass asks of sequence `seq` at `step`:
/// the options in turn (temperature alone; top-k with top-p; min-p with
/// top-p; a top-k of one; a narrow nucleus), each with its own uniform.
pub fn check_draw(seq: usize, step: usize) -> Draw {
    let u = SplitMix64((seq as u64) << 32 | step as u64).next_f64();
    let (temperature, top_k, top_p, min_p) = match (seq + step) % 5 {
        0 => (1.0, 0, 1.0, 0.0),
        1 => (0.8, 40, 0.9, 0.0),
        2 => (0.7, 0, 0.95, 0.05),
        3 => (1.3, 1, 1.0, 0.0),
        _ => (0.5, 0, 0.3, 0.0),
    };
    Draw {
        inv_t: 1.0 / temperature,
        top_k,
        top_p,
        min_p,
        u,
    }
}

/// The CPU backend `run` compares against, on `isa` (`None`: the best here).
fn cpu_backend(
    model: &Arc<Model>,
    run: &AgreementRun<'_>,
    isa: Option<crate::quant::Isa>,
    tokens_max: usize,
) -> CpuBackend {
    CpuBackend::new(
        Arc::clone(model),
        CpuOptions {
            threads_count: run.cpu_threads,
            step_tokens_max: tokens_max,
            step_seqs_max: run.prompts.len(),
            isa,
        },
    )
}

/// `run`'s prompts (random tokens of its seed) and the rows of logits each
/// asks for in its first step: its last positions, as a prompt's log
/// probabilities ask for them (up to `1 + SCORED_ROWS_MAX / n` of each of
/// `n` prompts).
fn prompts_of(model: &Model, run: &AgreementRun<'_>) -> (Vec<Vec<u32>>, Vec<usize>) {
    let vocab = model.config.vocab_len as u64;
    let mut rng = SplitMix64(run.seed);
    let inputs = run
        .prompts
        .iter()
        .map(|&len| (0..len).map(|_| (rng.next_u64() % vocab) as u32).collect())
        .collect();
    let share = 1 + crate::backend::SCORED_ROWS_MAX / run.prompts.len().max(1);
    let rows = run.prompts.iter().map(|&len| len.min(share)).collect();
    (inputs, rows)
}

/// Runs `model`'s prompts and decode steps through the CPU and CUDA
/// backends in lockstep: both see the same tokens (after the prompts, each
/// sequence's next token is the CPU's greedy choice), and every logit row is
/// compared: each decode token's, and each prompt's last positions' (as a
/// prompt's log probabilities ask for them: up to `1 + SCORED_ROWS_MAX / n`
/// of each of `n` prompts). Panics on a refused step or a non-finite logit.
pub fn agreement(
    model: &Arc<Model>,
    device: &Arc<dyn Device>,
    run: &AgreementRun<'_>,
) -> Agreement {
    let seqs = run.prompts.len() as u32;
    let longest = run.prompts.iter().max().copied().unwrap_or(0) + run.decode_steps;
    let per_seq = (longest as u32).div_ceil(run.page_tokens).max(1);
    let tokens_max = run.prompts.iter().sum::<usize>().max(run.prompts.len());
    let (mut cpu_pool, cpu_tables) = pool_with_tables(
        model,
        run.kv_type,
        run.page_tokens,
        seqs,
        per_seq,
        None,
        false,
    );
    let (mut dev_pool, dev_tables) = pool_with_tables(
        model,
        run.kv_type,
        run.page_tokens,
        seqs,
        per_seq,
        Some(device),
        false,
    );
    let mut cpu = cpu_backend(model, run, run.cpu_isa, tokens_max);
    let mut cuda = CudaBackend::new(
        Arc::clone(model),
        Arc::clone(device),
        CudaOptions {
            step_tokens_max: tokens_max,
            step_seqs_max: run.prompts.len(),
            graphs: run.graphs,
            tensor_cores: true,
            dependent_launches: true,
        },
    )
    .expect("the CUDA backend runs the model");
    cuda.set_decode_attention_by_warps(run.decode_by_warps);
    cuda.set_tensor_cores(run.tensor_cores);
    let vocab = model.config.vocab_len;
    let (mut inputs, mut rows) = prompts_of(model, run);
    let mut positions = vec![0usize; run.prompts.len()];
    let mut result = Agreement::default();
    for step in 0..=run.decode_steps {
        let cpu_logits = cpu
            .step(
                &lockstep(&cpu_tables, &inputs, &positions, &rows, FULL_ROWS),
                &mut cpu_pool,
            )
            .expect("a valid step")
            .values
            .to_vec();
        let dev_logits = cuda
            .step(
                &lockstep(&dev_tables, &inputs, &positions, &rows, FULL_ROWS),
                &mut dev_pool,
            )
            .expect("a valid step")
            .values
            .to_vec();
        // The same step again, each sampled row greedy (K and V rewritten
        // with the values they hold), each earlier row scored for the
        // prompt's next token: each sampled row comes back as its id alone
        // with its log probabilities, each earlier row as its scores.
        let picked = cuda
            .step(
                &lockstep(
                    &dev_tables,
                    &inputs,
                    &positions,
                    &rows,
                    Asks {
                        pick: &|_| Pick::Argmax,
                        adjusts: &[],
                        logprobs: Some(5),
                        scores: Some(5),
                    },
                ),
                &mut dev_pool,
            )
            .expect("a valid step");
        assert!(picked.values.is_empty(), "step {step}: no row in full");
        let picks = picked.picks.to_vec();
        let logprobs = picked.scored.to_vec();
        // Once more, each sampled row drawn, every other one adjusted first.
        let draw = |i: usize| Pick::Draw(check_draw(i, step));
        let adjusts: Vec<Vec<Adjust>> = (inputs.iter().enumerate())
            .map(|(i, input)| check_adjust(i, step, input, vocab))
            .collect();
        let drawn = cuda
            .step(
                &lockstep(
                    &dev_tables,
                    &inputs,
                    &positions,
                    &rows,
                    Asks {
                        pick: &draw,
                        adjusts: &adjusts,
                        logprobs: Some(3),
                        scores: None,
                    },
                ),
                &mut dev_pool,
            )
            .expect("a valid step");
        let (scored_drawn, draws) = (drawn.values.to_vec(), drawn.picks.to_vec());
        let drawn_scores = drawn.scored.to_vec();
        let mut candidates = Vec::new();
        assert_eq!(
            cpu_logits.len(),
            dev_logits.len(),
            "step {step}: rows differ"
        );
        let (mut at, mut full) = (0, 0);
        let pick_at = |r: usize| picks.iter().find(|p| p.0 as usize == r).map(|p| p.1);
        let scores_at = |r: usize| logprobs.iter().find(|s| s.0 as usize == r).map(|s| &s.1);
        let mut draws = draws.iter();
        for i in 0..run.prompts.len() {
            let mut greedy = 0;
            for row in 0..rows[i] {
                let (a, b) = (
                    &cpu_logits[at * vocab..(at + 1) * vocab],
                    &dev_logits[at * vocab..(at + 1) * vocab],
                );
                at += 1;
                if row + 1 < rows[i] {
                    let again = &scored_drawn[full * vocab..(full + 1) * vocab];
                    assert!(again == b, "step {step}, sequence {i}: a full row changed");
                    full += 1;
                    let (error, _) = compare_row(a, b, step, i);
                    result.worst_relative_scored = result.worst_relative_scored.max(error);
                    result.scored_rows += 1;
                    // The prompt's token after this row's position.
                    let target = inputs[i][inputs[i].len() + 1 - rows[i] + row];
                    let want = Logprobs::of(b, target, 5);
                    if pick_at(at - 1) == Some(target)
                        && scores_at(at - 1).is_some_and(|got| logprobs_close(got, &want))
                    {
                        result.prompt_scores_agree += 1;
                    }
                    continue;
                }
                let (error, mine) = compare_row(a, b, step, i);
                result.worst_relative = result.worst_relative.max(error);
                result.rows += 1;
                let theirs = argmax(b);
                let want = Logprobs::of(b, theirs as u32, 5);
                if pick_at(at - 1) == Some(theirs as u32)
                    && scores_at(at - 1).is_some_and(|got| logprobs_close(got, &want))
                {
                    result.picks_agree += 1;
                }
                let mut adjusted = b.to_vec();
                adjust(&mut adjusted, &adjusts[i]);
                let drawn = check_draw(i, step).pick(&adjusted, &mut candidates);
                let want = Logprobs::of(b, drawn, 3);
                let scores = drawn_scores.iter().find(|s| s.0 as usize == at - 1);
                if draws.next() == Some(&((at - 1) as u32, drawn))
                    && scores.is_some_and(|(_, got)| logprobs_close(got, &want))
                {
                    result.draws_agree += 1;
                }
                if mine == theirs {
                    result.greedy_agree += 1;
                } else if (a[mine] - a[theirs]).abs() <= run.tolerance * scale_of(a) {
                    result.near_ties += 1;
                }
                greedy = mine;
            }
            positions[i] = inputs[i].len();
            inputs[i].push(greedy as u32);
        }
        rows.fill(1);
    }
    result
}

/// The CPU backend's own drift on `run`'s prompts: the worst relative
/// difference between its portable path ([`Isa::Scalar`]) and its fastest
/// over the rows [`agreement`]'s first step compares (each prompt's last
/// positions). Both paths quantize a layer's input to 8 bits before its
/// matrix products, and sum in different orders; where one rounding flips,
/// the next layer's input moves by a quantization step. In a deep model of
/// random weights such flips grow from layer to layer (30 layers of
/// SmolLM2's shape part the two CPU paths by a few percent of the largest
/// logit), so a device that parts from the CPU by less than this has
/// nothing to answer for beyond what the CPU does to itself.
///
/// [`Isa::Scalar`]: crate::quant::Isa::Scalar
pub fn cpu_drift(model: &Arc<Model>, run: &AgreementRun<'_>) -> f32 {
    use crate::quant::Isa;
    let seqs = run.prompts.len() as u32;
    let longest = run.prompts.iter().max().copied().unwrap_or(0);
    let per_seq = (longest as u32).div_ceil(run.page_tokens).max(1);
    let tokens_max = run.prompts.iter().sum::<usize>().max(run.prompts.len());
    let vocab = model.config.vocab_len;
    let (inputs, rows) = prompts_of(model, run);
    let positions = vec![0usize; run.prompts.len()];
    let [portable, fastest] = [Isa::Scalar, Isa::detect()].map(|isa| {
        let (kv, tokens) = (run.kv_type, run.page_tokens);
        let (mut pool, tables) = pool_with_tables(model, kv, tokens, seqs, per_seq, None, false);
        let mut cpu = cpu_backend(model, run, Some(isa), tokens_max);
        cpu.step(
            &lockstep(&tables, &inputs, &positions, &rows, FULL_ROWS),
            &mut pool,
        )
        .expect("a valid step")
        .values
        .to_vec()
    });
    portable
        .chunks_exact(vocab)
        .zip(fastest.chunks_exact(vocab))
        .map(|(a, b)| compare_row(a, b, 0, 0).0)
        .fold(0.0, f32::max)
}

fn scale_of(row: &[f32]) -> f32 {
    row.iter()
        .fold(0.0f32, |m, v| m.max(v.abs()))
        .max(f32::MIN_POSITIVE)
}

/// One row's relative error against the CPU's, and the CPU's greedy token.
fn compare_row(a: &[f32], b: &[f32], step: usize, seq: usize) -> (f32, usize) {
    let scale = scale_of(a);
    let mut error = 0.0f32;
    for (&x, &y) in a.iter().zip(b) {
        assert!(
            x.is_finite() && y.is_finite(),
            "step {step} seq {seq}: a logit is not finite"
        );
        error = error.max((x - y).abs() / scale);
    }
    (error, argmax(a))
}

/// A rate through the backend.
#[derive(Clone, Debug, PartialEq)]
pub struct Rate {
    /// Tokens per second.
    pub tokens_per_s: f64,
    /// Seconds per step (the median).
    pub step_secs: f64,
    /// Bytes of weights and KV one step reads (decode only; 0 for prefill).
    pub bytes_per_step: u64,
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}

/// Bytes of the model's matrices one decode step streams: every layer's and
/// the output head (the embedding contributes only its rows).
pub fn weight_bytes(model: &Model) -> u64 {
    let layer = |l: &crate::model::LayerWeights| {
        [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]
            .iter()
            .map(|m| m.info.bytes_len)
            .sum::<u64>()
    };
    model.layers.iter().map(layer).sum::<u64>() + model.output.info.bytes_len
}

/// How a prefill runs, beyond its length and chunks: as the server runs it
/// ([`PrefillWay::SERVER`]) or with one choice undone, to measure it.
#[derive(Clone, Copy, Debug)]
pub struct PrefillWay {
    /// Products on the tensor cores, or a warp a row
    /// ([`CudaBackend::set_tensor_cores`]).
    pub tensor_cores: bool,
    /// Queries an attention item takes (`None`: the most its block holds;
    /// [`CudaBackend::set_prefill_item_queries`]).
    pub item_queries: Option<u32>,
}

impl PrefillWay {
    /// As the server runs a prefill.
    pub const SERVER: PrefillWay = PrefillWay {
        tensor_cores: true,
        item_queries: None,
    };
}

/// Prefill of one `len`-token prompt in chunks of `chunk` tokens, best of
/// `rounds` after one warm-up, run `way`: tokens per second.
pub fn prefill_rate(
    model: &Arc<Model>,
    device: &Arc<dyn Device>,
    len: usize,
    chunk: usize,
    rounds: usize,
    way: PrefillWay,
) -> Rate {
    prefill_run(model, device, len, chunk, rounds, false, way).0
}

/// Where a `len`-token prefill's steps (chunks of `chunk`) spend their time
/// on the device, kernel by kernel (see [`Device::profile_start`]): one
/// round after one untimed.
pub fn prefill_profile(
    model: &Arc<Model>,
    device: &Arc<dyn Device>,
    len: usize,
    chunk: usize,
) -> StepProfile {
    let (rate, launches) = prefill_run(model, device, len, chunk, 1, true, PrefillWay::SERVER);
    StepProfile::of(&launches, len.div_ceil(chunk), rate.step_secs)
}

/// [`prefill_rate`], its last round's launches timed when `profile`.
fn prefill_run(
    model: &Arc<Model>,
    device: &Arc<dyn Device>,
    len: usize,
    chunk: usize,
    rounds: usize,
    profile: bool,
    way: PrefillWay,
) -> (Rate, Vec<LaunchTime>) {
    let page_tokens = 16;
    let per_seq = (len as u32).div_ceil(page_tokens);
    let (mut pool, tables) = pool_with_tables(
        model,
        KvType::F16,
        page_tokens,
        1,
        per_seq,
        Some(device),
        false,
    );
    let mut cuda = CudaBackend::new(
        Arc::clone(model),
        Arc::clone(device),
        CudaOptions {
            step_tokens_max: chunk,
            step_seqs_max: 1,
            graphs: false,
            tensor_cores: true,
            dependent_launches: true,
        },
    )
    .expect("the CUDA backend runs the model");
    cuda.set_tensor_cores(way.tensor_cores);
    if let Some(queries) = way.item_queries {
        cuda.set_prefill_item_queries(queries);
    }
    let tokens: Vec<u32> = (0..len)
        .map(|i| (i * 7919 % model.config.vocab_len) as u32)
        .collect();
    let mut times = Vec::new();
    for round in 0..=rounds {
        if profile && round == rounds {
            device.profile_start();
        }
        let start = Instant::now();
        for at in (0..len).step_by(chunk) {
            let end = (at + chunk).min(len);
            let step = SeqStep {
                logits: usize::from(end == len),
                ..SeqStep::new(&tables[0], at, &tokens[at..end])
            };
            cuda.step(&[step], &mut pool).expect("a valid step");
        }
        if round > 0 {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    let launches = taken(device, profile);
    let secs = times.iter().copied().fold(f64::MAX, f64::min);
    let rate = Rate {
        tokens_per_s: len as f64 / secs,
        step_secs: secs / len.div_ceil(chunk) as f64,
        bytes_per_step: 0,
    };
    (rate, launches)
}

/// `run`'s decode steps (see [`DecodeRun`]): the median step's rate and
/// the bytes it reads.
///
/// The `depth` positions before the first decode token are not prefilled:
/// their K and V are the pool's pages as allocated (zeroed device memory).
/// A decode step reads every one of them through its page table whatever
/// it holds, and nothing in the kernels depends on the values (no branch,
/// no early exit), so the step is timed as after a prefill, without the
/// prefill: 524,288 tokens for batch 128 at depth 4,096, most of the GPU
/// check's time on an H100 (prefill is timed by [`prefill_rate`]).
pub fn decode_rate(model: &Arc<Model>, device: &Arc<dyn Device>, run: &DecodeRun) -> Rate {
    decode_run(model, device, run, false).0
}

/// Where `run`'s decode steps spend their time on the device, kernel by
/// kernel (see [`Device::profile_start`]), without graphs (a graph's
/// launches are not timed one by one), after the same warm-up as
/// [`decode_rate`].
pub fn decode_profile(
    model: &Arc<Model>,
    device: &Arc<dyn Device>,
    run: &DecodeRun,
) -> StepProfile {
    let run = DecodeRun {
        graphs: false,
        ..*run
    };
    let (rate, launches) = decode_run(model, device, &run, true);
    StepProfile::of(&launches, run.steps, rate.step_secs)
}

/// What [`decode_rate`] times: `steps` decode steps of `batch` sequences at
/// `depth` (after a warm-up of 4), the backend sized for prefill chunks of
/// `chunk`.
#[derive(Clone, Copy, Debug)]
pub struct DecodeRun {
    /// Sequences a step.
    pub batch: usize,
    /// Positions before the first timed token.
    pub depth: usize,
    /// Steps timed.
    pub steps: usize,
    /// Steps run as captured graphs.
    pub graphs: bool,
    /// The backend's prefill chunk (its step's most tokens, at least `batch`).
    pub chunk: usize,
    /// How each step's rows are wanted: [`Pick::Argmax`] (the device's
    /// argmax comes back, not the rows) as a greedy request's are,
    /// [`Pick::Draw`] as a sampled request's, [`Pick::Row`] (every row of
    /// logits copied to the host) as one asking for log probabilities.
    pub pick: Pick,
    /// Adjustments of each sequence's row before its pick (a request under
    /// a repetition penalty over its tokens, one in sixteen of them, its
    /// output's, also under a frequency penalty by their counts 1 to 4):
    /// this many entries a row, ids spread over the vocabulary. Most share
    /// one adjustment, so a row takes a word an id of them in the step
    /// buffer: 3,000 take 892 of the 1,024 rooms of a row's share at the
    /// largest step ([`decode_adjusts`]).
    pub adjusts: usize,
    /// Launches folded into others ([`CudaBackend::set_fusions`]).
    pub fusions: Fusions,
    /// Attention by warps, or by tiles
    /// ([`CudaBackend::set_decode_attention_by_warps`]).
    pub by_warps: bool,
    /// Products of steps past 8 tokens on the tensor cores, or a warp a row
    /// ([`CudaBackend::set_tensor_cores`]).
    pub tensor_cores: bool,
    /// The sequences a step may have ([`CudaOptions::step_seqs_max`], at
    /// least `batch`): what the step buffer, its page tables and attention
    /// items, is sized for.
    pub seqs_max: usize,
    /// A step's launches after its first as dependent launches, where the
    /// device has them ([`CudaBackend::set_dependent_launches`]).
    pub dependent_launches: bool,
}

impl DecodeRun {
    /// Greedy steps with every fusion, as the server runs them.
    pub fn new(batch: usize, depth: usize, steps: usize, graphs: bool, chunk: usize) -> DecodeRun {
        DecodeRun {
            batch,
            depth,
            steps,
            graphs,
            chunk,
            pick: Pick::Argmax,
            adjusts: 0,
            fusions: Fusions::default(),
            by_warps: true,
            tensor_cores: true,
            seqs_max: batch,
            dependent_launches: true,
        }
    }
}

/// The device's weights of a draw against the host's: the `draw_weights`
/// kernel (sample.cu's `exp_rn`, what the `pick` kernel weighs tokens by)
/// over every 4,099th f32 of [-87, 0] and the ends, compared bit for bit
/// with [`draw::exp_rn`](crate::backend::draw::exp_rn). A draw on the
/// device is the host's only where every weight is.
#[derive(Clone, Debug, PartialEq)]
pub struct DrawWeights {
    /// Values compared.
    pub values: usize,
    /// Those whose bits are the host's.
    pub equal: usize,
    /// The first that is not: the value, the device's weight, the host's.
    pub first_apart: Option<(f32, f32, f32)>,
}

/// Runs [`DrawWeights`]'s comparison on `device`.
pub fn draw_weights(device: &Arc<dyn Device>) -> Result<DrawWeights, super::device::DeviceError> {
    use super::device::{DeviceBuffer, Geometry};
    use super::launch::{DrawWeightsArgs, KernelArgs, ROW_BLOCK};
    use crate::backend::draw::exp_rn;
    // Negative floats rise as their bits fall, down to -0.
    let mut xs: Vec<f32> = ((0x8000_0000u32..=(-87.0f32).to_bits()).step_by(4099))
        .map(f32::from_bits)
        .collect();
    xs.extend([0.0, -0.0, -87.0, -f32::MIN_POSITIVE, -0.249_998_12]);
    let bytes: Vec<u8> = xs.iter().flat_map(|x| x.to_le_bytes()).collect();
    let values = DeviceBuffer::zeroed(device, bytes.len() as u64)?;
    values.write(0, &bytes)?;
    let args = DrawWeightsArgs {
        values: values.at(0),
        count: xs.len() as u32,
        unused: 0,
    };
    let geometry = Geometry {
        grid: (xs.len() as u32).div_ceil(ROW_BLOCK),
        block: ROW_BLOCK,
        shared_bytes: 0,
    };
    // SAFETY: the kernel reads and writes `count` floats of `values`.
    unsafe { device.launch(DrawWeightsArgs::KERNEL, geometry, args.bytes()) }?;
    let mut out = vec![0u8; bytes.len()];
    values.read(0, &mut out)?;
    let mut report = DrawWeights {
        values: xs.len(),
        equal: 0,
        first_apart: None,
    };
    for (x, word) in xs.iter().zip(out.chunks_exact(4)) {
        let got = f32::from_le_bytes(word.try_into().expect("4 bytes"));
        let want = exp_rn(*x);
        if got.to_bits() == want.to_bits() {
            report.equal += 1;
        } else {
            report.first_apart.get_or_insert((*x, got, want));
        }
    }
    Ok(report)
}

/// Sequence `seq`'s `n` adjustments of [`DecodeRun::adjusts`], in a
/// vocabulary of `vocab`.
pub fn decode_adjusts(seq: usize, n: usize, vocab: usize) -> Vec<Adjust> {
    let mut ids: Vec<u32> = (0..n)
        .map(|k| ((seq * 7919 + k * 40_503) % vocab) as u32)
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids.into_iter()
        .enumerate()
        .map(|(k, id)| Adjust {
            repetition: 1.2,
            penalty: match k % 16 {
                0 => 0.3 * (1 + k / 16 % 4) as f32,
                _ => 0.0,
            },
            ..Adjust::none(id)
        })
        .collect()
}

/// [`decode_rate`], its timed steps' launches timed when `profile`.
fn decode_run(
    model: &Arc<Model>,
    device: &Arc<dyn Device>,
    run: &DecodeRun,
    profile: bool,
) -> (Rate, Vec<LaunchTime>) {
    let DecodeRun {
        batch,
        depth,
        steps,
        graphs,
        chunk,
        pick,
        adjusts,
        fusions,
        by_warps,
        tensor_cores,
        seqs_max,
        dependent_launches,
    } = *run;
    let page_tokens = 16;
    let warmup = 4;
    let per_seq = ((depth + warmup + steps + 1) as u32).div_ceil(page_tokens);
    let (mut pool, tables) = pool_with_tables(
        model,
        KvType::F16,
        page_tokens,
        batch as u32,
        per_seq,
        Some(device),
        false,
    );
    let mut cuda = CudaBackend::new(
        Arc::clone(model),
        Arc::clone(device),
        CudaOptions {
            step_tokens_max: chunk.max(batch),
            step_seqs_max: seqs_max.max(batch),
            graphs,
            tensor_cores: true,
            dependent_launches: true,
        },
    )
    .expect("the CUDA backend runs the model");
    cuda.set_fusions(fusions);
    cuda.set_decode_attention_by_warps(by_warps);
    cuda.set_tensor_cores(tensor_cores);
    cuda.set_dependent_launches(dependent_launches);
    let vocab = model.config.vocab_len;
    let one: Vec<[u32; 1]> = (0..batch).map(|s| [(s % vocab) as u32]).collect();
    let adjust: Vec<Vec<Adjust>> = (0..batch)
        .map(|s| decode_adjusts(s, adjusts, vocab))
        .collect();
    let mut times = Vec::new();
    for i in 0..warmup + steps {
        let seqs: Vec<SeqStep> = (0..batch)
            .map(|s| SeqStep {
                pick,
                adjust: &adjust[s],
                ..SeqStep::new(&tables[s], depth + i, &one[s])
            })
            .collect();
        if profile && i == warmup {
            device.profile_start();
        }
        let start = Instant::now();
        cuda.step(&seqs, &mut pool).expect("a valid step");
        if i >= warmup {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    let launches = taken(device, profile);
    let step_secs = median(times);
    let position_bytes = pool.layout().position_bytes();
    let rate = Rate {
        tokens_per_s: batch as f64 / step_secs,
        step_secs,
        bytes_per_step: weight_bytes(model)
            + batch as u64 * (depth + warmup + steps / 2) as u64 * position_bytes,
    };
    (rate, launches)
}

/// The launches a profile timed, when one was taken.
fn taken(device: &Arc<dyn Device>, profile: bool) -> Vec<LaunchTime> {
    if profile {
        device.profile_take()
    } else {
        Vec::new()
    }
}

/// One kernel's part of a step (the same kernel on another grid, another
/// matrix say, is another part).
#[derive(Clone, Debug, PartialEq)]
pub struct KernelShare {
    /// The kernel.
    pub kernel: &'static str,
    /// Its grid (blocks).
    pub grid: u32,
    /// Launches a step.
    pub launches: f64,
    /// Seconds a step, the launches' device times summed.
    pub secs: f64,
}

/// Where a step's time goes on the device.
#[derive(Clone, Debug, PartialEq)]
pub struct StepProfile {
    /// A profiled step's wall time, host included (the median; each launch
    /// waited for, so longer than an unprofiled step).
    pub step_secs: f64,
    /// The parts, the costliest first.
    pub kernels: Vec<KernelShare>,
}

impl StepProfile {
    /// The profile of `launches`, made over `steps` steps.
    pub fn of(launches: &[LaunchTime], steps: usize, step_secs: f64) -> StepProfile {
        let per_step = 1.0 / steps.max(1) as f64;
        let mut kernels: Vec<KernelShare> = Vec::new();
        for launch in launches {
            let at = kernels
                .iter()
                .position(|k| k.kernel == launch.kernel && k.grid == launch.grid)
                .unwrap_or_else(|| {
                    kernels.push(KernelShare {
                        kernel: launch.kernel,
                        grid: launch.grid,
                        launches: 0.0,
                        secs: 0.0,
                    });
                    kernels.len() - 1
                });
            kernels[at].launches += 1.0;
            kernels[at].secs += launch.secs;
        }
        for kernel in &mut kernels {
            kernel.launches *= per_step;
            kernel.secs *= per_step;
        }
        kernels.sort_by(|a, b| b.secs.total_cmp(&a.secs));
        StepProfile { step_secs, kernels }
    }

    /// The kernels' device time a step, summed.
    pub fn kernel_secs(&self) -> f64 {
        self.kernels.iter().map(|k| k.secs).sum()
    }

    /// Launches a step.
    pub fn launches(&self) -> f64 {
        self.kernels.iter().map(|k| k.launches).sum()
    }
}

/// What one isolation check found.
#[cfg(any(test, feature = "fault-injection"))]
#[derive(Clone, Debug)]
pub struct Outcome {
    /// The check.
    pub name: &'static str,
    /// What happened.
    pub detail: String,
    /// Whether it is what must happen.
    pub pass: bool,
}

/// The page book's guarantees on a device: pages a step wrote read back
/// zero from device memory once released and scrubbed; a stale, a
/// foreign-pool and a cross-tenant page-table entry are each refused before
/// any launch (the last stops the engine: a panic, caught here, with the
/// page book's own message).
#[cfg(any(test, feature = "fault-injection"))]
pub fn isolation(model: &Arc<Model>, device: &Arc<dyn Device>) -> Vec<Outcome> {
    use crate::backend::StepError;
    use crate::kv::PageId;
    let mut rows = Vec::new();
    let options = CudaOptions {
        step_tokens_max: 64,
        step_seqs_max: 4,
        graphs: false,
        tensor_cores: true,
        dependent_launches: true,
    };
    let mut cuda =
        CudaBackend::new(Arc::clone(model), Arc::clone(device), options).expect("backend");
    let (mut pool, mut tables) = pool_with_tables(model, KvType::F16, 16, 2, 2, Some(device), true);
    let tokens: Vec<u32> = (0..20).collect();
    let step = SeqStep::new(&tables[0], 0, &tokens);
    cuda.step(&[step], &mut pool).expect("a valid step");
    let pages: Vec<PageId> = tables[0].handles().iter().map(|h| h.page).collect();
    let old = tables[0].handles().to_vec();
    pool.release(&mut tables[0]);
    // Paranoid pool: scrub asserts the page reads back zero from the device.
    let scrubbed = pool.scrub_released();
    rows.push(Outcome {
        name: "released pages read back scrubbed",
        detail: format!(
            "{scrubbed} pages (of {}) zero after scrub, read from device memory",
            pages.len()
        ),
        pass: scrubbed as usize == pages.len(),
    });
    // Stale: the old handles after the pages were leased again.
    let mut reservation = pool.reserve(OWNER, 2).expect("pages");
    let mut fresh = pool.page_table(&reservation, SeqId(9));
    pool.acquire(&mut reservation, &mut fresh).expect("page");
    pool.acquire(&mut reservation, &mut fresh).expect("page");
    let mut stale = pool.page_table(&reservation, SeqId(1));
    pool.release_reservation(reservation);
    for handle in old {
        stale.plant_fault_push(handle);
    }
    let before = device.launches();
    let stale_step = SeqStep::new(&stale, 0, &tokens);
    let refused = cuda.step(&[stale_step], &mut pool).err();
    let ok = refused == Some(StepError::StaleHandle { index: 0 }) && device.launches() == before;
    rows.push(Outcome {
        name: "stale page-table entry",
        detail: format!("{refused:?}, {} launches", device.launches() - before),
        pass: ok,
    });
    // Foreign pool: a table of another pool.
    let (_other, other_tables) =
        pool_with_tables(model, KvType::F16, 16, 1, 2, Some(device), false);
    let foreign = SeqStep::new(&other_tables[0], 0, &tokens);
    let refused = cuda.step(&[foreign], &mut pool).err();
    let ok = refused == Some(StepError::StaleHandle { index: 0 }) && device.launches() == before;
    rows.push(Outcome {
        name: "foreign-pool page-table entry",
        detail: format!("{refused:?}, {} launches", device.launches() - before),
        pass: ok,
    });
    // Cross-tenant: a live page of another owner in the table: the page book
    // stops the engine (a panic) before the device sees the table.
    let layout = model
        .config
        .pool_geometry(4, 16, KvType::F16)
        .layout()
        .expect("layout");
    let partitions = [
        PartitionConfig {
            owner: OwnerTag(1),
            pages_reserved: 2,
            pages_max: 2,
        },
        PartitionConfig {
            owner: OwnerTag(2),
            pages_reserved: 2,
            pages_max: 2,
        },
    ];
    let storage = DeviceStorage::new(device, layout).expect("storage");
    let mut shared = Pool::with_storage(
        layout,
        &partitions,
        PoolOptions::default(),
        Box::new(storage),
    )
    .expect("pool");
    let mut mine = shared.reserve(OwnerTag(1), 1).expect("page");
    let mut table = shared.page_table(&mine, SeqId(1));
    shared.acquire(&mut mine, &mut table).expect("page");
    let mut theirs = shared.reserve(OwnerTag(2), 1).expect("page");
    let mut their_table = shared.page_table(&theirs, SeqId(2));
    shared.acquire(&mut theirs, &mut their_table).expect("page");
    table.plant_fault_push(their_table.handles()[0]);
    let before = device.launches();
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let step = SeqStep::new(&table, 0, &tokens);
        let _ = cuda.step(&[step], &mut shared);
    }));
    let message = outcome
        .err()
        .and_then(|e| e.downcast_ref::<String>().cloned())
        .unwrap_or_default();
    let ok = message.contains("cross-tenant") && device.launches() == before;
    rows.push(Outcome {
        name: "cross-tenant page-table entry",
        detail: format!(
            "engine stopped: {message:?}, {} launches",
            device.launches() - before
        ),
        pass: ok,
    });
    rows
}
