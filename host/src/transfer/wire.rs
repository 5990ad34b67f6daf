//! The transfer link's messages and their bytes: one frame per message,
//! `[u32 LE length][u8 kind][payload]`, every field little-endian, every
//! length bounded before anything is allocated. Decoding is pure (bytes in,
//! a message or a typed error out) so it is fuzzed like every other parser
//! of outside bytes.

use bulkhead_kernels::kv::{KvType, OwnerTag, PageShape, TransferHeader, TransferIdentity};
use thiserror::Error;

/// The protocol version; a peer with another is refused at the handshake.
/// 2: page digests are XXH3-64 seeded with the used slot count (1: XXH64
/// of the count and the bytes).
pub const VERSION: u16 = 2;
/// The first bytes of every hello.
pub const MAGIC: [u8; 4] = *b"BKHT";
/// Most bytes of any message other than a page (hello, pairing, job with its
/// tokens, refusal).
pub const CONTROL_BYTES_MAX: u32 = 1 << 20;
/// Most bytes of a page message: a page of the largest geometry the pool
/// accepts is far below it; a peer's pairing may set a lower bound.
pub const PAGE_BYTES_MAX: u32 = 64 << 20;
/// Most tenants a pairing names.
pub const TENANTS_MAX: usize = 1024;
/// Most prompt tokens a job carries (the largest context a model may promise).
pub const JOB_TOKENS_MAX: usize = 1 << 18;
/// Most bytes of a text field (names, codes, reasons).
pub const TEXT_BYTES_MAX: usize = 1024;

/// Which side of the link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// Computes prompts' KV and sends it.
    Prefill = 1,
    /// Asks for KV, verifies it, decodes.
    Decode = 2,
}

/// A tenant as both sides must know it: stable id and name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PairTenant {
    /// Stable registry id.
    pub id: u32,
    /// Name.
    pub name: String,
}

/// What the decode side tells a prefill peer about one model, and what must
/// match (or be held) there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pairing {
    /// The model's id.
    pub model: String,
    /// Its fingerprint.
    pub fingerprint: u64,
    /// Its pool's page shape.
    pub shape: PageShape,
    /// The context the decode side promises.
    pub context_tokens: u32,
    /// Tenants that may use the model there.
    pub tenants: Vec<PairTenant>,
}

/// One prefill job: compute these tokens' KV for this request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Job {
    /// Decode side's request id.
    pub request: u64,
    /// Nonce for this job.
    pub job: u64,
    /// The tenant's stable id.
    pub owner: u32,
    /// The request's `max_tokens` (the prefill side admits the same total).
    pub max_tokens: u32,
    /// The prompt's tokens whose KV to send (all but the last).
    pub tokens: Vec<u32>,
}

/// Every message of the link.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// First message each way.
    Hello {
        /// Protocol version.
        version: u16,
        /// Sender's side.
        side: Side,
        /// A fresh random nonce.
        nonce: [u8; 32],
    },
    /// Second message each way: proof of the shared secret over both nonces.
    Proof([u8; 32]),
    /// Decode → prefill: the model to pair for.
    Pair(Pairing),
    /// Prefill → decode: paired.
    PairOk,
    /// Prefill → decode: not paired, and why (names the difference).
    PairRefused(String),
    /// Decode → prefill: a job.
    Job(Job),
    /// Prefill → decode: the job was refused (as a client would have been).
    Refused {
        /// HTTP status.
        status: u16,
        /// Error code.
        code: String,
        /// Message.
        message: String,
    },
    /// Prefill → decode: the transfer's header.
    Header(TransferHeader),
    /// Prefill → decode: one page.
    Page {
        /// Index in the transfer.
        index: u32,
        /// Sender's digest.
        digest: u64,
        /// Bytes.
        bytes: Vec<u8>,
    },
    /// Prefill → decode: the whole-transfer digest; nothing follows.
    Trailer(u64),
    /// Decode → prefill: verified (pages may be released), or refused.
    Verdict {
        /// Whether the import passed.
        ok: bool,
        /// Why not (a reason label).
        reason: String,
    },
}

