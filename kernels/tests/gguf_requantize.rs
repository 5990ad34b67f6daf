//! Re-quantization to Q8_0 (`gguf::requantize_q8_0`) on generated files: which
//! tensors convert and which are copied, how close the converted weights stay,
//! determinism, typed errors on weights Q8_0 cannot carry, and a converted
//! model running on the CPU backend. The real model is covered by
//! `model_golden.rs` (against an independent reference) and `tests/tests/cli.rs`.

use std::io::{self, Write};
use std::sync::Arc;

use bulkhead_kernels::backend::cpu::{CpuBackend, CpuOptions};
use bulkhead_kernels::backend::{Backend, SeqStep};
use bulkhead_kernels::gguf::{
    requantize_q8_0, Gguf, GgufWriter, RequantizeError, TensorInfo, Value, FILE_TYPE_KEY,
    FILE_TYPE_MOSTLY_Q8_0,
};
use bulkhead_kernels::kv::{KvType, OwnerTag, PartitionConfig, Pool, PoolOptions, SeqId};
use bulkhead_kernels::model::Model;
use bulkhead_kernels::quant::{dequantize_row, quantize_row, GgmlType, Isa};
use bulkhead_kernels::testing::{tiny_llama, TinySpec};
use half::f16;

const OWNER: OwnerTag = OwnerTag(1);
const PAGE_TOKENS: u32 = 4;
const PROMPT: [u32; 9] = [104, 101, 108, 108, 111, 32, 119, 261, 262];
/// Largest logit difference from the f32 model, as a fraction of the f32
/// logits' spread, that still counts as "close". Measured on the tiny model:
/// Q8_0 1.4% (weight rounding plus the 8-bit activations the Q8_0 kernels use),
/// Q4_0 18%; the bound sits between them with a margin of ~3.5x either way.
const CLOSE_FRACTION: f32 = 0.05;

fn requantized(bytes: &[u8]) -> Vec<u8> {
    let gguf = Gguf::from_bytes(bytes.to_vec()).expect("input parses");
    let mut out = Vec::new();
    requantize_q8_0(&gguf, &mut out).expect("requantizes");
    out
}

fn parse(bytes: Vec<u8>) -> Gguf {
    Gguf::from_bytes(bytes).expect("output parses")
}

fn dequantized(gguf: &Gguf, info: &TensorInfo) -> Vec<f32> {
    let mut out = vec![0.0; info.elements_count() as usize];
    dequantize_row(info.ty, gguf.tensor_bytes(info), &mut out).unwrap();
    out
}

/// Every tensor type the reader supports, as a 2-D matrix the tiny model can use.
fn spec_with(matrix_type: GgmlType, embedding_type: GgmlType) -> TinySpec {
    let k_quant = matrix_type.block_len() == 256 || embedding_type.block_len() == 256;
    TinySpec {
        embedding_len: if k_quant { 256 } else { 64 },
        ffn_len: if k_quant { 512 } else { 96 },
        matrix_type,
        embedding_type,
        separate_output: true,
        ..TinySpec::default()
    }
}

#[test]
fn converts_every_matrix_type_to_q8_0_within_half_a_step_and_copies_the_rest() {
    let cases = [
        (GgmlType::Q4_1, GgmlType::Q8_0),
        (GgmlType::Q4_0, GgmlType::F16),
        (GgmlType::Q4_K, GgmlType::Q6_K),
        (GgmlType::F16, GgmlType::F32),
        (GgmlType::F32, GgmlType::Q4_1),
    ];
    for (matrix_type, embedding_type) in cases {
        let source_bytes = tiny_llama(&spec_with(matrix_type, embedding_type));
        let source = parse(source_bytes.clone());
        let out = parse(requantized(&source_bytes));
        assert_eq!(out.tensors().len(), source.tensors().len());
        for (a, b) in source.tensors().iter().zip(out.tensors()) {
            assert_eq!(
                (&a.name, &a.dims),
                (&b.name, &b.dims),
                "order and shape kept"
            );
            if a.dims.len() == 1 || a.ty == GgmlType::Q8_0 {
                assert_eq!(b.ty, a.ty, "{} keeps its type", a.name);
                assert_eq!(out.tensor_bytes(b), source.tensor_bytes(a), "{}", a.name);
                continue;
            }
            assert_eq!(b.ty, GgmlType::Q8_0, "{} ({matrix_type:?})", a.name);
            let (before, after) = (dequantized(&source, a), dequantized(&out, b));
            for (block, (x, y)) in before.chunks(32).zip(after.chunks(32)).enumerate() {
                // Q8_0 rounds to the nearest of 127 steps of amax; the f16 scale
                // adds a relative error of at most 2^-11 of amax.
                let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let bound = amax / 127.0 * 0.5 + amax * (2f32.powi(-11) + 1e-6) + 1e-7;
                for (v, w) in x.iter().zip(y) {
                    assert!(
                        (v - w).abs() <= bound,
                        "{} {matrix_type:?} block {block}: {v} -> {w}, bound {bound}",
                        a.name
                    );
                }
            }
        }
    }
}

