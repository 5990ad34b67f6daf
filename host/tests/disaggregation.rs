//! Prefill/decode disaggregation in one process: a prefill engine and a
//! decode engine joined by an in-memory pipe that runs the real link (the
//! handshake, pairing, framing, the page book's verification), with a
//! man-in-the-middle between them that injects each fault of issue 23 on
//! the prefill side's frames. Every fault ends the request with a 5xx-class
//! finish and no text, and both pools come back to their baseline; an
//! intact transfer decodes exactly what one engine alone decodes.

use bulkhead::engine::admission::Admission;
use bulkhead::engine::build::{self, EngineSpec};
use bulkhead::engine::handoff::{PrefillRefusal, RemotePrefill, Transferred};
use bulkhead::engine::request::{Event, FinishReason, NewRequest, RequestId};
use bulkhead::engine::sampling::SamplingParams;
use bulkhead::engine::scheduler::TenantLimits;
use bulkhead::engine::service::{EngineHandle, EngineService};
use bulkhead::tenancy::TenantId;
use bulkhead::transfer::link::{self, PrefillModel, PrefillModels, Secret, Timeouts};
use bulkhead::transfer::wire::{Message, Pairing};
use bulkhead::transfer::{dispatch, Connector, DecodeLink, JobContext, Stream};
use bulkhead_kernels::gguf::Gguf;
use bulkhead_kernels::kv::{KvType, PoolOptions};
use bulkhead_kernels::model::Model;
use bulkhead_kernels::testing::{tiny_llama, TinySpec};
use bulkhead_kernels::tokenizer::Tokenizer;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef-test";
const MODEL: &str = "tiny";

fn tenants() -> Vec<TenantLimits> {
    [(1, "alpha"), (2, "beta")]
        .into_iter()
        .map(|(id, name)| TenantLimits {
            id: TenantId(id),
            name: name.into(),
            weight: 1,
            queue_depth_max: 8,
            running_max: 4,
            pages_reserved: 16,
            pages_max: 32,
            prefix_cache: false,
        })
        .collect()
}

fn spec() -> EngineSpec {
    EngineSpec {
        pool_pages: 32,
        page_tokens: 8,
        kv_type: KvType::F16,
        threads: 1,
        step_tokens_max: 64,
        step_seqs_max: 4,
        pool_options: PoolOptions {
            poison_released: true,
            paranoid: true,
        },
        placement: bulkhead::engine::placement::Placement::Cpu,
        cuda: Default::default(),
    }
}

/// What the man in the middle does to the prefill side's frames.
#[derive(Clone, Debug)]
enum Fault {
    None,
    /// Flip one byte of page `n`.
    Corrupt(u32),
    /// Claim another digest for page `n` (the trailer resealed to match).
    WrongDigest(u32),
    /// Leave page `n` out.
    Drop(u32),
    /// Send page `n` twice.
    Duplicate(u32),
    /// Swap pages 0 and 1, indices and all.
    Reorder,
    /// Cut page `n` short.
    Truncate(u32),
    /// The incident: a header that claims the prompt and one token of KV.
    Placeholder,
    /// Send the previous transfer (another request's, maybe another
    /// tenant's) instead of this one.
    Replay,
    /// Send the header, then hold the pages past the link's frame deadline.
    Delay,
    /// Close both ways after `n` frames from the prefill side (a process
    /// killed at that step of the protocol).
    Kill(usize),
}

struct Rig {
    runtime: tokio::runtime::Runtime,
    prefill: Option<EngineService>,
    decode: Option<EngineService>,
    both: Option<EngineService>,
    admission: Admission,
    both_admission: Admission,
    decode_handle: EngineHandle,
    prefill_handle: EngineHandle,
    fault: Arc<Mutex<Fault>>,
    ids: AtomicU64,
    link: Arc<DecodeLink>,
}

struct Offered(PrefillModel, AtomicU64);

