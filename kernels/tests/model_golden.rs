//! The whole SmolLM2 model against an independent reference: a NumPy forward
//! pass over tensors dequantized by the `gguf` package, with f32 activations
//! (scripts/golden_logits.py). Our engine quantizes activations to 8 bits for the
//! integer dot products, so logits agree within a stated tolerance, not exactly.
//!
//! Two files, each with a fixture generated from that same file:
//!
//! ```text
//! SmolLM2-135M-Instruct.Q4_1.gguf  downloaded (setup.sh)   logits_smollm2.json
//! SmolLM2-135M-Instruct.Q8_0.gguf  bulkhead quantize       logits_smollm2_q8.json
//!                                  (models.sh)
//! ```
//!
//! The Q8_0 file runs the Q8_0 kernels in every matrix, and the reference reads
//! it with the `gguf` package, which also proves our writer's output is GGUF.
//!
//! Tolerance: for each reference top-10 token at each checked position, our
//! logit is within `LOGIT_TOLERANCE` of the reference's (logits of this model
//! span roughly -10..40), and our top-1 equals the reference's top-1 unless the
//! reference's own top-2 margin is below the tolerance.
//!
//! Measured, largest difference on the scalar / AVX2 / AVX-512 paths:
//!
//! ```text
//!                                Q4_1                 Q8_0
//! 2026-11-29, Zen 4              0.46 / 0.65 / 0.52   -
//! 2026-11-30, AMD EPYC (AVX-512) 0.46 / 0.65 / 0.58   0.48 / 0.48 / 0.42
//! 2026-11-30, batch-invariant     0.46 / 0.65 / 0.53   0.48 / 0.48 / 0.44
//!   AVX-512 (same machine)
//! 2026-11-30, f16 KV, span-tiled   0.56 / 0.57 / 0.46   0.59 / 0.63 / 0.68
//!   attention (same machine)
//! ```
//!
//! The long prompt (4,100 tokens, its own fixture; best instruction set only):
//! largest difference 0.61 with f16 KV and 0.60 with f32 KV (AVX-512,
//! 2026-11-30). f16 keeps 11 significant bits of each K and V value, so a
//! score `q·k` of magnitude ~10 moves by ~0.005 and the softmax weights by
//! less than a percent of themselves; measured, that costs 0.003 on the worst
//! top-10 logit at 4k positions, two orders below what 8-bit activations cost
//! (below). The same 1.0 tolerance holds.
//!
//! Eight-bit weights do not shrink the difference: it comes from the 8-bit
//! activations, which both files share. Each matrix product agrees across
//! instruction sets to ~1e-7 relative, but such reorderings flip the rounding of
//! some 8-bit activation codes, and a flipped code is a full quantization step,
//! so the paths differ from one another by as much as from the reference.
//! Re-running the NumPy reference with only the RMSNorm outputs rounded to 8-bit
//! blocks moves its own logits by 0.27: differences of this size are what
//! activation quantization costs, not a bug. A wrong RoPE, mask or norm moves
//! logits by whole units and changes top-1 tokens.

mod common;

use common::harness::{harness, harness_with, ids, top1};

use bulkhead_kernels::kv::KvType;
use bulkhead_kernels::model::Model;
use bulkhead_kernels::quant::{GgmlType, Isa};
use serde_json::Value;
use std::sync::Arc;

/// Largest accepted |ours - reference| on a reference top-10 logit.
const LOGIT_TOLERANCE: f32 = 1.0;

fn fixture(file: &str) -> Value {
    let path = common::repo_root()
        .join("kernels/tests/fixtures")
        .join(file);
    serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("fixture JSON")
}

/// A model file and the reference fixture generated from that same file.
struct Golden {
    model: Arc<Model>,
    fixture: Value,
}

/// The default model (Q4_1 matrices, a Q8_0 embedding).
fn q4_1() -> Option<Golden> {
    let path = common::smollm2_path()?;
    Some(Golden {
        model: Arc::new(Model::open(&path).expect("the default model loads")),
        fixture: fixture("logits_smollm2.json"),
    })
}

/// The default model re-quantized by `bulkhead quantize --to q8_0`: every
/// matrix runs the Q8_0 kernels.
fn q8_0() -> Option<Golden> {
    let path = common::smollm2_q8_path()?;
    let model = Model::open(&path).expect("the Q8_0 model loads");
    let matrices = model
        .layers
        .iter()
        .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]);
    for matrix in matrices.chain([&model.token_embd, &model.output]) {
        assert_eq!(matrix.ty(), GgmlType::Q8_0, "{}", matrix.info.name);
    }
    Some(Golden {
        model: Arc::new(model),
        fixture: fixture("logits_smollm2_q8.json"),
    })
}

