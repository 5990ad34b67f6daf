//! Decode throughput at a context depth, without the prefill that would build
//! the depth: the pages are filled with random K and V instead, so one run of a
//! few seconds measures what `bulkhead bench engine --decode-context N` takes
//! a minute (and a prefill of N tokens) to measure.
//!
//! `cargo run -p bulkhead-kernels --release --example decode_depth MODEL [DEPTH] [TOKENS] [THREADS] [ROUNDS]`
//!
//! Prints tokens per second for each round of TOKENS decode steps, and the
//! median; the values in the pages are random, so the figure is the engine's
//! cost, not a model's output.

use bulkhead_kernels::backend::cpu::{CpuBackend, CpuOptions};
use bulkhead_kernels::backend::{Backend, Pick, PromptScores, SeqStep};
use bulkhead_kernels::kv::{KvType, OwnerTag, PartitionConfig, Pool, PoolOptions, SeqId};
use bulkhead_kernels::model::Model;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

const PAGE_TOKENS: u32 = 16;
const OWNER: OwnerTag = OwnerTag(1);

fn main() {
    let mut args = std::env::args().skip(1);
    let path = PathBuf::from(
        args.next()
            .expect("usage: decode_depth MODEL [DEPTH] [TOKENS] [THREADS] [ROUNDS]"),
    );
    let mut number = |default: usize| {
        args.next()
            .map(|a| a.parse::<usize>().expect("a number"))
            .unwrap_or(default)
    };
    let depth = number(8128);
    let tokens = number(64);
    let threads = number(2);
    let rounds = number(5);
    let model = Arc::new(Model::open(&path).expect("model loads"));
    let c = &model.config;
    let pages = (depth + tokens).div_ceil(PAGE_TOKENS as usize) as u32;
    let geometry = c.pool_geometry(pages, PAGE_TOKENS, KvType::F16);
    let partition = PartitionConfig {
        owner: OWNER,
        pages_reserved: pages,
        pages_max: pages,
    };
    let mut pool = Pool::new(geometry, &[partition], PoolOptions::default()).expect("pool");
    let mut reservation = pool.reserve(OWNER, pages).expect("capacity");
    let mut table = pool.page_table(&reservation, SeqId(0));
    for _ in 0..pages {
        pool.acquire(&mut reservation, &mut table).expect("booked");
    }
    pool.release_reservation(reservation);
    // Random K and V (xorshift), scaled as real activations roughly are.
    let kv_dim = c.kv_len();
    let mut state = 0x9E37_79B9u32;
    let mut random = |out: &mut [f32]| {
        for v in out {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            *v = (state as f32 / u32::MAX as f32 - 0.5) * 4.0;
        }
    };
    let (mut k, mut v) = (vec![0.0f32; kv_dim], vec![0.0f32; kv_dim]);
    for pos in 0..depth {
        let lease = table.lease(pos / PAGE_TOKENS as usize).expect("page");
        for layer in 0..c.layers_count as u32 {
            random(&mut k);
            random(&mut v);
            let slot = (pos % PAGE_TOKENS as usize) as u32;
            pool.write_kv(lease, layer, slot, &k, &v).expect("write");
        }
    }
    let mut backend = CpuBackend::new(
        Arc::clone(&model),
        CpuOptions {
            threads_count: threads,
            step_tokens_max: 64,
            step_seqs_max: 1,
            isa: None,
        },
    );
    let mut rates = Vec::new();
    for round in 0..rounds {
        let started = Instant::now();
        for i in 0..tokens {
            let step = SeqStep {
                pages: &table,
                // Every round decodes the same positions: depth..depth + tokens.
                pos_start: depth + i,
                tokens: &[1],
                logits: 1,
                pick: Pick::Row,
                adjust: &[],
                logprobs: None,
                scores: PromptScores::NONE,
            };
            backend.step(&[step], &mut pool).expect("step");
        }
        let rate = tokens as f64 / started.elapsed().as_secs_f64();
        println!("round {round}: {rate:.1} tok/s");
        rates.push(rate);
    }
    rates.sort_by(f64::total_cmp);
    println!(
        "decode at depth {depth}, {threads} threads, {:?}: median {:.1} tok/s",
        backend.isa(),
        rates[rates.len() / 2]
    );
}