/// Why bytes are not a message.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum WireError {
    /// Fewer bytes than the message needs.
    #[error("message cut short")]
    Short,
    /// Bytes left after the message.
    #[error("{0} bytes after the message")]
    Trailing(usize),
    /// A kind byte no message has.
    #[error("unknown message kind {0}")]
    Kind(u8),
    /// A length above its bound.
    #[error("{what} of {len} above its maximum {max}")]
    TooLong {
        /// What.
        what: &'static str,
        /// Its length.
        len: u64,
        /// The bound.
        max: u64,
    },
    /// A field with a value it cannot have.
    #[error("bad {0}")]
    Field(&'static str),
}

const HELLO: u8 = 1;
const PROOF: u8 = 2;
const PAIR: u8 = 3;
const PAIR_OK: u8 = 4;
const PAIR_REFUSED: u8 = 5;
const JOB: u8 = 6;
const REFUSED: u8 = 7;
const HEADER: u8 = 8;
const PAGE: u8 = 9;
const TRAILER: u8 = 10;
const VERDICT: u8 = 11;

impl Message {
    /// The kind byte.
    pub fn kind(&self) -> u8 {
        match self {
            Message::Hello { .. } => HELLO,
            Message::Proof(_) => PROOF,
            Message::Pair(_) => PAIR,
            Message::PairOk => PAIR_OK,
            Message::PairRefused(_) => PAIR_REFUSED,
            Message::Job(_) => JOB,
            Message::Refused { .. } => REFUSED,
            Message::Header(_) => HEADER,
            Message::Page { .. } => PAGE,
            Message::Trailer(_) => TRAILER,
            Message::Verdict { .. } => VERDICT,
        }
    }