#[test]
fn q4_1_logits_agree_with_the_numpy_reference() {
    if let Some(golden) = q4_1() {
        logits_agree_with_the_numpy_reference(&golden);
    }
}

#[test]
fn q8_0_logits_agree_with_the_numpy_reference() {
    if let Some(golden) = q8_0() {
        logits_agree_with_the_numpy_reference(&golden);
    }
}

#[test]
fn q4_1_greedy_decoding_follows_the_reference_and_is_deterministic() {
    if let Some(golden) = q4_1() {
        greedy_decoding_follows_the_reference_and_is_deterministic(&golden);
    }
}

#[test]
fn q8_0_greedy_decoding_follows_the_reference_and_is_deterministic() {
    if let Some(golden) = q8_0() {
        greedy_decoding_follows_the_reference_and_is_deterministic(&golden);
    }
}

fn logits_agree_with_the_numpy_reference(golden: &Golden) {
    // Every instruction set this CPU has, the scalar reference path included.
    for isa in Isa::available() {
        let worst = worst_top10_difference(golden, isa, KvType::default());
        eprintln!("{isa:?}: largest logit difference on reference top-10 tokens: {worst:.4}");
    }
}

/// The largest difference from the reference on its top-10 logits at every
/// checked position (asserting each is within tolerance, and top-1 agrees
/// where the reference's own margin allows).
fn worst_top10_difference(golden: &Golden, isa: Isa, kv_type: KvType) -> f32 {
    let (model, fixture) = (&golden.model, &golden.fixture);
    let mut worst = 0.0f32;
    for prompt in fixture["prompts"].as_array().unwrap() {
        let ids = ids(&prompt["ids"]);
        let mut h = harness_with(model, isa, ids.len(), kv_type);
        let mut pos = 0;
        // Feed the prompt in chunks ending at each checked position: this also
        // exercises chunked prefill against a reference that has none.
        for checked in prompt["positions"].as_array().unwrap() {
            let end = checked["pos"].as_u64().unwrap() as usize + 1;
            let logits = h.step(pos, &ids[pos..end]);
            pos = end;
            let what = format!(
                "{isa:?} {kv_type:?} prompt {:?} pos {}",
                prompt["text"],
                end - 1
            );
            worst = worst.max(check_top10(&logits, checked, &what));
        }
    }
    worst
}

/// Checks `logits` against one fixture position (`{pos, top}`): each
/// reference top-10 logit within tolerance, and the same top-1 unless the
/// reference's own margin is below the tolerance. Returns the largest difference.
fn check_top10(logits: &[f32], checked: &Value, what: &str) -> f32 {
    let reference: Vec<(u32, f32)> = checked["top"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p[0].as_u64().unwrap() as u32, p[1].as_f64().unwrap() as f32))
        .collect();
    let mut worst = 0.0f32;
    for &(id, expected) in &reference {
        let diff = (logits[id as usize] - expected).abs();
        worst = worst.max(diff);
        assert!(
            diff <= LOGIT_TOLERANCE,
            "{what}: token {id} logit {} vs reference {expected}",
            logits[id as usize]
        );
    }
    let margin = reference[0].1 - reference[1].1;
    if margin > LOGIT_TOLERANCE {
        assert_eq!(top1(logits), reference[0].0, "{what}: top-1 differs");
    }
    worst
}

fn greedy_decoding_follows_the_reference_and_is_deterministic(golden: &Golden) {
    let (model, greedy) = (&golden.model, &golden.fixture["greedy"]);
    let prompt = ids(&greedy["ids"]);
    let expected = ids(&greedy["continuation"]);
    let run = || {
        let mut h = harness(model, Isa::detect(), prompt.len() + expected.len());
        let last = h.step(0, &prompt);
        h.greedy(prompt.len(), last, expected.len())
    };
    let first = run();
    assert_eq!(first, run(), "greedy decoding is deterministic");
    follows_the_reference(&first, greedy);
}

/// `ours` equals the fixture's greedy continuation up to the first position
/// where the reference itself was nearly tied; past a divergence the contexts
/// differ, so nothing more is compared.
fn follows_the_reference(ours: &[u32], greedy: &Value) {
    let expected = ids(&greedy["continuation"]);
    let margins: Vec<f32> = greedy["top2_margins"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_f64().unwrap() as f32)
        .collect();
    for (i, (&ours, &theirs)) in ours.iter().zip(&expected).enumerate() {
        if ours != theirs {
            assert!(
                margins[i] < LOGIT_TOLERANCE,
                "greedy token {i}: ours {ours}, reference {theirs}, reference margin {}",
                margins[i]
            );
            eprintln!(
                "diverged at token {i} where the reference margin was {}",
                margins[i]
            );
            return;
        }
    }
}

