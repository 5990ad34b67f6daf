//! `bulkhead serve --model FILE`: one GGUF file served to one tenant with no
//! policy file, as `llama-server -m FILE --api-key K` does — the same engine,
//! capacity contract and isolation underneath, with a policy derived from
//! the file.
//!
//! 1. **The model**: its id is the file's name without `.gguf`, lower-cased;
//!    its promised context is the file's own (`context_length`), lowered to
//!    what the memory budget can hold for one sequence.
//! 2. **The memory budget**: `--memory-max`, or half of this machine's
//!    memory. The KV pool takes what the weights leave of it, from one
//!    full-context sequence up to [`CONTEXTS_MAX`] of them.
//! 3. **One tenant**, `default`, reserving the whole pool, its key from
//!    `--api-key` (or generated at the first start and shown once, as for any
//!    policy tenant), the admin listener on loopback as always.
//! 4. **The store** in `--store`, or `$XDG_STATE_HOME/bulkhead/<id>`
//!    (`~/.local/state/bulkhead/<id>`), so keys and usage survive a restart.
//!
//! [`derive()`] returns the policy as TOML text, which `bulkhead check --model`
//! prints and `serve` parses like any policy file.

use crate::capacity::human_bytes;
use crate::catalog;
use crate::config::{Config, ModelSpec};
use crate::engine::placement::BackendChoice;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// The most full-context sequences the derived pool holds.
pub const CONTEXTS_MAX: u64 = 4;
/// The smallest context worth serving.
const CONTEXT_MIN: u64 = 256;
/// Token positions per page.
const PAGE_TOKENS: u64 = 16;
/// The variable `--api-key` travels in (the tenant's `key_env`).
pub const API_KEY_ENV: &str = "BULKHEAD_API_KEY";

/// What `--model` mode is given.
pub struct Single<'a> {
    /// The GGUF file.
    pub model: &'a Path,
    /// The memory budget (default: half of this machine's memory).
    pub memory_max: Option<u64>,
    /// The store's folder.
    pub store: Option<PathBuf>,
}

/// The policy `--model` mode serves, as TOML, and parsed.
pub fn derive(single: &Single) -> Result<(String, Config)> {
    let path = std::path::absolute(single.model)
        .with_context(|| format!("--model {}", single.model.display()))?;
    let id = model_id(&path)?;
    let budget = match single.memory_max {
        Some(bytes) => bytes,
        None => machine_memory()? / 2,
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
    // The file's context and weights, and the KV bytes of one page.
    let probe = |context: u64, pool_pages: u64| ModelSpec {
        id: id.clone(),
        path: path.clone(),
        context_tokens: context as u32,
        threads,
        page_tokens: PAGE_TOKENS as u32,
        pool_pages: pool_pages as u32,
        seq_pages_max: context.div_ceil(PAGE_TOKENS) as u32,
        step_tokens_max: 256,
        step_seqs_max: 32,
        kv_type: Default::default(),
        backend: None,
    };
    // Sizes only: the same bytes wherever the model will compute.
    let inspected = catalog::inspect(&probe(PAGE_TOKENS, 1), BackendChoice::Cpu)?;
    let weights = inspected.memory.weights_bytes;
    let page_bytes = inspected.memory.kv_bytes.max(1);
    let file_context = inspected.file_context_tokens;
    let Some(left) = budget.checked_sub(weights) else {
        bail!(
            "the weights of {} take {} of a {} memory budget: give --memory-max more",
            path.display(),
            human_bytes(weights),
            human_bytes(budget)
        );
    };
    let pages_left = left / page_bytes;
    let context_pages = file_context
        .min(u64::from(u32::MAX))
        .div_ceil(PAGE_TOKENS)
        .min(pages_left);
    let context = (context_pages * PAGE_TOKENS).min(file_context);
    if context < CONTEXT_MIN {
        bail!(
            "a {} memory budget leaves room for {} tokens of context after the weights ({}); give --memory-max more",
            human_bytes(budget),
            context,
            human_bytes(weights)
        );
    }
    let seq_pages = context.div_ceil(PAGE_TOKENS);
    let pool_pages = pages_left
        .min(seq_pages * CONTEXTS_MAX)
        .min(u64::from(u32::MAX));
    let store = match &single.store {
        Some(dir) => std::path::absolute(dir)?,
        None => state_home()?.join("bulkhead").join(&id),
    };
    let toml = format!(
        "# Derived by `bulkhead serve --model` from {file} (bulkhead check --model prints it).\n\
         [server]\n\
         listen = \"127.0.0.1:8080\"\n\
         admin_listen = \"127.0.0.1:8081\"\n\n\
         [store]\n\
         path = {store:?}\n\n\
         [engine]\n\
         memory_max = {budget}  # {budget_h}\n\n\
         [[models]]\n\
         id = {id:?}\n\
         path = {file:?}\n\
         context_tokens = {context}  # the file holds {file_context}\n\
         threads = {threads}\n\
         page_tokens = {PAGE_TOKENS}\n\
         pool_pages = {pool_pages}  # {pool_h} of KV: {seqs} full-context sequences\n\
         seq_pages_max = {seq_pages}\n\n\
         [tenants.default]\n\
         pages_reserved = {pool_pages}\n\
         pages_max = {pool_pages}\n\
         key_env = {API_KEY_ENV:?}  # --api-key\n",
        file = path.display().to_string(),
        store = store.display().to_string(),
        budget_h = human_bytes(budget),
        pool_h = human_bytes(pool_pages * page_bytes),
        seqs = pool_pages / seq_pages,
    );
    let mut config = Config::parse(&toml)?;
    config.source = store.join("policy.toml");
    Ok((toml, config))
}

/// The id of a model file: its name without `.gguf`, lower-cased, every
/// character outside `[a-z0-9._-]` a `-`.
fn model_id(path: &Path) -> Result<String> {
    let stem = path
        .file_name()
        .and_then(|n| n.to_str())
        .map(|n| n.strip_suffix(".gguf").unwrap_or(n))
        .filter(|s| !s.is_empty())
        .with_context(|| format!("{}: not a file name", path.display()))?;
    Ok(stem
        .chars()
        .map(|c| match c.to_ascii_lowercase() {
            c @ ('a'..='z' | '0'..='9' | '.' | '_' | '-') => c,
            _ => '-',
        })
        .take(64)
        .collect())
}

/// This machine's memory (`MemTotal` of /proc/meminfo).
fn machine_memory() -> Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo")
        .context("reading /proc/meminfo (give --memory-max)")?;
    text.lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(|kib| kib * 1024)
        .context("no MemTotal in /proc/meminfo (give --memory-max)")
}

fn state_home() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("XDG_STATE_HOME").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    let home = std::env::var_os("HOME").context("no HOME to keep the store in: give --store")?;
    Ok(PathBuf::from(home).join(".local/state"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_the_file_name_made_safe() {
        let id = |p: &str| model_id(Path::new(p)).unwrap();
        assert_eq!(
            id("/m/Llama-3.2-1B-Instruct-Q4_K_M.gguf"),
            "llama-3.2-1b-instruct-q4_k_m"
        );
        assert_eq!(id("a b+c.gguf"), "a-b-c");
        assert!(model_id(Path::new("/")).is_err());
    }
}
