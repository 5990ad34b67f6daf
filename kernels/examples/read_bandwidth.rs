//! How fast this machine's memory delivers bytes to 1..=N threads that only
//! read: the ceiling for a decode step that streams every weight once (batch
//! 1 on a model larger than the last-level cache).
//!
//! `cargo run --release -p bulkhead-kernels --example read_bandwidth [-- THREADS [MIB]]`
//! (default: every core, 1024 MiB), best of ten passes per thread count.

use std::time::Instant;

fn main() {
    let mut args = std::env::args().skip(1);
    let threads_max: usize = args
        .next()
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let mib: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1024);
    let words = mib << 17;
    // Written once, so every page is really there before the clock starts.
    let buffer: Vec<u64> = (0..words as u64).collect();
    for threads in 1..=threads_max {
        let mut best = 0f64;
        let mut check = 0u64;
        for _ in 0..10 {
            let start = Instant::now();
            let sum = std::thread::scope(|s| {
                let share = words.div_ceil(threads);
                let handles: Vec<_> = buffer
                    .chunks(share)
                    .map(|chunk| s.spawn(move || sum(chunk)))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("a reader panicked"))
                    .fold(0u64, u64::wrapping_add)
            });
            let seconds = start.elapsed().as_secs_f64();
            best = best.max((words * 8) as f64 / seconds / 1e9);
            check = check.wrapping_add(sum);
        }
        println!("threads {threads}: read {best:.1} GB/s (best of 10 passes over {mib} MiB; check {check:x})");
    }
}

/// Eight independent sums, so the loop is bound by loads, not by one
/// dependency chain (the compiler vectorizes it).
fn sum(words: &[u64]) -> u64 {
    let mut lanes = [0u64; 8];
    let mut chunks = words.chunks_exact(8);
    for chunk in &mut chunks {
        for (lane, &w) in lanes.iter_mut().zip(chunk) {
            *lane = lane.wrapping_add(w);
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .fold(0u64, |a, &w| a.wrapping_add(w));
    lanes.iter().fold(tail, |a, &l| a.wrapping_add(l))
}
