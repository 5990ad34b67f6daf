//! Bodies of the fuzz targets for this crate's parsers of outside bytes
//! (issue 21, item 9): the GGUF reader and the tokenizer.
//!
//! Each `pub fn` takes arbitrary bytes and must return normally for every
//! input: a panic is a bug. They live here rather than in `fuzz/` so that
//!
//! 1. each `fuzz/fuzz_targets/<target>.rs` is a three-line libFuzzer wrapper;
//! 2. `kernels/tests/fuzz_corpora.rs` replays every committed corpus and
//!    regression input through the same functions in `cargo test`, with no
//!    libFuzzer and no nightly compiler.
//!
//! Besides not panicking, each target asserts the negative space where it is
//! cheap: a parsed file's tensor index stays inside the file, what it decodes
//! to stays inside the memory budget, a parsed file written back parses to the
//! same thing; encoded ids are in the vocabulary, user text never becomes a
//! control token, decoding inverts encoding.

use std::sync::{Arc, OnceLock};

use crate::gguf::{decoded_bytes_max, Gguf, GgufError, GgufWriter, TensorInfo, Value};
use crate::model::{Model, ModelConfig};
use crate::quant::GgmlType;
use crate::testing::{tiny_llama, TinySpec};
use crate::tokenizer::{DecodeOptions, EncodeOptions, TokenType, Tokenizer, TokenizerError};

/// Parses arbitrary bytes as a GGUF file and, when they parse, checks the
/// index against the bytes, rewrites the file and loads what a model load
/// would (hyper-parameters, tokenizer, weights).
pub fn gguf(data: &[u8]) {
    let Ok(file) = Gguf::from_bytes(data.to_vec()) else {
        return;
    };
    check_index(&file, data);
    check_decoded_bytes(&file, data.len());
    check_rewrite(&file);
    load_like_a_model(file);
}

/// Every tensor lies inside the file, aligned, with the size its shape needs,
/// and no two overlap; every name and key is unique and found by lookup.
fn check_index(file: &Gguf, data: &[u8]) {
    let alignment = file
        .get("general.alignment")
        .and_then(Value::as_u64)
        .unwrap_or(crate::gguf::ALIGNMENT_DEFAULT);
    let data_start = file.data_start();
    assert!(
        data_start.is_multiple_of(alignment),
        "data section misaligned"
    );
    let mut ranges = Vec::with_capacity(file.tensors().len());
    for tensor in file.tensors() {
        assert!(
            !tensor.dims.is_empty() && tensor.dims.len() <= 4,
            "{tensor:?}"
        );
        let elements = tensor
            .dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .expect("the reader refuses overflowing shapes");
        assert!(elements > 0, "a zero dimension was accepted: {tensor:?}");
        assert_eq!(tensor.ty.bytes_for(elements), Some(tensor.bytes_len));
        assert!(tensor.offset % alignment == 0, "{tensor:?}");
        let start = data_start + tensor.offset;
        let end = start + tensor.bytes_len;
        assert!(end <= data.len() as u64, "{tensor:?} leaves the file");
        assert_eq!(
            file.tensor_bytes(tensor),
            &data[start as usize..end as usize]
        );
        let found = file.tensor(&tensor.name).expect("every tensor is indexed");
        assert_eq!(found.offset, tensor.offset, "two tensors share a name");
        ranges.push((start, end));
    }
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        assert!(pair[0].1 <= pair[1].0, "tensors overlap: {pair:?}");
    }
    for (index, (key, value)) in file.metadata().iter().enumerate() {
        assert!(
            std::ptr::eq(file.get(key).expect("every key is indexed"), value),
            "key {index} {key:?} is not unique"
        );
    }
}

