//! Behaviour tests for the pool, and canary tests for its checker: every planted fault
//! must be caught.

use super::*;
use std::panic::{catch_unwind, AssertUnwindSafe};

const A: OwnerTag = OwnerTag(10);
const B: OwnerTag = OwnerTag(20);
const C: OwnerTag = OwnerTag(30);

fn geometry(pages_count: u32) -> PoolGeometry {
    PoolGeometry {
        pages_count,
        page_tokens: 4,
        layers: 2,
        kv_heads: 1,
        head_dim: 3,
        kv_type: KvType::F32,
    }
}

/// 10 pages: A reserves 2 (max 6), B reserves 3 (max 3), C reserves 0 (max 10).
/// The burst region is 5 pages.
fn pool_with(options: PoolOptions) -> Pool {
    let partitions = [
        PartitionConfig {
            owner: A,
            pages_reserved: 2,
            pages_max: 6,
        },
        PartitionConfig {
            owner: B,
            pages_reserved: 3,
            pages_max: 3,
        },
        PartitionConfig {
            owner: C,
            pages_reserved: 0,
            pages_max: 10,
        },
    ];
    Pool::new(geometry(10), &partitions, options).unwrap()
}

fn pool() -> Pool {
    pool_with(PoolOptions {
        poison_released: true,
        paranoid: true,
    })
}

/// Reserves `pages` for `owner` and acquires them all into a new table.
fn lease_pages(pool: &mut Pool, owner: OwnerTag, seq: u64, pages: u32) -> PageTable {
    let mut reservation = pool.reserve(owner, pages).unwrap();
    let mut table = pool.page_table(&reservation, SeqId(seq));
    for _ in 0..pages {
        pool.acquire(&mut reservation, &mut table).unwrap();
    }
    assert_eq!(pool.release_reservation(reservation), 0);
    table
}

fn row(value: f32) -> Vec<f32> {
    vec![value; 3]
}

fn panics(f: impl FnOnce()) -> bool {
    catch_unwind(AssertUnwindSafe(f)).is_err()
}

// ---- Lifecycle ----------------------------------------------------------------------

#[test]
fn rejects_acquire_from_exhausted_reservation() {
    let mut pool = pool();
    let mut reservation = pool.reserve(A, 1).unwrap();
    let mut table = pool.page_table(&reservation, SeqId(1));
    pool.acquire(&mut reservation, &mut table).unwrap();
    let before = pool.stats();
    assert_eq!(
        pool.acquire(&mut reservation, &mut table),
        Err(AcquireError::ReservationExhausted { owner: A })
    );
    assert_eq!(pool.stats(), before);
    assert_eq!(table.pages_count(), 1);
    pool.release(&mut table);
    pool.check_invariants().unwrap();
}

#[test]
fn reserve_books_counts_without_touching_pages() {
    let mut pool = pool();
    let reservation = pool.reserve(A, 3).unwrap();
    let stats = pool.stats();
    assert_eq!(
        (stats.pages_free, stats.pages_owned, stats.pages_booked),
        (10, 0, 3)
    );
    assert!((0..10).all(|p| pool.page_meta(PageId(p)).unwrap().state == PageState::Free));
    assert_eq!(pool.release_reservation(reservation), 3);
    assert_eq!(pool.stats().pages_booked, 0);
    pool.check_invariants().unwrap();
}

#[test]
fn reserve_refuses_beyond_max_pages() {
    let mut pool = pool();
    let table = lease_pages(&mut pool, B, 1, 3);
    assert_eq!(
        pool.reserve(B, 1).unwrap_err(),
        ReserveError::AboveMax {
            owner: B,
            pages_wanted: 4,
            pages_max: 3
        }
    );
    assert!(matches!(
        pool.reserve(A, 7),
        Err(ReserveError::AboveMax { .. })
    ));
    drop_table(&mut pool, table);
}

#[test]
fn reserve_refuses_unknown_owner_and_zero_pages() {
    let mut pool = pool();
    assert_eq!(
        pool.reserve(OwnerTag(99), 1).unwrap_err(),
        ReserveError::UnknownOwner {
            owner: OwnerTag(99)
        }
    );
    assert_eq!(pool.reserve(A, 0).unwrap_err(), ReserveError::ZeroPages);
    assert_eq!(pool.stats().pages_booked, 0);
}