#[test]
fn copies_metadata_in_order_and_sets_the_file_type() {
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", Value::String("llama".into()))
        .metadata(FILE_TYPE_KEY, Value::U32(3))
        .metadata("general.alignment", Value::U32(64))
        .metadata("names", Value::Array(vec![Value::String("a".into())]))
        .tensor("w", &[32, 2], GgmlType::F32, vec![0u8; 256]);
    let out = parse(requantized(&w.to_bytes()));
    let keys: Vec<&str> = out.metadata().iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys,
        [
            "general.architecture",
            FILE_TYPE_KEY,
            "general.alignment",
            "names"
        ]
    );
    assert_eq!(
        out.u64(FILE_TYPE_KEY).unwrap(),
        u64::from(FILE_TYPE_MOSTLY_Q8_0)
    );
    assert_eq!(
        out.get("names"),
        Some(&Value::Array(vec![Value::String("a".into())]))
    );
    assert_eq!(out.tensor("w").unwrap().ty, GgmlType::Q8_0);

    // A file without a file type gets one, after everything else.
    let mut w = GgufWriter::new();
    w.metadata("a", Value::Bool(true))
        .tensor("v", &[4], GgmlType::F32, vec![0u8; 16]);
    let out = parse(requantized(&w.to_bytes()));
    assert_eq!(out.metadata().last().unwrap().0, FILE_TYPE_KEY);
    assert_eq!(out.metadata().len(), 2);
}

#[test]
fn keeps_one_dimensional_tensors_and_rows_that_are_not_whole_q8_0_blocks() {
    let f16_row = |n: usize| -> Vec<u8> {
        (0..n)
            .flat_map(|i| f16::from_f32(i as f32 * 0.25).to_bits().to_le_bytes())
            .collect()
    };
    let mut w = GgufWriter::new();
    w.tensor("odd_rows", &[48, 2], GgmlType::F16, f16_row(96))
        .tensor("norm", &[64], GgmlType::F32, vec![0x3F; 256])
        .tensor("f16_vector", &[64], GgmlType::F16, f16_row(64))
        .tensor("matrix", &[64, 3, 2], GgmlType::F16, f16_row(384));
    let source = parse(w.to_bytes());
    let out_bytes = {
        let mut out = Vec::new();
        let report = requantize_q8_0(&source, &mut out).unwrap();
        assert_eq!(report.converted, [(GgmlType::F16, 1)]);
        assert_eq!(report.kept, [(GgmlType::F16, 2), (GgmlType::F32, 1)]);
        assert_eq!(report.converted_count() + report.kept_count(), 4);
        assert_eq!(
            report.tensor_bytes_in,
            source.tensors().iter().map(|t| t.bytes_len).sum::<u64>()
        );
        out
    };
    let out = parse(out_bytes);
    for name in ["odd_rows", "norm", "f16_vector"] {
        let (a, b) = (source.tensor(name).unwrap(), out.tensor(name).unwrap());
        assert_eq!(b.ty, a.ty, "{name}");
        assert_eq!(out.tensor_bytes(b), source.tensor_bytes(a), "{name}");
    }
    let matrix = out.tensor("matrix").unwrap();
    assert_eq!(
        (matrix.ty, &matrix.dims[..]),
        (GgmlType::Q8_0, &[64, 3, 2][..])
    );
}

#[test]
fn output_is_deterministic_and_a_fixed_point() {
    let source = tiny_llama(&spec_with(GgmlType::Q4_1, GgmlType::F16));
    let once = requantized(&source);
    assert_eq!(once, requantized(&source), "same input, same bytes");
    // Q8_0 tensors are copied and the file type is already Q8_0: nothing changes.
    assert_eq!(requantized(&once), once);
}

#[test]
fn refuses_weights_q8_0_cannot_carry_with_the_tensor_and_row() {
    let f32_bytes =
        |values: &[f32]| -> Vec<u8> { values.iter().flat_map(|v| v.to_le_bytes()).collect() };
    for (bad, row) in [(f32::NAN, 1), (f32::INFINITY, 0), (-1e12, 1)] {
        let mut values = vec![0.5f32; 64];
        values[32 * row + 7] = bad;
        let mut w = GgufWriter::new();
        w.tensor("fine", &[32, 2], GgmlType::F32, f32_bytes(&[1.0; 64]))
            .tensor("w", &[32, 2], GgmlType::F32, f32_bytes(&values));
        let gguf = parse(w.to_bytes());
        let err = requantize_q8_0(&gguf, &mut Vec::new()).unwrap_err();
        match &err {
            RequantizeError::Unrepresentable { name, row: r, .. } => {
                assert_eq!((name.as_str(), *r), ("w", row as u64), "{err}");
            }
            other => panic!("expected Unrepresentable, got {other}"),
        }
        assert!(err.to_string().contains("\"w\" row"), "{err}");
    }
    // An F16 infinity in a source file is refused the same way.
    let mut inf = vec![0u8; 64];
    inf[..2].copy_from_slice(&f16::INFINITY.to_bits().to_le_bytes());
    let mut w = GgufWriter::new();
    w.tensor("h", &[32, 1], GgmlType::F16, inf);
    let err = requantize_q8_0(&parse(w.to_bytes()), &mut Vec::new()).unwrap_err();
    assert!(
        matches!(err, RequantizeError::Unrepresentable { .. }),
        "{err}"
    );
}

