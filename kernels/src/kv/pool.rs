//! The pool: page states, the reserve → acquire → release → scrub verbs, KV access.
//!
//! See the module doc of [`crate::kv`] for the lifecycle and the error/assert policy.

use super::geometry::{GeometryError, PageLayout, PoolGeometry};
use super::ids::{Generation, Lease, OwnerTag, PageHandle, PageId, PoolId, SeqId};
use super::page_table::PageTable;
use super::partition::{PartitionConfig, PartitionError, Partitions};
use super::storage::{host_storage, DeviceValues, KvSlab, PageStorage};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use thiserror::Error;

/// Gives each pool a distinct id, so a reservation or table from another pool is caught.
static POOL_ID_NEXT: AtomicU32 = AtomicU32::new(1);

/// Test and debug switches, all off in production.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolOptions {
    /// Fill released pages with the value type's poison (a NaN, see
    /// [`super::KvValue::POISON`]) so that reads before writes are visible.
    pub poison_released: bool,
    /// Verify page contents: zero after scrub and at acquire (assert), and every free
    /// page zero in `check_invariants`. Costs a pass over the page each time.
    pub paranoid: bool,
}

/// A page's state. Transitions (each asserts its from-state):
/// `Free → Owned → Released → Scrubbed → Free`, and for a prefix cache
/// `Owned → Shared → Released` (shared by `share`, back to dirty by `evict`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageState {
    /// Clean (all zeros) and on the free list.
    Free,
    /// Leased to one sequence of one owner.
    Owned {
        /// The owner.
        owner: OwnerTag,
        /// The sequence.
        seq: SeqId,
    },
    /// Read-only, final content, readable by any sequence of its owner that
    /// holds its handle: a prefix-cache page. Never written again.
    Shared {
        /// The owner (never another's: sharing is within one owner only).
        owner: OwnerTag,
        /// Page tables that hold it; 0 means only the owner's cache keeps it.
        refs: u32,
    },
    /// Dirty: released, waiting for scrub, still charged to its last owner.
    Released {
        /// The last owner.
        owner: OwnerTag,
    },
    /// Zeroed, about to become free (only inside `scrub_released`).
    Scrubbed {
        /// The last owner.
        owner: OwnerTag,
    },
}

/// A page's state and the generation of its latest lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageMeta {
    /// The state.
    pub state: PageState,
    /// The latest lease's generation (the current one while `Owned`).
    pub generation: Generation,
}

