//! Every family and weight type against llama.cpp, on the very same files.
//!
//! The models (`testing::conformance_models`) are random-weight models of
//! each family's options at a tiny size, written by the crate's generator; the
//! three `llamacpp-*.gguf` files are the F32 one of width 256 quantized by
//! llama.cpp's own `llama-quantize` (committed: block layouts that are
//! someone else's). The fixture holds llama.cpp's token ids, top-10 logits at
//! every prompt position and a greedy continuation for each
//! (`scripts/llama_fixtures.py`, which also says how to rebuild llama.cpp).
//!
//! Checked per model, on every instruction set this CPU has:
//! 1. our tokenizer gives llama.cpp's ids for each prompt;
//! 2. each of llama.cpp's top-10 logits at each position is within the
//!    model's tolerance (relative to the largest logit magnitude there), and
//!    our top-1 is llama.cpp's wherever its own margin exceeds that tolerance;
//! 3. greedy decoding follows llama.cpp's continuation up to the first
//!    position where llama.cpp itself was nearly tied.
//!
//! Tolerances, relative to the largest |logit| at the position, and the worst
//! measured (2026-12-04, this machine: the same on AVX-512, AVX2 and scalar):
//!
//! ```text
//!                               tolerance  worst measured
//! F32 weights (family checks)   1e-3       2.7e-4 (llama3), 2.5e-4 (qwen2),
//!                                          2.2e-4 (qwen3), 2.7e-4 (llama),
//!                                          2.4e-4 (llama, linear RoPE x4),
//!                                          2.6e-4 (phi3)
//! F32, GELU families            2e-3       2.6e-4 (gemma), 4.0e-4 (gemma2),
//!                                          1.06e-3 (gemma3, scalar; 8.2e-4
//!                                          with llama.cpp's f16 GELU copied)
//! F16, BF16                     1e-2       4.7e-4, 3.2e-3 (llama.cpp rounds
//!                                          activations to bf16; we keep f32)
//! 8-, 6-, 5- and 4-bit types    6e-2       1.1e-2 (Q8_0) .. 1.9e-2 (Q4_K_M):
//!                                          8-bit activations on both sides,
//!                                          rounded in different places
//! ```
//!
//! llama.cpp computes GELU through an f16 table (its input and its output
//! rounded to f16); ours is the exact tanh form, hence the GELU families'
//! wider tolerance. Their logits are also soft-capped (to 3 in the tiny
//! models), which shrinks the largest |logit| the error is measured against.
//!
//! Llama-3's frequency factors move these logits by ~1e-2 relative within a
//! few positions, so running the llama3 file without them fails the F32
//! tolerance ten times over. The canaries below make the same point for each
//! Gemma option: leaving out the window, either soft cap, the embedding
//! scale, the GELU gate or the local layers' RoPE base moves the logits by
//! 39 to 1,100 times the tolerance (7.8e-2 .. 2.2 relative, measured). Random-weight logits are flat (top-2 margins of
//! a few hundredths), so greedy continuations may part at a near-tie: they
//! are compared up to the first position where llama.cpp's margin is within
//! twice the tolerance.
//!
//! The real SmolLM2-135M re-quantized by llama-quantize (Q4_K_M: mostly
//! Q5_0 and Q8_0, as its width 576 is not whole super-blocks; Q6_K: Q6_K and
//! Q8_0) differs from llama.cpp by up to 1.4 logits (5.9e-2 of the largest;
//! 6.5e-2 since the K-quant kernels scale in i16 pairs; tolerance 8e-2), its greedy continuation parting after 2 to 32 tokens
//! depending on the instruction set. Both engines are that far from an f64
//! NumPy forward pass over the same dequantized weights (golden_logits.py,
//! 2026-12-04, top-10 logits of its prompts): llama.cpp worst 1.20 / mean
//! 0.29 (Q6_K), 1.10 / 0.31 (Q4_K_M); Bulkhead worst 1.38 / mean 0.27-0.30
//! and 1.32 / 0.27-0.32 on scalar, AVX2 and AVX-512. Two 8-bit activation
//! quantizations rounding apart, not a wrong kernel (a wrong one moves
//! logits by several units).
//!
//! `CONFORMANCE_DEBUG=1` prints every logit that uses more than half its
//! tolerance.
//!
//! A canary below shows the F32 tolerance is tight enough to catch a wrong
//! RoPE pairing: the qwen2 file relabelled llama fails it.

