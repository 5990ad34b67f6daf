//! Host-owned budgets for plugins: token buckets, booked atomically, and the
//! bookings of each request, given back when the request ends.
//!
//! 1. **Reserve**: a plugin books a request's worst case in a bucket (`limit`
//!    units, refilled continuously, all of it every `window_ms`). The check and
//!    the booking happen under one lock, so concurrent requests can never book
//!    more than the bucket holds — there is no check-then-report gap.
//! 2. **Reconcile**: when the request ends, the host gives back what it did not
//!    use: a `tokens` booking keeps only the request's real prompt and
//!    completion tokens; a `requests` booking is kept whole.
//! 3. **Release**: a request refused or failed before it ran (a later plugin's
//!    reject, a trap, a full queue) gets every booking back.
//! 4. **Bounds**: buckets belong to (tenant, plugin); each has at most
//!    [`BUCKETS_PER_PLUGIN_MAX`]; past it, a full (idle) bucket is forgotten to
//!    make room, or the booking is refused. Bookings live only while their
//!    request is in flight. Nothing here is persisted: a restart refills.

use crate::engine::request::RequestId;
use crate::tenancy::TenantId;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

/// Most buckets one plugin of one tenant may hold.
pub const BUCKETS_PER_PLUGIN_MAX: usize = 4096;
/// Longest bucket key, in bytes.
pub const BUCKET_KEY_BYTES_MAX: usize = 128;

/// What a bucket counts (WIT `budget.unit`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    /// Requests: kept as booked.
    Requests,
    /// Tokens: reconciled to the real count.
    Tokens,
}

/// Why a booking was refused (WIT `budget.budget-error`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BudgetError {
    /// Not enough now; enough again after this many milliseconds.
    Exhausted(u32),
    /// The plugin holds the most buckets it may.
    TooManyKeys,
    /// A bad argument.
    Invalid(String),
}

/// Whose bucket: a tenant's plugin's key.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct BucketKey {
    tenant: TenantId,
    plugin: Arc<str>,
    key: String,
}

#[derive(Clone, Copy, Debug)]
struct Bucket {
    limit: u64,
    window_ms: u32,
    /// Units available, as of `updated`.
    level: f64,
    updated: Instant,
}

impl Bucket {
    fn refill(&mut self, now: Instant) {
        let elapsed_ms = now.saturating_duration_since(self.updated).as_secs_f64() * 1000.0;
        let rate = self.limit as f64 / f64::from(self.window_ms);
        self.level = (self.level + elapsed_ms * rate).min(self.limit as f64);
        self.updated = now;
    }

    fn is_full(&self) -> bool {
        self.level >= self.limit as f64
    }
}

/// One booking of a request.
#[derive(Clone, Debug)]
struct Booking {
    bucket: BucketKey,
    unit: Unit,
    amount: u64,
}

#[derive(Default)]
struct Book {
    buckets: HashMap<BucketKey, Bucket>,
    /// Buckets per (tenant, plugin).
    counts: HashMap<(TenantId, Arc<str>), usize>,
    bookings: HashMap<RequestId, Vec<Booking>>,
}

/// Every plugin's buckets and every request's bookings.
#[derive(Default)]
pub struct Budgets {
    book: Mutex<Book>,
}

fn validate(key: &str, limit: u64, window_ms: u32) -> Result<(), BudgetError> {
    if key.is_empty() || key.len() > BUCKET_KEY_BYTES_MAX {
        return Err(BudgetError::Invalid(format!(
            "a key is 1..={BUCKET_KEY_BYTES_MAX} bytes"
        )));
    }
    if limit == 0 || window_ms == 0 {
        return Err(BudgetError::Invalid(
            "limit and window-ms must be at least 1".into(),
        ));
    }
    Ok(())
}