impl PrefillModels for Offered {
    fn model(&self, id: &str) -> Option<PrefillModel> {
        (id == MODEL).then(|| self.0.clone())
    }
    fn request_id(&self) -> RequestId {
        RequestId(1_000_000 + self.1.fetch_add(1, Ordering::Relaxed))
    }
}

fn pairing(model: &Model, shape: bulkhead_kernels::kv::PageShape) -> Pairing {
    link::pairing_of(
        MODEL,
        model.gguf.fingerprint(),
        shape,
        256,
        tenants().into_iter().map(|t| (t.id.0, t.name)),
    )
}

fn timeouts() -> Timeouts {
    Timeouts {
        connect: Duration::from_secs(1),
        frame: Duration::from_millis(500),
    }
}

impl Rig {
    fn new() -> Rig {
        let gguf = Arc::new(Gguf::from_bytes(tiny_llama(&TinySpec::default())).unwrap());
        let model = Arc::new(Model::load(Arc::clone(&gguf)).unwrap());
        let tokenizer = Arc::new(Tokenizer::from_gguf(&gguf).unwrap());
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let build = || build::scheduler(&model, &tokenizer, &spec(), tenants()).unwrap();
        let prefill = build();
        let shape = prefill.pool().page_shape();
        let prefill_admission = prefill.admission(256);
        let prefill = EngineService::start(prefill).unwrap();
        let (jobs, queue) = tokio::sync::mpsc::unbounded_channel();
        let mut decode = build();
        decode.set_remote_prefill(RemotePrefill {
            model: model.gguf.fingerprint(),
            jobs,
        });
        let admission = decode.admission(256);
        let decode = EngineService::start(decode).unwrap();
        let both = build();
        let both_admission = both.admission(256);
        let both = EngineService::start(both).unwrap();
        let offered = Arc::new(Offered(
            PrefillModel {
                pairing: pairing(&model, shape),
                admission: prefill_admission,
                engine: prefill.handle(),
            },
            AtomicU64::new(0),
        ));
        let fault = Arc::new(Mutex::new(Fault::None));
        let recorded = Arc::new(Mutex::new(Vec::new()));
        let connector: Connector = {
            let (offered, fault, recorded) = (
                Arc::clone(&offered),
                Arc::clone(&fault),
                Arc::clone(&recorded),
            );
            Arc::new(move |_hint: Option<String>| {
                let (offered, fault, recorded) = (
                    Arc::clone(&offered),
                    fault.lock().unwrap().clone(),
                    Arc::clone(&recorded),
                );
                Box::pin(async move {
                    let (decode_end, middle_d) = tokio::io::duplex(1 << 20);
                    let (middle_p, prefill_end) = tokio::io::duplex(1 << 20);
                    tokio::spawn(async move {
                        let _ = link::serve_prefill(
                            prefill_end,
                            &Secret::new(SECRET).unwrap(),
                            timeouts(),
                            &*offered,
                        )
                        .await;
                    });
                    tokio::spawn(middle(middle_d, middle_p, fault, recorded));
                    Ok(Box::new(decode_end) as Box<dyn Stream>)
                })
            })
        };
        let link_state = Arc::new(DecodeLink::default());
        runtime.spawn(dispatch(
            queue,
            JobContext {
                connector,
                secret: Secret::new(SECRET).unwrap(),
                timeouts: timeouts(),
                pairing: Arc::new(pairing(&model, shape)),
                engine: decode.handle(),
                state: Arc::clone(&link_state),
                model: MODEL.into(),
            },
        ));
        Rig {
            runtime,
            decode_handle: decode.handle(),
            prefill_handle: prefill.handle(),
            prefill: Some(prefill),
            decode: Some(decode),
            both: Some(both),
            admission,
            both_admission,
            fault,
            ids: AtomicU64::new(1),
            link: link_state,
        }
    }

    fn set(&self, fault: Fault) {
        *self.fault.lock().unwrap() = fault;
    }

