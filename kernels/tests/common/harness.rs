//! A model on the CPU backend over one sequence's pages, fed as the server
//! feeds it (prefill chunks, then one token per step): what the golden and
//! conformance tests compare with their references.

use bulkhead_kernels::backend::cpu::{CpuBackend, CpuOptions};
use bulkhead_kernels::backend::{Backend, SeqStep};
use bulkhead_kernels::kv::{
    KvType, OwnerTag, PageTable, PartitionConfig, Pool, PoolOptions, SeqId,
};
use bulkhead_kernels::model::Model;
use bulkhead_kernels::quant::Isa;
use serde_json::Value;
use std::sync::Arc;

const PAGE_TOKENS: u32 = 16;
/// Most tokens in one step: the server's default prefill chunk.
const CHUNK_TOKENS: usize = 512;
const OWNER: OwnerTag = OwnerTag(1);

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

pub struct Harness {
    pub backend: CpuBackend,
    pub pool: Pool,
    pub table: PageTable,
}

pub fn harness(model: &Arc<Model>, isa: Isa, tokens_max: usize) -> Harness {
    harness_with(model, isa, tokens_max, KvType::default())
}

pub fn harness_with(model: &Arc<Model>, isa: Isa, tokens_max: usize, kv_type: KvType) -> Harness {
    let c = &model.config;
    let pages = tokens_max.div_ceil(PAGE_TOKENS as usize) as u32;
    let geometry = c.pool_geometry(pages, PAGE_TOKENS, kv_type);
    let partition = PartitionConfig {
        owner: OWNER,
        pages_reserved: pages,
        pages_max: pages,
    };
    let options = PoolOptions {
        poison_released: true,
        paranoid: false,
    };
    let mut pool = Pool::new(geometry, &[partition], options).unwrap();
    let mut reservation = pool.reserve(OWNER, pages).unwrap();
    let mut table = pool.page_table(&reservation, SeqId(1));
    for _ in 0..pages {
        pool.acquire(&mut reservation, &mut table).unwrap();
    }
    pool.release_reservation(reservation);
    let backend = CpuBackend::new(
        Arc::clone(model),
        CpuOptions {
            threads_count: 2,
            step_tokens_max: CHUNK_TOKENS,
            step_seqs_max: 1,
            isa: Some(isa),
        },
    );
    Harness {
        backend,
        pool,
        table,
    }
}

impl Harness {
    /// Feeds `tokens` from `pos_start` in steps of at most `CHUNK_TOKENS`
    /// (as the server does); the logits of the last one.
    pub fn step(&mut self, pos_start: usize, tokens: &[u32]) -> Vec<f32> {
        let mut logits = Vec::new();
        let mut pos = pos_start;
        for piece in tokens.chunks(CHUNK_TOKENS) {
            let step = SeqStep {
                logits: usize::from(pos + piece.len() == pos_start + tokens.len()),
                ..SeqStep::new(&self.table, pos, piece)
            };
            let out = self.backend.step(&[step], &mut self.pool).unwrap();
            if out.rows_count() == 1 {
                logits = out.row(0).to_vec();
            }
            pos += piece.len();
        }
        logits
    }
}

impl Harness {
    /// `count` greedy tokens after a prompt of `len` tokens whose last logits
    /// are `last`.
    pub fn greedy(&mut self, len: usize, mut last: Vec<f32>, count: usize) -> Vec<u32> {
        let mut out = Vec::new();
        for i in 0..count {
            let next = top1(&last);
            out.push(next);
            last = self.step(len + i, &[next]);
        }
        out
    }
}

/// The greedy token of `logits` (the backends' argmax).
pub fn top1(logits: &[f32]) -> u32 {
    bulkhead_kernels::backend::argmax(logits)
}
