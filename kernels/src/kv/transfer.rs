//! KV transfers between pools: a prefill side exports a sequence's prompt
//! pages, a decode side imports them into pages it reserved, and nothing it
//! imported can be decoded from before the page book has checked it (I5:
//! completion is not validation).
//!
//! The receiver decides what it will accept before a byte arrives: it books
//! the sequence's pages in the tenant's partition, acquires them into the
//! sequence's own table, and wraps that table in an [`Import`] with the
//! [`TransferIdentity`] it asked for — the request, a fresh job nonce, the
//! tenant's stable id, the model's fingerprint, and the token count and token
//! digest of *its own* tokenization. An `Import` cannot be stepped (it gives
//! its table to nobody); [`Pool::import`] is its only way out, and gives the
//! table back as decodable only when, in this order:
//!
//! 1. the header's page shape is this pool's (page tokens, layers, KV heads,
//!    head width, value type);
//! 2. every identity field equals what the receiver asked for (a replayed,
//!    swapped or unasked-for transfer differs in request, job or owner; a
//!    placeholder that claims one token differs in `tokens`);
//! 3. the header's page count is what `tokens` needs, and is what arrived:
//!    each page once, in order, each exactly as long as its used slots;
//! 4. the digest over the header and the page digests is the sender's;
//! 5. each page's bytes hashed, as they arrived, to the digest its frame
//!    claimed ([`ReceivedPage::arrived`] hashes them, and nothing changes
//!    them after), and, written into its reserved page, read back from
//!    *storage* bit for bit as those bytes: what is stored hashes to the
//!    sender's digest.
//!
//! Hashing as each page arrives, off the engine thread, keeps the digest
//! out of the import's time: the engine thread only copies and compares.
//!
//! Anything else refuses the import ([`ImportRefused`]) and hands the table
//! back to be released: the pages, possibly half-written, go through the one
//! release path and are scrubbed before reuse (I4), like any other.
//!
//! A page's bytes on the wire are the digest's order, so its digest is
//! `XXH3-64(bytes, seed = tokens_used)`:
//!
//! ```text
//! for layer in 0..layers:
//!     K[layer][0..tokens_used][kv_dim]  stored bits, LE
//!     V[layer][0..tokens_used][kv_dim]  stored bits, LE
//! ```

use super::digest::Xxh64;
use super::geometry::PoolGeometry;
use super::ids::OwnerTag;
use super::page_table::PageTable;
use super::pool::{KvError, Pool};
use super::storage::KvType;
use thiserror::Error;

/// Who and what a transfer is for: what the receiver asked for, and what the
/// sender's header must repeat field for field.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TransferIdentity {
    /// The receiver's request id.
    pub request: u64,
    /// A nonce the receiver drew for this job: an earlier transfer of the same
    /// request (a replay) carries another.
    pub job: u64,
    /// The tenant's stable registry id (its partition).
    pub owner: OwnerTag,
    /// The model's fingerprint (both sides computed it from their files).
    pub model: u64,
    /// KV positions carried.
    pub tokens: u32,
    /// [`tokens_digest`] of the token ids those positions hold.
    pub tokens_digest: u64,
}

/// The page shape both pools must share: the geometry without the pool size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PageShape {
    /// Token positions per page.
    pub page_tokens: u32,
    /// Transformer layers.
    pub layers: u32,
    /// KV heads per layer.
    pub kv_heads: u32,
    /// Values per head.
    pub head_dim: u32,
    /// How each value is stored.
    pub kv_type: KvType,
}

impl PageShape {
    /// The shape of `geometry`'s pages.
    pub fn of(geometry: &PoolGeometry) -> PageShape {
        PageShape {
            page_tokens: geometry.page_tokens,
            layers: geometry.layers,
            kv_heads: geometry.kv_heads,
            head_dim: geometry.head_dim,
            kv_type: geometry.kv_type,
        }
    }

    /// Pages that hold `tokens` positions.
    pub fn pages_for(&self, tokens: u32) -> u32 {
        tokens.div_ceil(self.page_tokens)
    }