    /// Runs one greedy request of `tenant` through `handle`: its text and
    /// how it finished.
    fn run(&self, both: bool, tenant: u32, prompt: &[u32]) -> (String, FinishReason) {
        let (text, reason, _) = self.run_with(both, tenant, prompt, SamplingParams::default());
        (text, reason)
    }

    /// [`Rig::run`] with `sampling`; also counts the prompt log
    /// probabilities it received.
    fn run_with(
        &self,
        both: bool,
        tenant: u32,
        prompt: &[u32],
        sampling: SamplingParams,
    ) -> (String, FinishReason, usize) {
        let (events, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let request = NewRequest {
            id: RequestId(self.ids.fetch_add(1, Ordering::Relaxed)),
            tenant: TenantId(tenant),
            prompt: prompt.to_vec(),
            max_tokens: 12,
            sampling,
            stop: Vec::new(),
            deadline: Instant::now() + Duration::from_secs(20),
            events,
            cache_salt: None,
            prefill_hint: None,
        };
        let (admission, handle) = if both {
            (&self.both_admission, self.both.as_ref().unwrap().handle())
        } else {
            (&self.admission, self.decode_handle.clone())
        };
        let admitted = admission.admit(request).unwrap();
        self.runtime.block_on(async move {
            handle.submit(admitted).await.unwrap();
            let (mut text, mut scored) = (String::new(), 0);
            while let Some(event) = rx.recv().await {
                match event {
                    Event::Text(t) => text.push_str(&t),
                    Event::Logprob(_) => {}
                    Event::PromptLogprob(_) => scored += 1,
                    Event::Finished { reason, .. } => return (text, reason, scored),
                }
            }
            panic!("no finish");
        })
    }

    /// Waits until both pools are at their baseline: nothing in flight,
    /// every page free and zero, every invariant holding.
    fn baseline(&self) {
        for (side, handle) in [
            ("decode", &self.decode_handle),
            ("prefill", &self.prefill_handle),
        ] {
            let until = Instant::now() + Duration::from_secs(5);
            loop {
                let audit = self.runtime.block_on(handle.audit()).unwrap();
                let clean = audit.in_flight == 0
                    && audit.pages_free == audit.pages_count
                    && audit.free_pages_dirty.is_empty()
                    && audit.invariants.is_ok();
                if clean {
                    break;
                }
                assert!(
                    Instant::now() < until,
                    "{side} pool not back to baseline: {audit:?}"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        for service in [self.decode.take(), self.prefill.take(), self.both.take()]
            .into_iter()
            .flatten()
        {
            service.shutdown(Duration::from_millis(100), FinishReason::Shutdown);
        }
    }
}

fn reseal(frames: &mut [Message]) {
    let Some(Message::Header(header)) = frames.first().cloned() else {
        return;
    };
    let digests: Vec<u64> = frames
        .iter()
        .filter_map(|m| match m {
            Message::Page { digest, .. } => Some(*digest),
            _ => None,
        })
        .collect();
    if let Some(Message::Trailer(d)) = frames.last_mut() {
        *d = bulkhead_kernels::kv::transfer_digest(&header, digests.into_iter());
    }
}

/// The man in the middle: decode's frames pass as they are; the prefill
/// side's transfer (header to trailer) is collected, changed by `fault`,
/// recorded, and sent on.
async fn middle(
    decode: tokio::io::DuplexStream,
    prefill: tokio::io::DuplexStream,
    fault: Fault,
    recorded: Arc<Mutex<Vec<Message>>>,
) {
    let (mut d_read, mut d_write) = tokio::io::split(decode);
    let (mut p_read, mut p_write) = tokio::io::split(prefill);
    let upstream = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut d_read, &mut p_write).await;
        let _ = p_write.shutdown().await;
    });
    let mut seen = 0usize;
    let mut transfer: Vec<Message> = Vec::new();
    loop {
        let Some(message) = read_frame_half(&mut p_read).await else {
            break;
        };
        seen += 1;
        if let Fault::Kill(n) = fault {
            if seen > n {
                break;
            }
        }
        if matches!(fault, Fault::Delay) && matches!(message, Message::Header(_)) {
            // The header on time, then nothing past the frame deadline.
            if d_write.write_all(&message.encode()).await.is_err() {
                return;
            }
            tokio::time::sleep(timeouts().frame * 3).await;
            continue;
        }
        match message {
            Message::Header(_) | Message::Page { .. } => {
                transfer.push(message);
                continue;
            }
            Message::Trailer(_) => {
                transfer.push(message);
                let original = transfer.clone();
                apply(&fault, &mut transfer, &recorded).await;
                *recorded.lock().unwrap() = original;
                for m in transfer.drain(..) {
                    if d_write.write_all(&m.encode()).await.is_err() {
                        return;
                    }
                }
            }
            other => {
                if d_write.write_all(&other.encode()).await.is_err() {
                    return;
                }
            }
        }
    }
    // Killed, or the prefill side closed: close the decode side too.
    let _ = d_write.shutdown().await;
    upstream.abort();
}

async fn apply(fault: &Fault, frames: &mut Vec<Message>, recorded: &Mutex<Vec<Message>>) {
    let page = |frames: &mut Vec<Message>, n: u32| -> usize {
        frames
            .iter()
            .position(|m| matches!(m, Message::Page { index, .. } if *index == n))
            .expect("the prompt has that page")
    };
    match fault {
        Fault::None | Fault::Kill(_) => {}
        Fault::Corrupt(n) => {
            let at = page(frames, *n);
            if let Message::Page { bytes, .. } = &mut frames[at] {
                let middle = bytes.len() / 2;
                bytes[middle] ^= 0x10;
            }
        }
        Fault::WrongDigest(n) => {
            let at = page(frames, *n);
            if let Message::Page { digest, .. } = &mut frames[at] {
                *digest ^= 0xdead;
            }
            reseal(frames);
        }
        Fault::Drop(n) => {
            let at = page(frames, *n);
            frames.remove(at);
            reseal(frames);
        }
        Fault::Duplicate(n) => {
            let at = page(frames, *n);
            let copy = frames[at].clone();
            frames.insert(at, copy);
            reseal(frames);
        }
        Fault::Reorder => {
            let (a, b) = (page(frames, 0), page(frames, 1));
            frames.swap(a, b);
            reseal(frames);
        }
        Fault::Truncate(n) => {
            let at = page(frames, *n);
            if let Message::Page { bytes, .. } = &mut frames[at] {
                bytes.truncate(bytes.len() / 3);
            }
            reseal(frames);
        }
        Fault::Placeholder => {
            // One page of one token, a header that still claims the prompt.
            let first = page(frames, 0);
            let Message::Header(mut header) = frames[0].clone() else {
                unreachable!()
            };
            let mut one = frames[first].clone();
            if let Message::Page { bytes, digest, .. } = &mut one {
                bytes.truncate(header.shape.page_bytes(1) as usize);
                *digest = bulkhead_kernels::kv::page_digest(1, bytes);
            }
            header.pages = 1;
            let trailer = frames.last().cloned().unwrap();
            *frames = vec![Message::Header(header), one, trailer];
            reseal(frames);
        }
        Fault::Replay => {
            let earlier = recorded.lock().unwrap().clone();
            assert!(!earlier.is_empty(), "a transfer to replay");
            *frames = earlier;
        }
        Fault::Delay => unreachable!("delayed in middle()"),
    }
}

/// Reads one frame's message (None at the end of the stream).
async fn read_frame_half(
    stream: &mut tokio::io::ReadHalf<tokio::io::DuplexStream>,
) -> Option<Message> {
    let mut head = [0u8; 5];
    stream.read_exact(&mut head).await.ok()?;
    let len = u32::from_le_bytes(head[..4].try_into().unwrap()) as usize;
    let mut payload = vec![0u8; len - 1];
    stream.read_exact(&mut payload).await.ok()?;
    Some(Message::decode(head[4], &payload).expect("the real sender's frames decode"))
}

/// A prompt of `n` byte tokens from `seed`.
fn prompt(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| 32 + (i * 7 + seed) % 90).collect()
}