/// Why a pool could not be created.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum PoolError {
    /// Bad geometry.
    #[error(transparent)]
    Geometry(#[from] GeometryError),
    /// Bad partitions.
    #[error(transparent)]
    Partition(#[from] PartitionError),
}

/// Why a reservation was refused. Nothing was booked.
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
pub enum ReserveError {
    /// The owner has no partition in this pool.
    #[error("owner {owner:?} has no partition in this pool")]
    UnknownOwner {
        /// The owner.
        owner: OwnerTag,
    },
    /// A reservation of zero pages.
    #[error("a reservation needs at least one page")]
    ZeroPages,
    /// The owner's own ceiling: it can never hold that many pages at once.
    #[error("owner {owner:?} would hold {pages_wanted} pages, above its pages_max {pages_max}")]
    AboveMax {
        /// The owner.
        owner: OwnerTag,
        /// Held plus requested.
        pages_wanted: u64,
        /// Its maximum.
        pages_max: u32,
    },
    /// Not now: the owner's reservation and the free burst region are used up.
    #[error("owner {owner:?} asked for {pages} pages, {pages_available} available now")]
    Exhausted {
        /// The owner.
        owner: OwnerTag,
        /// Requested.
        pages: u32,
        /// What it could get now.
        pages_available: u32,
    },
}

/// Why an acquire was refused. The reservation is unchanged.
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
pub enum AcquireError {
    /// Every page this reservation booked has been acquired.
    #[error("reservation for owner {owner:?} has no booked page left")]
    ReservationExhausted {
        /// The owner.
        owner: OwnerTag,
    },
}

/// Why a KV access (or a share, attach or evict) was refused. Nothing changed.
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
pub enum KvError {
    /// `attach` or `evict` of a page that is not shared.
    #[error("page {page:?} is not shared")]
    NotShared {
        /// The page.
        page: PageId,
    },
    /// `evict` of a shared page that page tables still hold.
    #[error("page {page:?} is held by {refs} page tables")]
    InUse {
        /// The page.
        page: PageId,
        /// How many tables hold it.
        refs: u32,
    },
    /// The handle was leased from another pool (another model's): refused before
    /// its page index is even looked at.
    #[error("page {page:?} belongs to pool {handle_pool:?}, not to this pool {pool:?}")]
    ForeignPool {
        /// The page the handle names (in its own pool).
        page: PageId,
        /// The pool that leased the handle.
        handle_pool: PoolId,
        /// This pool.
        pool: PoolId,
    },
    /// The handle names no page of this pool.
    #[error("page {page:?} is not in this pool")]
    PageOutOfRange {
        /// The page.
        page: PageId,
    },
    /// The handle's lease has ended: the page was released, or leased again since.
    #[error("stale handle: page {page:?} generation {generation:?} is no longer leased")]
    StaleHandle {
        /// The page.
        page: PageId,
        /// The handle's generation.
        generation: Generation,
    },
}

/// Booked capacity in one owner's partition: the only thing that can acquire pages (I1).
///
/// Not `Clone`: one booking, one token. It holds counts only; pages are chosen at
/// acquire. Return unused capacity with [`Pool::release_reservation`]. Dropping a
/// reservation that still books pages leaks that capacity: it is recorded where
/// [`Pool::check_invariants`] reports it, and panics in builds with debug assertions.
#[derive(Debug)]
#[must_use = "booked pages leak unless acquired or returned with Pool::release_reservation"]
pub struct Reservation {
    pool_id: PoolId,
    owner: OwnerTag,
    pages_booked: u32,
    leaks: Arc<ReservationLeaks>,
}

/// Reservations dropped while still booking pages, counted by their `Drop`.
#[derive(Debug, Default)]
pub(super) struct ReservationLeaks {
    pub(super) reservations: AtomicU32,
    pub(super) pages: AtomicU64,
}

impl Reservation {
    /// The owner whose partition this books.
    pub fn owner(&self) -> OwnerTag {
        self.owner
    }

    /// Pages booked and not yet acquired.
    pub fn pages_booked(&self) -> u32 {
        self.pages_booked
    }

    /// Acquires one booked page into `table`; the same as [`Pool::acquire`].
    pub fn acquire(
        &mut self,
        pool: &mut Pool,
        table: &mut PageTable,
    ) -> Result<PageHandle, AcquireError> {
        pool.acquire(self, table)
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.pages_booked == 0 {
            return;
        }
        self.leaks.reservations.fetch_add(1, Ordering::Relaxed);
        self.leaks
            .pages
            .fetch_add(u64::from(self.pages_booked), Ordering::Relaxed);
        if cfg!(debug_assertions) && !std::thread::panicking() {
            panic!(
                "reservation for owner {:?} dropped with {} booked pages: return it with Pool::release_reservation",
                self.owner, self.pages_booked
            );
        }
    }
}

/// Pool-wide page counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolStats {
    /// Pages in the pool.
    pub pages_count: u32,
    /// Clean pages on the free list.
    pub pages_free: u32,
    /// Pages leased to a sequence.
    pub pages_owned: u32,
    /// Dirty pages waiting for scrub.
    pub pages_released: u32,
    /// Shared (prefix-cache) pages.
    pub pages_shared: u32,
    /// Of those, the pages no table holds (only a cache keeps them): each
    /// owner's to evict when it needs pages, so not in use (a vLLM pool
    /// counts such blocks free).
    pub pages_shared_idle: u32,
    /// Pages booked by live reservations, not yet acquired.
    pub pages_booked: u32,
}

/// One owner's counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartitionStats {
    /// The configured partition.
    pub config: PartitionConfig,
    /// Booked by live reservations, not yet acquired.
    pub pages_booked: u32,
    /// Leased to its sequences.
    pub pages_owned: u32,
    /// Released by it and not yet scrubbed (still charged to it).
    pub pages_released: u32,
    /// Shared (its prefix cache): read-only, held by its sequences or only by
    /// its cache, charged to it.
    pub pages_shared: u32,
    /// What a reservation could book right now.
    pub pages_available: u32,
}