    /// Used slots of page `index` of a transfer of `tokens` positions.
    pub fn tokens_in_page(&self, tokens: u32, index: u32) -> u32 {
        tokens
            .saturating_sub(index.saturating_mul(self.page_tokens))
            .min(self.page_tokens)
    }

    /// Bytes a page with `tokens_used` slots carries.
    pub fn page_bytes(&self, tokens_used: u32) -> u64 {
        2 * u64::from(self.layers)
            * u64::from(tokens_used)
            * u64::from(self.kv_heads)
            * u64::from(self.head_dim)
            * self.kv_type.bytes()
    }
}

/// What a transfer says about itself before its pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransferHeader {
    /// Whose and what.
    pub identity: TransferIdentity,
    /// Pages that follow.
    pub pages: u32,
    /// Their shape.
    pub shape: PageShape,
}

/// One page as received: its index in the transfer, the digest the sender
/// claims for it, its bytes, and what they hashed to as they arrived. Made
/// only by [`ReceivedPage::arrived`], and read-only after: the hash is of
/// these bytes and no others.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReceivedPage {
    index: u32,
    digest: u64,
    bytes: Vec<u8>,
    /// The used slots the bytes were hashed for, and their digest.
    hashed: (u32, u64),
}

impl ReceivedPage {
    /// Page `index` of the transfer `header` announces, as it arrived:
    /// hashes `bytes` for the slots that page of `header` uses (an import
    /// whose header differs from what the receiver asked for is refused
    /// before this matters).
    pub fn arrived(header: &TransferHeader, index: u32, digest: u64, bytes: Vec<u8>) -> Self {
        let tokens_used = header.shape.tokens_in_page(header.identity.tokens, index);
        let hashed = (tokens_used, page_digest(tokens_used, &bytes));
        ReceivedPage {
            index,
            digest,
            bytes,
            hashed,
        }
    }

    /// Position in the transfer (0-based).
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The sender's digest of it.
    pub fn digest(&self) -> u64 {
        self.digest
    }

    /// Its used slots, in the wire order of the module doc.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

/// A whole transfer as received, not yet checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Received {
    /// The header.
    pub header: TransferHeader,
    /// The pages, in arrival order.
    pub pages: Vec<ReceivedPage>,
    /// The sender's [`transfer_digest`].
    pub digest: u64,
}

/// The digest of a token sequence: identity of what a transfer's KV is for.
pub fn tokens_digest(tokens: &[u32]) -> u64 {
    let mut hasher = Xxh64::new();
    hasher.write_u32(tokens.len() as u32);
    for &token in tokens {
        hasher.write_u32(token);
    }
    hasher.finish()
}

/// The digest of one page's wire bytes (equal to the pool's page digest of
/// the same values).
pub fn page_digest(tokens_used: u32, bytes: &[u8]) -> u64 {
    super::digest::xxh3_64(bytes, u64::from(tokens_used))
}

/// The digest over a transfer: its header's fields and its page digests in
/// order, so pages reordered, duplicated or swapped with another transfer's
/// are caught even where each page is intact.
pub fn transfer_digest(header: &TransferHeader, page_digests: impl Iterator<Item = u64>) -> u64 {
    let mut hasher = Xxh64::new();
    let id = &header.identity;
    for word in [id.request, id.job, id.model, id.tokens_digest] {
        hasher.write(&word.to_le_bytes());
    }
    let shape = &header.shape;
    for word in [
        id.owner.0,
        id.tokens,
        header.pages,
        shape.page_tokens,
        shape.layers,
        shape.kv_heads,
        shape.head_dim,
        shape.kv_type.bytes() as u32,
    ] {
        hasher.write_u32(word);
    }
    for digest in page_digests {
        hasher.write(&digest.to_le_bytes());
    }
    hasher.finish()
}

/// A sequence's prompt pages copied out for a transfer: the sender's side.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Export {
    /// The header to send.
    pub header: TransferHeader,
    /// Each page's used slots, in order (`header.pages` of them).
    pub pages: Vec<Vec<u8>>,
}

impl Export {
    /// Used slots of page `index`.
    pub fn tokens_in_page(&self, index: u32) -> u32 {
        self.header
            .shape
            .tokens_in_page(self.header.identity.tokens, index)
    }

