//! The invariant checker: recounts everything from the page array and compares.
//!
//! `check_invariants` sees the pool alone; `check_page_tables` adds the live page
//! tables, which only the caller knows. Both are O(pages) (plus O(values) for the
//! zero check in paranoid mode) and meant for tests, simulation and a paranoid mode,
//! not for every step of a production scheduler. `free_pages_dirty` is the zero check
//! alone, on demand in any mode: O(values of the free pages), for an audit.

use super::ids::{Generation, OwnerTag, PageId, SeqId};
use super::page_table::PageTable;
use super::pool::{PageState, Pool};
use std::sync::atomic::Ordering;
use thiserror::Error;

/// A broken invariant. Any of these means the pool must not serve another step.
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
pub enum Violation {
    /// The free list and the `Free` pages disagree (missing, duplicated, or not free).
    #[error("free list disagrees with page {page:?}")]
    FreeList {
        /// The page.
        page: PageId,
    },
    /// The scrub queue and the `Released` pages disagree (a double release lists twice).
    #[error("released list disagrees with page {page:?}")]
    ReleasedList {
        /// The page.
        page: PageId,
    },
    /// A page rests in `Scrubbed`, which only exists inside a scrub.
    #[error("page {page:?} left in Scrubbed")]
    ScrubbedAtRest {
        /// The page.
        page: PageId,
    },
    /// A page is charged to an owner with no partition.
    #[error("page {page:?} charged to unknown owner {owner:?}")]
    UnknownOwner {
        /// The page.
        page: PageId,
        /// The owner.
        owner: OwnerTag,
    },
    /// A partition's counter disagrees with the pages.
    #[error("owner {owner:?}: {counter} is {recorded}, pages say {counted}")]
    Count {
        /// The owner.
        owner: OwnerTag,
        /// Which counter.
        counter: &'static str,
        /// The counter's value.
        recorded: u32,
        /// The recount.
        counted: u32,
    },
    /// An owner holds more than its `pages_max`.
    #[error("owner {owner:?} holds {pages_held} pages, above pages_max {pages_max}")]
    AboveMax {
        /// The owner.
        owner: OwnerTag,
        /// Booked + owned + released.
        pages_held: u32,
        /// Its maximum.
        pages_max: u32,
    },
    /// Σ max(held, reserved) exceeds the pool: someone ate another's reservation.
    #[error("owners claim {pages_claimed} pages of {pages_count}: a reservation was taken")]
    ReservationTaken {
        /// Σ pages_claimed.
        pages_claimed: u64,
        /// The pool's pages.
        pages_count: u32,
    },
    /// Fewer free pages than booked ones: an acquire could find none.
    #[error("{pages_booked} pages booked but only {pages_free} free")]
    BookedUnbacked {
        /// Σ booked.
        pages_booked: u64,
        /// Free pages.
        pages_free: u32,
    },
    /// Reservations were dropped while still booking pages (leaked capacity).
    #[error("{reservations} reservations dropped holding {pages} booked pages")]
    ReservationDropped {
        /// How many reservations.
        reservations: u32,
        /// Their booked pages.
        pages: u64,
    },
    /// A free page is not all zeros (paranoid mode): it would be handed out dirty.
    #[error("free page {page:?} is not scrubbed")]
    FreePageDirty {
        /// The page.
        page: PageId,
    },
    /// One page appears in two page tables (or twice in one).
    #[error("page {page:?} is in two page tables")]
    PageInTwoTables {
        /// The page.
        page: PageId,
    },
    /// A table holds a handle whose lease has ended.
    #[error("page table holds stale handle for page {page:?}: generation {handle:?}, page at {page_generation:?}")]
    StaleHandleInTable {
        /// The page.
        page: PageId,
        /// The handle's generation.
        handle: Generation,
        /// The page's generation.
        page_generation: Generation,
    },
    /// A table holds a page owned by a different owner or sequence.
    #[error("page table of {owner:?}/{seq:?} holds page {page:?} it does not own")]
    TableNotOwner {
        /// The page.
        page: PageId,
        /// The table's owner.
        owner: OwnerTag,
        /// The table's sequence.
        seq: SeqId,
    },
    /// An owned page is in no page table (a table was dropped without release).
    #[error("owned page {page:?} is in no page table")]
    OrphanPage {
        /// The page.
        page: PageId,
    },
    /// A page table names a page this pool does not have.
    #[error("page table names page {page:?}, outside the pool")]
    PageOutOfRange {
        /// The page.
        page: PageId,
    },
    /// A page table of another pool.
    #[error("a page table belongs to another pool")]
    ForeignTable,
    /// A page table holds a handle another pool leased.
    #[error("page {page:?} in a table was leased by another pool")]
    ForeignHandleInTable {
        /// The page the handle names.
        page: PageId,
    },
    /// A shared page's reference count and the tables holding it disagree.
    #[error("shared page {page:?} counts {refs} references, {tables} tables hold it")]
    SharedRefs {
        /// The page.
        page: PageId,
        /// Its count.
        refs: u32,
        /// Tables that hold it.
        tables: u32,
    },
}