/// A paged KV pool with tenant partitions. See [`crate::kv`].
#[derive(Debug)]
pub struct Pool {
    pub(super) pool_id: PoolId,
    pub(super) layout: PageLayout,
    pub(super) options: PoolOptions,
    /// The values, allocated once, zeroed: each page logically
    /// `// [layer][k|v][page_tokens][kv_dim]` (how they are laid out in memory
    /// is storage's own; host storage is layer-major). Reached only after the
    /// book above has checked the lease.
    pub(super) storage: Box<dyn PageStorage>,
    /// `// [pages_count]`
    pub(super) pages: Vec<PageMeta>,
    /// Every `Free` page, once; a stack, so recently scrubbed pages are reused first.
    pub(super) pages_free: Vec<PageId>,
    /// Every `Released` page, once: the scrub queue.
    pub(super) pages_released: Vec<PageId>,
    pub(super) partitions: Partitions,
    pub(super) leaks: Arc<ReservationLeaks>,
}

impl Pool {
    /// Validates geometry and partitions and allocates every page in host
    /// memory, zeroed, values of the geometry's `kv_type`.
    pub fn new(
        geometry: PoolGeometry,
        partitions: &[PartitionConfig],
        options: PoolOptions,
    ) -> Result<Pool, PoolError> {
        let layout = geometry.layout()?;
        Pool::with_storage(layout, partitions, options, host_storage(layout))
    }

    /// A pool over `storage`, which must hold `layout`'s pages, zeroed, in its
    /// `kv_type` (a device backend's storage).
    pub fn with_storage(
        layout: PageLayout,
        partitions: &[PartitionConfig],
        options: PoolOptions,
        storage: Box<dyn PageStorage>,
    ) -> Result<Pool, PoolError> {
        let geometry = layout.geometry();
        assert_eq!(
            storage.kv_type(),
            geometry.kv_type,
            "storage of another value type than the layout"
        );
        let partitions = Partitions::new(partitions, geometry.pages_count)?;
        let pages_count = geometry.pages_count;
        let initial = PageMeta {
            state: PageState::Free,
            generation: Generation(0),
        };
        Ok(Pool {
            pool_id: PoolId(POOL_ID_NEXT.fetch_add(1, Ordering::Relaxed)),
            layout,
            options,
            storage,
            pages: vec![initial; pages_count as usize],
            // Reversed so that page 0 is handed out first.
            pages_free: (0..pages_count).rev().map(PageId).collect(),
            pages_released: Vec::with_capacity(pages_count as usize),
            partitions,
            leaks: Arc::default(),
        })
    }

    /// This pool's identity (carried by every handle it leases).
    pub fn id(&self) -> PoolId {
        self.pool_id
    }

    /// The validated page layout.
    pub fn layout(&self) -> &PageLayout {
        &self.layout
    }

    /// The options the pool was created with.
    pub fn options(&self) -> PoolOptions {
        self.options
    }

    /// A page's state and generation; `None` if the id is not in this pool.
    pub fn page_meta(&self, page: PageId) -> Option<PageMeta> {
        self.pages.get(page.index()).copied()
    }

    /// Pool-wide counts.
    pub fn stats(&self) -> PoolStats {
        let pages_count = self.layout.geometry().pages_count;
        // Fit u32: each list holds at most pages_count distinct pages.
        let pages_free = self.pages_free.len() as u32;
        let pages_released = self.pages_released.len() as u32;
        let pages_booked = self.partitions.list.iter().map(|p| p.pages_booked).sum();
        let pages_shared: u32 = self.partitions.list.iter().map(|p| p.pages_shared).sum();
        let pages_shared_idle = self
            .partitions
            .list
            .iter()
            .map(|p| p.pages_shared_idle)
            .sum();
        PoolStats {
            pages_count,
            pages_free,
            pages_owned: pages_count - pages_free - pages_released - pages_shared,
            pages_released,
            pages_shared,
            pages_shared_idle,
            pages_booked,
        }
    }