/// What the parse holds in memory is within the budget the reader promises
/// (counted here independently of the reader's own charges: sizes only, no
/// allocator rounding, so this is a lower bound of what the reader charged).
fn check_decoded_bytes(file: &Gguf, file_len: usize) {
    fn value_bytes(value: &Value) -> u64 {
        match value {
            Value::String(s) => s.len() as u64,
            Value::Array(items) => items
                .iter()
                .map(|item| std::mem::size_of::<Value>() as u64 + value_bytes(item))
                .sum(),
            _ => 0,
        }
    }
    let metadata: u64 = file
        .metadata()
        .iter()
        .map(|(key, value)| {
            (std::mem::size_of::<(String, Value)>() + 2 * key.len()) as u64 + value_bytes(value)
        })
        .sum();
    let tensors: u64 = file
        .tensors()
        .iter()
        .map(|t| (std::mem::size_of::<TensorInfo>() + 2 * t.name.len() + 8 * t.dims.len()) as u64)
        .sum();
    let budget = decoded_bytes_max(file_len);
    assert!(
        metadata + tensors <= budget,
        "a {file_len}-byte file decoded to {} bytes, over its budget of {budget}",
        metadata + tensors
    );
}

/// Written back by the crate's own writer, the file parses to the same
/// metadata, tensor headers and tensor bytes.
fn check_rewrite(file: &Gguf) {
    let mut writer = GgufWriter::new();
    for (key, value) in file.metadata() {
        writer.metadata(key, value.clone());
    }
    for tensor in file.tensors() {
        let bytes = file.tensor_bytes(tensor).to_vec();
        writer.tensor(&tensor.name, &tensor.dims, tensor.ty, bytes);
    }
    let again = match Gguf::from_bytes(writer.to_bytes()) {
        Ok(again) => again,
        // The rewrite drops padding and any bytes no tensor uses, so a file
        // whose budget those bytes paid for may no longer afford its header.
        Err(GgufError::Absurd {
            what: "decoded header bytes",
            ..
        }) => return,
        Err(e) => panic!("a parsed file, written back, does not parse: {e}"),
    };
    // Debug compares NaN payloads as equal, as they are equal here.
    assert_eq!(
        format!("{:?}", file.metadata()),
        format!("{:?}", again.metadata())
    );
    assert_eq!(file.tensors().len(), again.tensors().len());
    for (a, b) in file.tensors().iter().zip(again.tensors()) {
        assert_eq!((&a.name, &a.dims, a.ty), (&b.name, &b.dims, b.ty));
        assert_eq!(file.tensor_bytes(a), again.tensor_bytes(b));
    }
}

/// What loading a model does with a parsed file: hyper-parameters, the
/// tokenizer, the weights; each may refuse the file but none may panic.
fn load_like_a_model(file: Gguf) {
    let config = ModelConfig::from_gguf(&file);
    let tokenizer = Tokenizer::from_gguf(&file).ok();
    if let Some(tokenizer) = &tokenizer {
        for text in ["Hello, world! <|im_end|> 123", " \u{2581}é\n\t"] {
            for parse_special in [false, true] {
                let options = EncodeOptions {
                    add_bos: false,
                    parse_special,
                };
                if let Ok(ids) = tokenizer.encode(text, options) {
                    assert!(ids.iter().all(|&id| (id as usize) < tokenizer.vocab_len()));
                    let _ = tokenizer.decode(&ids, DecodeOptions::default());
                }
            }
        }
    }
    if config.is_err() {
        return;
    }
    let Ok(model) = Model::load(Arc::new(file)) else {
        return;
    };
    let mut row = vec![0.0; model.config.embedding_len];
    model.embed(0, &mut row);
    model.embed((model.config.vocab_len - 1) as u32, &mut row);
    if let Some(tokenizer) = &tokenizer {
        let _ = model.check_tokenizer(tokenizer);
    }
}

/// The fuzzed tokenizers, built once per process from GGUF files this crate
/// writes itself: byte-level BPE (a tiny llama) and SentencePiece.
fn tokenizers() -> &'static [Tokenizer; 2] {
    static TOKENIZERS: OnceLock<[Tokenizer; 2]> = OnceLock::new();
    TOKENIZERS.get_or_init(|| {
        let load = |bytes: Vec<u8>| {
            let file = Gguf::from_bytes(bytes).expect("the crate's own file parses");
            Tokenizer::from_gguf(&file).expect("the crate's own vocabulary loads")
        };
        [load(tiny_bpe_file()), load(tiny_spm_file())]
    })
}

/// A tiny llama with a byte-level BPE vocabulary, small enough to be a seed
/// of the GGUF corpus too.
pub fn tiny_bpe_file() -> Vec<u8> {
    tiny_llama(&TinySpec {
        layers: 1,
        embedding_len: 32,
        heads: 2,
        kv_heads: 1,
        ffn_len: 32,
        context_len: 64,
        ..TinySpec::default()
    })
}

