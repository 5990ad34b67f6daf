//! What a `#![no_std]` policy plugin needs besides its wit-bindgen bindings,
//! so that the component imports nothing but `bulkhead:policy`.
//!
//! The host links no WASI (no clocks, streams, pollables, files or random
//! bytes: nothing a call could block on or ask the host to fill), and refuses
//! a component that imports anything its world does not name. A Rust guest
//! built with `std` imports WASI interfaces even when it uses none of them
//! (its panic machinery writes to stderr), so every plugin here is
//! `#![no_std]` with `alloc`, and links this crate for:
//!
//! - a global allocator (dlmalloc over the linear memory, as `std` uses);
//! - `cabi_realloc`, the canonical ABI's allocation export, which `std`
//!   provides on `wasm32-wasip2` and a `no_std` guest must provide itself;
//! - a panic handler that traps (`unreachable`): the host counts the trap as
//!   the plugin's fault and fails the request closed.
//!
//! Use it with `use bulkhead_guest as _;` in the plugin's `lib.rs`.

#![no_std]

extern crate alloc;

use alloc::alloc::{alloc, realloc, Layout};

#[global_allocator]
static ALLOCATOR: dlmalloc::GlobalDlmalloc = dlmalloc::GlobalDlmalloc;

/// The canonical ABI's allocator: the host calls it to place arguments (a
/// request's headers, a list of candidates) in the plugin's memory.
///
/// # Safety
///
/// Called by the host only, with the contract of the component model's
/// `cabi_realloc`: `old` and `old_len` describe a block this function
/// returned (or are null and 0), `align` is a power of two.
#[no_mangle]
pub unsafe extern "C" fn cabi_realloc(
    old: *mut u8,
    old_len: usize,
    align: usize,
    new_len: usize,
) -> *mut u8 {
    let ptr = if old_len == 0 {
        if new_len == 0 {
            return align as *mut u8;
        }
        // SAFETY: new_len > 0 and align is a power of two (the ABI's contract).
        unsafe { alloc(Layout::from_size_align_unchecked(new_len, align)) }
    } else {
        // SAFETY: old was allocated with this layout (the ABI's contract).
        unsafe {
            realloc(
                old,
                Layout::from_size_align_unchecked(old_len, align),
                new_len,
            )
        }
    };
    if ptr.is_null() {
        core::arch::wasm32::unreachable();
    }
    ptr
}

/// `memcmp`, which the compiler calls to compare slices and strings: `std`
/// gets it from wasi-libc, a `no_std` guest from here. (Copies and fills
/// need nothing: bulk-memory instructions do them.)
///
/// # Safety
///
/// `a` and `b` are valid for reads of `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn memcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    let mut i = 0;
    while i < n {
        // SAFETY: i < n, and both are valid for n bytes.
        let (x, y) = unsafe { (*a.add(i), *b.add(i)) };
        if x != y {
            return i32::from(x) - i32::from(y);
        }
        i += 1;
    }
    0
}

/// `bcmp`: `memcmp` when only equality matters.
///
/// # Safety
///
/// As [`memcmp`].
#[no_mangle]
pub unsafe extern "C" fn bcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    // SAFETY: the same contract.
    unsafe { memcmp(a, b, n) }
}

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    core::arch::wasm32::unreachable()
}
