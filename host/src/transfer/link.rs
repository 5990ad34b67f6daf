//! The transfer link over any byte stream (TCP, a Unix socket, or an
//! in-memory pipe in tests): framing with bounds and deadlines, the
//! shared-secret handshake, pairing, and the two sides of a job.
//!
//! ```text
//!  decode                                   prefill
//!    Hello{version, decode, nonce_d} ──►
//!                                  ◄── Hello{version, prefill, nonce_p}
//!    Proof(HMAC(secret, T ‖ 2))      ──►    T = "bulkhead-transfer-v1" ‖ nonce_d ‖ nonce_p
//!                                  ◄── Proof(HMAC(secret, T ‖ 1))
//!    Pair{model, fingerprint, shape, context, tenants} ──►
//!                                  ◄── PairOk | PairRefused(difference)
//!    Job{request, job, owner, max_tokens, tokens} ──►
//!                                  ◄── Refused{status, code} | Header, Page × n, Trailer
//!    Verdict{ok, reason}             ──►    (the prefill side's pages go only now)
//! ```
//!
//! Each side proves the secret without sending it, over both fresh nonces,
//! so a recorded handshake proves nothing later; nothing but the handshake
//! is read from a peer that has not proved it. Every frame is bounded by its
//! kind before it is read, and every read by a deadline.

use super::wire::{
    frame_bound, Job, Message, PairTenant, Pairing, Side, WireError, PAGE_BYTES_MAX, VERSION,
};
use crate::engine::admission::Admission;
use crate::engine::handoff::{ExportTo, PrefillRefusal, Transferred};
use crate::engine::request::{Event, NewRequest, Rejection, RequestId};
use crate::engine::sampling::SamplingParams;
use crate::engine::service::{EngineHandle, SubmitError};
use crate::tenancy::TenantId;
use bulkhead_kernels::kv::{page_digest, transfer_digest, PageShape, Received, ReceivedPage};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};
use subtle::ConstantTimeEq;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The shortest secret accepted (bytes).
pub const SECRET_BYTES_MIN: usize = 32;

/// The link's shared secret (`BULKHEAD_TRANSFER_SECRET`). Never logged.
#[derive(Clone)]
pub struct Secret(Arc<Vec<u8>>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// A secret of at least [`SECRET_BYTES_MIN`] bytes.
    pub fn new(bytes: &[u8]) -> Result<Secret, String> {
        if bytes.len() < SECRET_BYTES_MIN {
            return Err(format!(
                "the transfer secret is {} bytes; it must be at least {SECRET_BYTES_MIN} (e.g. `openssl rand -hex 32`)",
                bytes.len()
            ));
        }
        Ok(Secret(Arc::new(bytes.to_vec())))
    }

    fn proof(&self, transcript: &[u8], side: Side) -> [u8; 32] {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key length");
        mac.update(transcript);
        mac.update(&[side as u8]);
        mac.finalize().into_bytes().into()
    }
}

/// Deadlines of the link.
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    /// Connecting to a peer.
    pub connect: Duration,
    /// Any one frame (and the handshake), once expected.
    pub frame: Duration,
}

impl Default for Timeouts {
    fn default() -> Timeouts {
        Timeouts {
            connect: Duration::from_secs(2),
            frame: Duration::from_secs(10),
        }
    }
}

/// Why the link failed. Labels go to logs and metrics; nothing of a
/// prompt is in any of them.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The stream failed or closed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// A deadline passed.
    #[error("timed out waiting for {0}")]
    Timeout(&'static str),
    /// Bytes that are not a message.
    #[error("bad frame: {0}")]
    Wire(#[from] WireError),
    /// A message out of protocol.
    #[error("expected {expected}, got {got}")]
    Unexpected {
        /// What was due.
        expected: &'static str,
        /// What came.
        got: &'static str,
    },
    /// The peer speaks another version, or is on the same side.
    #[error("peer: {0}")]
    Peer(String),
    /// The peer did not prove the secret.
    #[error("the peer did not prove the shared secret")]
    Unauthenticated,
    /// The pairing was refused (the message names the difference).
    #[error("pairing refused: {0}")]
    PairRefused(String),
}

impl LinkError {
    /// A short label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            LinkError::Io(_) => "io",
            LinkError::Timeout(_) => "timeout",
            LinkError::Wire(_) => "frame",
            LinkError::Unexpected { .. } => "protocol",
            LinkError::Peer(_) => "peer",
            LinkError::Unauthenticated => "unauthenticated",
            LinkError::PairRefused(_) => "pairing",
        }
    }
}