/// A SentencePiece (`llama`) vocabulary with byte fallback, an unknown
/// token, controls and one user-defined token; no tensors.
pub fn tiny_spm_file() -> Vec<u8> {
    let mut tokens = vec!["<unk>".to_owned(), "<s>".to_owned(), "</s>".to_owned()];
    let mut types = vec![2, 3, 3];
    let mut scores = vec![0.0f32; 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    let pieces = [
        ("\u{2581}", -1.0),
        ("h", -10.0),
        ("e", -10.0),
        ("l", -10.0),
        ("o", -10.0),
        ("w", -10.0),
        ("r", -10.0),
        ("d", -10.0),
        ("ll", -1.0),
        ("he", -2.0),
        ("hell", -3.0),
        ("hello", -0.5),
        ("\u{2581}h", -5.0),
        ("\u{2581}w", -1.5),
        ("or", -2.5),
        ("\u{2581}wor", -1.8),
        ("ld", -2.2),
        ("é", -4.0),
        ("<s", -1.0),
    ];
    for (text, score) in pieces {
        tokens.push(text.to_owned());
        types.push(1);
        scores.push(score);
    }
    tokens.push("<tool>".to_owned());
    types.push(4);
    scores.push(0.0);
    let strings = |v: Vec<String>| Value::Array(v.into_iter().map(Value::String).collect());
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", Value::String("llama".into()))
        .metadata("tokenizer.ggml.model", Value::String("llama".into()))
        .metadata("tokenizer.ggml.tokens", strings(tokens))
        .metadata(
            "tokenizer.ggml.token_type",
            Value::Array(types.into_iter().map(Value::I32).collect()),
        )
        .metadata(
            "tokenizer.ggml.scores",
            Value::Array(scores.into_iter().map(Value::F32).collect()),
        )
        .metadata("tokenizer.ggml.unknown_token_id", Value::U32(0))
        .metadata("tokenizer.ggml.bos_token_id", Value::U32(1))
        .metadata("tokenizer.ggml.eos_token_id", Value::U32(2))
        .metadata("tokenizer.ggml.add_space_prefix", Value::Bool(true));
    w.to_bytes()
}

/// The flags byte of a tokenizer input.
///
/// ```text
/// bit 0  tokenizer: 0 byte-level BPE, 1 SentencePiece
/// bit 1  what follows: 0 text to encode, 1 token ids to decode (u16 LE each)
/// bit 2  parse_special (encode) / skip_special (decode)
/// bit 3  add_bos (encode)
/// ```
const SPM: u8 = 1;
const IDS: u8 = 1 << 1;
const SPECIAL: u8 = 1 << 2;
const BOS: u8 = 1 << 3;

/// Encodes arbitrary text or decodes arbitrary ids with a tiny tokenizer
/// (the first byte chooses which, and the options; see `SPM`).
pub fn tokenizer(data: &[u8]) {
    let Some((&flags, payload)) = data.split_first() else {
        return;
    };
    let spm = flags & SPM != 0;
    let tokenizer = &tokenizers()[usize::from(spm)];
    if flags & IDS != 0 {
        decode_ids(tokenizer, spm, flags, payload);
    } else {
        encode_text(tokenizer, spm, flags, &String::from_utf8_lossy(payload));
    }
}

fn encode_text(tokenizer: &Tokenizer, spm: bool, flags: u8, text: &str) {
    let options = EncodeOptions {
        add_bos: flags & BOS != 0,
        parse_special: flags & SPECIAL != 0,
    };
    let ids = tokenizer
        .encode(text, options)
        .unwrap_or_else(|e| panic!("encoding {text:?} failed: {e}"));
    let vocab_len = tokenizer.vocab_len();
    assert!(ids.iter().all(|&id| (id as usize) < vocab_len), "{ids:?}");
    let text_ids = if options.add_bos {
        assert_eq!(ids.first().copied(), tokenizer.bos());
        &ids[1..]
    } else {
        &ids[..]
    };
    if !options.parse_special {
        // User text never becomes a control token. (User-defined tokens are
        // text to both merge algorithms: a vocabulary's merges may build one.)
        for &id in text_ids {
            let ty = tokenizer.token_type(id).expect("checked above");
            assert!(
                ty != TokenType::Control,
                "{text:?} encoded to control token {id}"
            );
        }
        // The lower bound the server uses to refuse a prompt by its size alone.
        let per_token = tokenizer.text_bytes_per_token_max();
        assert!(
            text_ids.len() >= text.len().div_ceil(per_token),
            "{text:?}: {} tokens, fewer than {} bytes / {per_token}",
            text_ids.len(),
            text.len()
        );
        check_round_trip(tokenizer, spm, text, text_ids);
    }
    // `encode_into` stops exactly at its budget, and agrees with `encode`.
    let mut out = Vec::new();
    assert_eq!(
        tokenizer.encode_into(text, options, ids.len(), &mut out),
        Ok(())
    );
    assert_eq!(out, ids);
    if let Some(budget) = ids.len().checked_sub(1) {
        let mut out = Vec::new();
        assert_eq!(
            tokenizer.encode_into(text, options, budget, &mut out),
            Err(TokenizerError::TooManyTokens { max: budget })
        );
    }
}

/// Decoding inverts encoding. Byte-level BPE is lossless; SentencePiece
/// spells a space as U+2581, so text that contains U+2581 itself does not
/// come back (it comes back as spaces).
fn check_round_trip(tokenizer: &Tokenizer, spm: bool, text: &str, ids: &[u32]) {
    if spm && text.contains('\u{2581}') {
        return;
    }
    let decoded = tokenizer
        .decode(ids, DecodeOptions::default())
        .expect("encoded ids decode");
    assert_eq!(decoded, text, "decode(encode(text)) differs: {ids:?}");
}

fn decode_ids(tokenizer: &Tokenizer, spm: bool, flags: u8, payload: &[u8]) {
    let options = DecodeOptions {
        skip_special: flags & SPECIAL != 0,
    };
    // Mostly valid ids, a few past the end of the vocabulary.
    let span = tokenizer.vocab_len() as u32 + 4;
    let ids: Vec<u32> = payload
        .chunks_exact(2)
        .map(|pair| u32::from(u16::from_le_bytes([pair[0], pair[1]])) % span)
        .collect();
    let decoded = tokenizer.decode(&ids, options);
    let first_unknown = ids
        .iter()
        .copied()
        .find(|&id| id as usize >= tokenizer.vocab_len());
    match (first_unknown, decoded) {
        (Some(id), Err(TokenizerError::UnknownTokenId { id: bad, .. })) => assert_eq!(id, bad),
        (None, Ok(text)) => assert_eq!(text, decode_model(tokenizer, spm, &ids, options)),
        (unknown, result) => panic!("ids {ids:?} (unknown: {unknown:?}) decoded to {result:?}"),
    }
}

/// Decoding as documented, from the public per-token pieces: rendered bytes
/// joined (specials left out when asked, SentencePiece's leading space
/// dropped: the SentencePiece vocabulary here adds one), invalid UTF-8
/// replaced as `String::from_utf8_lossy` does.
fn decode_model(tokenizer: &Tokenizer, spm: bool, ids: &[u32], options: DecodeOptions) -> String {
    let mut bytes = Vec::new();
    let mut first = true;
    for &id in ids {
        let skip = options.skip_special
            && matches!(
                tokenizer.token_type(id),
                Ok(TokenType::Control | TokenType::Unknown | TokenType::Unused)
            );
        let mut piece = if skip {
            &[][..]
        } else {
            tokenizer
                .token_to_piece_bytes(id)
                .expect("ids are valid here")
        };
        if spm && first && !piece.is_empty() {
            first = false;
            piece = piece.strip_prefix(b" ").unwrap_or(piece);
        }
        bytes.extend_from_slice(piece);
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Seeds of the GGUF corpus: the tiny models this crate writes.
pub fn gguf_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let mut small = GgufWriter::new();
    small
        .metadata("general.alignment", Value::U32(64))
        .metadata("names", Value::Array(vec![Value::String("a".into())]))
        .metadata(
            "nested",
            Value::Array(vec![
                Value::Array(vec![Value::U8(1), Value::U8(2)]),
                Value::Array(vec![Value::I64(-2)]),
            ]),
        )
        .metadata("pi", Value::F64(3.25))
        .tensor("a", &[4], GgmlType::F32, vec![0; 16])
        .tensor("b", &[32, 2], GgmlType::Q8_0, vec![7; 68]);
    vec![
        ("seed-tiny-llama-bpe.gguf", tiny_bpe_file()),
        ("seed-spm-vocab.gguf", tiny_spm_file()),
        ("seed-small-every-type.gguf", small.to_bytes()),
    ]
}

/// Seeds of the tokenizer corpus: a flags byte, then text or ids.
pub fn tokenizer_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let text = |flags: u8, text: &str| [&[flags][..], text.as_bytes()].concat();
    let ids = |flags: u8, ids: &[u16]| {
        let mut out = vec![flags | IDS];
        out.extend(ids.iter().flat_map(|id| id.to_le_bytes()));
        out
    };
    vec![
        (
            "seed-bpe-text",
            text(0, "Hello world, hello! 12345 \u{1F600}"),
        ),
        (
            "seed-bpe-special",
            text(SPECIAL | BOS, "<|im_start|>user\nhi<|im_end|>"),
        ),
        ("seed-spm-text", text(SPM, " hello world é \u{2581}")),
        (
            "seed-spm-special",
            text(SPM | SPECIAL, "<s>hello<tool></s>"),
        ),
        ("seed-bpe-ids", ids(0, &[104, 101, 264, 0, 255, 262, 263])),
        (
            "seed-spm-ids-skip",
            ids(SPM | SPECIAL, &[1, 3 + 0xE2, 3 + 0x82, 3 + 0xAC, 273, 2, 0]),
        ),
    ]
}

/// The fuzz workspace of this repository (`fuzz/`), next to this crate.
pub fn fuzz_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

/// Runs every file of `fuzz/corpus/<target>/` and `fuzz/regressions/<target>/`
/// through `body`, except the regressions named in `skipped` (inputs of
/// known bugs whose fix is pending: each has an `#[ignore]`d test of its
/// own), and returns how many ran. A missing or empty corpus fails loudly:
/// a replay of nothing must not pass. Every input runs even after one
/// fails, and the failures are listed by path.
pub fn replay(target: &str, body: fn(&[u8]), skipped: &[&str]) -> usize {
    let corpus = fuzz_dir().join("corpus").join(target);
    let mut paths = files(&corpus);
    assert!(
        !paths.is_empty(),
        "no corpus for fuzz target {target}: {} is missing or empty",
        corpus.display()
    );
    let regressions = fuzz_dir().join("regressions").join(target);
    if regressions.exists() {
        paths.extend(
            files(&regressions)
                .into_iter()
                .filter(|p| !skipped.iter().any(|s| p.ends_with(s))),
        );
    }
    let failed: Vec<String> = paths
        .iter()
        .filter(|path| !replays_cleanly(path, body))
        .map(|path| path.display().to_string())
        .collect();
    assert!(
        failed.is_empty(),
        "fuzz target {target} panicked on {} of {} inputs: {failed:#?}",
        failed.len(),
        paths.len()
    );
    paths.len()
}

/// Runs one input file through `body`; false if it panicked. A file gone
/// since the folder was listed (a fuzzer running meanwhile minimizes its
/// corpus in place) counts as clean.
pub fn replays_cleanly(path: &std::path::Path, body: fn(&[u8])) -> bool {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return true,
        Err(e) => panic!("cannot read {}: {e}", path.display()),
    };
    std::panic::catch_unwind(|| body(&bytes)).is_ok()
}

/// The files of `dir`, sorted (none if it does not exist).
fn files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut paths: Vec<_> = entries
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|path| path.is_file())
        .collect();
    paths.sort();
    paths
}

/// Writes `seeds` into `fuzz/corpus/<target>/` (the first seeding of a
/// corpus; later runs of the fuzzer add to it and `cargo fuzz cmin` trims it).
pub fn write_seeds(target: &str, seeds: &[(&str, Vec<u8>)]) -> std::io::Result<()> {
    let dir = fuzz_dir().join("corpus").join(target);
    std::fs::create_dir_all(&dir)?;
    for (name, bytes) in seeds {
        std::fs::write(dir.join(name), bytes)?;
    }
    Ok(())
}