    /// One owner's counts; `None` if it has no partition here.
    pub fn partition_stats(&self, owner: OwnerTag) -> Option<PartitionStats> {
        let index = self.partitions.index(owner)?;
        let partition = &self.partitions.list[index];
        Some(PartitionStats {
            config: partition.config,
            pages_booked: partition.pages_booked,
            pages_owned: partition.pages_owned,
            pages_released: partition.pages_released,
            pages_shared: partition.pages_shared,
            pages_available: self.partitions.pages_available(index),
        })
    }

    /// Adds a partition for a new owner (a tenant created while serving). Refused,
    /// changing nothing, when the owner has one, the config is invalid, the
    /// reservations would exceed the pool, or the reservation's pages are held
    /// by other owners' bursts right now.
    pub fn add_partition(&mut self, config: PartitionConfig) -> Result<(), PartitionError> {
        self.partitions.add(config)
    }

    /// Changes an owner's reservation and maximum (same refusals as
    /// [`Pool::add_partition`], and a maximum below what the owner holds).
    pub fn set_partition(&mut self, config: PartitionConfig) -> Result<(), PartitionError> {
        self.partitions.set(config)
    }

    /// Removes an owner's partition. Its sequences must have finished and its
    /// released pages been scrubbed: it holds no page, so none can still carry
    /// its data when the partition is gone.
    pub fn remove_partition(&mut self, owner: OwnerTag) -> Result<(), PartitionError> {
        self.partitions.remove(owner)
    }

    /// Books `pages` pages in `owner`'s partition without touching any page (I1): its
    /// reserved headroom plus the free burst region, never above its `pages_max` (I8).
    pub fn reserve(&mut self, owner: OwnerTag, pages: u32) -> Result<Reservation, ReserveError> {
        let index = self
            .partitions
            .index(owner)
            .ok_or(ReserveError::UnknownOwner { owner })?;
        if pages == 0 {
            return Err(ReserveError::ZeroPages);
        }
        let partition = &self.partitions.list[index];
        let pages_wanted = u64::from(partition.pages_held()) + u64::from(pages);
        if pages_wanted > u64::from(partition.config.pages_max) {
            return Err(ReserveError::AboveMax {
                owner,
                pages_wanted,
                pages_max: partition.config.pages_max,
            });
        }
        let pages_available = self.partitions.pages_available(index);
        if pages > pages_available {
            return Err(ReserveError::Exhausted {
                owner,
                pages,
                pages_available,
            });
        }
        self.partitions.list[index].pages_booked += pages;
        Ok(Reservation {
            pool_id: self.pool_id,
            owner,
            pages_booked: pages,
            leaks: Arc::clone(&self.leaks),
        })
    }

    /// Returns a reservation's unacquired pages to the pool; the token is consumed.
    /// Returns how many pages were unbooked.
    pub fn release_reservation(&mut self, mut reservation: Reservation) -> u32 {
        assert_eq!(
            reservation.pool_id, self.pool_id,
            "reservation from another pool"
        );
        let index = self.partition_index(reservation.owner);
        let partition = &mut self.partitions.list[index];
        let pages = reservation.pages_booked;
        assert!(
            partition.pages_booked >= pages,
            "booked count below a live reservation"
        );
        partition.pages_booked -= pages;
        reservation.pages_booked = 0;
        pages
    }

    /// An empty page table for sequence `seq` of the reservation's owner.
    pub fn page_table(&self, reservation: &Reservation, seq: SeqId) -> PageTable {
        assert_eq!(
            reservation.pool_id, self.pool_id,
            "reservation from another pool"
        );
        PageTable::new(
            self.pool_id,
            reservation.owner,
            seq,
            self.layout.geometry().page_tokens,
        )
    }

