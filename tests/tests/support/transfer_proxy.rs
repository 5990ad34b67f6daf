//! A man in the middle on the transfer link between two real processes: a
//! decode process names this proxy as its prefill peer, and the proxy relays
//! to the real prefill process over loopback TCP. The decode side's frames
//! pass untouched (the handshake proves the secret over both sides' nonces,
//! so relaying it is transparent); the prefill side's transfers pass intact
//! unless a fault is armed for the tenant that owns the next one, in which
//! case that one transfer is changed as the fault says. The proxy parses the
//! frames with the host's own wire code and reseals digests with the page
//! book's, so a fault is exactly what a broken or hostile prefill side would
//! send — the decode side must catch it by its own checks.

use bulkhead::transfer::wire::Message;
use bulkhead_kernels::kv::{page_digest, transfer_digest};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What happens to the armed tenant's next transfer.
#[derive(Clone, Debug)]
pub enum Fault {
    /// Flip one byte of page `n`.
    Corrupt(u32),
    /// Claim another digest for page `n` (the trailer resealed to match).
    WrongDigest(u32),
    /// Leave page `n` out (resealed).
    Drop(u32),
    /// Send page `n` twice (resealed).
    Duplicate(u32),
    /// Swap pages 0 and 1, indices and all (resealed).
    Reorder,
    /// Cut page `n` to a third (resealed).
    Truncate(u32),
    /// The incident: a header that still claims the whole prompt, one page
    /// of one token of KV, every digest resealed to match.
    Placeholder,
    /// Send the previous transfer that passed (another request's, often
    /// another tenant's) instead of this one.
    Replay,
    /// Send the header, then hold the pages this long (past the decode
    /// side's frame deadline).
    Delay(Duration),
    /// Hold the header itself, reading nothing more from the prefill side
    /// (its writer blocks, as on a slow network), until the decode side
    /// closes, [`TransferProxy::release`] is called, or this long passes:
    /// both sides hold their pages mid-transfer, for a test to act.
    Hold(Duration),
    /// After `n` frames of the transfer (0: none, not even the header),
    /// close both ways, as a process killed at that step would.
    Kill(usize),
}

#[derive(Default)]
struct State {
    /// (tenant id, fault) for the next transfer that tenant owns.
    armed: Option<(u32, Fault)>,
    /// The last transfer that passed as sent, for `Replay`.
    last: Vec<Message>,
    /// Transfers being held by `Hold` now.
    holding: u32,
    /// Ends the holds.
    released: bool,
}

/// A proxy listening on a loopback port of its own.
pub struct TransferProxy {
    /// `127.0.0.1:PORT`, for `--prefill-peer`.
    pub addr: String,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
}

