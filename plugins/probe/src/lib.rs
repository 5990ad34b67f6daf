//! A test instrument, not a policy: what it does is chosen per request by the
//! `x-probe` header, so one component can be every hostile guest the host must
//! contain, and a probe of what the host shows it.
//!
//! Hostile (each must cost its request a 503 and nobody else anything):
//! `loop` (spins until fuel or the deadline ends it), `host-loop` (calls the
//! host forever: host calls cost no fuel), `memory` (grows without end),
//! `trap` (panics), `handles` (hoards partition handles), `state-flood` (writes
//! state until refused, then keeps going), `big` (answers with a huge code and
//! message). `clock` makes one host call and admits (blocked, in the tests, by
//! a stalled host call); `spin-under` spins until just under its deadline,
//! then admits.
//!
//! The same behaviours in `route` come from `x-probe-route`; in `on-complete`
//! from `x-probe-complete`, which `admit` keeps in state for every later
//! `on-complete` of the tenant's requests (each reads it back: a host call)
//! until a request sets it to `none`.
//!
//! Probes: `snoop-write` leaves `x-secret` in linear memory (a static buffer
//! and a freed heap block); `snoop-read` rejects with whatever it finds there
//! (`leak`), or admits when memory is clean; `snoop-self` leaves a secret and
//! looks for it in the same call (it must find it: the checker's canary); `state-set` stores `x-value` under
//! the key `shared`, `state-get` rejects with what `shared` holds; `report`
//! rejects with the last completion `on-complete` saw; `stats` rejects with its
//! partition's counts; `alloc` takes `x-probe-mib` MiB of memory and admits;
//! `headers` rejects with the names of the headers it was shown; `bidi`
//! rejects with a message full of invisible characters; anything else admits.

#![no_std]

extern crate alloc;

use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use bulkhead_guest as _;

wit_bindgen::generate!({ path: "../../wit", world: "tenant-policy" });

use alloc::vec;
use bulkhead::policy::host;
use bulkhead::policy::kv_pool::Partition;
use bulkhead::policy::state;
use bulkhead::policy::types::{Adjustments, Completion, Decision, Rejection, RequestView};
use exports::bulkhead::policy::policy::Guest;

const SECRET_BYTES: usize = 64;
static mut STATIC_SECRET: [u8; SECRET_BYTES] = [0; SECRET_BYTES];
/// A heap block the size of which `snoop-read` asks for again.
const HEAP_BLOCK: usize = 1 << 16;

struct Probe;

fn header<'r>(request: &'r RequestView, name: &str) -> &'r str {
    request
        .headers
        .iter()
        .find(|h| h.name == name)
        .map_or("", |h| h.value.as_str())
}

fn admit() -> Decision {
    Decision::Admit(Adjustments {
        max_tokens: None,
        priority: None,
    })
}

fn tell(code: &str, message: String) -> Decision {
    Decision::Reject(Rejection {
        status: 403,
        code: code.into(),
        message,
        retry_after_ms: None,
    })
}

fn snoop_write(secret: &str) {
    let bytes = secret.as_bytes();
    let n = bytes.len().min(SECRET_BYTES);
    // SAFETY: one call at a time per instance (the host runs no threads here).
    unsafe {
        let buffer = &mut *core::ptr::addr_of_mut!(STATIC_SECRET);
        buffer[..n].copy_from_slice(&bytes[..n]);
    }
    let mut block = vec![0u8; HEAP_BLOCK];
    for chunk in block.chunks_mut(n.max(1)) {
        let m = chunk.len().min(n);
        chunk[..m].copy_from_slice(&bytes[..m]);
    }
    drop(block);
}

/// The marker every secret starts with ("SECRET-"), stored XOR 0x5a so that
/// the probe's own data never contains it.
const MARKER_X: [u8; 7] = {
    let plain = *b"SECRET-";
    let mut out = [0u8; 7];
    let mut i = 0;
    while i < 7 {
        out[i] = plain[i] ^ 0x5a;
        i += 1;
    }
    out
};

fn find_marker(bytes: &[u8]) -> Option<usize> {
    bytes
        .windows(MARKER_X.len())
        .position(|w| w.iter().zip(MARKER_X).all(|(&b, m)| b ^ 0x5a == m))
}

/// Looks for a secret left by an earlier call anywhere in this instance's
/// linear memory (the current call holds none: `snoop-read` requests carry no
/// `x-secret`).
fn snoop_read() -> Option<String> {
    // SAFETY: as above.
    let stat = unsafe { *core::ptr::addr_of!(STATIC_SECRET) };
    if stat.iter().any(|&b| b != 0) {
        return Some(format!("static: {}", String::from_utf8_lossy(&stat)));
    }
    // An uninitialised heap block where the earlier call's block was.
    let mut block: Vec<u8> = Vec::with_capacity(HEAP_BLOCK);
    // SAFETY: reading what the allocator hands out before writing it is the
    // point of this probe; u8 has no invalid values.
    unsafe { block.set_len(HEAP_BLOCK) };
    if let Some(at) = find_marker(&block) {
        let end = (at + SECRET_BYTES).min(HEAP_BLOCK);
        return Some(format!(
            "heap: {}",
            String::from_utf8_lossy(&block[at..end])
        ));
    }
    // Then every byte of linear memory.
    let len = core::arch::wasm32::memory_size(0) * 65536;
    // SAFETY: addresses below the memory's size are valid to read in wasm32;
    // address 0 is skipped (Rust treats it as null).
    let memory = unsafe { core::slice::from_raw_parts(1 as *const u8, len - 1) };
    find_marker(memory).map(|at| {
        let end = (at + SECRET_BYTES).min(memory.len());
        format!("memory: {}", String::from_utf8_lossy(&memory[at..end]))
    })
}