#[test]
fn reserve_never_takes_another_tenants_reserved_pages() {
    let mut pool = pool();
    // C (no reservation) takes everything it can: the 5-page burst region.
    let c = lease_pages(&mut pool, C, 1, 5);
    assert_eq!(
        pool.reserve(C, 1).unwrap_err(),
        ReserveError::Exhausted {
            owner: C,
            pages: 1,
            pages_available: 0
        }
    );
    // A and B still get their full reservations, and nothing more.
    let a = lease_pages(&mut pool, A, 2, 2);
    let b = lease_pages(&mut pool, B, 3, 3);
    assert!(matches!(
        pool.reserve(A, 1),
        Err(ReserveError::Exhausted { .. })
    ));
    pool.check_page_tables(&[&a, &b, &c]).unwrap();
    for table in [a, b, c] {
        drop_table(&mut pool, table);
    }
}

#[test]
fn dirty_pages_count_against_their_owner_until_scrubbed() {
    let mut pool = pool();
    let mut c = lease_pages(&mut pool, C, 1, 5);
    pool.release(&mut c);
    // C's 5 dirty pages still block C, but not A's or B's reservations.
    assert_eq!(pool.partition_stats(C).unwrap().pages_available, 0);
    assert_eq!(pool.partition_stats(A).unwrap().pages_available, 2);
    assert_eq!(pool.partition_stats(B).unwrap().pages_available, 3);
    assert_eq!(pool.scrub_released(), 5);
    assert_eq!(pool.partition_stats(C).unwrap().pages_available, 5);
    pool.check_invariants().unwrap();
}

#[test]
fn released_page_is_not_handed_out_until_scrubbed() {
    let mut pool = pool_with(PoolOptions::default());
    let mut a = lease_pages(&mut pool, A, 1, 6);
    let released = a.handles()[5].page;
    pool.release_last(&mut a).unwrap();
    // Every other page goes out; the dirty one does not.
    let b = lease_pages(&mut pool, B, 2, 3);
    let c = lease_pages(&mut pool, C, 3, 1);
    assert_eq!(pool.stats().pages_free, 0);
    assert!(c
        .handles()
        .iter()
        .chain(b.handles())
        .all(|h| h.page != released));
    assert_eq!(
        pool.page_meta(released).unwrap().state,
        PageState::Released { owner: A }
    );
    assert!(matches!(
        pool.reserve(C, 1),
        Err(ReserveError::Exhausted { .. })
    ));
    pool.check_page_tables(&[&a, &b, &c]).unwrap();
    for table in [a, b, c] {
        drop_table(&mut pool, table);
    }
}

#[test]
fn generation_increments_on_every_lease() {
    let mut pool = pool();
    let mut table = lease_pages(&mut pool, A, 1, 1);
    let first = table.handles()[0];
    pool.release(&mut table);
    pool.scrub_released();
    let table = lease_pages(&mut pool, A, 1, 1);
    let second = table.handles()[0];
    assert_eq!(second.page, first.page);
    assert_eq!(second.generation, first.generation.next());
    drop_table(&mut pool, table);
}

#[test]
fn token_capacity_is_pages_times_page_tokens() {
    let mut pool = pool();
    let table = lease_pages(&mut pool, A, 1, 3);
    assert_eq!(table.token_capacity(), 12);
    drop_table(&mut pool, table);
}

// ---- KV access ----------------------------------------------------------------------

#[test]
fn write_then_read_round_trips_per_layer_and_slot() {
    let mut pool = pool();
    let table = lease_pages(&mut pool, A, 1, 2);
    let lease = table.lease(1).unwrap();
    pool.write_kv(lease, 1, 2, &row(1.5), &row(-2.0)).unwrap();
    let (k, v) = pool.page_kv(lease, 1).unwrap();
    let (k, v) = (k.to_f32_vec(), v.to_f32_vec());
    assert_eq!(k.len(), 4 * 3);
    assert_eq!(&k[6..9], &row(1.5)[..]);
    assert_eq!(&v[6..9], &row(-2.0)[..]);
    assert!(k[..6].iter().chain(&v[..6]).all(|&f| f == 0.0));
    let (k0, v0) = pool.page_kv(lease, 0).unwrap();
    assert!(k0.is_zero() && v0.is_zero());
    let other = table.lease(0).unwrap();
    assert!(pool.page_kv(other, 1).unwrap().0.is_zero());
    drop_table(&mut pool, table);
}

