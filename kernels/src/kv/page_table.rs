//! A sequence's page table: the ordered pages that hold its KV, and whose they are.
//!
//! Only the pool adds a page to a table (in `Pool::acquire`) or removes one (in
//! `Pool::release` / `Pool::release_last`), so a table holds only pages leased to its
//! own `(owner, seq)` (I3). Token `t` of the sequence lives in page `t / page_tokens`,
//! slot `t % page_tokens`.

use super::ids::{Lease, OwnerTag, PageHandle, PoolId, SeqId};

/// The pages of one sequence, in token order.
#[derive(Debug, PartialEq, Eq)]
pub struct PageTable {
    pub(super) pool_id: PoolId,
    owner: OwnerTag,
    seq: SeqId,
    page_tokens: u32,
    handles: Vec<PageHandle>,
}

impl PageTable {
    pub(super) fn new(pool_id: PoolId, owner: OwnerTag, seq: SeqId, page_tokens: u32) -> Self {
        PageTable {
            pool_id,
            owner,
            seq,
            page_tokens,
            handles: Vec::new(),
        }
    }

    /// The owner every page of this table is leased to.
    pub fn owner(&self) -> OwnerTag {
        self.owner
    }

    /// The sequence every page of this table is leased to.
    pub fn seq(&self) -> SeqId {
        self.seq
    }

    /// The handles, in token order.
    pub fn handles(&self) -> &[PageHandle] {
        &self.handles
    }

    /// Pages in the table.
    pub fn pages_count(&self) -> usize {
        self.handles.len()
    }

    /// Whether the table holds no page.
    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    /// Token positions the table's pages can hold: `pages_count * page_tokens`.
    pub fn token_capacity(&self) -> u64 {
        self.handles.len() as u64 * u64::from(self.page_tokens)
    }

    /// The lease for the page at `index`, for the KV accessors; `None` past the end.
    pub fn lease(&self, index: usize) -> Option<Lease> {
        self.handles.get(index).map(|&handle| Lease {
            handle,
            owner: self.owner,
            seq: self.seq,
        })
    }

    pub(super) fn push(&mut self, handle: PageHandle) {
        self.handles.push(handle);
    }

    pub(super) fn pop(&mut self) -> Option<PageHandle> {
        self.handles.pop()
    }

    /// Fault injection: adds a handle the pool never leased to this table, as a buggy
    /// table update would (a page in two tables, or a stale handle).
    #[cfg(any(test, feature = "fault-injection"))]
    #[doc(hidden)]
    pub fn plant_fault_push(&mut self, handle: PageHandle) {
        self.handles.push(handle);
    }
}
