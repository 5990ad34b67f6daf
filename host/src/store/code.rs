//! Plugin code on disk, beside the store's database: each version of each
//! plugin has files of its own, owned by its record alone.
//!
//! Components and their sealed compiled forms are the store's only large
//! values, and sled keeps the space of large values long after they are
//! overwritten or deleted (150 uploads to one plugin name grew a store from
//! 1 MB to 263 MB, for good). So they live in files named after their owner,
//! and the store's size follows what is live:
//!
//! 1. An upload writes the new version's files ([`PluginCode::put`]: a
//!    temporary file, fsync, rename, fsync of the folder), then commits the
//!    record that names them, then deletes the previous version's files.
//! 2. Nothing is shared: two tenants (or two plugins) uploading the same
//!    bytes get two copies, and deleting one never touches the other.
//! 3. At start, [`PluginCode::reclaim`] deletes every file no record names
//!    (what a crash between the steps of 1 left behind).
//!
//! On a store shared by many servers (etcd), the component is in the store
//! instead, committed with its record (`Batch::put_plugin_code`), and this
//! folder holds only this server's compiled forms: what each server compiles
//! for itself, under its own secret.
//!
//! ```text
//!   plugin-code/<tenant u32 hex>-<plugin id u64 hex>-v<version>.wasm     the component
//!   plugin-code/<tenant u32 hex>-<plugin id u64 hex>-v<version>.sealed   its compiled form
//! ```

use super::StoreError;
use std::collections::HashSet;
use std::io::Write as _;
use std::path::{Path, PathBuf};

/// The folder, inside the store's.
pub const CODE_DIR: &str = "plugin-code";

/// One version of one plugin: whose files these are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CodeOwner {
    /// The plugin's tenant.
    pub tenant: u32,
    /// The plugin's id (never reused).
    pub plugin: u64,
    /// The upload.
    pub version: u32,
}

/// Which of a version's two files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CodeKind {
    /// The component as uploaded.
    Wasm,
    /// Its compiled form, sealed by this host (see `policy::artifact`).
    Sealed,
}

impl CodeKind {
    fn extension(self) -> &'static str {
        match self {
            CodeKind::Wasm => "wasm",
            CodeKind::Sealed => "sealed",
        }
    }
}

impl CodeOwner {
    /// Its name, unique per owner: `<tenant u32 hex>-<plugin id u64 hex>-v<version>`.
    pub fn stem(&self) -> String {
        format!("{:08x}-{:016x}-v{}", self.tenant, self.plugin, self.version)
    }

    fn file_name(&self, kind: CodeKind) -> String {
        format!("{}.{}", self.stem(), kind.extension())
    }

    /// The owner a file name belongs to, if it is one of ours.
    fn parse(name: &str) -> Option<(CodeOwner, CodeKind)> {
        let (stem, extension) = name.rsplit_once('.')?;
        let kind = match extension {
            "wasm" => CodeKind::Wasm,
            "sealed" => CodeKind::Sealed,
            _ => return None,
        };
        let mut parts = stem.splitn(3, '-');
        let tenant = u32::from_str_radix(parts.next()?, 16).ok()?;
        let plugin = u64::from_str_radix(parts.next()?, 16).ok()?;
        let version = parts.next()?.strip_prefix('v')?.parse().ok()?;
        Some((
            CodeOwner {
                tenant,
                plugin,
                version,
            },
            kind,
        ))
    }
}

/// The plugin code folder of a store.
pub struct PluginCode {
    dir: PathBuf,
}

fn io(context: &str, path: &Path, e: std::io::Error) -> StoreError {
    StoreError::Io(format!("{context} {}: {e}", path.display()))
}

impl PluginCode {
    /// The folder `CODE_DIR` inside `store_dir`, created if missing.
    pub fn open(store_dir: &Path) -> Result<PluginCode, StoreError> {
        let dir = store_dir.join(CODE_DIR);
        std::fs::create_dir_all(&dir).map_err(|e| StoreError::Open {
            path: dir.display().to_string(),
            cause: e.to_string(),
        })?;
        Ok(PluginCode { dir })
    }

    fn path(&self, owner: CodeOwner, kind: CodeKind) -> PathBuf {
        self.dir.join(owner.file_name(kind))
    }

