//! [`Storage`] on sled 0.34: one tree, atomic batches, `flush` before a commit
//! returns (sled writes are durable only after a flush).
//!
//! Damaged files must not pass for an empty or older store: sled recovers its
//! log up to the first record that fails its checksum and drops the rest, so a
//! damaged store could open "fine" with its latest records gone — revoked keys
//! working again, deleted tenants back. Every commit therefore also counts
//! itself inside the batch (`storage/commits`) and, once flushed, in a file
//! beside the database ([`COMMITS_FILE`]). Opening a database that holds fewer
//! commits than the file says were acknowledged is refused, naming both.
//!
//! sled is no longer maintained; it stays behind the [`Storage`] trait so a
//! replacement touches this file only. Opening must never panic on a bad
//! folder: a second server holding the lock, an unwritable folder, or files
//! that are not a sled database each give [`StoreError::Open`] naming the path
//! and the cause (sled can panic on some corrupt files; that panic is caught
//! here and reported the same way).

use super::{Entry, Expect, Storage, StoreError, Write};
use std::path::Path;

/// sled's page cache, in bytes: the control plane's data is small.
const CACHE_BYTES: u64 = 16 << 20;
/// The file beside the database holding the count of acknowledged commits.
pub const COMMITS_FILE: &str = "bulkhead-commits";
/// The key of the same count inside the database.
const COMMITS_KEY: &[u8] = b"storage/commits";

/// The sled database of a store.
pub struct SledStorage {
    db: sled::Db,
    dir: std::path::PathBuf,
    /// Commits so far; the mutex also orders commits with their count.
    commits: std::sync::Mutex<u64>,
}

impl SledStorage {
    /// Opens or creates the database in `dir`.
    pub fn open(dir: &Path) -> Result<SledStorage, StoreError> {
        let open_error = |cause: String| StoreError::Open {
            path: dir.display().to_string(),
            cause,
        };
        if let Err(e) = std::fs::create_dir_all(dir) {
            return Err(open_error(e.to_string()));
        }
        probe_writable(dir).map_err(|e| open_error(format!("the folder is not writable: {e}")))?;
        let config = sled::Config::new().path(dir).cache_capacity(CACHE_BYTES);
        // sled reports most failures as errors, but a few corrupt files make
        // it panic while recovering; neither may take the process down.
        // The config is dropped, not reused, if opening panics.
        let opened = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| config.open()));
        let db = match opened {
            Ok(Ok(db)) => db,
            Ok(Err(e)) => return Err(open_error(describe(&e))),
            Err(_) => {
                return Err(open_error(
                    "its files are corrupt (sled could not recover them)".into(),
                ))
            }
        };
        let in_db = match db.get(COMMITS_KEY).map_err(|e| open_error(e.to_string()))? {
            Some(bytes) => u64::from_be_bytes(
                bytes
                    .as_ref()
                    .try_into()
                    .map_err(|_| open_error("its commit count is unreadable".into()))?,
            ),
            None => 0,
        };
        let acknowledged =
            read_commits(dir).map_err(|e| open_error(format!("{COMMITS_FILE}: {e}")))?;
        if in_db < acknowledged {
            return Err(open_error(format!(
                "its files are damaged: the database holds {in_db} commits, but {acknowledged} were \
                 acknowledged ({COMMITS_FILE}); restore the folder from a backup, or move it away to \
                 start from the policy"
            )));
        }
        Ok(SledStorage {
            db,
            dir: dir.to_path_buf(),
            commits: std::sync::Mutex::new(in_db),
        })
    }
}

