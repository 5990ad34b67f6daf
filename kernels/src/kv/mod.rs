//! Paged KV pool with tenant partitions: the one place KV memory lives.
//!
//! A [`Pool`] owns every KV value of one model, allocated once at startup and split in
//! pages of `page_tokens` positions across all layers (layout in [`PageLayout`]). Owners
//! are opaque [`OwnerTag`]s; the host's scheduler is the only caller.
//!
//! The pool is a page *book* (partitions, page states, generations, leases, and
//! every check below) over a [`PageStorage`] that holds the values: f16 by
//! default, f32 as the reference, in host memory ([`storage`]). Storage knows
//! pages by index only; it is reached after the book has checked the lease.
//!
//! # Invariants
//!
//! - **I1 admission before allocation**: only a [`Reservation`] can acquire a page, and
//!   `reserve` books counts without touching a page. A refused reserve books nothing.
//! - **I3 ownership**: every page carries `(owner, seq, generation)`; a [`PageTable`]
//!   holds only pages leased to its `(owner, seq)`, because only the pool edits tables;
//!   every KV access names a [`Lease`] that is checked on write *and* on read (for a
//!   forward pass, every lease of every table of the step once: [`Pool::step_view`]).
//! - **I4 scrub before reuse**: released pages are dirty until `scrub_released` zeroes
//!   them; only `Free` pages are handed out, asserted at acquire (and zero-checked in
//!   paranoid mode). Poison mode fills released pages with a NaN ([`POISON_BITS`],
//!   [`POISON_BITS_F16`]).
//! - **I8 partitioned capacity**: Σ max(held, reserved) ≤ pages_count and held ≤
//!   pages_max for every owner (arithmetic in [`partition`]), so no owner's load can
//!   reduce what another can still get up to its reservation.
//!
//! # Lifecycle
//!
//! 1. `Pool::new` validates geometry and partitions, allocates every page zeroed: all `Free`.
//! 2. `reserve(owner, pages)` books capacity in the owner's partition → [`Reservation`].
//! 3. `page_table(&reservation, seq)` makes the sequence's empty [`PageTable`].
//! 4. `acquire(&mut reservation, &mut table)`: `Free → Owned { owner, seq }`, the
//!    generation increments, the handle is appended to the table.
//! 5. `write_kv` / `page_kv` / `digest` take a [`Lease`] (`table.lease(i)`);
//!    `step_view(&tables)` checks every lease of a step's tables once, for its writes
//!    and reads.
//! 6. `release(&mut table)` / `release_last`: `Owned → Released` (dirty, poisoned in
//!    poison mode, still charged to the owner).
//! 7. `scrub_released()`, between scheduler steps: `Released → Scrubbed → Free`.
//! 8. `release_reservation(reservation)` returns booked pages that were never acquired.
//!
//! A prefix cache shares pages within one owner:
//!
//! - `share(&table, i)`: `Owned { owner, seq } → Shared { owner, refs: 1 }`; the page's
//!   content is final and read-only from then on (`write_kv` asserts, and the backend
//!   refuses a step that would write it).
//! - `attach(&mut table, handle)`: another sequence *of the same owner* appends it
//!   (`refs += 1`); another owner's table is an assert (I7).
//! - `release` of a table takes one reference; at `refs == 0` the page stays `Shared`,
//!   charged to its owner, for the owner's cache.
//! - `evict(owner, handle)` at `refs == 0`: `Shared → Released`, scrubbed like any
//!   release; its handles are stale from then on.
//!
//! ```text
//!            acquire (gen += 1)         release                 scrub: zero
//!   ┌──────┐ ─────────────────► ┌───────────────┐ ───────► ┌──────────────┐ ──────► ┌──────────┐
//!   │ Free │                    │ Owned         │          │ Released     │         │ Scrubbed │
//!   │clean │                    │ {owner, seq}  │          │ {owner} dirty│         │ {owner}  │
//!   └──────┘ ◄───────────────────────────────────────────────────────────────────── └──────────┘
//!                                  verify zero (paranoid), push on free list
//! ```
//!
//! # Errors and asserts
//!
//! Typed errors are for what a correct host can meet: configuration
//! ([`PoolError`]), capacity ([`ReserveError`], [`AcquireError`]), and a lease that has
//! ended ([`KvError::StaleHandle`]: a handle kept past its sequence's release, e.g. by a
//! racing cancel). Asserts (on in release) are for states a correct host cannot reach:
//! a *current* lease claimed by another owner or sequence (a handle in the wrong
//! table: crash rather than serve another tenant's KV), a stale handle inside a page
//! table, a non-free page on the free list, a reservation or table from another pool,
//! wrong `k`/`v` lengths, layer or slot out of range, a counter about to underflow.
//!
//! A reservation dropped while still booking pages cannot reach the pool (it holds
//! counts, not a pool reference), so it records itself in a shared counter that
//! [`Pool::check_invariants`] reports as [`Violation::ReservationDropped`], and panics
//! when debug assertions are on. A page table dropped while holding pages shows up in
//! [`Pool::check_page_tables`] as [`Violation::OrphanPage`].
//!
//! # Concurrency
//!
//! Every mutation takes `&mut Pool`, and reads borrow it, so a release can never
//! overlap an in-flight write (I6) within one pool: the borrow checker proves it.
//!
//! # Not here
//!
//! The prefix cache's index (which token prefix is in which shared page, per tenant and
//! model, I7) and its eviction policy live in the host's scheduler; this module only
//! keeps shared pages read-only, counted and owner-bound. A device (CUDA) pool will
//! be this same book over a device [`PageStorage`] (`Pool::with_storage`): scrub,
//! poison and digest are storage operations, every check stays here.
//!
//! ```compile_fail
//! // A reservation is one booking: it cannot be cloned.
//! fn twice(r: bulkhead_kernels::kv::Reservation) -> (bulkhead_kernels::kv::Reservation, bulkhead_kernels::kv::Reservation) {
//!     (r.clone(), r)
//! }
//! ```

mod check;
pub mod digest;
#[cfg(any(test, feature = "fault-injection"))]
mod fault;
mod geometry;
mod ids;
mod page_table;
pub mod partition;
mod pool;
pub mod storage;
pub mod transfer;

#[cfg(test)]
mod tests;

pub use check::Violation;
pub use digest::{digest_page, digest_slabs, fnv1a64, xxh3_64, Xxh64};
pub use geometry::{
    GeometryError, PageLayout, PoolGeometry, HEAD_DIM_MAX, KV_HEADS_MAX, LAYERS_MAX,
    PAGES_COUNT_MAX, PAGE_TOKENS_MAX, POOL_BYTES_MAX,
};
pub use ids::{Generation, Lease, OwnerTag, PageHandle, PageId, PoolId, SeqId};
pub use page_table::PageTable;
pub use partition::{PartitionConfig, PartitionError, PARTITIONS_MAX};
pub use pool::{
    AcquireError, KvError, PageMeta, PageState, PartitionStats, Pool, PoolError, PoolOptions,
    PoolStats, Reservation, ReserveError, StepView,
};
pub use storage::{
    DeviceValues, KvSlab, KvType, KvValue, PageStorage, POISON_BITS, POISON_BITS_F16,
};
pub use transfer::{
    page_digest, tokens_digest, transfer_digest, Export, Import, ImportError, ImportRefused,
    PageShape, Received, ReceivedPage, TransferHeader, TransferIdentity,
};