/// Frames over a stream.
pub struct Framed<S> {
    stream: S,
    timeouts: Timeouts,
    /// Largest page message accepted (the paired shape's full page).
    page_bytes_max: u32,
    /// Whether the peer proved the secret: until then every frame is
    /// bounded by [`HANDSHAKE_BYTES_MAX`].
    authenticated: bool,
}

/// Most payload bytes of a frame before the handshake is done (a hello is
/// 39, a proof 32): an unauthenticated peer makes nothing larger allocated.
pub const HANDSHAKE_BYTES_MAX: u32 = 64;

/// How long a prefill job may take on the prefill side, queued and computed
/// (the decode side's own deadline ends it sooner by closing the link).
pub const PREFILL_JOB_TIMEOUT: Duration = Duration::from_secs(300);

impl<S: AsyncRead + AsyncWrite + Unpin> Framed<S> {
    /// Frames over `stream`; pages up to [`PAGE_BYTES_MAX`] until paired.
    pub fn new(stream: S, timeouts: Timeouts) -> Framed<S> {
        Framed {
            stream,
            timeouts,
            page_bytes_max: PAGE_BYTES_MAX,
            authenticated: false,
        }
    }

    /// Sends one message.
    pub async fn send(&mut self, message: &Message) -> Result<(), LinkError> {
        let bytes = message.encode();
        match tokio::time::timeout(self.timeouts.frame, self.stream.write_all(&bytes)).await {
            Ok(result) => Ok(result?),
            Err(_) => Err(LinkError::Timeout("the peer to read")),
        }
    }

    /// Flushes what was sent.
    pub async fn flush(&mut self) -> Result<(), LinkError> {
        match tokio::time::timeout(self.timeouts.frame, self.stream.flush()).await {
            Ok(result) => Ok(result?),
            Err(_) => Err(LinkError::Timeout("the peer to read")),
        }
    }

    /// Receives one message within the frame deadline; `what` names it for
    /// the error.
    pub async fn recv(&mut self, what: &'static str) -> Result<Message, LinkError> {
        match tokio::time::timeout(self.timeouts.frame, self.recv_unbounded()).await {
            Ok(result) => result,
            Err(_) => Err(LinkError::Timeout(what)),
        }
    }

    /// Receives one message with no deadline (a server waiting for its next
    /// job on an idle connection; the caller bounds it).
    async fn recv_unbounded(&mut self) -> Result<Message, LinkError> {
        let mut head = [0u8; 5];
        self.stream.read_exact(&mut head).await?;
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
        let kind = head[4];
        let bound = if self.authenticated {
            frame_bound(kind, self.page_bytes_max)
        } else {
            HANDSHAKE_BYTES_MAX
        };
        if len == 0 || len - 1 > bound {
            return Err(WireError::TooLong {
                what: "frame",
                len: u64::from(len),
                max: u64::from(bound) + 1,
            }
            .into());
        }
        let mut payload = vec![0u8; (len - 1) as usize];
        self.stream.read_exact(&mut payload).await?;
        Ok(Message::decode(kind, &payload)?)
    }