#[test]
fn an_intact_transfer_decodes_exactly_what_one_engine_decodes() {
    let rig = Rig::new();
    for (tenant, len, seed) in [(1, 21, 3), (2, 8, 5), (1, 9, 7), (2, 2, 11), (1, 1, 13)] {
        let p = prompt(len, seed);
        let (alone, why_alone) = rig.run(true, tenant, &p);
        let (split, why_split) = rig.run(false, tenant, &p);
        assert_eq!(why_split, why_alone, "prompt of {len}");
        assert!(matches!(
            why_split,
            FinishReason::Length | FinishReason::Stop
        ));
        assert_eq!(split, alone, "prompt of {len}: the same greedy text");
        rig.baseline();
    }
    assert!(rig.link.paired.load(Ordering::Relaxed));
}

#[test]
fn a_prompt_whose_log_probabilities_are_asked_for_is_computed_here_not_by_the_peer() {
    let rig = Rig::new();
    // Every transfer would fail: the request never asks for one.
    rig.set(Fault::Corrupt(0));
    let p = prompt(21, 3);
    let scoring = SamplingParams {
        prompt_logprobs: Some(2),
        ..SamplingParams::default()
    };
    let (alone, why_alone, _) = rig.run_with(true, 1, &p, scoring.clone());
    let (split, why_split, scored) = rig.run_with(false, 1, &p, scoring);
    assert_eq!(why_split, why_alone);
    assert!(matches!(
        why_split,
        FinishReason::Length | FinishReason::Stop
    ));
    assert_eq!(split, alone, "the same greedy text");
    assert_eq!(scored, p.len() - 1, "every prompt token after the first");
    rig.baseline();
    // Without them, the same prompt goes to the peer (and its transfer fails).
    let (_, reason) = rig.run(false, 1, &p);
    assert_eq!(reason, FinishReason::TransferFailed);
    rig.set(Fault::None);
    rig.baseline();
}

