//! The GGUF reader's memory budget (issue 21, item 8): a small hostile file
//! must not make the reader allocate much more than the file's own size.
//!
//! Every array item decodes to a 32-byte `Value`, so before the budget a file
//! that was one long u8 array decoded to 32 times its size (a 10 MB file
//! raised RSS by 320 MB). Here a counting allocator measures the peak of what
//! `Gguf::from_bytes` really allocates, on its own thread, for each shape of
//! hostile header, and checks it against `decoded_bytes_max` of the file.
//! (The allocator is this test binary's own, which is why these tests live in
//! a file of their own.)

use bulkhead_kernels::gguf::{decoded_bytes_max, Gguf, GgufError, DECODED_BYTES_PER_FILE_BYTE_MAX};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// The system allocator, counting what the current thread holds while
/// `COUNTING` is set on it.
struct Counting;

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static LIVE_BYTES: Cell<usize> = const { Cell::new(0) };
    static PEAK_BYTES: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: every call is forwarded unchanged to `System`; the bookkeeping only
// touches const-initialized thread-locals, which never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note_alloc(layout.size());
        // SAFETY: the caller's contract is passed through unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        note_free(layout.size());
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note_alloc(new_size);
        note_free(layout.size());
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn note_alloc(bytes: usize) {
    let _ = COUNTING.try_with(|counting| {
        if counting.get() {
            let live = LIVE_BYTES.with(|l| {
                l.set(l.get() + bytes);
                l.get()
            });
            PEAK_BYTES.with(|p| p.set(p.get().max(live)));
        }
    });
}

fn note_free(bytes: usize) {
    let _ = COUNTING.try_with(|counting| {
        if counting.get() {
            LIVE_BYTES.with(|l| l.set(l.get().saturating_sub(bytes)));
        }
    });
}

/// Parses `bytes` and returns the result with the most bytes the parse held
/// allocated at once (the file's own buffer, allocated before, not counted).
fn parse_measured(bytes: Vec<u8>) -> (Result<Gguf, GgufError>, usize) {
    LIVE_BYTES.with(|l| l.set(0));
    PEAK_BYTES.with(|p| p.set(0));
    COUNTING.with(|c| c.set(true));
    let result = Gguf::from_bytes(bytes);
    COUNTING.with(|c| c.set(false));
    (result, PEAK_BYTES.with(Cell::get))
}

/// Builds a GGUF header by hand: the writer would need the 32-byte `Value`s
/// this test is about to hold the items.
struct Raw(Vec<u8>);