    /// The message's name, for errors and logs.
    pub fn name(&self) -> &'static str {
        match self {
            Message::Hello { .. } => "hello",
            Message::Proof(_) => "proof",
            Message::Pair(_) => "pair",
            Message::PairOk => "pair_ok",
            Message::PairRefused(_) => "pair_refused",
            Message::Job(_) => "job",
            Message::Refused { .. } => "refused",
            Message::Header(_) => "header",
            Message::Page { .. } => "page",
            Message::Trailer(_) => "trailer",
            Message::Verdict { .. } => "verdict",
        }
    }

    /// The whole frame: length, kind, payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![0u8; 4];
        out.push(self.kind());
        match self {
            Message::Hello {
                version,
                side,
                nonce,
            } => {
                out.extend_from_slice(&MAGIC);
                out.extend_from_slice(&version.to_le_bytes());
                out.push(*side as u8);
                out.extend_from_slice(nonce);
            }
            Message::Proof(mac) => out.extend_from_slice(mac),
            Message::Pair(p) => {
                put_text(&mut out, &p.model);
                put_u64(&mut out, p.fingerprint);
                put_shape(&mut out, &p.shape);
                put_u32(&mut out, p.context_tokens);
                put_u32(&mut out, p.tenants.len() as u32);
                for t in &p.tenants {
                    put_u32(&mut out, t.id);
                    put_text(&mut out, &t.name);
                }
            }
            Message::PairOk => {}
            Message::PairRefused(reason) => put_text(&mut out, reason),
            Message::Job(j) => {
                put_u64(&mut out, j.request);
                put_u64(&mut out, j.job);
                put_u32(&mut out, j.owner);
                put_u32(&mut out, j.max_tokens);
                put_u32(&mut out, j.tokens.len() as u32);
                for &t in &j.tokens {
                    put_u32(&mut out, t);
                }
            }
            Message::Refused {
                status,
                code,
                message,
            } => {
                out.extend_from_slice(&status.to_le_bytes());
                put_text(&mut out, code);
                put_text(&mut out, message);
            }
            Message::Header(h) => {
                let id = &h.identity;
                put_u64(&mut out, id.request);
                put_u64(&mut out, id.job);
                put_u32(&mut out, id.owner.0);
                put_u64(&mut out, id.model);
                put_u32(&mut out, id.tokens);
                put_u64(&mut out, id.tokens_digest);
                put_u32(&mut out, h.pages);
                put_shape(&mut out, &h.shape);
            }
            Message::Page {
                index,
                digest,
                bytes,
            } => {
                put_u32(&mut out, *index);
                put_u64(&mut out, *digest);
                out.extend_from_slice(bytes);
            }
            Message::Trailer(digest) => put_u64(&mut out, *digest),
            Message::Verdict { ok, reason } => {
                out.push(u8::from(*ok));
                put_text(&mut out, reason);
            }
        }
        let len = (out.len() - 4) as u32;
        out[..4].copy_from_slice(&len.to_le_bytes());
        out
    }

    /// A message from one frame's kind and payload (its length already read
    /// and bounded by [`frame_bound`]).
    pub fn decode(kind: u8, payload: &[u8]) -> Result<Message, WireError> {
        let mut r = Reader(payload);
        let message = match kind {
            HELLO => {
                if r.take(4)? != MAGIC {
                    return Err(WireError::Field("magic"));
                }
                let version = u16::from_le_bytes(r.array()?);
                let side = match r.u8()? {
                    1 => Side::Prefill,
                    2 => Side::Decode,
                    _ => return Err(WireError::Field("side")),
                };
                Message::Hello {
                    version,
                    side,
                    nonce: r.array()?,
                }
            }
            PROOF => Message::Proof(r.array()?),
            PAIR => {
                let model = r.text()?;
                let fingerprint = r.u64()?;
                let shape = r.shape()?;
                let context_tokens = r.u32()?;
                let count = r.u32()? as usize;
                if count > TENANTS_MAX {
                    return Err(WireError::TooLong {
                        what: "tenant list",
                        len: count as u64,
                        max: TENANTS_MAX as u64,
                    });
                }
                let mut tenants = Vec::with_capacity(count);
                for _ in 0..count {
                    tenants.push(PairTenant {
                        id: r.u32()?,
                        name: r.text()?,
                    });
                }
                Message::Pair(Pairing {
                    model,
                    fingerprint,
                    shape,
                    context_tokens,
                    tenants,
                })
            }
            PAIR_OK => Message::PairOk,
            PAIR_REFUSED => Message::PairRefused(r.text()?),
            JOB => {
                let request = r.u64()?;
                let job = r.u64()?;
                let owner = r.u32()?;
                let max_tokens = r.u32()?;
                let count = r.u32()? as usize;
                if count > JOB_TOKENS_MAX {
                    return Err(WireError::TooLong {
                        what: "job tokens",
                        len: count as u64,
                        max: JOB_TOKENS_MAX as u64,
                    });
                }
                if r.0.len() < count * 4 {
                    return Err(WireError::Short);
                }
                let tokens = (0..count).map(|_| r.u32()).collect::<Result<_, _>>()?;
                Message::Job(Job {
                    request,
                    job,
                    owner,
                    max_tokens,
                    tokens,
                })
            }
            REFUSED => Message::Refused {
                status: u16::from_le_bytes(r.array()?),
                code: r.text()?,
                message: r.text()?,
            },
            HEADER => {
                let identity = TransferIdentity {
                    request: r.u64()?,
                    job: r.u64()?,
                    owner: OwnerTag(r.u32()?),
                    model: r.u64()?,
                    tokens: r.u32()?,
                    tokens_digest: r.u64()?,
                };
                Message::Header(TransferHeader {
                    identity,
                    pages: r.u32()?,
                    shape: r.shape()?,
                })
            }
            PAGE => Message::Page {
                index: r.u32()?,
                digest: r.u64()?,
                bytes: std::mem::take(&mut r.0).to_vec(),
            },
            TRAILER => Message::Trailer(r.u64()?),
            VERDICT => {
                let ok = match r.u8()? {
                    0 => false,
                    1 => true,
                    _ => return Err(WireError::Field("verdict")),
                };
                Message::Verdict {
                    ok,
                    reason: r.text()?,
                }
            }
            other => return Err(WireError::Kind(other)),
        };
        if !r.0.is_empty() {
            return Err(WireError::Trailing(r.0.len()));
        }
        Ok(message)
    }
}