fn fails(rig: &Rig, fault: Fault, expect: FinishReason) {
    rig.set(Fault::None);
    // A transfer to replay: beta's, so a replay into alpha's request is
    // another request, job and tenant.
    let _ = rig.run(false, 2, &prompt(19, 1));
    rig.set(fault.clone());
    let (text, reason) = rig.run(false, 1, &prompt(20, 2));
    assert_eq!(reason, expect, "{fault:?}");
    assert!(text.is_empty(), "{fault:?}: nothing generated from bad KV");
    rig.set(Fault::None);
    rig.baseline();
    // And the link still works afterwards.
    let (_, reason) = rig.run(false, 1, &prompt(20, 2));
    assert!(
        matches!(reason, FinishReason::Length | FinishReason::Stop),
        "{fault:?}: then {reason:?}"
    );
    rig.baseline();
}

#[test]
fn every_corrupted_or_rearranged_transfer_fails_the_request_and_frees_both_pools() {
    let rig = Rig::new();
    for fault in [
        Fault::Corrupt(1),
        Fault::WrongDigest(0),
        Fault::Drop(2),
        Fault::Duplicate(1),
        Fault::Reorder,
        Fault::Truncate(0),
        Fault::Placeholder,
        Fault::Replay,
    ] {
        fails(&rig, fault, FinishReason::TransferFailed);
    }
}

#[test]
fn a_late_or_cut_off_transfer_fails_the_request_and_frees_both_pools() {
    let rig = Rig::new();
    fails(&rig, Fault::Delay, FinishReason::TransferFailed);
    // Killed after: the prefill hello, its proof, the pairing, the header,
    // the first page (every step before the verdict).
    for n in 0..5 {
        fails(&rig, Fault::Kill(n), FinishReason::TransferFailed);
    }
}