/// A prompt of 4,100 tokens (its own fixture, from the reference's `--long`
/// mode), fed in 512-token chunks with the KV pool in f16, the default:
/// logits at depths 512 to 4,100, then a greedy continuation from there.
#[test]
fn q4_1_long_prompt_follows_the_reference() {
    long_prompt_follows_the_reference(KvType::F16);
}

/// The same with f32 KV, the reference storage: what f16 costs is the
/// difference between the two (recorded at the top). Ignored by default, for
/// time: `cargo test --test model_golden -- --ignored`.
#[test]
#[ignore = "a second 4,100-token prefill; run with --ignored to measure f32 KV"]
fn q4_1_long_prompt_follows_the_reference_with_f32_kv() {
    long_prompt_follows_the_reference(KvType::F32);
}

fn long_prompt_follows_the_reference(kv_type: KvType) {
    let Some(path) = common::smollm2_path() else {
        return;
    };
    let model = Arc::new(Model::open(&path).expect("the default model loads"));
    let fixture = fixture("logits_smollm2_long.json");
    let (prompt, greedy) = (&fixture["prompts"][0], &fixture["greedy"]);
    let ids = ids(&prompt["ids"]);
    assert!(
        ids.len() >= 4000,
        "the long fixture has {} tokens",
        ids.len()
    );
    assert_eq!(ids, self::ids(&greedy["ids"]), "one prompt for both checks");
    let continuation = greedy["continuation"].as_array().unwrap().len();
    let isa = Isa::detect();
    let mut h = harness_with(&model, isa, ids.len() + continuation, kv_type);
    let (mut pos, mut worst, mut last) = (0, 0.0f32, Vec::new());
    for checked in prompt["positions"].as_array().unwrap() {
        let end = checked["pos"].as_u64().unwrap() as usize + 1;
        last = h.step(pos, &ids[pos..end]);
        pos = end;
        let what = format!("{isa:?} {kv_type:?} long prompt pos {}", end - 1);
        worst = worst.max(check_top10(&last, checked, &what));
    }
    assert_eq!(pos, ids.len(), "the last checked position ends the prompt");
    eprintln!("long prompt, {kv_type:?} KV: largest logit difference on reference top-10 tokens: {worst:.4}");
    follows_the_reference(&h.greedy(pos, last, continuation), greedy);
}

/// The checker itself must fail on a model that is only slightly wrong: the
/// final norm's gain scaled by 10% (as a wrong epsilon or a mis-read norm
/// tensor would do) must break the tolerance.
#[test]
fn canary_a_slightly_wrong_model_breaks_the_tolerance() {
    let Some(path) = common::smollm2_path() else {
        return;
    };
    let mut bytes = std::fs::read(&path).unwrap();
    let (needle, len) = {
        let gguf = bulkhead_kernels::gguf::Gguf::from_bytes(bytes.clone()).unwrap();
        let norm = gguf.tensor("output_norm.weight").unwrap();
        (gguf.tensor_bytes(norm).to_vec(), norm.bytes_len as usize)
    };
    // The 2304 bytes of a 576-float gain vector occur once in the file.
    let offset = bytes
        .windows(len)
        .position(|w| w == needle.as_slice())
        .unwrap();
    for chunk in bytes[offset..offset + len].chunks_exact_mut(4) {
        let v = f32::from_le_bytes(chunk.try_into().unwrap()) * 1.1;
        chunk.copy_from_slice(&v.to_le_bytes());
    }
    let gguf = bulkhead_kernels::gguf::Gguf::from_bytes(bytes).unwrap();
    let model = Arc::new(Model::load(Arc::new(gguf)).unwrap());
    let fixture = fixture("logits_smollm2.json");
    let prompt = &fixture["prompts"][0];
    let ids = ids(&prompt["ids"]);
    let mut h = harness(&model, Isa::detect(), ids.len());
    let logits = h.step(0, &ids);
    let last = prompt["positions"].as_array().unwrap().last().unwrap();
    let worst = last["top"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (logits[p[0].as_u64().unwrap() as usize] - p[1].as_f64().unwrap() as f32).abs())
        .fold(0.0f32, f32::max);
    assert!(
        worst > LOGIT_TOLERANCE,
        "a 10% norm error moved logits by only {worst}"
    );
}
