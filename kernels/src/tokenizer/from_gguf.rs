//! Reading a [`VocabSpec`] from a GGUF file's `tokenizer.ggml.*` metadata.

use super::{Tokenizer, TokenizerError, VocabSpec};
use crate::gguf::{metadata_error, Gguf, GgufError, Value};

/// Why a tokenizer could not be built from a file.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The metadata is missing or has the wrong types.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// The vocabulary itself is unusable.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

fn strings(gguf: &Gguf, key: &str) -> Result<Option<Vec<String>>, GgufError> {
    let Some(Value::Array(items)) = gguf.get(key) else {
        return match gguf.get(key) {
            None => Ok(None),
            Some(_) => Err(metadata_error(key, "expected an array of strings")),
        };
    };
    items
        .iter()
        .map(|item| match item {
            Value::String(s) => Ok(s.clone()),
            _ => Err(metadata_error(key, "expected an array of strings")),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

fn numbers<T>(
    gguf: &Gguf,
    key: &str,
    convert: impl Fn(&Value) -> Option<T>,
) -> Result<Option<Vec<T>>, GgufError> {
    match gguf.get(key) {
        None => Ok(None),
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| convert(item).ok_or_else(|| metadata_error(key, "unexpected element type")))
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        Some(_) => Err(metadata_error(key, "expected an array")),
    }
}

fn id(gguf: &Gguf, key: &str) -> Result<Option<u32>, GgufError> {
    match gguf.get(key) {
        None => Ok(None),
        Some(value) => value
            .as_u64()
            .and_then(|v| u32::try_from(v).ok())
            .map(Some)
            .ok_or_else(|| metadata_error(key, "not a token id")),
    }
}

fn flag(gguf: &Gguf, key: &str, default: bool) -> Result<bool, GgufError> {
    match gguf.get(key) {
        None => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(metadata_error(key, "not a bool")),
    }
}

impl VocabSpec {
    /// The vocabulary described by `gguf`'s `tokenizer.ggml.*` keys.
    pub fn from_gguf(gguf: &Gguf) -> Result<VocabSpec, GgufError> {
        let model = gguf.str("tokenizer.ggml.model")?.to_string();
        let tokens = strings(gguf, "tokenizer.ggml.tokens")?
            .ok_or_else(|| metadata_error("tokenizer.ggml.tokens", "missing"))?;
        let pre = match gguf.get("tokenizer.ggml.pre") {
            Some(_) => Some(gguf.str("tokenizer.ggml.pre")?.to_string()),
            None => None,
        };
        let token_types = numbers(gguf, "tokenizer.ggml.token_type", |v| {
            v.as_u64().and_then(|n| i32::try_from(n).ok())
        })?;
        let scores = numbers(gguf, "tokenizer.ggml.scores", |v| {
            v.as_f64().map(|f| f as f32)
        })?;
        Ok(VocabSpec {
            add_bos: flag(gguf, "tokenizer.ggml.add_bos_token", model == "llama")?,
            add_space_prefix: flag(gguf, "tokenizer.ggml.add_space_prefix", model == "llama")?,
            model,
            pre,
            tokens,
            token_types,
            scores,
            merges: strings(gguf, "tokenizer.ggml.merges")?,
            bos: id(gguf, "tokenizer.ggml.bos_token_id")?,
            eos: id(gguf, "tokenizer.ggml.eos_token_id")?,
            unk: id(gguf, "tokenizer.ggml.unknown_token_id")?,
            pad: id(gguf, "tokenizer.ggml.padding_token_id")?,
        })
    }
}

impl Tokenizer {
    /// The tokenizer stored in a GGUF file.
    pub fn from_gguf(gguf: &Gguf) -> Result<Tokenizer, LoadError> {
        Ok(Tokenizer::new(VocabSpec::from_gguf(gguf)?)?)
    }
}