mod common;

use bulkhead_kernels::gguf::Gguf;
use bulkhead_kernels::model::{Activation, Model, ModelConfig, ModelError, RopeStyle};
use bulkhead_kernels::quant::{GgmlType, Isa};
use bulkhead_kernels::testing::{conformance_spec, tiny_llama, TinySpec};
use bulkhead_kernels::tokenizer::{EncodeOptions, Tokenizer};
use common::harness::{harness, ids, top1};
use serde_json::Value;
use std::sync::{Arc, OnceLock};

fn read_fixture(file: &str) -> Value {
    let path = common::repo_root()
        .join("kernels/tests/fixtures/conformance")
        .join(file);
    serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("JSON")
}

fn fixture() -> &'static Value {
    static FIXTURE: OnceLock<Value> = OnceLock::new();
    FIXTURE.get_or_init(|| read_fixture("llamacpp.json"))
}

/// The relative tolerance for the real SmolLM2 in llama-quantize's K-quant
/// mixes (module doc).
const SMOLLM2_TOLERANCE: f32 = 8e-2;

/// The relative tolerance for a model whose matrices are `ty`.
fn tolerance(ty: GgmlType) -> f32 {
    match ty {
        GgmlType::F32 => 1e-3,
        GgmlType::F16 | GgmlType::BF16 => 1e-2,
        _ => 6e-2,
    }
}

/// The tolerance for `model`: its matrices' type decides, except that F32
/// weights with a GELU gate get twice the F32 one (llama.cpp's GELU rounds
/// its input and output to f16; ours is exact: module doc).
fn model_tolerance(model: &Model) -> f32 {
    let tol = tolerance(matrix_type(model));
    match model.config.activation {
        Activation::GeluTanh => tol.max(GELU_F32_TOLERANCE),
        Activation::Silu => tol,
    }
}

/// The F32 tolerance of the GELU families (module doc).
const GELU_F32_TOLERANCE: f32 = 2e-3;

/// A conformance model: generated (and checked to be the file the fixture
/// was made from) or one of the committed llama-quantize files.
fn load(name: &str) -> (Arc<Model>, Tokenizer) {
    let entry = &fixture()["models"][name];
    let gguf = if entry["file"] == "generated" {
        let spec = conformance_spec(name);
        let gguf = Gguf::from_bytes(tiny_llama(&spec)).unwrap();
        let fingerprint = format!("{:016x}", gguf.fingerprint());
        assert_eq!(
            entry["fingerprint"].as_str().unwrap(),
            fingerprint,
            "{name}: the generator no longer writes the file the fixture was made from; \
             run scripts/llama_fixtures.py"
        );
        gguf
    } else {
        let path = common::repo_root().join(entry["file"].as_str().unwrap());
        Gguf::open(&path).unwrap()
    };
    let gguf = Arc::new(gguf);
    let tokenizer = Tokenizer::from_gguf(&gguf).expect("tokenizer");
    (Arc::new(Model::load(gguf).expect(name)), tokenizer)
}

/// The type of the model's block matrices (the least exact one decides).
fn matrix_type(model: &Model) -> GgmlType {
    model
        .matrices()
        .map(|m| m.ty())
        .max_by(|a, b| tolerance(*a).total_cmp(&tolerance(*b)))
        .unwrap()
}