impl TransferProxy {
    /// Relays to the prefill side's `upstream` (`127.0.0.1:PORT`).
    pub fn start(upstream: &str) -> TransferProxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        listener.set_nonblocking(true).unwrap();
        let state = Arc::new(Mutex::new(State::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, st, upstream) = (Arc::clone(&state), Arc::clone(&stop), upstream.to_string());
        std::thread::spawn(move || {
            while !st.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((decode, _)) => {
                        decode.set_nonblocking(false).unwrap();
                        let (s, upstream) = (Arc::clone(&s), upstream.clone());
                        std::thread::spawn(move || relay(decode, &upstream, &s));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        TransferProxy { addr, state, stop }
    }

    /// Changes the next transfer owned by tenant `owner` (its stable id).
    pub fn arm(&self, owner: u32, fault: Fault) {
        let mut s = self.state.lock().unwrap();
        s.armed = Some((owner, fault));
        s.released = false;
    }

    /// Ends a `Hold`: the held transfer goes on from where it stopped.
    pub fn release(&self) {
        self.state.lock().unwrap().released = true;
    }

    /// Whether the armed fault has been applied (nothing armed any more).
    pub fn fired(&self) -> bool {
        self.state.lock().unwrap().armed.is_none()
    }

    /// Disarms a fault that was not applied.
    pub fn disarm(&self) {
        self.state.lock().unwrap().armed = None;
    }

    /// Whether a `Hold` holds a transfer's header now.
    pub fn holding(&self) -> bool {
        self.state.lock().unwrap().holding > 0
    }

    /// Waits until a `Hold` holds a transfer's header.
    pub fn wait_holding(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while !self.holding() {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        true
    }
}

impl Drop for TransferProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn relay(decode: TcpStream, upstream: &str, state: &Mutex<State>) {
    let Ok(prefill) = TcpStream::connect(upstream) else {
        return; // the prefill process is down: the decode side sees a close
    };
    let closed = Arc::new(AtomicBool::new(false));
    let (mut d_read, mut p_write) = (decode.try_clone().unwrap(), prefill.try_clone().unwrap());
    let c = Arc::clone(&closed);
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut d_read, &mut p_write);
        c.store(true, Ordering::Relaxed);
        let _ = p_write.shutdown(Shutdown::Both);
    });
    let (mut p_read, mut d_write) = (prefill.try_clone().unwrap(), decode.try_clone().unwrap());
    let mut transfer: Vec<Message> = Vec::new();
    let mut fault: Option<Fault> = None;
    let mut sent = 0usize; // frames of this transfer sent on
    while let Some(message) = read_frame(&mut p_read) {
        if let Message::Header(header) = &message {
            let mut s = state.lock().unwrap();
            fault = match &s.armed {
                Some((owner, _)) if *owner == header.identity.owner.0 => {
                    s.armed.take().map(|(_, f)| f)
                }
                _ => None,
            };
            transfer.clear();
            sent = 0;
        }
        let in_transfer = matches!(
            message,
            Message::Header(_) | Message::Page { .. } | Message::Trailer(_)
        );
        match (&fault, in_transfer) {
            (Some(Fault::Kill(n)), true) => {
                if sent >= *n {
                    break;
                }
                sent += 1;
                if send(&mut d_write, &message).is_err() {
                    break;
                }
            }
            (Some(Fault::Delay(hold)), true) => {
                let header = matches!(message, Message::Header(_));
                if send(&mut d_write, &message).is_err() {
                    break;
                }
                if header {
                    std::thread::sleep(*hold);
                }
            }
            (Some(Fault::Hold(hold)), true) if matches!(message, Message::Header(_)) => {
                state.lock().unwrap().holding += 1;
                let until = Instant::now() + *hold;
                while Instant::now() < until
                    && !closed.load(Ordering::Relaxed)
                    && !state.lock().unwrap().released
                {
                    std::thread::sleep(Duration::from_millis(10));
                }
                state.lock().unwrap().holding -= 1;
                if closed.load(Ordering::Relaxed) || send(&mut d_write, &message).is_err() {
                    break;
                }
            }
            (Some(Fault::Hold(_)), true) => {
                if send(&mut d_write, &message).is_err() {
                    break;
                }
            }
            (_, true) => {
                let last = matches!(message, Message::Trailer(_));
                transfer.push(message);
                if !last {
                    continue;
                }
                let original = std::mem::take(&mut transfer);
                let mut frames = original.clone();
                if let Some(f) = &fault {
                    let earlier = state.lock().unwrap().last.clone();
                    apply(f, &mut frames, earlier);
                } else {
                    state.lock().unwrap().last = original;
                }
                if frames.iter().any(|m| send(&mut d_write, m).is_err()) {
                    break;
                }
            }
            (_, false) => {
                if send(&mut d_write, &message).is_err() {
                    break;
                }
            }
        }
    }
    // The prefill side closed, or a kill: close both ways.
    let _ = decode.shutdown(Shutdown::Both);
    let _ = prefill.shutdown(Shutdown::Both);
}

fn send(stream: &mut TcpStream, message: &Message) -> std::io::Result<()> {
    stream.write_all(&message.encode())
}

/// One frame's message: `[u32 LE length][u8 kind][payload]`; None at the
/// end of the stream.
fn read_frame(stream: &mut TcpStream) -> Option<Message> {
    let mut head = [0u8; 5];
    stream.read_exact(&mut head).ok()?;
    let len = u32::from_le_bytes(head[..4].try_into().unwrap()) as usize;
    let mut payload = vec![0u8; len.checked_sub(1)?];
    stream.read_exact(&mut payload).ok()?;
    Some(Message::decode(head[4], &payload).expect("the real sender's frames decode"))
}

/// Recomputes the trailer over the header and the pages' claimed digests.
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
        *d = transfer_digest(&header, digests.into_iter());
    }
}

fn apply(fault: &Fault, frames: &mut Vec<Message>, earlier: Vec<Message>) {
    let page = |frames: &[Message], n: u32| -> usize {
        frames
            .iter()
            .position(|m| matches!(m, Message::Page { index, .. } if *index == n))
            .expect("the prompt has that page")
    };
    match fault {
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
            let first = page(frames, 0);
            let Message::Header(mut header) = frames[0].clone() else {
                unreachable!("a transfer starts with its header")
            };
            let mut one = frames[first].clone();
            if let Message::Page { bytes, digest, .. } = &mut one {
                bytes.truncate(header.shape.page_bytes(1) as usize);
                *digest = page_digest(1, bytes);
            }
            header.pages = 1;
            let trailer = frames.last().cloned().unwrap();
            *frames = vec![Message::Header(header), one, trailer];
            reseal(frames);
        }
        Fault::Replay => {
            assert!(!earlier.is_empty(), "a transfer to replay");
            *frames = earlier;
        }
        Fault::Delay(_) | Fault::Hold(_) | Fault::Kill(_) => {
            unreachable!("streamed in relay()")
        }
    }
}