    /// Resolves when the peer closes the connection, or sends anything at a
    /// time it must be waiting (the prefill side's, while a job is computed):
    /// either way the job is over. Cancel-safe: dropped before it resolves,
    /// it has consumed nothing.
    pub async fn peer_gone(&mut self) -> LinkError {
        let mut byte = [0u8; 1];
        match self.stream.read(&mut byte).await {
            Ok(0) => LinkError::Io(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(_) => LinkError::Unexpected {
                expected: "nothing while the prefill runs",
                got: "bytes",
            },
            Err(error) => LinkError::Io(error),
        }
    }

    /// Bounds page messages to one full page of `shape`.
    pub fn set_shape(&mut self, shape: &PageShape) {
        self.page_bytes_max = shape
            .page_bytes(shape.page_tokens)
            .min(u64::from(PAGE_BYTES_MAX)) as u32;
    }

    /// Both sides prove the secret over both nonces (module doc).
    pub async fn handshake(&mut self, side: Side, secret: &Secret) -> Result<(), LinkError> {
        let mut nonce = [0u8; 32];
        getrandom::fill(&mut nonce).map_err(|e| std::io::Error::other(e.to_string()))?;
        self.send(&Message::Hello {
            version: VERSION,
            side,
            nonce,
        })
        .await?;
        self.flush().await?;
        let theirs = match self.recv("hello").await? {
            Message::Hello {
                version,
                side: their_side,
                nonce,
            } => {
                if version != VERSION {
                    return Err(LinkError::Peer(format!(
                        "protocol version {version}, this process speaks {VERSION}"
                    )));
                }
                if their_side == side {
                    return Err(LinkError::Peer("both sides have the same role".into()));
                }
                nonce
            }
            other => {
                return Err(LinkError::Unexpected {
                    expected: "hello",
                    got: other.name(),
                })
            }
        };
        let (decode_nonce, prefill_nonce) = match side {
            Side::Decode => (nonce, theirs),
            Side::Prefill => (theirs, nonce),
        };
        let mut transcript = b"bulkhead-transfer-v1".to_vec();
        transcript.extend_from_slice(&decode_nonce);
        transcript.extend_from_slice(&prefill_nonce);
        let other = match side {
            Side::Decode => Side::Prefill,
            Side::Prefill => Side::Decode,
        };
        self.send(&Message::Proof(secret.proof(&transcript, side)))
            .await?;
        self.flush().await?;
        match self.recv("proof").await? {
            Message::Proof(mac) => {
                let want = secret.proof(&transcript, other);
                if bool::from(mac.ct_eq(&want)) {
                    self.authenticated = true;
                    Ok(())
                } else {
                    Err(LinkError::Unauthenticated)
                }
            }
            other => Err(LinkError::Unexpected {
                expected: "proof",
                got: other.name(),
            }),
        }
    }
}

/// Why a pairing does not hold, naming the first difference that matters:
/// the prefill side must hold every prompt the decode side admits (I2), and
/// both must agree on the model, the page shape and who each tenant is.
pub fn pairing_difference(decode: &Pairing, prefill: &Pairing) -> Option<String> {
    if decode.model != prefill.model {
        return Some(format!(
            "model {:?} is not {:?}",
            decode.model, prefill.model
        ));
    }
    if decode.fingerprint != prefill.fingerprint {
        return Some(format!(
            "model {:?}: the files differ (fingerprint {:016x} here, {:016x} there)",
            decode.model, decode.fingerprint, prefill.fingerprint
        ));
    }
    if decode.shape != prefill.shape {
        return Some(format!(
            "model {:?}: page shape {:?} here, {:?} there",
            decode.model, decode.shape, prefill.shape
        ));
    }
    if prefill.context_tokens < decode.context_tokens {
        return Some(format!(
            "model {:?}: the decode side promises {} tokens of context, the prefill side holds {}",
            decode.model, decode.context_tokens, prefill.context_tokens
        ));
    }
    let known: BTreeSet<(u32, &str)> = prefill
        .tenants
        .iter()
        .map(|t| (t.id, t.name.as_str()))
        .collect();
    for t in &decode.tenants {
        if !known.contains(&(t.id, t.name.as_str())) {
            return Some(format!(
                "model {:?}: tenant {:?} (id {}) is not the same tenant there (run both roles from one seeded policy)",
                decode.model, t.name, t.id
            ));
        }
    }
    None
}

/// One model a prefill process offers to decode peers.
#[derive(Clone)]
pub struct PrefillModel {
    /// What it pairs as.
    pub pairing: Pairing,
    /// Its static admission.
    pub admission: Admission,
    /// Its engine.
    pub engine: EngineHandle,
}

/// The models a prefill process offers, looked up per pairing (the catalog
/// changes while connections live).
pub trait PrefillModels: Send + Sync + 'static {
    /// Model `id`, if served here.
    fn model(&self, id: &str) -> Option<PrefillModel>;
    /// A fresh local request id.
    fn request_id(&self) -> RequestId;
}