/// Checks one model on every instruction set; returns the worst relative
/// difference seen.
fn conforms(name: &str) -> f32 {
    let (model, tokenizer) = load(name);
    let tol = model_tolerance(&model);
    conforms_to(name, &model, &tokenizer, &fixture()["models"][name], tol)
}

fn conforms_to(
    name: &str,
    model: &Arc<Model>,
    tokenizer: &Tokenizer,
    entry: &Value,
    tol: f32,
) -> f32 {
    let mut worst = 0.0f32;
    for isa in Isa::available() {
        for prompt in entry["prompts"].as_array().unwrap() {
            let expected = ids(&prompt["ids"]);
            let text = prompt["text"].as_str().unwrap();
            // As llama.cpp tokenizes a completion: BOS as the file says,
            // special-token text not parsed.
            let options = EncodeOptions {
                add_bos: tokenizer.add_bos(),
                parse_special: false,
            };
            let ours = tokenizer.encode(text, options).unwrap();
            assert_eq!(ours, expected, "{name}: ids of {text:?}");
            let positions = prompt["positions"].as_array().unwrap();
            let mut h = harness(model, isa, expected.len());
            for (pos, checked) in positions.iter().enumerate() {
                let logits = h.step(pos, &expected[pos..pos + 1]);
                let what = format!("{name} {isa:?} {text:?} pos {pos}");
                worst = worst.max(check_top10(&logits, &checked["top"], tol, &what));
            }
        }
        follows_greedy(name, model, isa, &entry["greedy"], tol);
    }
    eprintln!("{name}: worst relative difference {worst:.2e} (tolerance {tol:.0e})");
    worst
}

fn check_top10(logits: &[f32], top: &Value, tol: f32, what: &str) -> f32 {
    let reference: Vec<(u32, f32)> = top
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p[0].as_u64().unwrap() as u32, p[1].as_f64().unwrap() as f32))
        .collect();
    let scale = logits.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-6);
    let mut worst = 0.0f32;
    for &(id, expected) in &reference {
        let relative = (logits[id as usize] - expected).abs() / scale;
        if std::env::var_os("CONFORMANCE_DEBUG").is_some() && relative > tol / 2.0 {
            eprintln!(
                "{what}: token {id} {} vs {expected} (scale {scale})",
                logits[id as usize]
            );
        }
        worst = worst.max(relative);
        assert!(
            relative <= tol,
            "{what}: token {id} logit {} vs llama.cpp {expected} ({relative:.2e} > {tol:.0e})",
            logits[id as usize]
        );
    }
    if reference[0].1 - reference[1].1 > tol * scale {
        assert_eq!(top1(logits), reference[0].0, "{what}: top-1 differs");
    }
    worst
}

fn follows_greedy(name: &str, model: &Arc<Model>, isa: Isa, greedy: &Value, tol: f32) {
    let prompt = ids(&greedy["ids"]);
    let expected = ids(&greedy["continuation"]);
    let margins: Vec<f32> = greedy["top2_margins"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_f64().unwrap() as f32)
        .collect();
    let mut h = harness(model, isa, prompt.len() + expected.len());
    let last = h.step(0, &prompt);
    let scale = last.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let ours = h.greedy(prompt.len(), last, expected.len());
    let agreed = ours
        .iter()
        .zip(&expected)
        .take_while(|(a, b)| a == b)
        .count();
    if agreed < expected.len() {
        assert!(
            margins[agreed] < 2.0 * tol * scale,
            "{name} {isa:?}: greedy token {agreed} is {} where llama.cpp chose {} \
             by a margin of {}",
            ours[agreed],
            expected[agreed],
            margins[agreed]
        );
    }
    eprintln!(
        "{name} {isa:?}: greedy agrees on {agreed} of {} tokens",
        expected.len()
    );
}

#[test]
fn llama_conforms_to_llama_cpp() {
    conforms("llama-f32");
}

#[test]
fn llama3_rope_frequency_factors_conform_to_llama_cpp() {
    conforms("llama3-f32");
}