    /// Turns one booked page into an owned clean page at the end of `table`:
    /// `Free → Owned { owner, seq }`, with a new generation.
    pub fn acquire(
        &mut self,
        reservation: &mut Reservation,
        table: &mut PageTable,
    ) -> Result<PageHandle, AcquireError> {
        assert_eq!(
            reservation.pool_id, self.pool_id,
            "reservation from another pool"
        );
        assert_eq!(table.pool_id, self.pool_id, "page table from another pool");
        assert_eq!(
            reservation.owner,
            table.owner(),
            "reservation and page table owners differ"
        );
        let owner = reservation.owner;
        if reservation.pages_booked == 0 {
            return Err(AcquireError::ReservationExhausted { owner });
        }
        // Every booked page is backed by a free one: free = pages_count - Σ(owned +
        // released) ≥ Σ booked, because Σ held ≤ Σ claimed ≤ pages_count. A pop that
        // finds none means the accounting is broken.
        let Some(page) = self.pages_free.pop() else {
            panic!("booked page without a free page: accounting broken");
        };
        let meta = &mut self.pages[page.index()];
        assert_eq!(
            meta.state,
            PageState::Free,
            "page {page:?} on the free list is not free"
        );
        if self.options.paranoid {
            assert!(
                self.page_is_zero(page),
                "free page {page:?} is not scrubbed"
            );
        }
        let meta = &mut self.pages[page.index()];
        meta.generation = meta.generation.next();
        meta.state = PageState::Owned {
            owner,
            seq: table.seq(),
        };
        let handle = PageHandle {
            pool: self.pool_id,
            page,
            generation: meta.generation,
        };
        let index = self.partition_index(owner);
        let partition = &mut self.partitions.list[index];
        assert!(partition.pages_booked > 0 && reservation.pages_booked > 0);
        partition.pages_booked -= 1;
        partition.pages_owned += 1;
        reservation.pages_booked -= 1;
        table.push(handle);
        Ok(handle)
    }

    /// Empties `table`: each owned page is released (`Owned → Released`, dirty),
    /// each shared one loses this table's reference (it stays shared, for the
    /// owner's cache or its other sequences). Returns how many pages left the
    /// table. The table may be dropped afterwards.
    pub fn release(&mut self, table: &mut PageTable) -> u32 {
        let mut pages = 0;
        while self.release_last(table).is_some() {
            pages += 1;
        }
        pages
    }

    /// Takes the last page out of `table` (owned: `Owned → Released`, dirty;
    /// shared: one reference less); `None` if empty.
    pub fn release_last(&mut self, table: &mut PageTable) -> Option<PageHandle> {
        assert_eq!(table.pool_id, self.pool_id, "page table from another pool");
        let handle = table.pop()?;
        let (owner, seq) = (table.owner(), table.seq());
        let meta = &mut self.pages[handle.page.index()];
        // A table's handle is always current: only the pool edits tables. Anything else
        // is a corrupted table, and releasing through it could free another's page.
        assert_eq!(
            meta.generation, handle.generation,
            "stale handle in page table: {handle:?}"
        );
        if let PageState::Shared {
            owner: shared_owner,
            refs,
        } = meta.state
        {
            assert_eq!(
                shared_owner, owner,
                "page table holds another owner's shared page"
            );
            assert!(refs > 0, "shared page in a table with no reference counted");
            meta.state = PageState::Shared {
                owner,
                refs: refs - 1,
            };
            if refs == 1 {
                let at = self.partition_index(owner);
                self.partitions.list[at].pages_shared_idle += 1;
            }
            return Some(handle);
        }
        assert_eq!(
            meta.state,
            PageState::Owned { owner, seq },
            "page table holds a page it does not own"
        );
        meta.state = PageState::Released { owner };
        if self.options.poison_released {
            self.storage.poison(handle.page.index());
        }
        self.pages_released.push(handle.page);
        let index = self.partition_index(owner);
        let partition = &mut self.partitions.list[index];
        assert!(partition.pages_owned > 0, "owned count below a live page");
        partition.pages_owned -= 1;
        partition.pages_released += 1;
        Some(handle)
    }

