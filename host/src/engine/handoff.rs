//! The engine's side of prefill/decode disaggregation: what a decode-role
//! scheduler asks a prefill peer for, what a prefill-role scheduler hands
//! back, and how a transfer can end. The link (framing, sockets, the shared
//! secret) is `crate::transfer`'s; the verification is the page book's
//! ([`bulkhead_kernels::kv::transfer`]).
//!
//! A sequence's phase (`Scheduler`'s `Phase`) is explicit:
//!
//! ```text
//!  decode role:   start ──► Transfer ──verified──► Prefill (last token) ──► Decode ──► finish
//!                              │ refused, cut off, timed out, abandoned
//!                              └──► finish(transfer_failed | prefill_refused | cancelled | …)
//!  prefill role:  start ──► Prefill (whole prompt, no logits) ──► Exported ──verdict──► finish(exported)
//!  both:          start ──► Prefill ──► Decode ──► finish
//! ```
//!
//! KV state (the page table, or the import that holds it) is apart from the
//! client-output state (sampler, detokenizer, stop matcher): a transfer
//! replaces only the first.

use bulkhead_kernels::kv::{Export, Received, TransferIdentity};
use std::time::Instant;
use tokio::sync::{mpsc, oneshot};

/// Where a decode-role scheduler sends its prefill jobs.
#[derive(Clone)]
pub struct RemotePrefill {
    /// The model's fingerprint (in every identity it asks for).
    pub model: u64,
    /// The link's job queue (bounded by the sequence slots: a job exists
    /// only for a started sequence).
    pub jobs: mpsc::UnboundedSender<PrefillRequest>,
}

/// One prefill job as the decode side's scheduler asks for it.
pub struct PrefillRequest {
    /// What the transfer must carry.
    pub identity: TransferIdentity,
    /// The tokens whose KV to compute (the prompt but its last token).
    pub tokens: Vec<u32>,
    /// The request's `max_tokens` (the prefill side admits the same total).
    pub max_tokens: u32,
    /// The request's deadline.
    pub deadline: Instant,
    /// The prefill peer a gateway chose for it, unchecked (the link checks it).
    pub prefill_hint: Option<String>,
    /// Resolves (with an error) when the sequence stops waiting — it ended or
    /// was preempted: the job stops and the link closes.
    pub abandoned: oneshot::Receiver<()>,
}

/// Why a prefill peer refused a job, as the client would have been refused
/// with `--role both`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillRefusal {
    /// The tenant's queue there is full (429).
    QueueFull,
    /// The prompt does not fit there (400): pairing makes this a bug.
    ContextLength,
    /// The peer does not know the tenant (403).
    TenantUnknown,
    /// The peer cannot take jobs now (503).
    Unavailable,
}

impl PrefillRefusal {
    /// Its wire code.
    pub fn code(self) -> &'static str {
        match self {
            PrefillRefusal::QueueFull => "queue_full",
            PrefillRefusal::ContextLength => "context_length_exceeded",
            PrefillRefusal::TenantUnknown => "tenant_unknown",
            PrefillRefusal::Unavailable => "prefill_unavailable",
        }
    }

    /// From a wire code (an unknown one is `Unavailable`).
    pub fn from_code(code: &str) -> PrefillRefusal {
        match code {
            "queue_full" => PrefillRefusal::QueueFull,
            "context_length_exceeded" => PrefillRefusal::ContextLength,
            "tenant_unknown" => PrefillRefusal::TenantUnknown,
            _ => PrefillRefusal::Unavailable,
        }
    }

    /// Its HTTP status.
    pub fn status(self) -> u16 {
        match self {
            PrefillRefusal::QueueFull => 429,
            PrefillRefusal::ContextLength => 400,
            PrefillRefusal::TenantUnknown => 403,
            PrefillRefusal::Unavailable => 503,
        }
    }
}

/// How a transfer the decode side asked for came back.
#[derive(Debug)]
pub enum Transferred {
    /// Bytes arrived whole (not yet verified: the page book does that).
    Received(Received),
    /// The peer refused the job.
    Refused(PrefillRefusal),
    /// The link failed: no peer, handshake, pairing, cut off, timed out, or
    /// a frame out of protocol (the reason label, for logs and metrics).
    Failed(&'static str),
}

/// Where a prefill-role sequence's export goes, and how it learns that its
/// pages may go.
pub struct ExportTo {
    /// The receiver's request id and job nonce, and the model's fingerprint.
    pub request: u64,
    /// The job nonce.
    pub job: u64,
    /// The model's fingerprint.
    pub model: u64,
    /// Receives the export once the prompt's KV is complete.
    pub export: oneshot::Sender<Export>,
    /// Dropped by the link when the receiver's verdict is in (or the link
    /// failed for good): the sequence then releases its pages.
    pub held: oneshot::Sender<()>,
}