/// The hostile behaviours every export can show; false for any other mode.
fn act(mode: &str) -> bool {
    match mode {
        "loop" => {
            let mut x: u64 = 1;
            loop {
                x = core::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
        }
        "host-loop" => loop {
            core::hint::black_box(host::now_ms());
        },
        "memory" => {
            let mut hoard: Vec<Vec<u8>> = Vec::new();
            loop {
                hoard.push(vec![1u8; 1 << 20]);
            }
        }
        "trap" => panic!("the probe traps on purpose"),
        "clock" => {
            core::hint::black_box(host::now_ms());
            true
        }
        "spin-under" => {
            // Spin in slices of work, checking the time left between them.
            while host::remaining().time_ms > 2 {
                let mut x: u64 = 1;
                for _ in 0..20_000 {
                    x = core::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                }
            }
            true
        }
        _ => false,
    }
}

/// The state key of the `on-complete` behaviour.
const COMPLETE_KEY: &str = "complete";

impl Guest for Probe {
    fn admit(request: RequestView) -> Decision {
        let later = header(&request, "x-probe-complete");
        if !later.is_empty() {
            let _ = state::set(COMPLETE_KEY, later.as_bytes(), None);
        }
        let mode = header(&request, "x-probe");
        if act(mode) {
            return admit();
        }
        match mode {
            "handles" => {
                let mut held = Vec::new();
                loop {
                    held.push(Partition::mine());
                }
            }
            "state-flood" => {
                for i in 0.. {
                    let _ = state::set(&format!("flood-{i}"), &[7u8; 4096], None);
                }
                admit()
            }
            "big" => Decision::Reject(Rejection {
                status: 599,
                code: "X".repeat(100_000),
                message: "m".repeat(1 << 20),
                retry_after_ms: Some(u32::MAX),
            }),
            "snoop-write" => {
                snoop_write(header(&request, "x-secret"));
                admit()
            }
            // The checker's canary: a secret this very call left on its heap
            // must be found, or `snoop-read` proves nothing.
            "snoop-self" => {
                let secret = header(&request, "x-secret").as_bytes().to_vec();
                let mut block = vec![0u8; HEAP_BLOCK];
                block[1000..1000 + secret.len()].copy_from_slice(&secret);
                drop(core::hint::black_box(block));
                match snoop_read() {
                    Some(found) => tell("leak", found),
                    None => admit(),
                }
            }
            "snoop-read" => match snoop_read() {
                Some(found) => tell("leak", found),
                None => admit(),
            },
            "state-set" => {
                let value = header(&request, "x-value").as_bytes().to_vec();
                match state::set("shared", &value, None) {
                    Ok(()) => admit(),
                    Err(e) => tell("state_error", format!("{e:?}")),
                }
            }
            "state-get" => {
                let found = state::get("shared").map_or_else(
                    || "none".into(),
                    |v| String::from_utf8_lossy(&v).into_owned(),
                );
                tell("state", found)
            }
            "report" => {
                let last = state::get("last-completion").map_or_else(
                    || "none".into(),
                    |v| String::from_utf8_lossy(&v).into_owned(),
                );
                tell("report", last)
            }
            "alloc" => {
                let mib: usize = header(&request, "x-probe-mib").parse().unwrap_or(1);
                let mut block = vec![0u8; mib << 20];
                for page in block.chunks_mut(4096) {
                    page[0] = 1;
                }
                core::hint::black_box(&block);
                admit()
            }
            // A message with a bidirectional override, a zero-width space
            // and a bell: the host must show none of them.
            "bidi" => tell("bidi", "ok\u{202e}gnp.exe\u{200b}!\u{7}".into()),
            "headers" => {
                let names: Vec<&str> = request.headers.iter().map(|h| h.name.as_str()).collect();
                tell("headers", names.join(","))
            }
            "stats" => {
                let s = Partition::mine().stats();
                tell(
                    "stats",
                    format!(
                        "reserved={} max={} in_use={} available={} queued={} running={}",
                        s.pages_reserved,
                        s.pages_max,
                        s.pages_in_use,
                        s.pages_available,
                        s.queued,
                        s.running
                    ),
                )
            }
            "remaining" => {
                let r = host::remaining();
                tell(
                    "remaining",
                    format!(
                        "time_ms={} fuel={} memory={} host_calls={}",
                        r.time_ms, r.fuel, r.memory_bytes, r.host_calls
                    ),
                )
            }
            _ => admit(),
        }
    }

    fn route(request: RequestView, _candidates: Vec<String>) -> Option<String> {
        act(header(&request, "x-probe-route"));
        None
    }

    fn on_complete(completion: Completion) {
        if let Some(mode) = state::get(COMPLETE_KEY) {
            act(&String::from_utf8_lossy(&mode));
        }
        let text = format!(
            "request={} outcome={:?} prompt_tokens={} completion_tokens={}",
            completion.request_id,
            completion.outcome,
            completion.prompt_tokens,
            completion.completion_tokens
        );
        let _ = state::set("last-completion", text.as_bytes(), None);
    }
}

export!(Probe);