    /// Shares the page at `index` of `table`: `Owned { owner, seq } → Shared {
    /// owner, refs: 1 }` (the table keeps it, now read-only). Its content must be
    /// final: no sequence writes it again (`write_kv` asserts, the backend refuses
    /// a step that would). Returns its handle, which [`Pool::attach`] appends to
    /// another table of the same owner.
    pub fn share(&mut self, table: &PageTable, index: usize) -> PageHandle {
        assert_eq!(table.pool_id, self.pool_id, "page table from another pool");
        let handle = *table
            .handles()
            .get(index)
            .expect("share of a page outside the table");
        let (owner, seq) = (table.owner(), table.seq());
        let meta = &mut self.pages[handle.page.index()];
        assert_eq!(
            meta.generation, handle.generation,
            "stale handle in page table: {handle:?}"
        );
        assert_eq!(
            meta.state,
            PageState::Owned { owner, seq },
            "share of a page the table does not own"
        );
        meta.state = PageState::Shared { owner, refs: 1 };
        let at = self.partition_index(owner);
        let partition = &mut self.partitions.list[at];
        assert!(partition.pages_owned > 0, "owned count below a live page");
        partition.pages_owned -= 1;
        partition.pages_shared += 1;
        handle
    }

    /// Appends shared page `handle` to `table`, a sequence of the page's owner:
    /// one reference more. Refused, changing nothing, for a handle whose lease
    /// ended (the page was evicted since) or a page that is not shared; asserts
    /// the owner (another owner's page reaching this table is a bug, never a
    /// shared prefix: I7).
    pub fn attach(&mut self, table: &mut PageTable, handle: PageHandle) -> Result<(), KvError> {
        assert_eq!(table.pool_id, self.pool_id, "page table from another pool");
        let page = self.check_handle(handle)?;
        let meta = &mut self.pages[page.index()];
        let PageState::Shared { owner, refs } = meta.state else {
            return Err(KvError::NotShared { page });
        };
        assert_eq!(
            owner,
            table.owner(),
            "attach of another owner's shared page"
        );
        meta.state = PageState::Shared {
            owner,
            refs: refs.checked_add(1).expect("references fit u32"),
        };
        table.push(handle);
        if refs == 0 {
            let at = self.partition_index(owner);
            let partition = &mut self.partitions.list[at];
            assert!(
                partition.pages_shared_idle > 0,
                "idle count below an idle page"
            );
            partition.pages_shared_idle -= 1;
        }
        Ok(())
    }

    /// Evicts a shared page no table holds: `Shared { owner, refs: 0 } →
    /// Released` (dirty, scrubbed with the other released pages; poisoned in
    /// poison mode), still charged to `owner` until scrubbed. Refused, changing
    /// nothing, for a stale handle, a page that is not shared, or one in use.
    pub fn evict(&mut self, owner: OwnerTag, handle: PageHandle) -> Result<(), KvError> {
        let page = self.check_handle(handle)?;
        let meta = &mut self.pages[page.index()];
        let PageState::Shared {
            owner: shared_owner,
            refs,
        } = meta.state
        else {
            return Err(KvError::NotShared { page });
        };
        assert_eq!(shared_owner, owner, "evict of another owner's shared page");
        if refs > 0 {
            return Err(KvError::InUse { page, refs });
        }
        meta.state = PageState::Released { owner };
        if self.options.poison_released {
            self.storage.poison(page.index());
        }
        self.pages_released.push(page);
        let at = self.partition_index(owner);
        let partition = &mut self.partitions.list[at];
        assert!(
            partition.pages_shared > 0 && partition.pages_shared_idle > 0,
            "shared count below a shared page"
        );
        partition.pages_shared -= 1;
        partition.pages_shared_idle -= 1;
        partition.pages_released += 1;
        Ok(())
    }

    /// Whether `lease` may be written: its page is owned by its sequence, not
    /// shared (errors as for a read).
    pub fn is_writable(&self, lease: Lease) -> Result<bool, KvError> {
        let page = self.check_lease(lease)?;
        Ok(matches!(
            self.pages[page.index()].state,
            PageState::Owned { .. }
        ))
    }

    /// Scrubs every released page: zero, `Released → Scrubbed → Free`; the capacity
    /// returns to its last owner. The scheduler runs this between steps. Returns how
    /// many pages were scrubbed.
    pub fn scrub_released(&mut self) -> u32 {
        let mut pages = 0;
        while let Some(page) = self.pages_released.pop() {
            self.scrub(page);
            pages += 1;
        }
        pages
    }