/// Per-owner recount from the page array.
#[derive(Clone, Copy, Default)]
struct Recount {
    pages_owned: u32,
    pages_shared: u32,
    pages_shared_idle: u32,
    pages_released: u32,
}

impl Pool {
    /// Verifies everything about the pool that must hold between calls.
    pub fn check_invariants(&self) -> Result<(), Violation> {
        self.check_lists()?;
        self.check_partitions()?;
        let reservations = self.leaks.reservations.load(Ordering::Relaxed);
        if reservations > 0 {
            return Err(Violation::ReservationDropped {
                reservations,
                pages: self.leaks.pages.load(Ordering::Relaxed),
            });
        }
        if self.options.paranoid {
            if let Some(page) = self.free_pages_unscrubbed().next() {
                return Err(Violation::FreePageDirty { page });
            }
        }
        Ok(())
    }

    /// Every free page that is not all zeros, in free-list order: pages a
    /// scrub missed, which would be handed out dirty. Scans every free page's
    /// values whatever [`PoolOptions::paranoid`](super::PoolOptions::paranoid)
    /// says — one pass over the free pages' bytes — so it answers an audit
    /// (is every released page scrubbed?) in any build; not for every step.
    pub fn free_pages_dirty(&self) -> Vec<PageId> {
        self.free_pages_unscrubbed().collect()
    }