/// Serves one decode peer's connection: handshake, pairing, then jobs until
/// the peer closes. Every error closes the connection; the engine releases
/// any job's pages once the link lets go of it.
pub async fn serve_prefill<S: AsyncRead + AsyncWrite + Unpin>(
    stream: S,
    secret: &Secret,
    timeouts: Timeouts,
    models: &dyn PrefillModels,
) -> Result<(), LinkError> {
    let mut link = Framed::new(stream, timeouts);
    link.handshake(Side::Prefill, secret).await?;
    let asked = match link.recv("pair").await? {
        Message::Pair(pairing) => pairing,
        other => {
            return Err(LinkError::Unexpected {
                expected: "pair",
                got: other.name(),
            })
        }
    };
    let Some(model) = models.model(&asked.model) else {
        let reason = format!("model {:?} is not served here", asked.model);
        link.send(&Message::PairRefused(reason.clone())).await?;
        link.flush().await?;
        return Err(LinkError::PairRefused(reason));
    };
    if let Some(reason) = pairing_difference(&asked, &model.pairing) {
        link.send(&Message::PairRefused(reason.clone())).await?;
        link.flush().await?;
        return Err(LinkError::PairRefused(reason));
    }
    link.set_shape(&model.pairing.shape);
    link.send(&Message::PairOk).await?;
    link.flush().await?;
    loop {
        // Idle between jobs: the peer keeps the connection as long as it
        // wants; a job once begun is bounded frame by frame.
        let job = match link.recv_unbounded().await {
            Ok(Message::Job(job)) => job,
            Ok(other) => {
                return Err(LinkError::Unexpected {
                    expected: "job",
                    got: other.name(),
                })
            }
            Err(LinkError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        };
        prefill_job(&mut link, models, &model, job).await?;
    }
}

/// Runs one job and sends its transfer; returns once the peer's verdict is
/// in (the job's pages are released then, by dropping `held`).
async fn prefill_job<S: AsyncRead + AsyncWrite + Unpin>(
    link: &mut Framed<S>,
    models: &dyn PrefillModels,
    model: &PrefillModel,
    job: Job,
) -> Result<(), LinkError> {
    let started = Instant::now();
    let refuse = |refusal: PrefillRefusal| Message::Refused {
        status: refusal.status(),
        code: refusal.code().to_string(),
        message: String::new(),
    };
    if !model.pairing.tenants.iter().any(|t| t.id == job.owner) {
        link.send(&refuse(PrefillRefusal::TenantUnknown)).await?;
        return link.flush().await;
    }
    let (events, mut receiver) = tokio::sync::mpsc::unbounded_channel::<Event>();
    let (export, exported) = tokio::sync::oneshot::channel();
    let (held, held_here) = tokio::sync::oneshot::channel::<()>();
    let id = models.request_id();
    let request = NewRequest {
        id,
        tenant: TenantId(job.owner),
        prompt: job.tokens,
        max_tokens: job.max_tokens,
        sampling: SamplingParams::default(),
        stop: Vec::new(),
        deadline: started + PREFILL_JOB_TIMEOUT,
        events,
        cache_salt: None,
        prefill_hint: None,
    };
    let to = ExportTo {
        request: job.request,
        job: job.job,
        model: model.pairing.fingerprint,
        export,
        held,
    };
    let admitted = match model.admission.admit_prefill(request, to) {
        Ok(admitted) => admitted,
        Err(rejection) => {
            let refusal = match rejection {
                Rejection::ContextLengthExceeded { .. } | Rejection::PromptTooLong { .. } => {
                    PrefillRefusal::ContextLength
                }
                Rejection::QueueFull => PrefillRefusal::QueueFull,
                Rejection::TenantRemoved => PrefillRefusal::TenantUnknown,
                _ => PrefillRefusal::Unavailable,
            };
            link.send(&refuse(refusal)).await?;
            return link.flush().await;
        }
    };
    match model.engine.submit(admitted).await {
        Ok(()) => {}
        Err(error) => {
            let refusal = match error {
                SubmitError::Rejected(Rejection::QueueFull) => PrefillRefusal::QueueFull,
                SubmitError::Rejected(Rejection::TenantRemoved) => PrefillRefusal::TenantUnknown,
                _ => PrefillRefusal::Unavailable,
            };
            link.send(&refuse(refusal)).await?;
            return link.flush().await;
        }
    }
    tracing::debug!(
        request_id = id.0,
        peer_request = job.request,
        "prefill job queued"
    );
    let export = tokio::select! {
        export = exported => export.ok(),
        // The job ended before its export (its deadline, its tenant removed,
        // a shutdown): the receiver hears it as a refusal.
        _ = async { while let Some(event) = receiver.recv().await { if matches!(event, Event::Finished { .. }) { break; } } } => None,
        // The decode side left (its client did, or it stopped): dropping
        // the job's events cancels it at the engine's next step, as a client
        // leaving does in one process, instead of computing a prompt nobody
        // waits for (up to PREFILL_JOB_TIMEOUT).
        gone = link.peer_gone() => {
            metrics::counter!("bulkhead_prefill_jobs_abandoned_total").increment(1);
            tracing::info!(
                request_id = id.0,
                peer_request = job.request,
                tenant_id = job.owner,
                ms = started.elapsed().as_millis() as u64,
                "prefill job cancelled: the decode peer left"
            );
            return match gone {
                LinkError::Io(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(()),
                other => Err(other),
            };
        }
    };
    let Some(export) = export else {
        link.send(&refuse(PrefillRefusal::Unavailable)).await?;
        return link.flush().await;
    };
    let bytes = export.bytes();
    let header = export.header;
    let sending = Instant::now();
    // A helper thread hashes the pages ahead of the socket writes, as far
    // ahead as it gets (the pages are in memory already: the channel holds
    // them, nothing more), so the link waits on hashing only for the first
    // page (BENCHMARKS.md "Disaggregation"). If the link fails, the channel
    // closes and the helper stops at its next page.
    let pages = export.pages;
    let count = pages.len();
    let (hashed_to, mut hashed) = tokio::sync::mpsc::channel(count.max(1));
    tokio::task::spawn_blocking(move || {
        for (index, page) in pages.into_iter().enumerate() {
            let index = index as u32;
            let started = Instant::now();
            let used = header.shape.tokens_in_page(header.identity.tokens, index);
            let digest = page_digest(used, &page);
            if hashed_to
                .blocking_send((index, digest, page, started.elapsed()))
                .is_err()
            {
                return;
            }
        }
    });
    let (mut hashing, mut waiting) = (Duration::ZERO, Duration::ZERO);
    link.send(&Message::Header(header)).await?;
    let mut digests = Vec::with_capacity(count);
    loop {
        let wait = Instant::now();
        let Some((index, digest, page, took)) = hashed.recv().await else {
            break;
        };
        waiting += wait.elapsed();
        hashing += took;
        digests.push(digest);
        link.send(&Message::Page {
            index,
            digest,
            bytes: page,
        })
        .await?;
    }
    if digests.len() != count {
        // The helper stopped early (it panicked): never a short transfer.
        return Err(LinkError::Io(std::io::Error::other("page hashing stopped")));
    }
    link.send(&Message::Trailer(transfer_digest(
        &header,
        digests.into_iter(),
    )))
    .await?;
    link.flush().await?;
    let sent = sending.elapsed();
    let verdict = link.recv("verdict").await;
    // The pages go now, whatever the verdict: the receiver has them, or
    // refused them, or is gone.
    drop(held_here);
    drop(receiver);
    match verdict? {
        Message::Verdict { ok, reason } => {
            metrics::counter!("bulkhead_transfers_sent_total", "result" => if ok { "ok" } else { "refused" }).increment(1);
            metrics::counter!("bulkhead_transfer_sent_bytes_total").increment(bytes);
            tracing::info!(
                request_id = id.0,
                peer_request = job.request,
                tenant_id = job.owner,
                tokens = header.identity.tokens,
                bytes,
                ok,
                reason = %reason,
                ms = started.elapsed().as_millis() as u64,
                send_us = sent.as_micros() as u64,
                hash_us = hashing.as_micros() as u64,
                hash_wait_us = waiting.as_micros() as u64,
                "transfer sent"
            );
            Ok(())
        }
        other => Err(LinkError::Unexpected {
            expected: "verdict",
            got: other.name(),
        }),
    }
}

/// What a fetch came to: the transfer (or why none), the connection for
/// the verdict, and how long its pages took.
pub struct Fetched<S> {
    /// The transfer, a refusal, or the failure.
    pub result: Transferred,
    /// The connection, open for the verdict (none after a failure).
    pub link: Option<Framed<S>>,
    /// How long the pages took.
    pub times: FetchTimes,
}

/// How long a fetch's pages took.
#[derive(Clone, Copy, Debug, Default)]
pub struct FetchTimes {
    /// From the header's arrival to the trailer's.
    pub wire: Duration,
    /// Of it, hashing each page as it arrived.
    pub hashing: Duration,
}

/// Decode side: pairs over a fresh connection and runs one job, returning
/// what arrived (or why nothing did) and the connection for the verdict.
pub async fn fetch<S: AsyncRead + AsyncWrite + Unpin>(
    stream: S,
    secret: &Secret,
    timeouts: Timeouts,
    pairing: &Pairing,
    job: Job,
) -> Fetched<S> {
    let mut link = Framed::new(stream, timeouts);
    let mut times = FetchTimes::default();
    match fetch_on(&mut link, secret, pairing, job, &mut times).await {
        Ok(result) => Fetched {
            result,
            link: Some(link),
            times,
        },
        Err(error) => {
            tracing::warn!(%error, "transfer link failed");
            Fetched {
                result: Transferred::Failed(error.reason()),
                link: None,
                times,
            }
        }
    }
}

async fn fetch_on<S: AsyncRead + AsyncWrite + Unpin>(
    link: &mut Framed<S>,
    secret: &Secret,
    pairing: &Pairing,
    job: Job,
    times: &mut FetchTimes,
) -> Result<Transferred, LinkError> {
    link.handshake(Side::Decode, secret).await?;
    link.send(&Message::Pair(pairing.clone())).await?;
    link.flush().await?;
    match link.recv("pairing").await? {
        Message::PairOk => {}
        Message::PairRefused(reason) => return Err(LinkError::PairRefused(reason)),
        other => {
            return Err(LinkError::Unexpected {
                expected: "pair_ok",
                got: other.name(),
            })
        }
    }
    link.set_shape(&pairing.shape);
    let pages_max = pairing
        .shape
        .pages_for(job.tokens.len().min(u32::MAX as usize) as u32);
    link.send(&Message::Job(job)).await?;
    link.flush().await?;
    // The header waits for the prompt's prefill there (queued and computed):
    // bounded by the request's deadline (the caller's), not a frame's.
    let header = match link.recv_unbounded().await? {
        Message::Header(header) => header,
        Message::Refused { code, .. } => {
            return Ok(Transferred::Refused(PrefillRefusal::from_code(&code)))
        }
        other => {
            return Err(LinkError::Unexpected {
                expected: "header",
                got: other.name(),
            })
        }
    };
    // Never more pages than this job can need, whatever the header says: a
    // count the page book refuses anyway is not worth reading.
    let header_at = Instant::now();
    let mut pages = Vec::new();
    loop {
        match link.recv("page").await? {
            Message::Page {
                index,
                digest,
                bytes,
            } => {
                if pages.len() as u32 >= pages_max {
                    return Err(LinkError::Unexpected {
                        expected: "trailer",
                        got: "page",
                    });
                }
                // Hashed as it arrives, here rather than on the engine
                // thread: the import only compares what it stored.
                let hashing = Instant::now();
                pages.push(ReceivedPage::arrived(&header, index, digest, bytes));
                times.hashing += hashing.elapsed();
            }
            Message::Trailer(digest) => {
                times.wire = header_at.elapsed();
                return Ok(Transferred::Received(Received {
                    header,
                    pages,
                    digest,
                }));
            }
            other => {
                return Err(LinkError::Unexpected {
                    expected: "page",
                    got: other.name(),
                })
            }
        }
    }
}

/// Decode side: tells the prefill peer the page book's verdict.
pub async fn send_verdict<S: AsyncRead + AsyncWrite + Unpin>(
    link: &mut Framed<S>,
    verdict: Result<(), &'static str>,
) -> Result<(), LinkError> {
    let (ok, reason) = match verdict {
        Ok(()) => (true, String::new()),
        Err(reason) => (false, reason.to_string()),
    };
    link.send(&Message::Verdict { ok, reason }).await?;
    link.flush().await
}

/// The pairing a model offers: its id, fingerprint, page shape, context and
/// the tenants that may use it.
pub fn pairing_of(
    model: &str,
    fingerprint: u64,
    shape: PageShape,
    context_tokens: u32,
    tenants: impl IntoIterator<Item = (u32, String)>,
) -> Pairing {
    Pairing {
        model: model.to_string(),
        fingerprint,
        shape,
        context_tokens,
        tenants: tenants
            .into_iter()
            .map(|(id, name)| PairTenant { id, name })
            .collect(),
    }
}

/// Decode side: handshake and pairing only (readiness), then the
/// connection closes. `Ok` when the peer pairs.
pub async fn probe<S: AsyncRead + AsyncWrite + Unpin>(
    stream: S,
    secret: &Secret,
    timeouts: Timeouts,
    pairing: &Pairing,
) -> Result<(), LinkError> {
    let mut link = Framed::new(stream, timeouts);
    link.handshake(Side::Decode, secret).await?;
    link.send(&Message::Pair(pairing.clone())).await?;
    link.flush().await?;
    match link.recv("pairing").await? {
        Message::PairOk => Ok(()),
        Message::PairRefused(reason) => Err(LinkError::PairRefused(reason)),
        other => Err(LinkError::Unexpected {
            expected: "pair_ok",
            got: other.name(),
        }),
    }
}