/// The most payload bytes a frame of `kind` may declare, before it is read:
/// pages up to `page_bytes_max` (what the pairing's shape allows), every
/// other message [`CONTROL_BYTES_MAX`].
pub fn frame_bound(kind: u8, page_bytes_max: u32) -> u32 {
    if kind == PAGE {
        page_bytes_max.saturating_add(12)
    } else {
        CONTROL_BYTES_MAX
    }
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_text(out: &mut Vec<u8>, text: &str) {
    // Longer texts are cut at a character boundary: names and reasons only.
    let mut end = text.len().min(TEXT_BYTES_MAX);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    out.extend_from_slice(&(end as u16).to_le_bytes());
    out.extend_from_slice(&text.as_bytes()[..end]);
}

fn put_shape(out: &mut Vec<u8>, s: &PageShape) {
    for v in [s.page_tokens, s.layers, s.kv_heads, s.head_dim] {
        put_u32(out, v);
    }
    out.push(match s.kv_type {
        KvType::F16 => 1,
        KvType::F32 => 2,
    });
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.0.len() < n {
            return Err(WireError::Short);
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        Ok(self.take(N)?.try_into().expect("N bytes taken"))
    }

    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn text(&mut self) -> Result<String, WireError> {
        let len = u16::from_le_bytes(self.array()?) as usize;
        if len > TEXT_BYTES_MAX {
            return Err(WireError::TooLong {
                what: "text",
                len: len as u64,
                max: TEXT_BYTES_MAX as u64,
            });
        }
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| WireError::Field("text (not UTF-8)"))
    }

    fn shape(&mut self) -> Result<PageShape, WireError> {
        let (page_tokens, layers, kv_heads, head_dim) =
            (self.u32()?, self.u32()?, self.u32()?, self.u32()?);
        let kv_type = match self.u8()? {
            1 => KvType::F16,
            2 => KvType::F32,
            _ => return Err(WireError::Field("kv_type")),
        };
        Ok(PageShape {
            page_tokens,
            layers,
            kv_heads,
            head_dim,
            kv_type,
        })
    }
}