/// The pool of `pool_with`, its values stored as f16.
fn pool_f16(options: PoolOptions) -> Pool {
    let partitions = [PartitionConfig {
        owner: A,
        pages_reserved: 2,
        pages_max: 6,
    }];
    let geometry = PoolGeometry {
        kv_type: KvType::F16,
        ..geometry(10)
    };
    Pool::new(geometry, &partitions, options).unwrap()
}

#[test]
fn f16_storage_rounds_on_write_and_is_half_the_bytes() {
    let mut pool = pool_f16(PoolOptions::default());
    assert_eq!(
        pool.layout().page_bytes() * 2,
        pool_with(PoolOptions::default()).layout().page_bytes()
    );
    let table = lease_pages(&mut pool, A, 1, 1);
    let lease = table.lease(0).unwrap();
    let k = [0.1, -3.0, 70000.0];
    let v = [1.0 / 3.0, 2049.0, -1e-8];
    pool.write_kv(lease, 1, 3, &k, &v).unwrap();
    let (k_read, v_read) = pool.page_kv(lease, 1).unwrap();
    assert!(matches!(k_read, KvSlab::F16(_)));
    let (k_read, v_read) = (k_read.to_f32_vec(), v_read.to_f32_vec());
    let rounded = |x: &[f32]| x.iter().map(|&x| KvType::F16.round(x)).collect::<Vec<_>>();
    assert_eq!(&k_read[9..12], &rounded(&k)[..]);
    assert_eq!(&v_read[9..12], &rounded(&v)[..]);
    assert_eq!(k_read[11], 65504.0, "saturates, never infinite");
    assert!(k_read[..9].iter().all(|&x| x == 0.0));
    drop_table(&mut pool, table);
}

#[test]
fn f16_storage_poisons_scrubs_and_digests_its_own_bits() {
    let options = PoolOptions {
        poison_released: true,
        paranoid: true,
    };
    let mut pool = pool_f16(options);
    let mut table = lease_pages(&mut pool, A, 1, 1);
    let lease = table.lease(0).unwrap();
    let empty = pool.digest(lease, 1).unwrap();
    pool.write_kv(lease, 0, 0, &row(0.5), &row(0.25)).unwrap();
    assert_ne!(pool.digest(lease, 1).unwrap(), empty);
    // The same values in an f32 pool digest differently: the digest covers
    // the stored bits, so a receiver must know the sender's type.
    let mut wide = pool_with(PoolOptions::default());
    let wide_table = lease_pages(&mut wide, A, 1, 1);
    wide.write_kv(wide_table.lease(0).unwrap(), 0, 0, &row(0.5), &row(0.25))
        .unwrap();
    assert_ne!(
        wide.digest(wide_table.lease(0).unwrap(), 1).unwrap(),
        pool.digest(lease, 1).unwrap()
    );
    drop_table(&mut wide, wide_table);
    let page = table.handles()[0].page;
    pool.release(&mut table);
    assert!(!pool.page_is_zero(page), "released page is poisoned");
    pool.scrub_released();
    assert!(pool.page_is_zero(page));
    let table = lease_pages(&mut pool, A, 1, 1);
    assert_eq!(table.handles()[0].page, page);
    let (k, v) = pool.page_kv(table.lease(0).unwrap(), 0).unwrap();
    assert!(k.is_zero() && v.is_zero());
    drop_table(&mut pool, table);
}

#[test]
fn a_step_view_checks_every_lease_once_and_reads_what_it_wrote() {
    let mut pool = pool();
    let (a, b) = (
        lease_pages(&mut pool, A, 1, 2),
        lease_pages(&mut pool, B, 2, 1),
    );
    {
        let mut view = pool.step_view(&[&a, &b]).unwrap();
        view.write_kv(0, 1, 1, 2, &row(1.5), &row(-2.0));
        view.write_kv(1, 0, 0, 0, &row(4.0), &row(4.0));
        let (k, v) = view.page(0, 1, 1);
        assert_eq!(&k.to_f32_vec()[6..9], &row(1.5)[..]);
        assert_eq!(&v.to_f32_vec()[6..9], &row(-2.0)[..]);
        assert!(view.page(0, 0, 1).0.is_zero(), "another page of the table");
        assert_eq!(view.page(1, 0, 0).0.to_f32_vec()[..3], row(4.0)[..]);
    }
    // The same values through the per-lease path.
    let (k, _) = pool.page_kv(a.lease(1).unwrap(), 1).unwrap();
    assert_eq!(&k.to_f32_vec()[6..9], &row(1.5)[..]);
    drop_table(&mut pool, b);
    // A table holding a handle whose lease ended is refused as a whole.
    let stale = lease_pages(&mut pool, A, 3, 1);
    pool.plant_fault_stale_generation(stale.handles()[0].page);
    assert!(matches!(
        pool.step_view(&[&a, &stale]),
        Err(KvError::StaleHandle { .. })
    ));
    // Another tenant's lease claimed by this table is a crash, never a read.
    let theirs = lease_pages(&mut pool, B, 4, 1);
    pool.plant_fault_owner(theirs.handles()[0].page, A);
    assert!(panics(|| {
        let _ = pool.step_view(&[&theirs]);
    }));
}

