//! Compiled plugins kept across restarts, loaded only if this host wrote them.
//!
//! Compiling a component takes time (Cranelift), so its compiled form is kept
//! in the store. Loading compiled code is trusting it completely
//! (`Component::deserialize` is `unsafe` for that reason), so a compiled form
//! is *sealed*: an HMAC-SHA-256 under a secret of this host's (a file beside
//! the store, created once, mode 0600), over the engine's compatibility hash
//! (its configuration) and the bytes, which carry Wasmtime's version. One that does
//! not open — another host's, another version's or configuration's, or changed
//! bytes — is ignored, and the component is compiled again from its source.
//!
//! ```text
//!   sealed = "BKART1" | hmac(secret, compat | bytes) [32] | bytes
//! ```

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::hash::{Hash, Hasher};
use std::io::Write as _;
use std::path::Path;
use wasmtime::component::Component;
use wasmtime::Engine;

/// The sealed form's magic and format version.
const MAGIC: &[u8; 6] = b"BKART1";
/// The secret's file, in the store's folder.
pub const SECRET_FILE: &str = "plugin-artifacts.key";
/// Bytes of the secret.
const SECRET_BYTES: usize = 32;

type HmacSha256 = Hmac<Sha256>;

/// This host's sealing secret.
pub struct Sealer {
    secret: [u8; SECRET_BYTES],
    /// Wasmtime's version and the engine's compatibility hash.
    context: Vec<u8>,
}

impl Sealer {
    /// Reads the secret in `dir`, creating it on first use.
    pub fn open(dir: &Path, engine: &Engine) -> std::io::Result<Sealer> {
        let path = dir.join(SECRET_FILE);
        let secret = match std::fs::read(&path) {
            Ok(bytes) => bytes.try_into().map_err(|_| {
                std::io::Error::other(format!(
                    "{} is not a {SECRET_BYTES}-byte key",
                    path.display()
                ))
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let mut secret = [0u8; SECRET_BYTES];
                getrandom::fill(&mut secret)
                    .map_err(|e| std::io::Error::other(format!("randomness: {e}")))?;
                let mut file = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode_0600()
                    .open(&path)?;
                file.write_all(&secret)?;
                file.sync_all()?;
                secret
            }
            Err(e) => return Err(e),
        };
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut hasher);
        // The serialized bytes carry Wasmtime's version (checked again at
        // deserialize); the hash covers the engine's configuration.
        let context = format!("wasmtime-engine {:016x}", hasher.finish()).into_bytes();
        Ok(Sealer { secret, context })
    }

    /// The tag over the engine's context, the source component's digest
    /// (`source_sha256`, so a compiled form opens only for the component it
    /// was compiled from) and the compiled bytes.
    fn mac(&self, source_sha256: &[u8; 32], bytes: &[u8]) -> HmacSha256 {
        let mut mac = HmacSha256::new_from_slice(&self.secret).expect("HMAC takes any key length");
        mac.update(&(self.context.len() as u64).to_le_bytes());
        mac.update(&self.context);
        mac.update(source_sha256);
        mac.update(bytes);
        mac
    }

    /// The sealed form of `component`, compiled from the component whose
    /// SHA-256 is `source_sha256`.
    pub fn seal(
        &self,
        component: &Component,
        source_sha256: &[u8; 32],
    ) -> wasmtime::Result<Vec<u8>> {
        let bytes = component.serialize()?;
        let tag = self.mac(source_sha256, &bytes).finalize().into_bytes();
        Ok([MAGIC.as_slice(), tag.as_slice(), &bytes].concat())
    }

    /// The component in `sealed`, if this host sealed it for this engine and
    /// for the component whose SHA-256 is `source_sha256`.
    pub fn open_sealed(
        &self,
        engine: &Engine,
        sealed: &[u8],
        source_sha256: &[u8; 32],
    ) -> Option<Component> {
        let rest = sealed.strip_prefix(MAGIC.as_slice())?;
        if rest.len() < 32 {
            return None;
        }
        let (tag, bytes) = rest.split_at(32);
        self.mac(source_sha256, bytes).verify_slice(tag).ok()?;
        // SAFETY: the bytes are what `Component::serialize` produced on this
        // host for an engine with this version and configuration: the HMAC
        // under this host's secret proves it (and that they are unchanged).
        unsafe { Component::deserialize(engine, bytes) }.ok()
    }
}

trait Mode0600 {
    fn mode_0600(&mut self) -> &mut Self;
}

impl Mode0600 for std::fs::OpenOptions {
    fn mode_0600(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        self.mode(0o600)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_form_opens_only_for_its_own_source_and_this_hosts_secret() {
        let dir = std::env::temp_dir().join(format!("bulkhead-seal-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let engine = Engine::default();
        // The smallest component: no imports, no exports.
        let component = Component::new(&engine, b"\0asm\x0d\0\x01\0").unwrap();
        let sealer = Sealer::open(&dir, &engine).unwrap();
        let (mine, other) = ([1u8; 32], [2u8; 32]);
        let sealed = sealer.seal(&component, &mine).unwrap();
        assert!(sealer.open_sealed(&engine, &sealed, &mine).is_some());
        assert!(
            sealer.open_sealed(&engine, &sealed, &other).is_none(),
            "another component's compiled form"
        );
        let mut flipped = sealed.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(sealer.open_sealed(&engine, &flipped, &mine).is_none());
        std::fs::remove_file(dir.join(SECRET_FILE)).unwrap();
        let another_host = Sealer::open(&dir, &engine).unwrap();
        assert!(another_host.open_sealed(&engine, &sealed, &mine).is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
