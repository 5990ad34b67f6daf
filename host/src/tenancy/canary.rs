//! The runtime canary guard (an operator option, `server.canary_guard`, off by
//! default): a last line of defence behind the isolation invariants, for
//! operators who want to see a leak blocked rather than read about it later.
//!
//! 1. The operator registers canary strings per tenant through the admin API
//!    (harmless unique markers it plants in that tenant's prompts or system
//!    prompts; stored with the tenant, never logged, never in a metric or an
//!    audit record).
//! 2. Every response's generated text is scanned for every *other* tenant's
//!    canaries ([`Scanner`]), streamed or not: one Aho-Corasick automaton over
//!    all canaries, built when the tenant directory is published.
//! 3. Across chunk boundaries too: the scanner holds back the last
//!    `longest − 1` bytes of text until the next piece (or the end) arrives,
//!    so every occurrence is whole in the scanned window before any byte of
//!    it is sent. Streams therefore lag by up to that many bytes.
//! 4. A hit ends the response with 500 `output_blocked` (a stream's last
//!    event), cancels the request, counts `bulkhead_canary_hits_total` and
//!    writes an audit record naming the request and both tenants.

use super::TenantId;
use crate::store::records::TenantRecord;
use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Shortest canary: shorter strings would match ordinary text.
pub const CANARY_BYTES_MIN: usize = 8;
/// Longest canary (also bounds how much text a stream holds back).
pub const CANARY_BYTES_MAX: usize = 256;
/// Most canaries per tenant.
pub const CANARIES_MAX: usize = 32;

/// Checks a tenant's canary list: at most [`CANARIES_MAX`], each
/// [`CANARY_BYTES_MIN`]..=[`CANARY_BYTES_MAX`] bytes, no duplicates. The
/// message never quotes a canary.
pub fn validate(canaries: &[String]) -> Result<(), String> {
    if canaries.len() > CANARIES_MAX {
        return Err(format!("at most {CANARIES_MAX} canaries per tenant"));
    }
    for (i, canary) in canaries.iter().enumerate() {
        if !(CANARY_BYTES_MIN..=CANARY_BYTES_MAX).contains(&canary.len()) {
            return Err(format!(
                "canary {i} is {} bytes; each must be {CANARY_BYTES_MIN}..={CANARY_BYTES_MAX}",
                canary.len()
            ));
        }
        if canaries[..i].contains(canary) {
            return Err(format!("canary {i} repeats an earlier one"));
        }
    }
    Ok(())
}

/// Every tenant's canaries, compiled for scanning.
#[derive(Debug)]
pub struct CanaryGuard {
    matcher: AhoCorasick,
    /// The tenants that registered each pattern (a string two tenants
    /// registered is one pattern).
    owners: Vec<Vec<TenantId>>,
    /// The longest pattern, in bytes.
    longest: usize,
}

/// A foreign canary in a response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hit {
    /// A tenant that registered it (not the reader).
    pub owner: TenantId,
}

impl CanaryGuard {
    /// The guard over `tenants`' canaries; `None` when there are none.
    pub fn build(tenants: &[TenantRecord]) -> Option<CanaryGuard> {
        let mut by_string: BTreeMap<&str, Vec<TenantId>> = BTreeMap::new();
        for tenant in tenants {
            for canary in &tenant.canaries {
                by_string
                    .entry(canary)
                    .or_default()
                    .push(TenantId(tenant.id));
            }
        }
        if by_string.is_empty() {
            return None;
        }
        let longest = by_string.keys().map(|c| c.len()).max().unwrap_or(1);
        let matcher = AhoCorasickBuilder::new()
            .match_kind(MatchKind::Standard)
            .build(by_string.keys())
            .ok()?;
        Some(CanaryGuard {
            matcher,
            owners: by_string.into_values().collect(),
            longest,
        })
    }

    /// A scanner for one response to `reader` (whose own canaries may appear).
    pub fn scanner(self: &Arc<Self>, reader: TenantId) -> Scanner {
        Scanner {
            guard: Arc::clone(self),
            reader,
            held: String::new(),
        }
    }
}

/// Scans one response's text as it is produced.
#[derive(Debug)]
pub struct Scanner {
    guard: Arc<CanaryGuard>,
    reader: TenantId,
    /// Text scanned but not yet released: the last `longest − 1` bytes, so a
    /// canary split across pieces is whole before any of it is sent.
    held: String,
}

impl Scanner {
    /// Takes the next piece of generated text; answers what may be sent now.
    pub fn push(&mut self, text: &str) -> Result<String, Hit> {
        self.held.push_str(text);
        self.check()?;
        let mut cut = self.held.len().saturating_sub(self.guard.longest - 1);
        while !self.held.is_char_boundary(cut) {
            cut -= 1;
        }
        Ok(self.held.drain(..cut).collect())
    }

    /// The end of the text: answers what is still held.
    pub fn finish(&mut self) -> Result<String, Hit> {
        self.check()?;
        Ok(std::mem::take(&mut self.held))
    }