#[test]
fn stale_handle_is_refused_after_release() {
    let mut pool = pool();
    let mut table = lease_pages(&mut pool, A, 1, 1);
    let lease = table.lease(0).unwrap();
    pool.release(&mut table);
    let stale = Err(KvError::StaleHandle {
        page: lease.handle.page,
        generation: lease.handle.generation,
    });
    assert_eq!(pool.page_kv(lease, 0).map(|_| ()), stale);
    assert_eq!(pool.write_kv(lease, 0, 0, &row(1.0), &row(1.0)), stale);
    assert_eq!(pool.digest(lease, 1).map(|_| ()), stale);
    pool.scrub_released();
    assert_eq!(pool.page_kv(lease, 0).map(|_| ()), stale);
}

#[test]
fn stale_handle_is_refused_after_the_page_is_leased_to_another_tenant() {
    let mut pool = pool();
    let mut a = lease_pages(&mut pool, A, 1, 1);
    let old = a.lease(0).unwrap();
    pool.release(&mut a);
    pool.scrub_released();
    let b = lease_pages(&mut pool, B, 2, 1);
    assert_eq!(b.handles()[0].page, old.handle.page);
    pool.write_kv(b.lease(0).unwrap(), 0, 0, &row(7.0), &row(7.0))
        .unwrap();
    // A's old handle now names B's data: refused as stale, never read.
    assert!(matches!(
        pool.page_kv(old, 0),
        Err(KvError::StaleHandle { .. })
    ));
    drop_table(&mut pool, b);
}

#[test]
fn rejects_handle_outside_the_pool() {
    let pool = pool();
    let lease = Lease {
        handle: PageHandle {
            pool: pool.id(),
            page: PageId(10),
            generation: Generation(1),
        },
        owner: A,
        seq: SeqId(1),
    };
    assert_eq!(
        pool.page_kv(lease, 0).map(|_| ()),
        Err(KvError::PageOutOfRange { page: PageId(10) })
    );
}

#[test]
fn refuses_another_pools_handle_even_when_everything_else_matches() {
    // Two pools (two models) with the same geometry: the same tenant's same
    // sequence leases page 0, generation 1, in each. Only the pool id tells the
    // handles apart, and each pool refuses the other's.
    let (mut first, mut second) = (pool(), pool());
    let a = lease_pages(&mut first, A, 1, 1);
    let b = lease_pages(&mut second, A, 1, 1);
    let (lease_a, lease_b) = (a.lease(0).unwrap(), b.lease(0).unwrap());
    assert_eq!(
        (lease_a.handle.page, lease_a.handle.generation),
        (lease_b.handle.page, lease_b.handle.generation)
    );
    assert_ne!(first.id(), second.id());
    let foreign = Err(KvError::ForeignPool {
        page: lease_a.handle.page,
        handle_pool: first.id(),
        pool: second.id(),
    });
    assert_eq!(second.page_kv(lease_a, 0).map(|_| ()), foreign);
    assert_eq!(second.digest(lease_a, 1).map(|_| ()), foreign);
    assert_eq!(
        second.write_kv(lease_a, 0, 0, &row(1.0), &row(1.0)),
        foreign
    );
    // Its own handles still work.
    second
        .write_kv(lease_b, 0, 0, &row(2.0), &row(2.0))
        .unwrap();
    drop_table(&mut first, a);
    drop_table(&mut second, b);
}

#[test]
fn cross_tenant_read_and_write_panic() {
    let mut pool = pool();
    let table = lease_pages(&mut pool, A, 1, 1);
    let theirs = Lease {
        owner: B,
        ..table.lease(0).unwrap()
    };
    assert!(panics(|| {
        let _ = pool.page_kv(theirs, 0);
    }));
    assert!(panics(|| {
        let _ = pool.write_kv(theirs, 0, 0, &row(1.0), &row(1.0));
    }));
    assert!(panics(|| {
        let _ = pool.digest(theirs, 1);
    }));
    let other_seq = Lease {
        seq: SeqId(2),
        ..table.lease(0).unwrap()
    };
    assert!(panics(|| {
        let _ = pool.page_kv(other_seq, 0);
    }));
    drop_table(&mut pool, table);
}