/// A sink that accepts `room` bytes and then fails, as a full disk does.
struct FullDisk {
    room: usize,
}

impl Write for FullDisk {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.room == 0 {
            return Err(io::Error::new(io::ErrorKind::StorageFull, "disk full"));
        }
        let n = buf.len().min(self.room);
        self.room -= n;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_failing_sink_is_an_io_error_not_a_panic() {
    let source = parse(tiny_llama(&TinySpec::default()));
    for room in [0, 100, 20_000] {
        let err = requantize_q8_0(&source, FullDisk { room }).unwrap_err();
        assert!(matches!(err, RequantizeError::Io(_)), "room {room}: {err}");
    }
}

/// Logits of the last prompt token on the scalar path.
fn last_logits(model: &Arc<Model>) -> Vec<f32> {
    let pages = (PROMPT.len() as u32).div_ceil(PAGE_TOKENS);
    let geometry = model
        .config
        .pool_geometry(pages, PAGE_TOKENS, KvType::default());
    let partition = PartitionConfig {
        owner: OWNER,
        pages_reserved: pages,
        pages_max: pages,
    };
    let mut pool = Pool::new(geometry, &[partition], PoolOptions::default()).unwrap();
    let mut reservation = pool.reserve(OWNER, pages).unwrap();
    let mut table = pool.page_table(&reservation, SeqId(1));
    for _ in 0..pages {
        pool.acquire(&mut reservation, &mut table).unwrap();
    }
    pool.release_reservation(reservation);
    let options = CpuOptions {
        threads_count: 1,
        step_tokens_max: 16,
        step_seqs_max: 1,
        isa: Some(Isa::Scalar),
    };
    let mut backend = CpuBackend::new(Arc::clone(model), options);
    let step = SeqStep::new(&table, 0, &PROMPT);
    backend.step(&[step], &mut pool).unwrap().row(0).to_vec()
}

/// The largest |reference - other| logit, and the spread (max - min) of the
/// reference's logits.
fn logit_difference(reference: &Arc<Model>, other: &Arc<Model>) -> (f32, f32) {
    let (a, b) = (last_logits(reference), last_logits(other));
    assert!(b.iter().all(|v| v.is_finite()), "finite logits");
    let max = a.iter().copied().fold(f32::MIN, f32::max);
    let min = a.iter().copied().fold(f32::MAX, f32::min);
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    (worst, max - min)
}

fn load(bytes: Vec<u8>) -> Arc<Model> {
    Arc::new(Model::load(Arc::new(parse(bytes))).expect("model loads"))
}

/// The converted model runs on the CPU backend, with Q8_0 in every matrix, and
/// its logits stay close to those of an f32 copy of the same weights: Q8_0
/// rounding is small next to the logits' spread.
#[test]
fn a_requantized_model_runs_on_the_cpu_backend_close_to_the_source() {
    let spec = spec_with(GgmlType::F32, GgmlType::F32);
    let source_bytes = tiny_llama(&spec);
    let q8 = load(requantized(&source_bytes));
    assert_eq!(q8.token_embd.ty(), GgmlType::Q8_0);
    assert!(q8
        .layers
        .iter()
        .all(|l| l.wq.ty() == GgmlType::Q8_0 && l.w_down.ty() == GgmlType::Q8_0));
    let (worst, spread) = logit_difference(&load(source_bytes), &q8);
    eprintln!("Q8_0 vs F32 tiny model: largest logit difference {worst:.5}, spread {spread:.3}");
    assert!(
        worst <= CLOSE_FRACTION * spread,
        "difference {worst} vs spread {spread}"
    );
}

/// The canary for the test above: the same comparison catches a model whose
/// weights were quantized to a format an order of magnitude coarser.
#[test]
fn canary_a_coarser_model_breaks_the_closeness_bound() {
    let spec = spec_with(GgmlType::F32, GgmlType::F32);
    let source_bytes = tiny_llama(&spec);
    let coarse = {
        let source = parse(source_bytes.clone());
        let mut w = GgufWriter::new();
        for (key, value) in source.metadata() {
            w.metadata(key, value.clone());
        }
        for info in source.tensors() {
            let values = dequantized(&source, info);
            let ty = if info.dims.len() == 2 {
                GgmlType::Q4_0
            } else {
                GgmlType::F32
            };
            let mut bytes = vec![0u8; ty.bytes_for(values.len() as u64).unwrap() as usize];
            quantize_row(ty, &values, &mut bytes).unwrap();
            w.tensor(&info.name, &info.dims, ty, bytes);
        }
        load(w.to_bytes())
    };
    let (worst, spread) = logit_difference(&load(source_bytes), &coarse);
    eprintln!("Q4_0 vs F32 tiny model: largest logit difference {worst:.5}, spread {spread:.3}");
    assert!(
        worst > CLOSE_FRACTION * spread,
        "difference {worst} vs spread {spread}"
    );
}