/// The acknowledged commit count (0 when the file does not exist yet).
fn read_commits(dir: &Path) -> std::io::Result<u64> {
    match std::fs::read_to_string(dir.join(COMMITS_FILE)) {
        Ok(text) => text
            .trim()
            .parse()
            .map_err(|_| std::io::Error::other("not a number")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(e),
    }
}

/// Replaces the commit count file durably: a new file, fsync, rename, fsync
/// of the folder.
fn write_commits(dir: &Path, commits: u64) -> std::io::Result<()> {
    let temp = dir.join(format!("{COMMITS_FILE}.new"));
    {
        let mut file = std::fs::File::create(&temp)?;
        std::io::Write::write_all(&mut file, format!("{commits}\n").as_bytes())?;
        file.sync_all()?;
    }
    std::fs::rename(&temp, dir.join(COMMITS_FILE))?;
    std::fs::File::open(dir)?.sync_all()
}

/// A readable cause for an open error (sled's lock error reads as an I/O error).
fn describe(error: &sled::Error) -> String {
    let text = error.to_string();
    if text.contains("could not acquire lock") {
        "another process (a second server?) has it open".into()
    } else {
        text
    }
}

/// Creates and removes a file in `dir`: sled itself would only notice an
/// unwritable folder at its first write.
fn probe_writable(dir: &Path) -> std::io::Result<()> {
    let probe = dir.join(".write-probe");
    std::fs::write(&probe, b"")?;
    std::fs::remove_file(&probe)
}

fn io(error: sled::Error) -> StoreError {
    StoreError::Io(error.to_string())
}

impl Storage for SledStorage {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.db.get(key).map_err(io)?.map(|v| v.to_vec()))
    }

    fn scan(
        &self,
        prefix: &[u8],
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<Entry>, StoreError> {
        let mut out = Vec::new();
        let entries: Box<dyn Iterator<Item = sled::Result<(sled::IVec, sled::IVec)>>> = match after
        {
            Some(after) => {
                // Start inside the prefix: a range from before it would stop at
                // the first key outside it.
                let start = if after < prefix {
                    std::ops::Bound::Included(prefix.to_vec())
                } else {
                    std::ops::Bound::Excluded(after.to_vec())
                };
                Box::new(
                    self.db
                        .range::<Vec<u8>, _>((start, std::ops::Bound::Unbounded))
                        .take_while(|entry| {
                            entry.as_ref().map_or(true, |(k, _)| k.starts_with(prefix))
                        }),
                )
            }
            None => Box::new(self.db.scan_prefix(prefix)),
        };
        for entry in entries.take(limit) {
            let (key, value) = entry.map_err(io)?;
            out.push((key.to_vec(), value.to_vec()));
        }
        Ok(out)
    }

    fn last(&self, prefix: &[u8]) -> Result<Option<Entry>, StoreError> {
        match self.db.scan_prefix(prefix).next_back() {
            Some(entry) => {
                let (key, value) = entry.map_err(io)?;
                Ok(Some((key.to_vec(), value.to_vec())))
            }
            None => Ok(None),
        }
    }

    fn commit_if(&self, expect: &[Expect], writes: Vec<Write>) -> Result<(), StoreError> {
        // The lock orders commits, and sled's own lock keeps every other
        // process out: nothing changes between the check and the batch.
        let mut commits = self.commits.lock().unwrap_or_else(|p| p.into_inner());
        for e in expect {
            let now = self.db.get(&e.key).map_err(io)?;
            if now.as_deref() != e.value.as_deref() {
                return Err(StoreError::Conflict);
            }
        }
        let next = *commits + 1;
        let mut batch = sled::Batch::default();
        for write in writes {
            match write {
                Write::Put { key, value } => batch.insert(key, value),
                Write::Delete { key } => batch.remove(key),
            }
        }
        batch.insert(COMMITS_KEY, &next.to_be_bytes());
        self.db.apply_batch(batch).map_err(io)?;
        self.db.flush().map_err(io)?;
        *commits = next;
        // After the flush: a crash between the two leaves the database ahead
        // of the file, which opens fine.
        write_commits(&self.dir, next).map_err(|e| StoreError::Io(format!("{COMMITS_FILE}: {e}")))
    }
}