    /// Bytes of every page together.
    pub fn bytes(&self) -> u64 {
        self.pages.iter().map(|p| p.len() as u64).sum()
    }
}

/// Pages reserved for a transfer, not yet decodable: only [`Pool::import`]
/// turns it back into a page table.
#[derive(Debug)]
#[must_use = "an import's pages are released only through Pool::import or Import::abandon"]
pub struct Import {
    table: PageTable,
    expect: TransferIdentity,
}

impl Import {
    /// What it waits for.
    pub fn expect(&self) -> &TransferIdentity {
        &self.expect
    }

    /// The table it holds, for the pool's own audits only (nothing outside
    /// the page book can read it, let alone step it).
    pub(super) fn table(&self) -> &PageTable {
        &self.table
    }

    /// Gives the table back without importing anything (the transfer was
    /// abandoned: the client left, the peer failed): release it as any other.
    /// Its pages hold nothing a sender wrote.
    pub fn abandon(self) -> PageTable {
        self.table
    }
}

/// Why an import was refused. Its table comes back with it, to be released.
#[derive(Debug)]
pub struct ImportRefused {
    /// The sequence's table (its pages may hold part of the transfer).
    pub table: PageTable,
    /// Why.
    pub error: ImportError,
}

/// What a transfer got wrong.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum ImportError {
    /// Pages of another shape (another model, page size or value type).
    #[error("the transfer's page shape {got:?} is not this pool's {want:?}")]
    Shape {
        /// The sender's.
        got: PageShape,
        /// This pool's.
        want: PageShape,
    },
    /// An identity field differs from what was asked for.
    #[error("the transfer's {field} is not the one asked for")]
    Identity {
        /// `request`, `job`, `owner`, `model`, `tokens` or `tokens_digest`.
        field: &'static str,
    },
    /// The header's page count does not hold its tokens.
    #[error("the header claims {claimed} pages; {tokens} tokens need {needed}")]
    PageCount {
        /// Claimed.
        claimed: u32,
        /// Needed.
        needed: u32,
        /// The header's tokens.
        tokens: u32,
    },
    /// More pages than the reserved table holds.
    #[error("the transfer needs {needed} pages; {reserved} were reserved")]
    Reserved {
        /// Needed.
        needed: u32,
        /// Reserved.
        reserved: u32,
    },
    /// Fewer or more pages arrived than the header announced.
    #[error("{arrived} pages arrived; the header announced {announced}")]
    Pages {
        /// Arrived.
        arrived: u32,
        /// Announced.
        announced: u32,
    },
    /// A page arrived out of order (duplicated, reordered or missing before it).
    #[error("page {index} arrived where page {expected} was due")]
    Order {
        /// Its index.
        index: u32,
        /// The one due.
        expected: u32,
    },
    /// A page's bytes are not as long as its used slots.
    #[error("page {index} carries {bytes} bytes; its {tokens_used} slots are {expected}")]
    Length {
        /// Its index.
        index: u32,
        /// Carried.
        bytes: u64,
        /// Its used slots.
        tokens_used: u32,
        /// Expected.
        expected: u64,
    },
    /// The digest over the header and page digests is not the sender's.
    #[error("the transfer's digest does not match its header and pages")]
    TransferDigest,
    /// A page, as stored, does not hash to its frame's digest.
    #[error("page {index} does not match its digest")]
    PageDigest {
        /// Its index.
        index: u32,
    },
    /// A page of the table is no longer leased to it (a bug; refused).
    #[error(transparent)]
    Lease(#[from] KvError),
}

impl ImportError {
    /// A short label for metrics and logs.
    pub fn reason(&self) -> &'static str {
        match self {
            ImportError::Shape { .. } => "shape",
            ImportError::Identity { .. } => "identity",
            ImportError::PageCount { .. } => "page_count",
            ImportError::Reserved { .. } => "reserved",
            ImportError::Pages { .. } => "pages",
            ImportError::Order { .. } => "order",
            ImportError::Length { .. } => "length",
            ImportError::TransferDigest => "transfer_digest",
            ImportError::PageDigest { .. } => "page_digest",
            ImportError::Lease(_) => "lease",
        }
    }
}