#[test]
fn a_transfer_nobody_asked_for_is_refused_and_changes_nothing() {
    let rig = Rig::new();
    let verdict = rig.runtime.block_on(rig.decode_handle.transferred(
        RequestId(424242),
        7,
        Transferred::Failed("test"),
    ));
    assert_eq!(verdict, Err("abandoned"));
    rig.baseline();
}

#[test]
fn a_prefill_refusal_reaches_the_client_as_a_single_process_would_give_it() {
    let rig = Rig::new();
    // Beta removed on the prefill side only: its job is refused there, and
    // the decode side ends the request with the refusal a single process
    // gives a removed tenant (403 tenant_removed), having sent nothing.
    let removed = rig.runtime.block_on(
        rig.prefill_handle
            .change_tenant(bulkhead::engine::service::TenantChange::Remove(TenantId(2))),
    );
    assert_eq!(removed, Ok(0));
    let (text, reason) = rig.run(false, 2, &prompt(12, 4));
    assert_eq!(
        reason,
        FinishReason::PrefillRefused(PrefillRefusal::TenantUnknown)
    );
    assert!(text.is_empty());
    rig.baseline();
    // Alpha is still served through the same peer.
    let (_, reason) = rig.run(false, 1, &prompt(12, 4));
    assert!(matches!(reason, FinishReason::Length | FinishReason::Stop));
    rig.baseline();
}

#[test]
fn a_peer_without_the_secret_gets_nothing() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let (a, b) = tokio::io::duplex(1 << 16);
        let good = Secret::new(SECRET).unwrap();
        let bad = Secret::new(b"another secret of thirty-two bytes!!").unwrap();
        let server = tokio::spawn(async move {
            let mut link = link::Framed::new(b, timeouts());
            link.handshake(bulkhead::transfer::wire::Side::Prefill, &good)
                .await
        });
        let mut link = link::Framed::new(a, timeouts());
        let client = link
            .handshake(bulkhead::transfer::wire::Side::Decode, &bad)
            .await;
        assert!(matches!(client, Err(link::LinkError::Unauthenticated)));
        assert!(matches!(
            server.await.unwrap(),
            Err(link::LinkError::Unauthenticated)
        ));
    });
    assert!(Secret::new(b"short").is_err());
}

#[test]
fn pairing_names_the_first_difference_that_matters() {
    let gguf = Arc::new(Gguf::from_bytes(tiny_llama(&TinySpec::default())).unwrap());
    let model = Model::load(Arc::clone(&gguf)).unwrap();
    let shape = bulkhead_kernels::kv::PageShape {
        page_tokens: 8,
        layers: 2,
        kv_heads: 2,
        head_dim: 16,
        kv_type: KvType::F16,
    };
    let here = pairing(&model, shape);
    assert_eq!(link::pairing_difference(&here, &here), None);
    let mut there = here.clone();
    there.fingerprint ^= 1;
    assert!(link::pairing_difference(&here, &there)
        .unwrap()
        .contains("files differ"));
    let mut there = here.clone();
    there.shape.kv_type = KvType::F32;
    assert!(link::pairing_difference(&here, &there)
        .unwrap()
        .contains("page shape"));
    let mut there = here.clone();
    there.context_tokens = 128;
    assert!(link::pairing_difference(&here, &there)
        .unwrap()
        .contains("holds 128"));
    let mut there = here.clone();
    there.tenants[1].id = 9;
    assert!(link::pairing_difference(&here, &there)
        .unwrap()
        .contains("tenant \"beta\""));
    // More context there than here is fine (it holds every prompt here).
    let mut there = here.clone();
    there.context_tokens = 512;
    assert_eq!(link::pairing_difference(&here, &there), None);
}