/// Decodes every frame of `bytes` (a recorded stream): the fuzz target's
/// body. Stops at the first error.
pub fn decode_stream(mut bytes: &[u8]) -> Result<Vec<Message>, WireError> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        if bytes.len() < 5 {
            return Err(WireError::Short);
        }
        let len = u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes"));
        let kind = bytes[4];
        let bound = frame_bound(kind, PAGE_BYTES_MAX);
        if len == 0 || len > bound.saturating_add(1) {
            return Err(WireError::TooLong {
                what: "frame",
                len: u64::from(len),
                max: u64::from(bound) + 1,
            });
        }
        let end = 4 + len as usize;
        if bytes.len() < end {
            return Err(WireError::Short);
        }
        out.push(Message::decode(kind, &bytes[5..end])?);
        bytes = &bytes[end..];
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> PageShape {
        PageShape {
            page_tokens: 16,
            layers: 30,
            kv_heads: 3,
            head_dim: 64,
            kv_type: KvType::F16,
        }
    }

    fn every_message() -> Vec<Message> {
        vec![
            Message::Hello {
                version: VERSION,
                side: Side::Decode,
                nonce: [7; 32],
            },
            Message::Proof([9; 32]),
            Message::Pair(Pairing {
                model: "smollm2".into(),
                fingerprint: 0xabcdef,
                shape: shape(),
                context_tokens: 8192,
                tenants: vec![
                    PairTenant {
                        id: 1,
                        name: "alpha".into(),
                    },
                    PairTenant {
                        id: 2,
                        name: "béta".into(),
                    },
                ],
            }),
            Message::PairOk,
            Message::PairRefused("fingerprint differs".into()),
            Message::Job(Job {
                request: 41,
                job: 0x1234_5678_9abc,
                owner: 2,
                max_tokens: 64,
                tokens: vec![1, 2, 3, 49151],
            }),
            Message::Refused {
                status: 400,
                code: "context_length_exceeded".into(),
                message: "too long".into(),
            },
            Message::Header(TransferHeader {
                identity: TransferIdentity {
                    request: 41,
                    job: 5,
                    owner: OwnerTag(2),
                    model: 6,
                    tokens: 17,
                    tokens_digest: 8,
                },
                pages: 2,
                shape: shape(),
            }),
            Message::Page {
                index: 1,
                digest: 99,
                bytes: vec![1, 2, 3],
            },
            Message::Trailer(1234),
            Message::Verdict {
                ok: false,
                reason: "page_digest".into(),
            },
        ]
    }

    #[test]
    fn every_message_round_trips() {
        let mut stream = Vec::new();
        for m in every_message() {
            let bytes = m.encode();
            let len = u32::from_le_bytes(bytes[..4].try_into().unwrap()) as usize;
            assert_eq!(len, bytes.len() - 4);
            assert_eq!(Message::decode(bytes[4], &bytes[5..]), Ok(m.clone()));
            stream.extend_from_slice(&bytes);
        }
        assert_eq!(decode_stream(&stream), Ok(every_message()));
    }

    #[test]
    fn every_cut_and_every_extra_byte_is_an_error_not_a_panic() {
        for m in every_message() {
            let bytes = m.encode();
            for cut in 5..bytes.len() {
                let r = Message::decode(bytes[4], &bytes[5..cut]);
                // A page's bytes may end anywhere; everything else is short.
                if !matches!(m, Message::Page { .. }) || cut < 17 {
                    assert!(r.is_err(), "{} cut at {cut}", m.name());
                }
            }
            if !matches!(m, Message::Page { .. }) {
                let mut longer = bytes[5..].to_vec();
                longer.push(0);
                assert_eq!(
                    Message::decode(bytes[4], &longer),
                    Err(WireError::Trailing(1)),
                    "{}",
                    m.name()
                );
            }
        }
    }

    #[test]
    fn lengths_are_bounded_before_allocation() {
        // A job that claims 2^31 tokens in a tiny frame.
        let mut payload = vec![0u8; 24];
        payload.extend_from_slice(&(1u32 << 31).to_le_bytes());
        assert!(matches!(
            Message::decode(JOB, &payload),
            Err(WireError::TooLong { .. })
        ));
        let mut payload = vec![0u8; 24];
        payload.extend_from_slice(&1000u32.to_le_bytes());
        assert_eq!(Message::decode(JOB, &payload), Err(WireError::Short));
        // A frame longer than its kind's bound.
        let mut frame = (CONTROL_BYTES_MAX + 2).to_le_bytes().to_vec();
        frame.push(JOB);
        assert!(matches!(
            decode_stream(&frame),
            Err(WireError::TooLong { .. })
        ));
        assert_eq!(Message::decode(200, &[]), Err(WireError::Kind(200)));
        let mut bad_magic = Message::Hello {
            version: 1,
            side: Side::Prefill,
            nonce: [0; 32],
        }
        .encode();
        bad_magic[5] = b'X';
        assert_eq!(
            Message::decode(HELLO, &bad_magic[5..]),
            Err(WireError::Field("magic"))
        );
    }

    #[test]
    fn long_texts_are_cut_at_a_character_boundary() {
        let long = "é".repeat(TEXT_BYTES_MAX);
        let m = Message::PairRefused(long);
        let bytes = m.encode();
        let Message::PairRefused(back) = Message::decode(bytes[4], &bytes[5..]).unwrap() else {
            panic!("kind");
        };
        assert_eq!(back.len(), TEXT_BYTES_MAX);
        assert!(back.chars().all(|c| c == 'é'));
    }
}