impl Pool {
    /// The shape of this pool's pages.
    pub fn page_shape(&self) -> PageShape {
        PageShape::of(&self.layout.geometry())
    }

    /// Copies the first `identity.tokens` positions of `table` out for a
    /// transfer (every lease checked). The pages stay the table's: the caller
    /// keeps them until the receiver has acknowledged or definitively failed.
    pub fn export(&self, table: &PageTable, identity: TransferIdentity) -> Result<Export, KvError> {
        let shape = self.page_shape();
        let pages = shape.pages_for(identity.tokens);
        assert!(
            pages as usize <= table.pages_count(),
            "export of {pages} pages from a table of {}",
            table.pages_count()
        );
        let mut out = Vec::with_capacity(pages as usize);
        for index in 0..pages {
            let page = self.check_lease(table.lease(index as usize).expect("index below pages"))?;
            let used = shape.tokens_in_page(identity.tokens, index);
            let mut bytes = Vec::with_capacity(shape.page_bytes(used) as usize);
            self.storage.read_rows(page.index(), used, &mut bytes);
            out.push(bytes);
        }
        Ok(Export {
            header: TransferHeader {
                identity,
                pages,
                shape,
            },
            pages: out,
        })
    }

    /// Wraps `table` (pages acquired for one sequence, none written) as an
    /// import waiting for `expect`.
    pub fn begin_import(&self, table: PageTable, expect: TransferIdentity) -> Import {
        assert_eq!(table.pool_id, self.pool_id, "page table from another pool");
        assert_eq!(table.owner(), expect.owner, "an import for another owner");
        Import { table, expect }
    }

    /// Checks `transfer` against what `import` asked for, writes its pages
    /// into the reserved ones, and checks each as stored against the bytes
    /// that hashed to its digest on arrival (the module doc's
    /// order). The table comes back decodable, or refused with the reason.
    pub fn import(
        &mut self,
        import: Import,
        transfer: &Received,
    ) -> Result<PageTable, ImportRefused> {
        let Import { table, expect } = import;
        match self.check_and_write(&table, &expect, transfer) {
            Ok(()) => Ok(table),
            Err(error) => Err(ImportRefused { table, error }),
        }
    }