#[test]
fn write_kv_asserts_shapes_and_ranges() {
    let mut pool = pool();
    let table = lease_pages(&mut pool, A, 1, 1);
    let lease = table.lease(0).unwrap();
    assert!(panics(|| {
        let _ = pool.write_kv(lease, 0, 0, &[1.0; 2], &row(1.0));
    }));
    assert!(panics(|| {
        let _ = pool.write_kv(lease, 2, 0, &row(1.0), &row(1.0));
    }));
    assert!(panics(|| {
        let _ = pool.write_kv(lease, 0, 4, &row(1.0), &row(1.0));
    }));
    drop_table(&mut pool, table);
}

#[test]
fn poison_fills_released_pages_and_scrub_clears_it() {
    let mut pool = pool();
    let mut table = lease_pages(&mut pool, A, 1, 1);
    let page = table.handles()[0].page;
    pool.release(&mut table);
    // A released page cannot be read through a lease; look at the storage.
    let (k, v) = pool.storage.host(page.index(), 1).unwrap();
    let (KvSlab::F32(k), KvSlab::F32(v)) = (k, v) else {
        panic!("f32 pool")
    };
    assert!(k.iter().chain(v).all(|f| f.to_bits() == POISON_BITS));
    pool.scrub_released();
    assert!(pool.page_is_zero(page));
    let table = lease_pages(&mut pool, A, 1, 1);
    assert_eq!(table.handles()[0].page, page);
    let (k, v) = pool.page_kv(table.lease(0).unwrap(), 1).unwrap();
    assert!(k.is_zero() && v.is_zero());
    drop_table(&mut pool, table);
}

#[test]
fn digest_covers_used_slots_of_the_leased_page() {
    let mut pool = pool();
    let table = lease_pages(&mut pool, A, 1, 1);
    let lease = table.lease(0).unwrap();
    let empty = pool.digest(lease, 2).unwrap();
    pool.write_kv(lease, 1, 1, &row(0.5), &row(0.25)).unwrap();
    let written = pool.digest(lease, 2).unwrap();
    assert_ne!(written, empty);
    let values = (0..pool.layout().page_values())
        .map(|i| {
            let (slab, at) = (
                i / pool.layout().slab_values(),
                i % pool.layout().slab_values(),
            );
            let (k, v) = pool.page_kv(lease, slab as u32 / 2).unwrap();
            let half = if slab % 2 == 0 { k } else { v };
            half.to_f32_vec()[at]
        })
        .collect::<Vec<f32>>();
    assert_eq!(written, digest_page(pool.layout(), &values, 2));
    assert_eq!(
        pool.digest(lease, 1).unwrap(),
        pool.digest(lease, 1).unwrap()
    );
    drop_table(&mut pool, table);
}

// ---- Misuse that must crash -----------------------------------------------------------

#[test]
fn reservation_from_another_pool_panics() {
    let mut one = pool();
    let mut two = pool();
    let mut reservation = one.reserve(A, 1).unwrap();
    let mut table = one.page_table(&reservation, SeqId(1));
    assert!(panics(|| {
        let _ = two.acquire(&mut reservation, &mut table);
    }));
    assert_eq!(one.release_reservation(reservation), 1);
}

#[test]
fn dropped_reservation_with_booked_pages_is_detected() {
    let mut pool = pool();
    let reservation = pool.reserve(A, 2).unwrap();
    let dropped = panics(move || drop(reservation));
    assert_eq!(dropped, cfg!(debug_assertions));
    assert_eq!(
        pool.check_invariants(),
        Err(Violation::ReservationDropped {
            reservations: 1,
            pages: 2
        })
    );
}

#[test]
fn dropping_a_used_up_reservation_is_fine() {
    let mut pool = pool();
    let mut reservation = pool.reserve(A, 1).unwrap();
    let mut table = pool.page_table(&reservation, SeqId(1));
    reservation.acquire(&mut pool, &mut table).unwrap();
    drop(reservation);
    pool.check_page_tables(&[&table]).unwrap();
    drop_table(&mut pool, table);
}

// ---- Canaries: the checker must catch each planted fault ----------------------------

