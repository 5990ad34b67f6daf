//! Identities used by the pool: opaque owners, sequences, pages, generations.
//!
//! Each is a newtype with an explicit width so that a page id can never be passed where
//! an owner tag is expected, and so that stored keys have a fixed size.

/// A pool's identity, unique within the process. Every handle carries the pool it
/// was leased from, so a handle (or page table) can never be used on another pool
/// (another model's) even where page index, generation, owner and sequence agree.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolId(pub u32);

/// An opaque tenant tag. The kernels crate never learns tenant names; the host maps its
/// `TenantId` to a tag when it builds the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OwnerTag(pub u32);

/// A sequence (one request's token stream) inside a tenant. Chosen by the host; the pool
/// only compares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

/// The index of a page in its pool: `0..pages_count`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageId(pub u32);

impl PageId {
    /// The page's index into the pool's arrays.
    pub fn index(self) -> usize {
        // A u32 always fits in usize on the 32- and 64-bit targets this crate supports.
        self.0 as usize
    }
}

/// How many times a page has been leased. Incremented on every acquire, so a handle
/// from an earlier lease no longer matches (a stale handle).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Generation(pub u32);

impl Generation {
    /// The generation of the next lease.
    ///
    /// Wraps after 2^32 leases of one page. A stale handle would then have to survive
    /// exactly 2^32 re-leases of its page to match again, and even then the owner and
    /// sequence are compared too (asserted), so a wrap cannot hand one tenant's page to
    /// another; wrapping is preferred over an assert that would stop a long-running host.
    pub fn next(self) -> Generation {
        Generation(self.0.wrapping_add(1))
    }
}

/// A reference to one lease of one page. `Copy`: holding a handle grants nothing by
/// itself; every access also names the owner and sequence, and is checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PageHandle {
    /// The pool that leased it.
    pub pool: PoolId,
    /// The page.
    pub page: PageId,
    /// The lease this handle was issued for.
    pub generation: Generation,
}

/// A claim to access one page: "I am `owner`'s sequence `seq` and I hold `handle`".
///
/// Every KV accessor takes a lease and checks all three parts against the page state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Lease {
    /// The page and generation.
    pub handle: PageHandle,
    /// The tenant the caller acts for.
    pub owner: OwnerTag,
    /// The sequence the caller acts for.
    pub seq: SeqId,
}