impl Budgets {
    fn book(&self) -> MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Books `amount` for `request` in the bucket (`tenant`, `plugin`, `key`);
    /// returns what is left.
    #[allow(clippy::too_many_arguments)]
    pub fn reserve(
        &self,
        request: RequestId,
        tenant: TenantId,
        plugin: &Arc<str>,
        key: &str,
        limit: u64,
        window_ms: u32,
        unit: Unit,
        amount: u64,
        now: Instant,
    ) -> Result<u64, BudgetError> {
        validate(key, limit, window_ms)?;
        if amount > limit {
            return Err(BudgetError::Invalid(format!(
                "{amount} is more than the bucket's limit of {limit}: it can never be booked"
            )));
        }
        let bucket_key = BucketKey {
            tenant,
            plugin: Arc::clone(plugin),
            key: key.to_string(),
        };
        let mut book = self.book();
        let book = &mut *book;
        let bucket = match book.buckets.get_mut(&bucket_key) {
            Some(bucket) => bucket,
            None => {
                make_room(book, tenant, plugin, now)?;
                *book.counts.entry((tenant, Arc::clone(plugin))).or_default() += 1;
                book.buckets.entry(bucket_key.clone()).or_insert(Bucket {
                    limit,
                    window_ms,
                    level: limit as f64,
                    updated: now,
                })
            }
        };
        bucket.refill(now);
        if bucket.limit != limit || bucket.window_ms != window_ms {
            // The plugin changed its limit: the new one governs from now on.
            bucket.limit = limit;
            bucket.window_ms = window_ms;
            bucket.level = bucket.level.min(limit as f64);
        }
        let wanted = amount as f64;
        if bucket.level + 1e-9 < wanted {
            let missing = wanted - bucket.level;
            let ms = missing * f64::from(window_ms) / limit as f64;
            return Err(BudgetError::Exhausted(
                ms.ceil().min(f64::from(u32::MAX)) as u32
            ));
        }
        bucket.level = (bucket.level - wanted).max(0.0);
        let left = bucket.level.floor() as u64;
        book.bookings.entry(request).or_default().push(Booking {
            bucket: bucket_key,
            unit,
            amount,
        });
        Ok(left)
    }

    /// What is left in a bucket, booking nothing.
    pub fn available(
        &self,
        tenant: TenantId,
        plugin: &Arc<str>,
        key: &str,
        limit: u64,
        window_ms: u32,
        now: Instant,
    ) -> Result<u64, BudgetError> {
        validate(key, limit, window_ms)?;
        let bucket_key = BucketKey {
            tenant,
            plugin: Arc::clone(plugin),
            key: key.to_string(),
        };
        let mut book = self.book();
        Ok(match book.buckets.get_mut(&bucket_key) {
            Some(bucket) => {
                bucket.refill(now);
                (bucket.level.floor() as u64).min(limit)
            }
            None => limit,
        })
    }

    /// The request ended having used `tokens` (prompt plus completion): token
    /// bookings give back what it did not use.
    pub fn reconcile(&self, request: RequestId, tokens: u64, now: Instant) {
        self.settle(request, now, |booking| match booking.unit {
            Unit::Requests => 0,
            Unit::Tokens => booking.amount.saturating_sub(tokens),
        });
    }

    /// The request never ran: every booking comes back.
    pub fn release(&self, request: RequestId, now: Instant) {
        self.settle(request, now, |booking| booking.amount);
    }

    fn settle(&self, request: RequestId, now: Instant, refund: impl Fn(&Booking) -> u64) {
        let mut book = self.book();
        let Some(bookings) = book.bookings.remove(&request) else {
            return;
        };
        for booking in bookings {
            let back = refund(&booking);
            if let Some(bucket) = book.buckets.get_mut(&booking.bucket) {
                bucket.refill(now);
                bucket.level = (bucket.level + back as f64).min(bucket.limit as f64);
            }
        }
    }

    /// Forgets every bucket of `tenant`'s `plugin` (deleted or replaced by an
    /// incompatible version), or of all of `tenant`'s plugins.
    pub fn forget(&self, tenant: TenantId, plugin: Option<&str>) {
        let mut book = self.book();
        let matches = |k: &BucketKey| k.tenant == tenant && plugin.is_none_or(|p| &*k.plugin == p);
        book.buckets.retain(|k, _| !matches(k));
        book.counts
            .retain(|(t, p), _| !(*t == tenant && plugin.is_none_or(|name| &**p == name)));
    }

    /// Requests with bookings (for tests and metrics).
    pub fn requests_booked(&self) -> usize {
        self.book().bookings.len()
    }
}