#[test]
fn llama_linear_rope_scaling_conforms_to_llama_cpp() {
    conforms("llama-linear-f32");
}

#[test]
fn qwen2_biases_and_neox_rope_conform_to_llama_cpp() {
    conforms("qwen2-f32");
}

#[test]
fn qwen3_head_norms_and_key_length_conform_to_llama_cpp() {
    conforms("qwen3-f32");
}

#[test]
fn gemma_embedding_scale_and_gelu_gate_conform_to_llama_cpp() {
    conforms("gemma-f32");
}

#[test]
fn gemma2_sliding_window_soft_caps_and_post_norms_conform_to_llama_cpp() {
    conforms("gemma2-f32");
}

#[test]
fn gemma3_local_rope_base_head_norms_and_window_conform_to_llama_cpp() {
    conforms("gemma3-f32");
}

#[test]
fn phi3_fused_qkv_and_gate_up_conform_to_llama_cpp() {
    conforms("phi3-f32");
}

#[test]
fn every_weight_type_conforms_to_llama_cpp() {
    for name in [
        "llama-f16",
        "llama-bf16",
        "llama-q8_0",
        "llama-q5_0",
        "llama-q5_1",
        "llama-q4_k",
        "llama-q5_k",
        "llama-q6_k",
        "llama-f32-256",
    ] {
        conforms(name);
    }
}

#[test]
fn files_quantized_by_llama_quantize_conform_to_llama_cpp() {
    for name in ["llamacpp-Q4_K_M", "llamacpp-Q5_K_M", "llamacpp-Q6_K"] {
        conforms(name);
    }
}

#[test]
fn smollm2_quantized_by_llama_quantize_conforms_to_llama_cpp() {
    // Mostly Q5_0 and Q8_0 (SmolLM2's width, 576, is not whole K-quant
    // super-blocks, so llama-quantize falls back for most matrices), with
    // Q4_K and Q6_K where rows are 1536 wide.
    let fixture = read_fixture("smollm2.json");
    for (ftype, entry) in fixture["models"].as_object().unwrap() {
        let path = common::repo_root().join(entry["file"].as_str().unwrap());
        let Ok(meta) = std::fs::metadata(&path) else {
            eprintln!(
                "skipped: {} is missing (scripts/llama_cpp.sh, then scripts/llama_fixtures.py)",
                path.display()
            );
            continue;
        };
        assert_eq!(
            meta.len(),
            entry["bytes_len"].as_u64().unwrap(),
            "{} is not the file the fixture was made from",
            path.display()
        );
        let gguf = Arc::new(Gguf::open(&path).unwrap());
        let tokenizer = Tokenizer::from_gguf(&gguf).unwrap();
        let model = Arc::new(Model::load(gguf).unwrap());
        let name = format!("SmolLM2 {ftype}");
        conforms_to(&name, &model, &tokenizer, entry, SMOLLM2_TOLERANCE);
    }
}

/// The worst relative difference from llama.cpp's logits on prompt 1 of
/// model `name` run with its blueprint changed by `change`: a different
/// model, which the model's tolerance must tell apart (the canaries).
fn worst_when_changed(name: &str, change: impl FnOnce(&mut ModelConfig)) -> (f32, f32) {
    let (model, _) = load(name);
    let mut config = model.config.clone();
    change(&mut config);
    assert_ne!(config, model.config, "{name}: the change changed nothing");
    let entry = &fixture()["models"][name];
    let wrong = Arc::new(model.with_config(config));
    let prompt = &entry["prompts"][1];
    let expected = ids(&prompt["ids"]);
    let mut h = harness(&wrong, Isa::Scalar, expected.len());
    let mut worst = 0.0f32;
    for (pos, checked) in prompt["positions"].as_array().unwrap().iter().enumerate() {
        let logits = h.step(pos, &expected[pos..pos + 1]);
        let scale = logits.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for p in checked["top"].as_array().unwrap() {
            let (id, value) = (
                p[0].as_u64().unwrap() as usize,
                p[1].as_f64().unwrap() as f32,
            );
            worst = worst.max((logits[id] - value).abs() / scale);
        }
    }
    (worst, model_tolerance(&model))
}