    /// The free pages that are not all zeros, scanned lazily.
    fn free_pages_unscrubbed(&self) -> impl Iterator<Item = PageId> + '_ {
        self.pages_free
            .iter()
            .copied()
            .filter(|&page| !self.page_is_zero(page))
    }

    /// `check_invariants`, plus: `tables` (every live page table of this pool) hold
    /// only current handles — to pages their own (owner, seq) owns, or shared
    /// pages of their own owner — no page twice in one table, an owned page in
    /// one table only and in one of them, and each shared page in exactly as
    /// many tables as it counts references.
    pub fn check_page_tables(&self, tables: &[&PageTable]) -> Result<(), Violation> {
        self.check_page_tables_with(tables, &[])
    }

    /// [`Pool::check_page_tables`] with the tables that imports waiting for a
    /// transfer hold (their pages are leased like any table's).
    pub fn check_page_tables_with(
        &self,
        tables: &[&PageTable],
        imports: &[&super::transfer::Import],
    ) -> Result<(), Violation> {
        let held: Vec<&PageTable> = imports.iter().map(|i| i.table()).collect();
        let tables: Vec<&PageTable> = tables.iter().copied().chain(held).collect();
        let tables = &tables[..];
        self.check_invariants()?;
        // How many tables hold each page.
        let mut holders = vec![0u32; self.pages.len()];
        for table in tables {
            if table.pool_id != self.pool_id {
                return Err(Violation::ForeignTable);
            }
            let mut in_this_table = std::collections::HashSet::new();
            for handle in table.handles() {
                let page = handle.page;
                if handle.pool != self.pool_id {
                    return Err(Violation::ForeignHandleInTable { page });
                }
                let Some(meta) = self.pages.get(page.index()) else {
                    return Err(Violation::PageOutOfRange { page });
                };
                holders[page.index()] += 1;
                let owned = matches!(meta.state, PageState::Owned { .. });
                if !in_this_table.insert(page) || (owned && holders[page.index()] > 1) {
                    return Err(Violation::PageInTwoTables { page });
                }
                if meta.generation != handle.generation {
                    return Err(Violation::StaleHandleInTable {
                        page,
                        handle: handle.generation,
                        page_generation: meta.generation,
                    });
                }
                let (owner, seq) = (table.owner(), table.seq());
                let ours = match meta.state {
                    PageState::Owned { .. } => meta.state == PageState::Owned { owner, seq },
                    PageState::Shared { owner: o, .. } => o == owner,
                    _ => false,
                };
                if !ours {
                    return Err(Violation::TableNotOwner { page, owner, seq });
                }
            }
        }
        for (index, meta) in self.pages.iter().enumerate() {
            let page = PageId(index as u32);
            match meta.state {
                PageState::Owned { .. } if holders[index] == 0 => {
                    return Err(Violation::OrphanPage { page })
                }
                PageState::Shared { refs, .. } if refs != holders[index] => {
                    return Err(Violation::SharedRefs {
                        page,
                        refs,
                        tables: holders[index],
                    })
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The free list and the scrub queue list exactly the `Free` and `Released` pages.
    fn check_lists(&self) -> Result<(), Violation> {
        let mut listed = vec![0u8; self.pages.len()];
        for &page in &self.pages_free {
            let seen = listed
                .get_mut(page.index())
                .ok_or(Violation::FreeList { page })?;
            if *seen != 0 || self.pages[page.index()].state != PageState::Free {
                return Err(Violation::FreeList { page });
            }
            *seen = 1;
        }
        for &page in &self.pages_released {
            let seen = listed
                .get_mut(page.index())
                .ok_or(Violation::ReleasedList { page })?;
            let released = matches!(self.pages[page.index()].state, PageState::Released { .. });
            if *seen != 0 || !released {
                return Err(Violation::ReleasedList { page });
            }
            *seen = 1;
        }
        for (index, meta) in self.pages.iter().enumerate() {
            let page = PageId(index as u32);
            match meta.state {
                PageState::Free if listed[index] == 0 => return Err(Violation::FreeList { page }),
                PageState::Released { .. } if listed[index] == 0 => {
                    return Err(Violation::ReleasedList { page })
                }
                PageState::Scrubbed { .. } => return Err(Violation::ScrubbedAtRest { page }),
                _ => {}
            }
        }
        Ok(())
    }

    /// Every partition's counters match the pages, no owner is above its maximum, and
    /// the reservations and bookings are backed by the pool.
    fn check_partitions(&self) -> Result<(), Violation> {
        let mut recounts = vec![Recount::default(); self.partitions.list.len()];
        for (index, meta) in self.pages.iter().enumerate() {
            let page = PageId(index as u32);
            let owner = match meta.state {
                PageState::Owned { owner, .. }
                | PageState::Shared { owner, .. }
                | PageState::Released { owner } => owner,
                _ => continue,
            };
            let at = self
                .partitions
                .index(owner)
                .ok_or(Violation::UnknownOwner { page, owner })?;
            let recount = &mut recounts[at];
            match meta.state {
                PageState::Owned { .. } => recount.pages_owned += 1,
                PageState::Shared { refs, .. } => {
                    recount.pages_shared += 1;
                    recount.pages_shared_idle += u32::from(refs == 0);
                }
                _ => recount.pages_released += 1,
            }
        }
        let mut pages_booked: u64 = 0;
        for (partition, recount) in self.partitions.list.iter().zip(&recounts) {
            let owner = partition.config.owner;
            let pairs = [
                ("pages_owned", partition.pages_owned, recount.pages_owned),
                ("pages_shared", partition.pages_shared, recount.pages_shared),
                (
                    "pages_shared_idle",
                    partition.pages_shared_idle,
                    recount.pages_shared_idle,
                ),
                (
                    "pages_released",
                    partition.pages_released,
                    recount.pages_released,
                ),
            ];
            for (counter, recorded, counted) in pairs {
                if recorded != counted {
                    return Err(Violation::Count {
                        owner,
                        counter,
                        recorded,
                        counted,
                    });
                }
            }
            let pages_held = u64::from(partition.pages_booked)
                + u64::from(partition.pages_owned)
                + u64::from(partition.pages_shared)
                + u64::from(partition.pages_released);
            if pages_held > u64::from(partition.config.pages_max) {
                return Err(Violation::AboveMax {
                    owner,
                    // Fits u32 here or saturates the report only; the check used u64.
                    pages_held: u32::try_from(pages_held).unwrap_or(u32::MAX),
                    pages_max: partition.config.pages_max,
                });
            }
            pages_booked += u64::from(partition.pages_booked);
        }
        let pages_count = self.layout.geometry().pages_count;
        let pages_claimed = self.partitions.pages_claimed_sum();
        if pages_claimed > u64::from(pages_count) {
            return Err(Violation::ReservationTaken {
                pages_claimed,
                pages_count,
            });
        }
        // Fits u32: the free list holds distinct pages (checked above).
        let pages_free = self.pages_free.len() as u32;
        if pages_booked > u64::from(pages_free) {
            return Err(Violation::BookedUnbacked {
                pages_booked,
                pages_free,
            });
        }
        Ok(())
    }
}