/// Makes room for one more bucket of (`tenant`, `plugin`): forgets a full
/// one (full buckets carry no state) if the plugin is at its cap.
fn make_room(
    book: &mut Book,
    tenant: TenantId,
    plugin: &Arc<str>,
    now: Instant,
) -> Result<(), BudgetError> {
    let count = book
        .counts
        .get(&(tenant, Arc::clone(plugin)))
        .copied()
        .unwrap_or(0);
    if count < BUCKETS_PER_PLUGIN_MAX {
        return Ok(());
    }
    let booked: std::collections::HashSet<&BucketKey> = book
        .bookings
        .values()
        .flatten()
        .map(|b| &b.bucket)
        .collect();
    let idle = book
        .buckets
        .iter_mut()
        .filter(|(k, _)| k.tenant == tenant && k.plugin == *plugin && !booked.contains(k))
        .find_map(|(k, b)| {
            b.refill(now);
            b.is_full().then(|| k.clone())
        });
    let Some(idle) = idle else {
        return Err(BudgetError::TooManyKeys);
    };
    book.buckets.remove(&idle);
    if let Some(count) = book.counts.get_mut(&(tenant, Arc::clone(plugin))) {
        *count -= 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const T: TenantId = TenantId(1);

    fn plugin() -> Arc<str> {
        Arc::from("limits")
    }

    #[test]
    fn concurrent_bookings_never_overrun_a_bucket() {
        let budgets = Arc::new(Budgets::default());
        let now = Instant::now();
        let admitted: usize = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..32u64)
                .map(|i| {
                    let budgets = Arc::clone(&budgets);
                    scope.spawn(move || {
                        budgets
                            .reserve(
                                RequestId(i),
                                T,
                                &plugin(),
                                "u",
                                10,
                                60_000,
                                Unit::Requests,
                                1,
                                now,
                            )
                            .is_ok()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| usize::from(h.join().unwrap()))
                .sum()
        });
        assert_eq!(admitted, 10, "exactly the limit, whatever the interleaving");
    }

    #[test]
    fn token_bookings_are_reconciled_and_refused_requests_get_everything_back() {
        let budgets = Budgets::default();
        let p = plugin();
        let now = Instant::now();
        let reserve = |id, amount| {
            budgets.reserve(
                RequestId(id),
                T,
                &p,
                "tok",
                100,
                60_000,
                Unit::Tokens,
                amount,
                now,
            )
        };
        assert_eq!(reserve(1, 60), Ok(40));
        assert!(matches!(reserve(2, 60), Err(BudgetError::Exhausted(_))));
        // Request 1 used 25 of its 60: 35 come back.
        budgets.reconcile(RequestId(1), 25, now);
        assert_eq!(reserve(2, 60), Ok(15));
        // Request 2 was refused later: all 60 come back.
        budgets.release(RequestId(2), now);
        assert_eq!(budgets.available(T, &p, "tok", 100, 60_000, now), Ok(75));
        assert_eq!(budgets.requests_booked(), 0);
    }

    #[test]
    fn buckets_refill_over_their_window_and_say_when() {
        let budgets = Budgets::default();
        let p = plugin();
        let now = Instant::now();
        for i in 0..4 {
            budgets
                .reserve(RequestId(i), T, &p, "r", 4, 1000, Unit::Requests, 1, now)
                .unwrap();
        }
        match budgets.reserve(RequestId(9), T, &p, "r", 4, 1000, Unit::Requests, 1, now) {
            Err(BudgetError::Exhausted(ms)) => assert_eq!(ms, 250),
            other => panic!("{other:?}"),
        }
        let later = now + Duration::from_millis(500);
        assert_eq!(
            budgets.reserve(RequestId(9), T, &p, "r", 4, 1000, Unit::Requests, 1, later),
            Ok(1)
        );
        // Another tenant's or plugin's bucket of the same key is another bucket.
        assert!(budgets
            .reserve(
                RequestId(10),
                TenantId(2),
                &p,
                "r",
                4,
                1000,
                Unit::Requests,
                1,
                now
            )
            .is_ok());
        assert!(budgets
            .reserve(
                RequestId(11),
                T,
                &Arc::from("other"),
                "r",
                4,
                1000,
                Unit::Requests,
                1,
                now
            )
            .is_ok());
    }

    #[test]
    fn bad_arguments_and_too_many_keys_are_refused() {
        let budgets = Budgets::default();
        let p = plugin();
        let now = Instant::now();
        for (key, limit, window, amount) in [
            ("", 1, 1, 1),
            ("k", 0, 1, 1),
            ("k", 1, 0, 1),
            ("k", 1, 1, 2),
        ] {
            assert!(matches!(
                budgets.reserve(
                    RequestId(1),
                    T,
                    &p,
                    key,
                    limit,
                    window,
                    Unit::Requests,
                    amount,
                    now
                ),
                Err(BudgetError::Invalid(_))
            ));
        }
        let long = "k".repeat(BUCKET_KEY_BYTES_MAX + 1);
        assert!(budgets.available(T, &p, &long, 1, 1, now).is_err());
        // Fill the cap with buckets that stay booked: the next key is refused.
        for i in 0..BUCKETS_PER_PLUGIN_MAX {
            budgets
                .reserve(
                    RequestId(i as u64),
                    T,
                    &p,
                    &format!("k{i}"),
                    2,
                    1000,
                    Unit::Requests,
                    1,
                    now,
                )
                .unwrap();
        }
        assert_eq!(
            budgets.reserve(
                RequestId(1 << 40),
                T,
                &p,
                "new",
                2,
                1000,
                Unit::Requests,
                1,
                now
            ),
            Err(BudgetError::TooManyKeys)
        );
        // Once a bucket is idle and full again, it makes room.
        budgets.release(RequestId(0), now);
        assert!(budgets
            .reserve(
                RequestId(1 << 40),
                T,
                &p,
                "new",
                2,
                1000,
                Unit::Requests,
                1,
                now
            )
            .is_ok());
    }
}