#[test]
fn canary_qwen2_run_as_llama_breaks_the_f32_tolerance() {
    // The qwen2 model with llama's RoPE pairing.
    let (worst, tol) = worst_when_changed("qwen2-f32", |c| c.rope_style = RopeStyle::Adjacent);
    assert!(
        worst > tol,
        "a wrong RoPE pairing stayed within {tol}: {worst}"
    );
}

#[test]
fn canaries_each_gemma_option_left_out_breaks_the_tolerance() {
    type Change = fn(&mut ModelConfig);
    let cases: [(&str, &str, Change); 6] = [
        ("gemma2-f32", "no window", |c| c.sliding_window = None),
        ("gemma2-f32", "no attention cap", |c| {
            c.attention_softcap = None
        }),
        ("gemma2-f32", "no logit cap", |c| c.final_softcap = None),
        ("gemma-f32", "SiLU gate", |c| {
            c.activation = Activation::Silu
        }),
        ("gemma-f32", "no embedding scale", |c| {
            c.embedding_scale = 1.0
        }),
        ("gemma3-f32", "local layers on the global RoPE base", |c| {
            let global = c.rope_base;
            c.sliding_window.as_mut().unwrap().rope_base = global;
        }),
    ];
    for (name, what, change) in cases {
        let (worst, tol) = worst_when_changed(name, change);
        eprintln!("{name} with {what}: worst {worst:.2e}");
        assert!(
            worst > 10.0 * tol,
            "{name} with {what} stayed near {tol}: {worst}"
        );
    }
}

#[test]
fn a_file_with_a_tensor_the_blueprint_does_not_read_is_refused_by_name() {
    // A llama file carrying qwen2's biases: running it without them would be
    // another model, so it must not load.
    let qwen2 = Gguf::from_bytes(tiny_llama(&conformance_spec("qwen2-f32"))).unwrap();
    let mut writer = bulkhead_kernels::gguf::GgufWriter::new();
    for (key, value) in qwen2.metadata() {
        let key = key.replace("qwen2.", "llama.");
        let value = match key.as_str() {
            "general.architecture" => bulkhead_kernels::gguf::Value::String("llama".into()),
            _ => value.clone(),
        };
        writer.metadata(&key, value);
    }
    for info in qwen2.tensors() {
        writer.tensor(
            &info.name,
            &info.dims,
            info.ty,
            qwen2.tensor_bytes(info).to_vec(),
        );
    }
    let file = Arc::new(Gguf::from_bytes(writer.to_bytes()).unwrap());
    match Model::load(file) {
        Err(ModelError::UnknownTensor(name, "llama")) => {
            assert!(name.ends_with(".bias"), "{name}")
        }
        Err(other) => panic!("refused for another reason: {other}"),
        Ok(_) => panic!("a llama file with biases loaded"),
    }
}

/// The tiny llama file with `extra` metadata added (or replaced).
fn with_metadata(extra: &[(&str, bulkhead_kernels::gguf::Value)]) -> Arc<Gguf> {
    with_metadata_of(&TinySpec::default(), extra)
}

/// The file of `spec` with `extra` metadata added (or replaced).
fn with_metadata_of(spec: &TinySpec, extra: &[(&str, bulkhead_kernels::gguf::Value)]) -> Arc<Gguf> {
    let base = Gguf::from_bytes(tiny_llama(spec)).unwrap();
    let mut writer = bulkhead_kernels::gguf::GgufWriter::new();
    for (key, value) in base.metadata() {
        if !extra.iter().any(|(k, _)| k == key) {
            writer.metadata(key, value.clone());
        }
    }
    for (key, value) in extra {
        writer.metadata(key, value.clone());
    }
    for info in base.tensors() {
        writer.tensor(
            &info.name,
            &info.dims,
            info.ty,
            base.tensor_bytes(info).to_vec(),
        );
    }
    Arc::new(Gguf::from_bytes(writer.to_bytes()).unwrap())
}