#[test]
fn canary_unscrubbed_page_handed_out_is_caught() {
    let mut pool = pool();
    let mut table = lease_pages(&mut pool, A, 1, 1);
    pool.release(&mut table);
    let page = pool.plant_fault_unscrubbed_free().unwrap();
    assert_eq!(
        pool.check_invariants(),
        Err(Violation::FreePageDirty { page })
    );
    // And the acquire side refuses to hand it out in paranoid mode.
    let mut reservation = pool.reserve(A, 1).unwrap();
    let mut table = pool.page_table(&reservation, SeqId(2));
    assert!(panics(|| {
        let _ = pool.acquire(&mut reservation, &mut table);
    }));
    drop(catch_unwind(AssertUnwindSafe(move || drop(reservation))));
}

#[test]
fn canary_dirty_free_page_is_caught() {
    let mut pool = pool();
    pool.plant_fault_dirty_free(PageId(4));
    assert_eq!(
        pool.check_invariants(),
        Err(Violation::FreePageDirty { page: PageId(4) })
    );
}

#[test]
fn free_pages_dirty_scans_every_free_page_whatever_the_options() {
    // Neither paranoid nor poisoning: the audit must not lean on either.
    let mut pool = pool_with(PoolOptions::default());
    assert_eq!(
        pool.free_pages_dirty(),
        Vec::<PageId>::new(),
        "a fresh pool"
    );
    let mut table = lease_pages(&mut pool, A, 1, 2);
    for index in 0..2 {
        let lease = table.lease(index).unwrap();
        pool.write_kv(lease, 1, 2, &row(3.0), &row(4.0)).unwrap();
    }
    pool.release(&mut table);
    pool.scrub_released();
    assert_eq!(pool.free_pages_dirty(), Vec::<PageId>::new(), "scrubbed");

    // A scrub that forgot to zero: the free list holds a written page.
    let mut table = lease_pages(&mut pool, A, 2, 1);
    pool.write_kv(table.lease(0).unwrap(), 0, 0, &row(1.0), &row(1.0))
        .unwrap();
    pool.release(&mut table);
    let unscrubbed = pool.plant_fault_unscrubbed_free().unwrap();
    assert_eq!(pool.free_pages_dirty(), vec![unscrubbed]);
    // Outside paranoid mode the invariant check does not read values: only
    // the audit sees it.
    pool.check_invariants().unwrap();
    pool.plant_fault_dirty_free(PageId(9));
    let mut dirty = pool.free_pages_dirty();
    dirty.sort();
    let mut want = vec![unscrubbed, PageId(9)];
    want.sort();
    assert_eq!(dirty, want);
}

#[test]
fn canary_double_release_is_caught() {
    let mut pool = pool();
    let mut table = lease_pages(&mut pool, A, 1, 1);
    let page = table.handles()[0].page;
    pool.release(&mut table);
    pool.check_invariants().unwrap();
    pool.plant_fault_double_release(page);
    assert_eq!(
        pool.check_invariants(),
        Err(Violation::ReleasedList { page })
    );
    // Through the API a double release cannot happen: the table is empty.
    assert_eq!(pool.release(&mut table), 0);
}

#[test]
fn canary_stale_generation_is_caught() {
    let mut pool = pool();
    let mut table = lease_pages(&mut pool, A, 1, 1);
    let handle = table.handles()[0];
    pool.plant_fault_stale_generation(handle.page);
    assert_eq!(
        pool.check_page_tables(&[&table]),
        Err(Violation::StaleHandleInTable {
            page: handle.page,
            handle: handle.generation,
            page_generation: handle.generation.next(),
        })
    );
    assert!(matches!(
        pool.page_kv(table.lease(0).unwrap(), 0),
        Err(KvError::StaleHandle { .. })
    ));
    // Releasing through a table with a stale handle is refused by assert.
    assert!(panics(|| {
        let _ = pool.release(&mut table);
    }));
}

#[test]
fn canary_page_in_two_tables_is_caught() {
    let mut pool = pool();
    let a = lease_pages(&mut pool, A, 1, 2);
    let mut b = lease_pages(&mut pool, A, 2, 1);
    pool.check_page_tables(&[&a, &b]).unwrap();
    b.plant_fault_push(a.handles()[1]);
    assert_eq!(
        pool.check_page_tables(&[&a, &b]),
        Err(Violation::PageInTwoTables {
            page: a.handles()[1].page
        })
    );
}

