//! The wall clock every record is stamped with (Unix milliseconds): the
//! store's records, the audit log, usage, plugin state and the catalog's
//! `created` borrow it from here, below all of them.

/// The current time, Unix milliseconds (0 before 1970).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