#[test]
fn options_the_engine_does_not_run_are_refused_by_name() {
    use bulkhead_kernels::gguf::Value;
    let text = |s: &str| Value::String(s.to_string());
    let cases = [
        (vec![("general.architecture", text("gemma4"))], "gemma4"),
        (vec![("llama.rope.scaling.type", text("yarn"))], "yarn"),
        (vec![("llama.expert_count", Value::U32(8))], "expert_count"),
        (
            vec![("llama.attn_logit_softcapping", Value::F32(50.0))],
            "soft-capping",
        ),
        (
            vec![("llama.final_logit_softcapping", Value::F32(30.0))],
            "soft-capping",
        ),
        (vec![("llama.attention.scale", Value::F32(0.1))], "scale"),
        (
            vec![("llama.rope.scaling.factor", Value::F32(-2.0))],
            "positive",
        ),
    ];
    for (extra, named) in cases {
        let error = match Model::load(with_metadata(&extra)) {
            Err(error) => error.to_string(),
            Ok(_) => panic!("{extra:?} loaded"),
        };
        assert!(error.contains(named), "{extra:?}: {error}");
    }
    // Linear scaling without a type (llama.cpp's default) is run, not refused.
    let scaled = Model::load(with_metadata(&[(
        "llama.rope.scale_linear",
        Value::F32(2.0),
    )]))
    .unwrap();
    assert_eq!(scaled.config.rope_freq_scale, 0.5);
}

#[test]
fn local_layers_and_windows_are_read_as_llama_cpp_reads_them() {
    use bulkhead_kernels::gguf::Value;
    use bulkhead_kernels::model::Architecture;
    let of = |architecture, layers, extra: &[(&str, Value)]| {
        let spec = TinySpec {
            architecture,
            layers,
            ..TinySpec::default()
        };
        Model::load(with_metadata_of(&spec, extra)).map(|m| m.config)
    };
    // gemma2 without the keys: a window of 4096 on even layers, the global
    // RoPE base, soft caps 50 and 30.
    let c = of(Architecture::Gemma2, 4, &[]).unwrap();
    let window = c.sliding_window.clone().unwrap();
    assert_eq!(window.window, 4096);
    assert_eq!(window.local, [true, false, true, false]);
    assert_eq!(
        (window.rope_base, window.rope_freq_scale),
        (c.rope_base, 1.0)
    );
    assert_eq!(
        (c.attention_softcap, c.final_softcap),
        (Some(50.0), Some(30.0))
    );
    // gemma3: five local layers to one global, local RoPE base 10,000;
    // without a window, none; a pattern as one flag per layer.
    let c = of(
        Architecture::Gemma3,
        7,
        &[("gemma3.attention.sliding_window", Value::U32(512))],
    )
    .unwrap();
    let window = c.sliding_window.unwrap();
    assert_eq!(window.local, [true, true, true, true, true, false, true]);
    assert_eq!((window.window, window.rope_base), (512, 10_000.0));
    assert_eq!((c.attention_softcap, c.final_softcap), (None, None));
    assert!(of(Architecture::Gemma3, 2, &[])
        .unwrap()
        .sliding_window
        .is_none());
    let flags = Value::Array(vec![Value::Bool(false), Value::Bool(true)]);
    let c = of(
        Architecture::Gemma3,
        2,
        &[
            ("gemma3.attention.sliding_window", Value::U32(64)),
            ("gemma3.attention.sliding_window_pattern", flags),
            ("gemma3.rope.freq_base_swa", Value::F32(5_000.0)),
        ],
    )
    .unwrap();
    let window = c.sliding_window.unwrap();
    assert_eq!(
        (window.local.as_slice(), window.rope_base),
        (&[false, true][..], 5_000.0)
    );
    // phi3 declares a window llama.cpp does not apply; neither do we.
    let c = of(
        Architecture::Phi3,
        2,
        &[("phi3.attention.sliding_window", Value::U32(2047))],
    );
    assert!(c.unwrap().sliding_window.is_none());
    // Bad values are refused by name.
    let refused = |architecture, extra: &[(&str, Value)], named: &str| {
        let error = of(architecture, 2, extra).expect_err("refused").to_string();
        assert!(error.contains(named), "{extra:?}: {error}");
    };
    refused(
        Architecture::Gemma2,
        &[("gemma2.attention.sliding_window", Value::U32(0))],
        "sliding_window",
    );
    refused(
        Architecture::Gemma2,
        &[(
            "gemma2.attention.sliding_window_pattern",
            Value::Array(vec![Value::Bool(true)]),
        )],
        "one boolean per layer",
    );
    refused(
        Architecture::Gemma2,
        &[("gemma2.attn_logit_softcapping", Value::F32(-1.0))],
        "positive",
    );
    // Gemma 2 27B (46 layers) scales q·k by 1/sqrt(d / heads), not by the head width.
    let spec = TinySpec {
        architecture: Architecture::Gemma2,
        head_dim: Some(32),
        ..TinySpec::default()
    };
    let config = ModelConfig::from_gguf(&with_metadata_of(
        &spec,
        &[("gemma2.block_count", Value::U32(46))],
    ))
    .unwrap();
    assert_eq!(config.attention_scale, 1.0 / 4.0); // d / heads = 64 / 4 = 16
    let config = ModelConfig::from_gguf(&with_metadata_of(&spec, &[])).unwrap();
    assert_eq!(config.attention_scale, 1.0 / 32f32.sqrt());
}