    fn check(&self) -> Result<(), Hit> {
        for found in self.guard.matcher.find_overlapping_iter(&self.held) {
            let owners = &self.guard.owners[found.pattern().as_usize()];
            if !owners.contains(&self.reader) {
                return Err(Hit { owner: owners[0] });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tenancy::{ModelAccess, Quota};

    fn record(id: u32, canaries: &[&str]) -> TenantRecord {
        TenantRecord {
            id,
            name: format!("t{id}"),
            quota: Quota {
                weight: 1,
                pages_reserved: 1,
                pages_max: 1,
                queue_depth_max: 1,
                running_max: 1,
                pending_max: 1,
                prefix_cache: true,
            },
            models: ModelAccess::All,
            canaries: canaries.iter().map(|c| c.to_string()).collect(),
            objective: None,
            created_ms: 0,
            updated_ms: 0,
        }
    }

    const ALPHA_CANARY: &str = "zebra-alpha-7f3e";

    fn guard() -> Arc<CanaryGuard> {
        Arc::new(
            CanaryGuard::build(&[
                record(1, &[ALPHA_CANARY, "ünïcode-ålpha"]),
                record(2, &["beta-marker-9c"]),
                record(3, &[]),
            ])
            .unwrap(),
        )
    }

    /// Everything a scanner lets out of `pieces`, or the hit.
    fn run(scanner: &mut Scanner, pieces: &[&str]) -> Result<String, Hit> {
        let mut out = String::new();
        for piece in pieces {
            out.push_str(&scanner.push(piece)?);
        }
        out.push_str(&scanner.finish()?);
        Ok(out)
    }

    #[test]
    fn a_foreign_canary_is_caught_wherever_the_pieces_split_it_and_none_of_it_leaves() {
        let guard = guard();
        let text = format!("some text, then {ALPHA_CANARY} and more");
        for a in 0..=text.len() {
            for b in a..=text.len() {
                let (Some(p1), Some(p2), Some(p3)) = (text.get(..a), text.get(a..b), text.get(b..))
                else {
                    continue;
                };
                let mut scanner = guard.scanner(TenantId(2));
                let mut sent = String::new();
                let mut hit = None;
                for piece in [p1, p2, p3] {
                    match scanner.push(piece) {
                        Ok(out) => sent.push_str(&out),
                        Err(h) => {
                            hit = Some(h);
                            break;
                        }
                    }
                }
                let hit = hit.or_else(|| scanner.finish().err());
                assert_eq!(hit, Some(Hit { owner: TenantId(1) }), "split at {a}, {b}");
                assert!(
                    sent.len() <= text.find(ALPHA_CANARY).unwrap(),
                    "split at {a}, {b}: a byte of the canary was sent: {sent:?}"
                );
            }
        }
    }

    #[test]
    fn a_tenants_own_canary_and_ordinary_text_pass_whole() {
        let guard = guard();
        let text = format!("alpha may read {ALPHA_CANARY} in its own output, ünïcode-ålpha too");
        let pieces: Vec<String> = text.chars().map(String::from).collect();
        let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
        assert_eq!(
            run(&mut guard.scanner(TenantId(1)), &pieces),
            Ok(text.clone())
        );
        let plain = "nothing to see here, zebra-alph and beta-marker-9 are prefixes only";
        for reader in [1, 2, 3] {
            assert_eq!(
                run(&mut guard.scanner(TenantId(reader)), &[plain]),
                Ok(plain.to_string())
            );
        }
        // A multi-byte canary, split inside a character.
        let mut scanner = guard.scanner(TenantId(3));
        let unicode = "x ünïcode-ålpha";
        assert_eq!(
            run(&mut scanner, &[&unicode[..5], &unicode[5..]]),
            Err(Hit { owner: TenantId(1) })
        );
    }

    #[test]
    fn a_string_two_tenants_registered_blocks_only_third_parties() {
        let guard = Arc::new(
            CanaryGuard::build(&[record(1, &["shared-marker"]), record(2, &["shared-marker"])])
                .unwrap(),
        );
        for reader in [1, 2] {
            assert!(run(&mut guard.scanner(TenantId(reader)), &["a shared-marker"]).is_ok());
        }
        assert!(run(&mut guard.scanner(TenantId(3)), &["a shared-marker"]).is_err());
    }

    #[test]
    fn lists_are_validated_without_quoting_a_canary() {
        assert_eq!(validate(&[]), Ok(()));
        let short = validate(&["secret7".into()]).unwrap_err();
        assert!(
            short.contains("7 bytes") && !short.contains("secret7"),
            "{short}"
        );
        assert!(validate(&["x".repeat(257)]).is_err());
        let twice = validate(&["marker-one".into(), "marker-one".into()]).unwrap_err();
        assert!(!twice.contains("marker-one"), "{twice}");
        let many: Vec<String> = (0..33).map(|i| format!("marker-{i:04}")).collect();
        assert!(validate(&many).is_err());
        assert!(validate(&many[..32]).is_ok());
        assert!(CanaryGuard::build(&[record(1, &[])]).is_none());
    }
}