    fn check_and_write(
        &mut self,
        table: &PageTable,
        expect: &TransferIdentity,
        transfer: &Received,
    ) -> Result<(), ImportError> {
        let header = &transfer.header;
        let want = self.page_shape();
        if header.shape != want {
            return Err(ImportError::Shape {
                got: header.shape,
                want,
            });
        }
        let (got, asked) = (&header.identity, expect);
        for (field, same) in [
            ("request", got.request == asked.request),
            ("job", got.job == asked.job),
            ("owner", got.owner == asked.owner),
            ("model", got.model == asked.model),
            ("tokens", got.tokens == asked.tokens),
            ("tokens_digest", got.tokens_digest == asked.tokens_digest),
        ] {
            if !same {
                return Err(ImportError::Identity { field });
            }
        }
        let needed = want.pages_for(asked.tokens);
        if header.pages != needed {
            return Err(ImportError::PageCount {
                claimed: header.pages,
                needed,
                tokens: asked.tokens,
            });
        }
        if needed as usize > table.pages_count() {
            return Err(ImportError::Reserved {
                needed,
                reserved: table.pages_count() as u32,
            });
        }
        if transfer.pages.len() != needed as usize {
            return Err(ImportError::Pages {
                arrived: transfer.pages.len().min(u32::MAX as usize) as u32,
                announced: needed,
            });
        }
        for (expected, page) in (0..needed).zip(&transfer.pages) {
            if page.index != expected {
                return Err(ImportError::Order {
                    index: page.index,
                    expected,
                });
            }
            let tokens_used = want.tokens_in_page(asked.tokens, expected);
            let length = want.page_bytes(tokens_used);
            if page.bytes.len() as u64 != length {
                return Err(ImportError::Length {
                    index: expected,
                    bytes: page.bytes.len() as u64,
                    tokens_used,
                    expected: length,
                });
            }
        }
        if transfer_digest(header, transfer.pages.iter().map(|p| p.digest)) != transfer.digest {
            return Err(ImportError::TransferDigest);
        }
        for page in &transfer.pages {
            let lease = table.lease(page.index as usize).expect("index below pages");
            let id = self.check_lease(lease)?;
            assert!(
                self.is_writable(lease)?,
                "an import into a page that is not the sequence's own"
            );
            let tokens_used = want.tokens_in_page(asked.tokens, page.index);
            if page.hashed != (tokens_used, page.digest) {
                return Err(ImportError::PageDigest { index: page.index });
            }
            self.storage
                .write_rows(id.index(), tokens_used, &page.bytes);
            if !self
                .storage
                .holds_rows(id.index(), tokens_used, &page.bytes, page.digest)
            {
                return Err(ImportError::PageDigest { index: page.index });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::storage::{host_storage, KvSlab, PageStorage};
    use crate::kv::{PartitionConfig, PoolOptions, SeqId};

    const PAGE_TOKENS: u32 = 4;

    fn pool(kv_type: KvType) -> Pool {
        pool_over(kv_type, |storage| storage)
    }

    /// A test pool whose host storage `wrap` may put behind another.
    fn pool_over(
        kv_type: KvType,
        wrap: impl FnOnce(Box<dyn PageStorage>) -> Box<dyn PageStorage>,
    ) -> Pool {
        let geometry = PoolGeometry {
            pages_count: 32,
            page_tokens: PAGE_TOKENS,
            layers: 2,
            kv_heads: 2,
            head_dim: 4,
            kv_type,
        };
        let partitions = [1, 2].map(|owner| PartitionConfig {
            owner: OwnerTag(owner),
            pages_reserved: 8,
            pages_max: 16,
        });
        let layout = geometry.layout().expect("valid geometry");
        Pool::with_storage(
            layout,
            &partitions,
            PoolOptions {
                poison_released: false,
                paranoid: true,
            },
            wrap(host_storage(layout)),
        )
        .expect("valid pool")
    }

    /// Host storage whose second row write tears: its last byte lands
    /// flipped, as a faulty copy (or device) would store it.
    #[derive(Debug)]
    struct TornWrites {
        inner: Box<dyn PageStorage>,
        writes: usize,
    }

    impl PageStorage for TornWrites {
        fn kv_type(&self) -> KvType {
            self.inner.kv_type()
        }
        fn write_token(&mut self, page: usize, k_at: usize, v_at: usize, k: &[f32], v: &[f32]) {
            self.inner.write_token(page, k_at, v_at, k, v)
        }
        fn scrub(&mut self, page: usize) {
            self.inner.scrub(page)
        }
        fn poison(&mut self, page: usize) {
            self.inner.poison(page)
        }
        fn is_zero(&self, page: usize) -> bool {
            self.inner.is_zero(page)
        }
        fn digest(&self, page: usize, tokens_used: u32) -> u64 {
            self.inner.digest(page, tokens_used)
        }
        fn host(&self, page: usize, layer: u32) -> Option<(KvSlab<'_>, KvSlab<'_>)> {
            self.inner.host(page, layer)
        }
        fn read_rows(&self, page: usize, tokens_used: u32, out: &mut Vec<u8>) {
            self.inner.read_rows(page, tokens_used, out)
        }
        fn write_rows(&mut self, page: usize, tokens_used: u32, bytes: &[u8]) {
            self.writes += 1;
            let mut bytes = bytes.to_vec();
            if self.writes == 2 {
                *bytes.last_mut().expect("a page has bytes") ^= 0x01;
            }
            self.inner.write_rows(page, tokens_used, &bytes)
        }
        fn holds_rows(&self, page: usize, tokens_used: u32, bytes: &[u8], digest: u64) -> bool {
            self.inner.holds_rows(page, tokens_used, bytes, digest)
        }
    }

    fn table(pool: &mut Pool, owner: u32, seq: u64, pages: u32) -> PageTable {
        let mut reservation = pool.reserve(OwnerTag(owner), pages).expect("fits");
        let mut table = pool.page_table(&reservation, SeqId(seq));
        for _ in 0..pages {
            pool.acquire(&mut reservation, &mut table).expect("booked");
        }
        pool.release_reservation(reservation);
        table
    }

    /// Fills positions `0..tokens` of `table` with values from `seed`.
    fn fill(pool: &mut Pool, table: &PageTable, tokens: u32, seed: f32) {
        let kv_dim = pool.layout().kv_dim();
        for t in 0..tokens {
            let lease = table.lease((t / PAGE_TOKENS) as usize).unwrap();
            for layer in 0..2 {
                let k: Vec<f32> = (0..kv_dim)
                    .map(|i| seed + (t * 100 + layer * 10) as f32 + i as f32 / 8.0)
                    .collect();
                let v: Vec<f32> = k.iter().map(|x| -x).collect();
                pool.write_kv(lease, layer, t % PAGE_TOKENS, &k, &v)
                    .unwrap();
            }
        }
    }

    fn identity(owner: u32, tokens: &[u32]) -> TransferIdentity {
        TransferIdentity {
            request: 7,
            job: 0x5eed,
            owner: OwnerTag(owner),
            model: 0xfeed,
            tokens: tokens.len() as u32,
            tokens_digest: tokens_digest(tokens),
        }
    }

    /// What a sender puts on the wire for `export`.
    fn send(export: &Export) -> Received {
        let pages: Vec<ReceivedPage> = export
            .pages
            .iter()
            .enumerate()
            .map(|(i, bytes)| {
                ReceivedPage::arrived(
                    &export.header,
                    i as u32,
                    page_digest(export.tokens_in_page(i as u32), bytes),
                    bytes.clone(),
                )
            })
            .collect();
        Received {
            header: export.header,
            digest: transfer_digest(&export.header, pages.iter().map(|p| p.digest)),
            pages,
        }
    }

    /// Recomputes the transfer digest after a fault changed pages or header,
    /// as a sender that lies consistently would.
    fn reseal(transfer: &mut Received) {
        transfer.digest =
            transfer_digest(&transfer.header, transfer.pages.iter().map(|p| p.digest));
    }

    struct Pair {
        sender: Pool,
        receiver: Pool,
        source: PageTable,
        tokens: Vec<u32>,
    }

    /// A sender pool holding owner 1's 10-token prompt (3 pages, the last
    /// partial) and an empty receiver pool of the same shape.
    fn pair(kv_type: KvType) -> Pair {
        let mut sender = pool(kv_type);
        let source = table(&mut sender, 1, 70, 3);
        fill(&mut sender, &source, 10, 1.0);
        Pair {
            sender,
            receiver: pool(kv_type),
            source,
            tokens: (100..110).collect(),
        }
    }

    fn refused(pair: &mut Pair, fault: impl FnOnce(&mut Received)) -> ImportError {
        let export = pair
            .sender
            .export(&pair.source, identity(1, &pair.tokens))
            .unwrap();
        let mut transfer = send(&export);
        fault(&mut transfer);
        // The fault happened on the wire: the receiver hashes what arrives.
        let header = transfer.header;
        for page in &mut transfer.pages {
            *page = ReceivedPage::arrived(
                &header,
                page.index,
                page.digest,
                std::mem::take(&mut page.bytes),
            );
        }
        let target = table(&mut pair.receiver, 1, 7, 4);
        let import = pair
            .receiver
            .begin_import(target, identity(1, &pair.tokens));
        let ImportRefused { mut table, error } = pair
            .receiver
            .import(import, &transfer)
            .expect_err("the fault is caught");
        // The one release path: dirty, then scrubbed, then free again.
        pair.receiver.release(&mut table);
        pair.receiver.scrub_released();
        pair.receiver
            .check_invariants()
            .expect("pool back to baseline");
        assert_eq!(pair.receiver.stats().pages_free, 32, "every page free");
        error
    }

    #[test]
    fn an_intact_transfer_imports_the_same_values_and_digests() {
        for kv_type in [KvType::F16, KvType::F32] {
            let mut p = pair(kv_type);
            let export = p.sender.export(&p.source, identity(1, &p.tokens)).unwrap();
            assert_eq!(export.header.pages, 3);
            assert_eq!(
                export.bytes(),
                p.sender.page_shape().page_bytes(10),
                "only used slots travel"
            );
            let target = table(&mut p.receiver, 1, 7, 4);
            let import = p.receiver.begin_import(target, identity(1, &p.tokens));
            let table = p.receiver.import(import, &send(&export)).expect("intact");
            for index in 0..3 {
                let used = PAGE_TOKENS.min(10 - index * PAGE_TOKENS);
                let theirs = p
                    .sender
                    .digest(p.source.lease(index as usize).unwrap(), used)
                    .unwrap();
                let ours = p
                    .receiver
                    .digest(table.lease(index as usize).unwrap(), used)
                    .unwrap();
                assert_eq!(theirs, ours, "page {index}");
                assert_eq!(
                    theirs,
                    page_digest(used, &export.pages[index as usize]),
                    "the wire digest is the pool's"
                );
                for layer in 0..2 {
                    let (k0, v0) = p
                        .sender
                        .page_kv(p.source.lease(index as usize).unwrap(), layer)
                        .unwrap();
                    let (k1, v1) = p
                        .receiver
                        .page_kv(table.lease(index as usize).unwrap(), layer)
                        .unwrap();
                    assert_eq!(k0.to_f32_vec(), k1.to_f32_vec());
                    assert_eq!(v0.to_f32_vec(), v1.to_f32_vec());
                }
            }
            // The fourth reserved page was never written.
            let (k, v) = p.receiver.page_kv(table.lease(3).unwrap(), 0).unwrap();
            assert!(k.is_zero() && v.is_zero());
        }
    }

    #[test]
    fn one_corrupted_byte_of_one_page_is_caught_as_it_arrives() {
        let mut p = pair(KvType::F16);
        let error = refused(&mut p, |t| t.pages[1].bytes[17] ^= 0x40);
        assert_eq!(error, ImportError::PageDigest { index: 1 });
    }

    /// An intact transfer whose page is not stored as it arrived (one byte
    /// of the second page's write torn) is refused: the check reads what is
    /// stored, not only what came over the wire.
    #[test]
    fn a_page_not_stored_as_it_arrived_is_caught_as_stored() {
        for kv_type in [KvType::F16, KvType::F32] {
            let mut p = pair(kv_type);
            p.receiver = pool_over(kv_type, |inner| Box::new(TornWrites { inner, writes: 0 }));
            let error = refused(&mut p, |_| {});
            assert_eq!(error, ImportError::PageDigest { index: 1 }, "{kv_type:?}");
        }
    }

    #[test]
    fn a_wrong_page_digest_is_caught_even_when_resealed() {
        let mut p = pair(KvType::F16);
        let error = refused(&mut p, |t| {
            t.pages[2].digest ^= 1;
            reseal(t);
        });
        assert_eq!(error, ImportError::PageDigest { index: 2 });
        // Without resealing, the whole-transfer digest catches it first.
        let error = refused(&mut p, |t| t.pages[2].digest ^= 1);
        assert_eq!(error, ImportError::TransferDigest);
    }

    #[test]
    fn truncated_dropped_duplicated_and_reordered_pages_are_refused() {
        let mut p = pair(KvType::F16);
        let error = refused(&mut p, |t| {
            t.pages[2].bytes.truncate(8);
        });
        assert!(
            matches!(error, ImportError::Length { index: 2, .. }),
            "{error}"
        );
        let error = refused(&mut p, |t| {
            t.pages.pop();
        });
        assert_eq!(
            error,
            ImportError::Pages {
                arrived: 2,
                announced: 3
            }
        );
        let error = refused(&mut p, |t| {
            let first = t.pages[0].clone();
            t.pages[1] = first;
        });
        assert_eq!(
            error,
            ImportError::Order {
                index: 0,
                expected: 1
            }
        );
        let error = refused(&mut p, |t| {
            t.pages.swap(0, 1);
        });
        assert_eq!(
            error,
            ImportError::Order {
                index: 1,
                expected: 0
            }
        );
        // Reordered with their indices rewritten to match: each page is
        // intact and in "order", but the whole digest binds them.
        let error = refused(&mut p, |t| {
            t.pages.swap(0, 1);
            t.pages[0].index = 0;
            t.pages[1].index = 1;
        });
        assert_eq!(error, ImportError::TransferDigest);
    }

    #[test]
    fn the_incidents_placeholder_never_passes_for_a_prompt() {
        let mut p = pair(KvType::F16);
        // A header that claims the whole prompt and carries one token of KV.
        let error = refused(&mut p, |t| {
            t.pages.truncate(1);
            t.pages[0]
                .bytes
                .truncate(t.header.shape.page_bytes(1) as usize);
            t.header.pages = 1;
            reseal(t);
        });
        assert_eq!(
            error,
            ImportError::PageCount {
                claimed: 1,
                needed: 3,
                tokens: 10
            }
        );
        // A header honest about carrying one token: not the prompt asked for.
        let error = refused(&mut p, |t| {
            t.header.identity.tokens = 1;
            t.header.identity.tokens_digest = tokens_digest(&[100]);
            t.header.pages = 1;
            t.pages.truncate(1);
            reseal(t);
        });
        assert_eq!(error, ImportError::Identity { field: "tokens" });
    }

    #[test]
    fn replayed_swapped_and_unasked_for_transfers_are_refused_by_identity() {
        let mut p = pair(KvType::F16);
        type Change = fn(&mut TransferIdentity);
        let cases: [(&str, Change); 5] = [
            ("request", |id| id.request += 1),
            ("job", |id| id.job ^= 1),
            ("owner", |id| id.owner = OwnerTag(2)),
            ("model", |id| id.model ^= 1),
            ("tokens_digest", |id| id.tokens_digest ^= 1),
        ];
        for (field, change) in cases {
            let error = refused(&mut p, |t| {
                change(&mut t.header.identity);
                reseal(t);
            });
            assert_eq!(error, ImportError::Identity { field }, "{field}");
        }
    }

    #[test]
    fn another_page_shape_is_refused_before_any_page_is_read() {
        let mut p = pair(KvType::F16);
        let error = refused(&mut p, |t| t.header.shape.kv_type = KvType::F32);
        assert!(matches!(error, ImportError::Shape { .. }), "{error}");
        let error = refused(&mut p, |t| t.header.shape.page_tokens = 8);
        assert!(matches!(error, ImportError::Shape { .. }), "{error}");
    }

    #[test]
    fn a_transfer_larger_than_the_reservation_is_refused() {
        let mut p = pair(KvType::F16);
        let export = p.sender.export(&p.source, identity(1, &p.tokens)).unwrap();
        let target = table(&mut p.receiver, 1, 7, 2);
        let import = p.receiver.begin_import(target, identity(1, &p.tokens));
        let refused = p.receiver.import(import, &send(&export)).unwrap_err();
        assert_eq!(
            refused.error,
            ImportError::Reserved {
                needed: 3,
                reserved: 2
            }
        );
        let mut table = refused.table;
        p.receiver.release(&mut table);
        p.receiver.scrub_released();
        p.receiver.check_invariants().unwrap();
    }

    #[test]
    fn an_abandoned_import_releases_like_any_table() {
        let mut p = pair(KvType::F16);
        let target = table(&mut p.receiver, 1, 7, 3);
        let import = p.receiver.begin_import(target, identity(1, &p.tokens));
        let mut table = import.abandon();
        assert_eq!(p.receiver.release(&mut table), 3);
        p.receiver.scrub_released();
        p.receiver.check_invariants().unwrap();
        assert_eq!(p.receiver.stats().pages_free, 32);
    }

    #[test]
    fn page_shape_arithmetic() {
        let shape = pool(KvType::F16).page_shape();
        assert_eq!(shape.pages_for(0), 0);
        assert_eq!(shape.pages_for(4), 1);
        assert_eq!(shape.pages_for(5), 2);
        assert_eq!(shape.tokens_in_page(10, 0), 4);
        assert_eq!(shape.tokens_in_page(10, 2), 2);
        assert_eq!(shape.tokens_in_page(10, 3), 0);
        assert_eq!(shape.page_bytes(1), 2 * 2 * 8 * 2);
        assert_ne!(tokens_digest(&[1, 2]), tokens_digest(&[2, 1]));
        assert_ne!(tokens_digest(&[]), tokens_digest(&[0]));
    }
}