#[test]
fn a_fused_qkv_matrix_is_the_same_model_as_three() {
    // The llama conformance model with Q, K and V written as one
    // `attn_qkv.weight` (rows Q, then K, then V) gives the same logits.
    let (model, _) = load("llama-f32");
    let mut writer = bulkhead_kernels::gguf::GgufWriter::new();
    for (key, value) in model.gguf.metadata() {
        writer.metadata(key, value.clone());
    }
    let gguf = &model.gguf;
    for info in gguf.tensors() {
        let name = &info.name;
        if name.ends_with("attn_k.weight") || name.ends_with("attn_v.weight") {
            continue;
        }
        if let Some(block) = name.strip_suffix("attn_q.weight") {
            let part = |p: &str| gguf.tensor(&format!("{block}{p}.weight")).unwrap();
            let (q, k, v) = (part("attn_q"), part("attn_k"), part("attn_v"));
            let bytes = [q, k, v]
                .iter()
                .flat_map(|t| gguf.tensor_bytes(t).to_vec())
                .collect();
            let rows = q.dims[1] + k.dims[1] + v.dims[1];
            writer.tensor(
                &format!("{block}attn_qkv.weight"),
                &[q.dims[0], rows],
                q.ty,
                bytes,
            );
            continue;
        }
        writer.tensor(name, &info.dims, info.ty, gguf.tensor_bytes(info).to_vec());
    }
    let fused =
        Arc::new(Model::load(Arc::new(Gguf::from_bytes(writer.to_bytes()).unwrap())).unwrap());
    assert!(fused.layers[0].wq.info.name.contains("attn_qkv"));
    let prompt = [1u32, 2, 3, 4, 5];
    let mut a = harness(&model, Isa::Scalar, prompt.len());
    let mut b = harness(&fused, Isa::Scalar, prompt.len());
    assert_eq!(a.step(0, &prompt), b.step(0, &prompt));
}