    /// Writes `owner`'s file of `kind`, durably, replacing nothing of anyone
    /// else's.
    pub fn put(&self, owner: CodeOwner, kind: CodeKind, bytes: &[u8]) -> Result<(), StoreError> {
        let path = self.path(owner, kind);
        let tmp = path.with_extension("partial");
        let write = || -> std::io::Result<()> {
            let mut file = std::fs::File::create(&tmp)?;
            file.write_all(bytes)?;
            file.sync_all()?;
            std::fs::rename(&tmp, &path)?;
            std::fs::File::open(&self.dir)?.sync_all()
        };
        write().map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            io("writing", &path, e)
        })
    }

    /// `owner`'s file of `kind`, if present.
    pub fn get(&self, owner: CodeOwner, kind: CodeKind) -> Result<Option<Vec<u8>>, StoreError> {
        let path = self.path(owner, kind);
        match std::fs::read(&path) {
            Ok(bytes) => Ok(Some(bytes)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io("reading", &path, e)),
        }
    }

    /// Deletes `owner`'s files (nothing if absent).
    pub fn delete(&self, owner: CodeOwner) -> Result<(), StoreError> {
        for kind in [CodeKind::Wasm, CodeKind::Sealed] {
            let path = self.path(owner, kind);
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io("deleting", &path, e)),
            }
        }
        Ok(())
    }

    /// Bytes of every file of `tenant`'s plugins, except `except`'s.
    pub fn bytes_of(&self, tenant: u32, except: Option<u64>) -> Result<u64, StoreError> {
        let mut total = 0;
        for (owner, _, bytes) in self.files()? {
            if owner.tenant == tenant && Some(owner.plugin) != except {
                total += bytes;
            }
        }
        Ok(total)
    }

    /// Deletes every file whose owner is not in `live` (and any temporary
    /// file); the count and bytes deleted.
    pub fn reclaim(&self, live: &HashSet<CodeOwner>) -> Result<(u64, u64), StoreError> {
        let (mut count, mut bytes) = (0, 0);
        let entries = std::fs::read_dir(&self.dir).map_err(|e| io("listing", &self.dir, e))?;
        for entry in entries {
            let entry = entry.map_err(|e| io("listing", &self.dir, e))?;
            let name = entry.file_name();
            let keep = name
                .to_str()
                .and_then(CodeOwner::parse)
                .is_some_and(|(owner, _)| live.contains(&owner));
            if !keep {
                let size = entry.metadata().map_or(0, |m| m.len());
                std::fs::remove_file(entry.path()).map_err(|e| io("deleting", &entry.path(), e))?;
                count += 1;
                bytes += size;
            }
        }
        Ok((count, bytes))
    }

    fn files(&self) -> Result<Vec<(CodeOwner, CodeKind, u64)>, StoreError> {
        let entries = std::fs::read_dir(&self.dir).map_err(|e| io("listing", &self.dir, e))?;
        let mut files = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| io("listing", &self.dir, e))?;
            if let Some((owner, kind)) = entry.file_name().to_str().and_then(CodeOwner::parse) {
                files.push((owner, kind, entry.metadata().map_or(0, |m| m.len())));
            }
        }
        Ok(files)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "bulkhead-code-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn owner(tenant: u32, plugin: u64, version: u32) -> CodeOwner {
        CodeOwner {
            tenant,
            plugin,
            version,
        }
    }

    #[test]
    fn the_same_bytes_of_two_owners_are_two_files_and_deleting_one_keeps_the_other() {
        let dir = folder();
        let code = PluginCode::open(&dir).unwrap();
        let (alpha, beta) = (owner(1, 1, 1), owner(2, 2, 1));
        for who in [alpha, beta] {
            code.put(who, CodeKind::Wasm, b"same bytes").unwrap();
            code.put(who, CodeKind::Sealed, b"sealed").unwrap();
        }
        code.delete(beta).unwrap();
        assert_eq!(code.get(beta, CodeKind::Wasm).unwrap(), None);
        assert_eq!(
            code.get(alpha, CodeKind::Wasm).unwrap().as_deref(),
            Some(&b"same bytes"[..])
        );
        assert_eq!(code.bytes_of(1, None).unwrap(), 16);
        assert_eq!(code.bytes_of(1, Some(1)).unwrap(), 0);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn reclaim_deletes_what_no_record_names_and_nothing_else() {
        let dir = folder();
        let code = PluginCode::open(&dir).unwrap();
        let (live, old, orphan) = (owner(1, 7, 3), owner(1, 7, 2), owner(3, 9, 1));
        for who in [live, old, orphan] {
            code.put(who, CodeKind::Wasm, &[0u8; 100]).unwrap();
        }
        std::fs::write(dir.join(CODE_DIR).join("x.partial"), b"torn").unwrap();
        let kept: HashSet<CodeOwner> = [live].into_iter().collect();
        assert_eq!(code.reclaim(&kept).unwrap(), (3, 204));
        assert!(code.get(live, CodeKind::Wasm).unwrap().is_some());
        assert!(code.get(old, CodeKind::Wasm).unwrap().is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn file_names_round_trip_and_others_are_not_ours() {
        let who = owner(0xabc, 0x1234_5678_9abc, 42);
        for kind in [CodeKind::Wasm, CodeKind::Sealed] {
            assert_eq!(CodeOwner::parse(&who.file_name(kind)), Some((who, kind)));
        }
        for name in [
            "x.wasm",
            "00000001-2.wasm",
            "1-2-3.wasm",
            "1-2-v3.txt",
            "zz-1-v1.wasm",
        ] {
            assert_eq!(CodeOwner::parse(name), None, "{name}");
        }
    }
}