#[test]
fn canary_cross_tenant_page_in_table_is_caught() {
    let mut pool = pool();
    let a = lease_pages(&mut pool, A, 1, 1);
    let mut b = lease_pages(&mut pool, B, 2, 1);
    b.plant_fault_push(a.handles()[0]);
    let page = a.handles()[0].page;
    // Checking B's table alone: A's page is not B's.
    assert_eq!(
        pool.check_page_tables(&[&b]),
        Err(Violation::TableNotOwner {
            page,
            owner: B,
            seq: SeqId(2)
        })
    );
    // And B reading through its table hits the ownership assert.
    assert!(panics(|| {
        let _ = pool.page_kv(b.lease(1).unwrap(), 0);
    }));
}

#[test]
fn canary_wrong_owner_lease_is_caught() {
    let mut pool = pool();
    let a = lease_pages(&mut pool, A, 1, 1);
    let page = a.handles()[0].page;
    pool.plant_fault_owner(page, C);
    assert!(matches!(
        pool.check_invariants(),
        Err(Violation::Count { .. })
    ));
    assert!(matches!(
        pool.check_page_tables(&[&a]),
        Err(Violation::Count { .. })
    ));
    assert!(panics(|| {
        let _ = pool.page_kv(a.lease(0).unwrap(), 0);
    }));
}

#[test]
fn canary_orphan_page_is_caught() {
    let mut pool = pool();
    let a = lease_pages(&mut pool, A, 1, 1);
    let page = a.handles()[0].page;
    std::mem::forget(a);
    pool.check_invariants().unwrap();
    assert_eq!(
        pool.check_page_tables(&[]),
        Err(Violation::OrphanPage { page })
    );
}

/// Releases a table's pages and drops it, checking the pool along the way.
fn drop_table(pool: &mut Pool, mut table: PageTable) {
    pool.release(&mut table);
    pool.scrub_released();
    pool.check_invariants().unwrap();
}

#[test]
fn canary_another_pools_handle_in_a_table_is_caught() {
    let (mut pool, mut other) = (pool(), pool());
    let mut a = lease_pages(&mut pool, A, 1, 1);
    let theirs = lease_pages(&mut other, A, 1, 1);
    a.plant_fault_push(theirs.handles()[0]);
    assert_eq!(
        pool.check_page_tables(&[&a]),
        Err(Violation::ForeignHandleInTable { page: PageId(0) })
    );
}

#[test]
fn canary_page_outside_the_pool_in_a_table_is_caught() {
    let mut pool = pool();
    let mut a = lease_pages(&mut pool, A, 1, 1);
    a.plant_fault_push(PageHandle {
        pool: pool.id(),
        page: PageId(10),
        generation: Generation(1),
    });
    assert_eq!(
        pool.check_page_tables(&[&a]),
        Err(Violation::PageOutOfRange { page: PageId(10) })
    );
}

/// A's sequence 1 with `pages` pages, the first `shared` of them shared.
fn with_shared(pool: &mut Pool, pages: u32, shared: usize) -> (PageTable, Vec<PageHandle>) {
    let table = lease_pages(pool, A, 1, pages);
    let handles = (0..shared).map(|i| pool.share(&table, i)).collect();
    (table, handles)
}

/// An empty table for A's sequence `seq` (through a reservation of one page,
/// returned at once).
fn empty_table(pool: &mut Pool, owner: OwnerTag, seq: u64) -> PageTable {
    let reservation = pool.reserve(owner, 1).unwrap();
    let table = pool.page_table(&reservation, SeqId(seq));
    pool.release_reservation(reservation);
    table
}