    fn scrub(&mut self, page: PageId) {
        let PageState::Released { owner } = self.pages[page.index()].state else {
            panic!("scrub of page {page:?} that is not released");
        };
        self.storage.scrub(page.index());
        self.pages[page.index()].state = PageState::Scrubbed { owner };
        if self.options.paranoid {
            assert!(
                self.page_is_zero(page),
                "page {page:?} not zero after scrub"
            );
        }
        let meta = &mut self.pages[page.index()];
        assert_eq!(meta.state, PageState::Scrubbed { owner });
        meta.state = PageState::Free;
        self.pages_free.push(page);
        let index = self.partition_index(owner);
        let partition = &mut self.partitions.list[index];
        assert!(
            partition.pages_released > 0,
            "released count below a dirty page"
        );
        partition.pages_released -= 1;
    }

    /// Writes one token's K and V (`[kv_dim]` each) into `slot` of `layer`.
    pub fn write_kv(
        &mut self,
        lease: Lease,
        layer: u32,
        slot: u32,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), KvError> {
        let page = self.check_lease(lease)?;
        self.write_leased(page, layer, slot, k, v);
        Ok(())
    }

    /// `write_kv` to a page whose lease the caller has checked.
    fn write_leased(&mut self, page: PageId, layer: u32, slot: u32, k: &[f32], v: &[f32]) {
        assert!(
            matches!(self.pages[page.index()].state, PageState::Owned { .. }),
            "write to shared page {page:?}"
        );
        let layout = self.layout;
        let kv_dim = layout.kv_dim();
        assert_eq!(k.len(), kv_dim, "k is not [kv_dim]");
        assert_eq!(v.len(), kv_dim, "v is not [kv_dim]");
        let k_at = layout.k_offset(layer) + layout.slot_offset(slot);
        let v_at = layout.v_offset(layer) + layout.slot_offset(slot);
        self.storage.write_token(page.index(), k_at, v_at, k, v);
    }

    /// One layer's K and V of a page, each `// [page_tokens][kv_dim]` in the
    /// stored type, for attention. Ownership is checked here (I3). Asserts the
    /// pool's storage is in host memory.
    pub fn page_kv(&self, lease: Lease, layer: u32) -> Result<(KvSlab<'_>, KvSlab<'_>), KvError> {
        let page = self.check_lease(lease)?;
        Ok(self.host_slabs(page, layer))
    }