impl Raw {
    fn new(tensors_count: u64, kv_count: u64) -> Raw {
        let mut out = b"GGUF".to_vec();
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&tensors_count.to_le_bytes());
        out.extend_from_slice(&kv_count.to_le_bytes());
        Raw(out)
    }

    fn u32(&mut self, v: u32) -> &mut Raw {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    fn u64(&mut self, v: u64) -> &mut Raw {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    fn string(&mut self, s: &str) -> &mut Raw {
        self.u64(s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
        self
    }

    /// A metadata entry `key` holding an array of `count` items of
    /// `item_type`, each encoded as `item`.
    fn array(&mut self, key: &str, item_type: u32, count: u64, item: &[u8]) -> &mut Raw {
        self.string(key).u32(9).u32(item_type).u64(count);
        for _ in 0..count {
            self.0.extend_from_slice(item);
        }
        self
    }
}

/// The budget the reader promises, plus a little for error messages.
fn bound(file_len: usize) -> usize {
    decoded_bytes_max(file_len) as usize + 4096
}

const MIB: u64 = 1 << 20;

#[test]
fn a_file_that_is_one_long_array_of_small_items_is_refused_before_it_is_decoded() {
    // Types 0 (u8), 7 (bool) and 3 (i16): 32 bytes of memory per 1 or 2 of file.
    for (item_type, item) in [(0u32, &[7u8][..]), (7, &[1]), (3, &[1, 0])] {
        let mut raw = Raw::new(0, 1);
        raw.array("hostile", item_type, MIB / item.len() as u64, item);
        let file_len = raw.0.len();
        let (result, peak_bytes) = parse_measured(raw.0);
        assert!(
            matches!(
                result,
                Err(GgufError::Absurd {
                    what: "decoded header bytes",
                    ..
                })
            ),
            "type {item_type}: {result:?}"
        );
        assert!(
            peak_bytes <= bound(file_len),
            "type {item_type}: a {file_len}-byte file made the reader hold {peak_bytes} bytes"
        );
        // Without the budget this was 32 MiB for the u8 file.
        assert!(peak_bytes < MIB as usize, "{peak_bytes}");
    }
}

#[test]
fn many_tiny_metadata_entries_are_refused_before_their_table_is_allocated() {
    // 65536 entries of 16 bytes each: a 1 MiB file whose entry table, keys and
    // indexes would take about 17 MiB.
    let count = 1u64 << 16;
    let mut raw = Raw::new(0, count);
    for i in 0..count {
        let key = format!("{:03x}", i % 4096) + &format!("{}", i / 4096);
        raw.string(&key).u32(0);
        raw.0.push(1);
    }
    let file_len = raw.0.len();
    let (result, peak_bytes) = parse_measured(raw.0);
    assert!(
        matches!(
            result,
            Err(GgufError::Absurd {
                what: "decoded header bytes",
                ..
            })
        ),
        "{result:?}"
    );
    assert!(peak_bytes <= bound(file_len), "{peak_bytes} for {file_len}");
}

#[test]
fn hostile_shapes_within_the_budget_parse_within_it() {
    let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
    // 100k one-byte strings: 9 bytes of file each, 32 + 32 of memory.
    let mut raw = Raw::new(0, 1);
    raw.array("strings", 8, 100_000, &[1, 0, 0, 0, 0, 0, 0, 0, b'a']);
    cases.push(("one-byte strings", raw.0));
    // 100k empty arrays inside one array: 12 bytes of file each, 32 of memory.
    let mut raw = Raw::new(0, 1);
    raw.array("nested", 9, 100_000, &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    cases.push(("nested empty arrays", raw.0));
    // 20k one-element f32 tensors.
    let count = 20_000u64;
    let mut raw = Raw::new(count, 0);
    for i in 0..count {
        raw.string(&format!("t{i}"))
            .u32(1)
            .u64(1)
            .u32(0)
            .u64(i * 32);
    }
    let data_start = raw.0.len().next_multiple_of(32);
    raw.0.resize(data_start + count as usize * 32, 0);
    cases.push(("many tensors", raw.0));

    for (name, bytes) in cases {
        let file_len = bytes.len();
        let (result, peak_bytes) = parse_measured(bytes);
        assert!(result.is_ok(), "{name}: {result:?}");
        assert!(
            peak_bytes <= bound(file_len),
            "{name}: a {file_len}-byte file made the reader hold {peak_bytes} bytes"
        );
    }
}

#[test]
fn a_large_vocabulary_with_per_token_arrays_is_still_accepted() {
    // The shape of a real tokenizer: 150k tokens, their i32 types and f32
    // scores (the densest legitimate arrays: 8 bytes of memory per byte).
    let count = 150_000u64;
    let mut raw = Raw::new(0, 3);
    raw.string("tokenizer.ggml.tokens").u32(9).u32(8).u64(count);
    for i in 0..count {
        raw.string(&format!("tok{i}"));
    }
    raw.array("tokenizer.ggml.token_type", 5, count, &1i32.to_le_bytes());
    raw.array("tokenizer.ggml.scores", 6, count, &0.5f32.to_le_bytes());
    let file_len = raw.0.len();
    let (result, peak_bytes) = parse_measured(raw.0);
    let gguf = result.expect("a plausible vocabulary parses");
    assert_eq!(
        gguf.array("tokenizer.ggml.scores").unwrap().len(),
        count as usize
    );
    assert!(peak_bytes <= bound(file_len), "{peak_bytes} for {file_len}");
    assert!(
        peak_bytes as u64 > file_len as u64,
        "the measurement is real: {peak_bytes} for {file_len}"
    );
    const { assert!(DECODED_BYTES_PER_FILE_BYTE_MAX >= 8) };
}