#[test]
fn shared_pages_are_read_by_every_holder_and_written_by_none() {
    let mut pool = pool();
    let (first, shared) = with_shared(&mut pool, 2, 1);
    pool.write_kv(first.lease(1).unwrap(), 0, 0, &row(3.0), &row(3.0))
        .unwrap();
    let mut second = empty_table(&mut pool, A, 2);
    pool.attach(&mut second, shared[0]).unwrap();
    assert_eq!(
        pool.page_meta(shared[0].page).unwrap().state,
        PageState::Shared { owner: A, refs: 2 }
    );
    pool.check_page_tables(&[&first, &second]).unwrap();
    // Both sequences read it; neither may write it.
    for table in [&first, &second] {
        let lease = table.lease(0).unwrap();
        assert!(pool.page_kv(lease, 0).is_ok());
        assert_eq!(pool.is_writable(lease), Ok(false));
    }
    assert_eq!(pool.is_writable(first.lease(1).unwrap()), Ok(true));
    // Counted once, against its owner.
    let stats = pool.partition_stats(A).unwrap();
    assert_eq!((stats.pages_owned, stats.pages_shared), (1, 1));
    // The end of one holder leaves it to the other; the end of both leaves it
    // to the owner's cache, still charged, until evicted.
    let mut first = first;
    assert_eq!(pool.release(&mut first), 2);
    assert_eq!(
        pool.stats().pages_released,
        1,
        "only the owned page is released"
    );
    pool.check_page_tables(&[&second]).unwrap();
    assert_eq!(
        pool.evict(A, shared[0]),
        Err(KvError::InUse {
            page: shared[0].page,
            refs: 1
        })
    );
    assert_eq!(pool.stats().pages_shared_idle, 0, "a table holds it");
    pool.release(&mut second);
    pool.check_page_tables(&[]).unwrap();
    assert_eq!(pool.partition_stats(A).unwrap().pages_shared, 1);
    // Kept by the cache alone it is idle (the invariants' recount agrees),
    // and in use again once a table attaches it.
    assert_eq!(pool.stats().pages_shared_idle, 1);
    pool.check_invariants().unwrap();
    let mut again = empty_table(&mut pool, A, 4);
    pool.attach(&mut again, shared[0]).unwrap();
    assert_eq!(pool.stats().pages_shared_idle, 0);
    pool.check_invariants().unwrap();
    pool.release(&mut again);
    assert_eq!(pool.stats().pages_shared_idle, 1);
    pool.evict(A, shared[0]).unwrap();
    assert_eq!(pool.stats().pages_shared_idle, 0);
    // With the first sequence's own page, both wait for the scrub.
    assert_eq!(pool.partition_stats(A).unwrap().pages_released, 2);
    // Scrubbed like any release, and its handle is dead.
    pool.scrub_released();
    pool.check_invariants().unwrap();
    assert!(pool.page_is_zero(shared[0].page));
    let mut third = empty_table(&mut pool, A, 3);
    assert!(matches!(
        pool.attach(&mut third, shared[0]),
        Err(KvError::StaleHandle { .. })
    ));
    assert!(matches!(
        pool.evict(A, shared[0]),
        Err(KvError::StaleHandle { .. })
    ));
    assert_eq!(pool.partition_stats(A).unwrap().pages_shared, 0);
}

#[test]
fn a_write_to_a_shared_page_panics() {
    let mut pool = pool();
    let (table, _) = with_shared(&mut pool, 1, 1);
    let lease = table.lease(0).unwrap();
    let result = catch_unwind(AssertUnwindSafe(|| {
        let _ = pool.write_kv(lease, 0, 0, &row(1.0), &row(1.0));
    }));
    assert!(
        result.is_err(),
        "a write into a shared page must never happen"
    );
}

#[test]
fn sharing_never_crosses_owners() {
    let mut pool = pool();
    let (_table, shared) = with_shared(&mut pool, 1, 1);
    let mut theirs = empty_table(&mut pool, C, 9);
    assert!(panics(|| {
        let _ = pool.attach(&mut theirs, shared[0]);
    }));
    assert!(panics(|| {
        let _ = pool.evict(C, shared[0]);
    }));
    // Another owner's lease on it is refused like any cross-tenant access.
    let lease = Lease {
        handle: shared[0],
        owner: C,
        seq: SeqId(9),
    };
    assert!(panics(|| {
        let _ = pool.page_kv(lease, 0);
    }));
}

#[test]
fn an_owner_with_shared_pages_cannot_be_removed_until_they_are_evicted() {
    let mut pool = pool();
    let (mut table, shared) = with_shared(&mut pool, 1, 1);
    pool.release(&mut table);
    assert!(matches!(
        pool.remove_partition(A),
        Err(PartitionError::StillHeld { pages_held: 1, .. })
    ));
    pool.evict(A, shared[0]).unwrap();
    pool.scrub_released();
    pool.remove_partition(A).unwrap();
}

#[test]
fn canary_a_shared_page_in_a_table_without_its_reference_is_caught() {
    let mut pool = pool();
    let (table, shared) = with_shared(&mut pool, 1, 1);
    let mut other = empty_table(&mut pool, A, 2);
    other.plant_fault_push(shared[0]);
    assert_eq!(
        pool.check_page_tables(&[&table, &other]),
        Err(Violation::SharedRefs {
            page: shared[0].page,
            refs: 1,
            tables: 2
        })
    );
}