    /// Checks every lease of every table of one step once, for the step's
    /// writes and reads of every layer, head and position (the CPU backend's
    /// forward pass). The view borrows the pool mutably, so nothing can
    /// release, share or re-lease those pages while it lives: each check holds
    /// for the whole step. A stale handle is refused, changing nothing.
    pub fn step_view(&mut self, tables: &[&PageTable]) -> Result<StepView<'_>, KvError> {
        let mut pages = Vec::with_capacity(tables.len());
        for table in tables {
            assert_eq!(table.pool_id, self.pool_id, "page table from another pool");
            let leased = (0..table.pages_count())
                .map(|i| self.check_lease(table.lease(i).expect("index below pages_count")))
                .collect::<Result<Vec<_>, _>>()?;
            pages.push(leased);
        }
        Ok(StepView { pool: self, pages })
    }

    fn host_slabs(&self, page: PageId, layer: u32) -> (KvSlab<'_>, KvSlab<'_>) {
        assert!(
            layer < self.layout.geometry().layers,
            "layer {layer} out of range"
        );
        self.storage
            .host(page.index(), layer)
            .expect("the pool's storage is not in host memory")
    }

    /// Whether the pool's values are in host memory (the CPU backend needs them).
    pub fn is_host(&self) -> bool {
        self.storage.host(0, 0).is_some()
    }

    /// Where the pool's values live on a device, if they do (the CUDA backend needs them).
    pub fn device_values(&self) -> Option<DeviceValues> {
        self.storage.device()
    }

    /// The digest of the page's first `tokens_used` slots (see [`super::digest`]).
    pub fn digest(&self, lease: Lease, tokens_used: u32) -> Result<u64, KvError> {
        let page = self.check_lease(lease)?;
        let page_tokens = self.layout.geometry().page_tokens;
        assert!(
            tokens_used <= page_tokens,
            "tokens_used {tokens_used} above page_tokens {page_tokens}"
        );
        Ok(self.storage.digest(page.index(), tokens_used))
    }

    /// Checks a lease against the page: a typed error for another pool's handle or
    /// an ended lease (a caller can plausibly hold one), an assert for a current
    /// lease claimed by someone else (a handle reached the wrong sequence: crash
    /// rather than serve it, I3).
    pub(super) fn check_lease(&self, lease: Lease) -> Result<PageId, KvError> {
        let page = self.check_handle(lease.handle)?;
        match self.pages[page.index()].state {
            PageState::Owned { owner, seq } => {
                assert_eq!(
                    owner, lease.owner,
                    "page {page:?} owner mismatch: cross-tenant access"
                );
                assert_eq!(seq, lease.seq, "page {page:?} sequence mismatch");
                Ok(page)
            }
            // Shared pages are read by any sequence of their owner; never another's.
            PageState::Shared { owner, .. } => {
                assert_eq!(
                    owner, lease.owner,
                    "page {page:?} owner mismatch: cross-tenant access"
                );
                Ok(page)
            }
            _ => Err(KvError::StaleHandle {
                page,
                generation: lease.handle.generation,
            }),
        }
    }

    /// Checks a handle's pool, page and generation: the page is the one the
    /// handle was issued for, and still leased (owned or shared).
    fn check_handle(&self, handle: PageHandle) -> Result<PageId, KvError> {
        let PageHandle {
            pool,
            page,
            generation,
        } = handle;
        if pool != self.pool_id {
            return Err(KvError::ForeignPool {
                page,
                handle_pool: pool,
                pool: self.pool_id,
            });
        }
        let meta = self
            .pages
            .get(page.index())
            .ok_or(KvError::PageOutOfRange { page })?;
        let leased = matches!(
            meta.state,
            PageState::Owned { .. } | PageState::Shared { .. }
        );
        if meta.generation != generation || !leased {
            return Err(KvError::StaleHandle { page, generation });
        }
        Ok(page)
    }

    pub(super) fn partition_index(&self, owner: OwnerTag) -> usize {
        match self.partitions.index(owner) {
            Some(index) => index,
            None => panic!("owner {owner:?} has no partition, yet holds pool state"),
        }
    }

    /// Whether every value of the page is +0.0 (bits, so -0.0 and NaN count as dirty).
    pub(super) fn page_is_zero(&self, page: PageId) -> bool {
        self.storage.is_zero(page.index())
    }
}

/// Every page of every table of one step, leases checked once
/// ([`Pool::step_view`]). Tables and pages are named by their index in the
/// step and in the table.
#[derive(Debug)]
pub struct StepView<'p> {
    pool: &'p mut Pool,
    /// `// [table][page index in the table]`
    pages: Vec<Vec<PageId>>,
}

impl StepView<'_> {
    /// The pool's page layout.
    pub fn layout(&self) -> &PageLayout {
        &self.pool.layout
    }

    /// Writes one token's K and V (`[kv_dim]` each) into `slot` of `layer` in
    /// the `index`-th page of table `table`. Asserts the page is not shared
    /// (the backend refuses such a step before it starts).
    pub fn write_kv(
        &mut self,
        table: usize,
        index: usize,
        layer: u32,
        slot: u32,
        k: &[f32],
        v: &[f32],
    ) {
        let page = self.pages[table][index];
        self.pool.write_leased(page, layer, slot, k, v);
    }

    /// K and V of `layer` in the `index`-th page of table `table`, each
    /// `// [page_tokens][kv_dim]`. Panics past a table's end.
    pub fn page(&self, table: usize, index: usize, layer: u32) -> (KvSlab<'_>, KvSlab<'_>) {
        self.pool.host_slabs(self.pages[table][index], layer)
    }

    /// The pages of table `table`, each lease checked when the view was made:
    /// what a device backend packs into the page tables its kernels read.
    pub fn page_ids(&self, table: usize) -> &[PageId] {
        &self.pages[table]
    }

    /// Where the pool's values live on a device, if they do.
    pub fn device_values(&self) -> Option<DeviceValues> {
        self.pool.storage.device()
    }
}
