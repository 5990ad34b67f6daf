//! Fault injection for canary tests: each hook plants one bug the checker must catch.
//!
//! Compiled only for this crate's tests and with feature `fault-injection` (for the
//! host's simulation tests). Each hook corrupts exactly one thing, so a canary shows
//! that the checker looks at that thing.

use super::ids::{OwnerTag, PageId};
use super::pool::{PageState, Pool};

impl Pool {
    /// Moves the first released page straight to the free list without zeroing it, as a
    /// scrub that forgot to zero would. Counters stay consistent; only the contents are
    /// wrong. Returns the page, or `None` if no page is released.
    #[doc(hidden)]
    pub fn plant_fault_unscrubbed_free(&mut self) -> Option<PageId> {
        let page = self.pages_released.pop()?;
        let PageState::Released { owner } = self.pages[page.index()].state else {
            panic!("released list holds a page that is not released");
        };
        let index = self.partition_index(owner);
        self.partitions.list[index].pages_released -= 1;
        self.pages[page.index()].state = PageState::Free;
        self.pages_free.push(page);
        Some(page)
    }

    /// Lists a released page on the scrub queue a second time, as a release without its
    /// state check would.
    #[doc(hidden)]
    pub fn plant_fault_double_release(&mut self, page: PageId) {
        self.pages_released.push(page);
    }

    /// Bumps an owned page's generation without a new lease, so the handles in its
    /// table become stale.
    #[doc(hidden)]
    pub fn plant_fault_stale_generation(&mut self, page: PageId) {
        let meta = &mut self.pages[page.index()];
        meta.generation = meta.generation.next();
    }

    /// Rewrites an owned page's owner, as a lease to the wrong tenant would.
    #[doc(hidden)]
    pub fn plant_fault_owner(&mut self, page: PageId, owner: OwnerTag) {
        let meta = &mut self.pages[page.index()];
        let PageState::Owned { seq, .. } = meta.state else {
            panic!("plant_fault_owner needs an owned page");
        };
        meta.state = PageState::Owned { owner, seq };
    }

    /// Writes one value into a free page, as a write through a stale pointer would.
    #[doc(hidden)]
    pub fn plant_fault_dirty_free(&mut self, page: PageId) {
        assert_eq!(self.pages[page.index()].state, PageState::Free);
        self.storage.write_token(page.index(), 0, 0, &[1.0], &[]);
    }
}
