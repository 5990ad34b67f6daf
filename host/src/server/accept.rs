//! One listener's accept loop, and the limits that keep hostile load — clients
//! that connect and say nothing, or say it very slowly — from taking the
//! connection slots everyone else needs. Nothing here needs a key: these limits
//! hold before anyone is authenticated.
//!
//! 1. **Global cap**: a permit out of `server.connections_max` is taken before
//!    `accept`, so past the cap new connections wait in the kernel's backlog.
//! 2. **Per-peer cap**: after `accept`, one peer (an IPv4 address, or an IPv6
//!    /64 prefix) holds at most `server.connections_per_peer_max` connections;
//!    one more is closed at once.
//! 3. **Handshake deadline**: from `accept`, the TLS handshake, protocol
//!    detection (HTTP/1, or the HTTP/2 preface) and the first request's headers
//!    complete within `server.handshake_timeout_ms`, or the connection closes.
//! 4. **Idle deadline**: a connection with no request in flight for
//!    `server.idle_timeout_ms` closes (HTTP/2 gets a GOAWAY first). A request is
//!    in flight from its headers until its response body ends, so a long
//!    stream is never idle; a slow request body is bounded by the handler's
//!    own read deadline.
//! 5. **Send deadline**: a response whose client does not take what it was
//!    handed — an HTTP/2 flow-control window that never opens, an HTTP/1
//!    socket nobody reads, so that the connection stops asking the response
//!    for more — closes its whole connection (`send_stall`) once it has
//!    waited out its allowance: a bucket of `server.send_stall_timeout_ms`
//!    that each wait for the client drains and each byte the client took
//!    refills by 1/`server.send_rate_min_bytes_per_s` seconds, never above
//!    the full bucket. So a client that stops reading goes within one stall
//!    timeout (once the buffers between are full), and one that reads but
//!    slower than the minimum rate soon after; time the response spends
//!    waiting for its own next bytes (the engine) is not counted.
//! 6. **Drain**: on stop, every connection is asked to close gracefully, and
//!    the loop waits for them until the drain deadline.
//!
//! HTTP/2's own limits are `[server]` fields too: concurrent streams, the
//! header list size, and the streams a client may reset (pending) or make
//! the server reset, per connection.
//!
//! ```text
//!  accept ─► peer cap ─► [TLS] ─► detect ─► headers ─► request … response end ─► idle ─► close
//!    └───────────── handshake_timeout ────────────┘    └─ send stall ─┘    └─ idle_timeout ─┘
//! ```

use crate::telemetry;
use axum::body::Body;
use axum::Router;
use bytes::Bytes;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio_rustls::TlsAcceptor;

/// How long a connection asked to close (idle, or draining after its last
/// request) may take before it is dropped.
pub const CLOSE_GRACE: Duration = Duration::from_secs(1);
/// Largest HTTP/1 read buffer (request line and headers), in bytes.
pub const H1_BUFFER_BYTES_MAX: usize = 64 << 10;
/// How long the loop backs off after a failed `accept` (out of descriptors).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The limits of one listener's connections (from `[server]`).
#[derive(Clone, Copy, Debug)]
pub struct ConnectionLimits {
    /// `server.connections_max`.
    pub connections_max: u32,
    /// `server.connections_per_peer_max`.
    pub per_peer_max: u32,
    /// `server.handshake_timeout_ms`.
    pub handshake: Duration,
    /// `server.idle_timeout_ms`.
    pub idle: Duration,
    /// `server.send_stall_timeout_ms`.
    pub send_stall: Duration,
    /// `server.send_rate_min_bytes_per_s`.
    pub send_rate_min_bytes_per_s: u64,
    /// `server.h2_streams_max`.
    pub h2_streams_max: u32,
    /// `server.h2_header_list_bytes_max`.
    pub h2_header_list_bytes_max: u32,
    /// `server.h2_pending_resets_max`.
    pub h2_pending_resets_max: u32,
    /// `server.h2_local_resets_max`.
    pub h2_local_resets_max: u32,
}

/// Why the listener closed a connection itself (a metric label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Closed {
    PeerLimit,
    Handshake,
    Idle,
    SendStall,
}

impl Closed {
    fn as_str(self) -> &'static str {
        match self {
            Closed::PeerLimit => "peer_limit",
            Closed::Handshake => "handshake_timeout",
            Closed::Idle => "idle_timeout",
            Closed::SendStall => "send_stall",
        }
    }
}

/// One listener: its socket, its routes and its limits.
pub struct Accept {
    /// "inference" or "admin" (logs and metric labels).
    pub name: &'static str,
    /// The bound socket.
    pub listener: TcpListener,
    /// The listener's routes.
    pub router: Router,
    /// TLS, when configured.
    pub tls: Option<TlsAcceptor>,
    /// Its limits.
    pub limits: ConnectionLimits,
}

impl Accept {
    /// Accepts until `stop`, then drains this listener's connections until `drain`.
    pub async fn run(self, mut stop: watch::Receiver<bool>, drain: Duration) {
        let slots = Arc::new(Semaphore::new(self.limits.connections_max as usize));
        let peers = Arc::new(Peers::default());
        let builder = builder(&self.limits);
        loop {
            // Hold a slot before accepting: past the cap, connections wait in
            // the kernel's backlog instead of being served.
            let slot = tokio::select! {
                slot = Arc::clone(&slots).acquire_owned() => match slot {
                    Ok(slot) => slot,
                    Err(_) => break,
                },
                _ = stop.changed() => break,
            };
            let (stream, peer) = tokio::select! {
                accepted = self.listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        tracing::warn!(listener = self.name, %error, "accept failed");
                        tokio::time::sleep(ACCEPT_BACKOFF).await;
                        continue;
                    }
                },
                _ = stop.changed() => break,
            };
            let accepted = Instant::now();
            let Some(peer_slot) = peers.enter(peer.ip(), self.limits.per_peer_max) else {
                telemetry::count_connection_closed(self.name, Closed::PeerLimit.as_str());
                tracing::debug!(listener = self.name, %peer, "per-peer connection cap; closed");
                continue;
            };
            let _ = stream.set_nodelay(true);
            let connection = Connection {
                listener: self.name,
                peer,
                accepted,
                limits: self.limits,
                router: self.router.clone(),
                builder: builder.clone(),
                tls: self.tls.clone(),
                stop: stop.clone(),
                _slots: (slot, peer_slot),
            };
            tokio::spawn(connection.serve(stream));
        }
        let (name, connections_max) = (self.name, self.limits.connections_max);
        drop(self);
        drain_connections(name, &slots, connections_max, drain).await;
    }
}

/// The HTTP/1 and HTTP/2 settings of a listener's connections.
fn builder(limits: &ConnectionLimits) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        // Headers are bounded by `expired`, the same way for HTTP/1 and
        // HTTP/2: the handshake deadline, then the idle one.
        .header_read_timeout(None)
        .max_buf_size(H1_BUFFER_BYTES_MAX);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.h2_streams_max)
        .max_header_list_size(limits.h2_header_list_bytes_max)
        .max_pending_accept_reset_streams(limits.h2_pending_resets_max as usize)
        .max_local_error_reset_streams(limits.h2_local_resets_max as usize);
    builder
}

/// Waits until every connection has given its slot back, at most `drain`
/// (the listener is closed: nothing new arrives).
async fn drain_connections(
    name: &'static str,
    slots: &Semaphore,
    connections_max: u32,
    drain: Duration,
) {
    let started = Instant::now();
    let open = connections_max as usize - slots.available_permits();
    match tokio::time::timeout(drain, slots.acquire_many(connections_max)).await {
        Ok(_) => tracing::info!(
            listener = name,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "drained"
        ),
        Err(_) => tracing::warn!(
            listener = name,
            open,
            "drain deadline passed with connections open"
        ),
    }
}

/// One accepted connection and everything it holds until it closes.
struct Connection {
    listener: &'static str,
    peer: SocketAddr,
    accepted: Instant,
    limits: ConnectionLimits,
    router: Router,
    builder: auto::Builder<TokioExecutor>,
    tls: Option<TlsAcceptor>,
    stop: watch::Receiver<bool>,
    /// The global and per-peer slots, given back when the connection ends.
    _slots: (OwnedSemaphorePermit, PeerSlot),
}

impl Connection {
    async fn serve(self, stream: TcpStream) {
        let handshake_deadline = self.accepted + self.limits.handshake;
        match self.tls.clone() {
            None => self.serve_io(TokioIo::new(stream)).await,
            Some(acceptor) => {
                let deadline = tokio::time::Instant::from_std(handshake_deadline);
                match tokio::time::timeout_at(deadline, acceptor.accept(stream)).await {
                    Ok(Ok(stream)) => self.serve_io(TokioIo::new(stream)).await,
                    Ok(Err(error)) => {
                        tracing::debug!(listener = self.listener, peer = %self.peer, %error, "tls handshake failed");
                    }
                    Err(_) => {
                        telemetry::count_connection_closed(
                            self.listener,
                            Closed::Handshake.as_str(),
                        );
                        tracing::debug!(listener = self.listener, peer = %self.peer, "tls handshake timed out");
                    }
                }
            }
        }
    }

    async fn serve_io<I>(self, io: TokioIo<I>)
    where
        I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (activity, watched) = watch::channel(Activity {
            in_flight: 0,
            requests: 0,
            idle_since: self.accepted,
            stall_at: None,
        });
        let requests = Requests(Arc::new(Shared {
            activity,
            waiting: Mutex::new(Waiting::default()),
            allowance: Allowance {
                stall: self.limits.send_stall,
                rate_min_bytes_per_s: self.limits.send_rate_min_bytes_per_s,
            },
        }));
        let service = TrackedService {
            router: self.router.clone(),
            requests: requests.clone(),
        };
        let conn = self.builder.serve_connection_with_upgrades(io, service);
        tokio::pin!(conn);
        let expired = expired(watched, self.accepted, self.limits);
        tokio::pin!(expired);
        let result = tokio::select! {
            result = conn.as_mut() => Some(result),
            closed = &mut expired => {
                telemetry::count_connection_closed(self.listener, closed.as_str());
                tracing::debug!(listener = self.listener, peer = %self.peer, reason = closed.as_str(), "closing connection");
                conn.as_mut().graceful_shutdown();
                tokio::time::timeout(CLOSE_GRACE, conn.as_mut()).await.ok()
            }
            () = stopped(self.stop.clone()) => {
                // Draining: finish the requests in flight, take no new ones.
                conn.as_mut().graceful_shutdown();
                Some(conn.as_mut().await)
            }
        };
        drop(requests);
        if let Some(Err(error)) = result {
            tracing::debug!(listener = self.listener, peer = %self.peer, %error, "connection ended with an error");
        }
    }
}

/// Resolves once the server stops (or its stop signal is gone).
async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|stop| *stop).await.is_ok();
}

/// A connection's requests: how many are in flight, how many there were,
/// since when none has been, and when the response waiting longest for its
/// client runs out of time.
#[derive(Clone, Copy, Debug)]
struct Activity {
    in_flight: u32,
    requests: u64,
    idle_since: Instant,
    stall_at: Option<Instant>,
}

/// How long a response may wait for its client: a bucket of `stall` that
/// waiting drains and bytes taken refill at `rate_min_bytes_per_s`.
#[derive(Clone, Copy, Debug)]
struct Allowance {
    stall: Duration,
    rate_min_bytes_per_s: u64,
}

impl Allowance {
    /// What is left of `left` after a wait of `waited` that ended with the
    /// client taking `bytes`.
    fn after(&self, left: Duration, waited: Duration, bytes: u64) -> Duration {
        let earned = Duration::from_secs_f64(bytes as f64 / self.rate_min_bytes_per_s as f64);
        left.saturating_sub(waited)
            .saturating_add(earned)
            .min(self.stall)
    }
}

/// The responses waiting for their client to take a frame: body serial →
/// when it runs out of time.
#[derive(Default)]
struct Waiting {
    deadlines: BTreeMap<u64, Instant>,
    serial_next: u64,
}

struct Shared {
    activity: watch::Sender<Activity>,
    waiting: Mutex<Waiting>,
    allowance: Allowance,
}

/// The writing side of a connection's [`Activity`], shared by its service.
#[derive(Clone)]
struct Requests(Arc<Shared>);

impl Requests {
    fn begin(&self) -> InFlight {
        self.0.activity.send_modify(|a| {
            a.in_flight += 1;
            a.requests += 1;
        });
        InFlight(self.clone())
    }

    fn serial(&self) -> u64 {
        let mut waiting = self.0.waiting.lock().unwrap_or_else(|p| p.into_inner());
        waiting.serial_next += 1;
        waiting.serial_next
    }

    /// Response `serial` waits for its client until `deadline` (None: it
    /// does not wait any more). Wakes the connection's watcher only when the
    /// earliest deadline comes sooner: a later one it finds when it wakes.
    fn wait(&self, serial: u64, deadline: Option<Instant>) {
        let mut waiting = self.0.waiting.lock().unwrap_or_else(|p| p.into_inner());
        match deadline {
            Some(at) => waiting.deadlines.insert(serial, at),
            None => waiting.deadlines.remove(&serial),
        };
        let earliest = waiting.deadlines.values().min().copied();
        self.0.activity.send_if_modified(|a| {
            let sooner = match (earliest, a.stall_at) {
                (Some(new), Some(old)) => new < old,
                (Some(_), None) => true,
                _ => false,
            };
            a.stall_at = earliest;
            sooner
        });
    }
}

/// One request in flight; dropped when its response body ends (or is dropped).
struct InFlight(Requests);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0 .0.activity.send_modify(|a| {
            assert!(a.in_flight > 0, "every request in flight began");
            a.in_flight -= 1;
            if a.in_flight == 0 {
                a.idle_since = Instant::now();
            }
        });
    }
}

/// Resolves once the connection must close: no first request within the
/// handshake deadline, no request in flight for the idle deadline, or a
/// response its client has not taken past its send deadline.
async fn expired(
    mut activity: watch::Receiver<Activity>,
    accepted: Instant,
    limits: ConnectionLimits,
) -> Closed {
    loop {
        let a = *activity.borrow_and_update();
        let deadline = match (a.in_flight, a.requests) {
            (0, 0) => Some((accepted + limits.handshake, Closed::Handshake)),
            (0, _) => Some((a.idle_since + limits.idle, Closed::Idle)),
            _ => a.stall_at.map(|at| (at, Closed::SendStall)),
        };
        let changed = match deadline {
            None => activity.changed().await,
            Some((at, closed)) => tokio::select! {
                _ = tokio::time::sleep_until(tokio::time::Instant::from_std(at)) => {
                    // A send deadline may have moved later meanwhile (the
                    // client took its frame): look again before closing.
                    let now = *activity.borrow();
                    if closed != Closed::SendStall || now.stall_at.is_some_and(|s| s <= Instant::now()) {
                        return closed;
                    }
                    continue;
                }
                changed = activity.changed() => changed,
            },
        };
        if changed.is_err() {
            // The connection's service is gone: the connection is ending anyway.
            return std::future::pending().await;
        }
    }
}

/// The router, counting each request in flight until its response body ends.
#[derive(Clone)]
struct TrackedService {
    router: Router,
    requests: Requests,
}

impl hyper::service::Service<Request<Incoming>> for TrackedService {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        let in_flight = self.requests.begin();
        let mut router = self.router.clone();
        // A Router is always ready (its `poll_ready` returns Ready).
        let future = tower_service::Service::call(&mut router, request);
        let requests = self.requests.clone();
        Box::pin(async move {
            let response = future.await?;
            Ok(response.map(|body| {
                Body::new(TrackedBody {
                    body,
                    serial: requests.serial(),
                    allowance_left: requests.0.allowance.stall,
                    requests,
                    handed_bytes: 0,
                    waiting_since: None,
                    _in_flight: in_flight,
                })
            }))
        })
    }
}

/// A response body that keeps its request in flight until it ends, and
/// tells its connection how long it has waited for its client: from handing
/// out a frame until the connection asks for the next one.
struct TrackedBody {
    body: Body,
    requests: Requests,
    serial: u64,
    /// What is left of its send allowance ([`Allowance`]).
    allowance_left: Duration,
    /// Bytes of the frame last handed to the connection.
    handed_bytes: u64,
    /// Since when that frame has not been followed by a poll.
    waiting_since: Option<Instant>,
    _in_flight: InFlight,
}

impl http_body::Body for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        // Asked again: the client took what it was handed.
        if let Some(since) = self.waiting_since.take() {
            let allowance = self.requests.0.allowance;
            self.allowance_left =
                allowance.after(self.allowance_left, since.elapsed(), self.handed_bytes);
            self.requests.wait(self.serial, None);
        }
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            self.handed_bytes = frame.data_ref().map_or(0, |d| d.len() as u64);
            let now = Instant::now();
            self.waiting_since = Some(now);
            self.requests
                .wait(self.serial, Some(now + self.allowance_left));
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for TrackedBody {
    fn drop(&mut self) {
        if self.waiting_since.is_some() {
            self.requests.wait(self.serial, None);
        }
    }
}

/// Open connections per peer.
#[derive(Default)]
struct Peers {
    open: Mutex<HashMap<PeerKey, u32>>,
}

/// A peer as the per-peer cap sees it: an IPv4 address, or an IPv6 /64 prefix
/// (one host commonly holds a whole /64).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum PeerKey {
    V4(u32),
    V6(u64),
}

impl PeerKey {
    fn of(ip: IpAddr) -> PeerKey {
        match ip {
            IpAddr::V4(v4) => PeerKey::V4(u32::from(v4)),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => PeerKey::V4(u32::from(v4)),
                None => PeerKey::V6((u128::from(v6) >> 64) as u64),
            },
        }
    }
}

impl Peers {
    /// A slot for one more connection from `ip`, or None at the cap.
    fn enter(self: &Arc<Peers>, ip: IpAddr, per_peer_max: u32) -> Option<PeerSlot> {
        let key = PeerKey::of(ip);
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let count = open.entry(key).or_insert(0);
        if *count >= per_peer_max {
            return None;
        }
        *count += 1;
        Some(PeerSlot {
            peers: Arc::clone(self),
            key,
        })
    }
}

/// One connection's place in its peer's count.
struct PeerSlot {
    peers: Arc<Peers>,
    key: PeerKey,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut open = self.peers.open.lock().unwrap_or_else(|p| p.into_inner());
        let count = open
            .get_mut(&self.key)
            .expect("a slot's peer is counted until the slot drops");
        *count -= 1;
        if *count == 0 {
            open.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A response body that never ends: 16 KiB frames, as fast as asked.
    struct Endless;

    impl http_body::Body for Endless {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            Poll::Ready(Some(Ok(Frame::data(Bytes::from(vec![b'x'; 16 << 10])))))
        }
    }

    fn limits(send_stall: Duration, rate: u64) -> ConnectionLimits {
        ConnectionLimits {
            connections_max: 4,
            per_peer_max: 4,
            handshake: Duration::from_secs(10),
            idle: Duration::from_secs(10),
            send_stall,
            send_rate_min_bytes_per_s: rate,
            h2_streams_max: 8,
            h2_header_list_bytes_max: 16 << 10,
            h2_pending_resets_max: 4,
            h2_local_resets_max: 4,
        }
    }

    /// One connection served over an in-memory pipe of `pipe_bytes`, answering
    /// every request with [`Endless`]; the client's end of the pipe.
    fn serve_endless(
        limits: ConnectionLimits,
        pipe_bytes: usize,
    ) -> (tokio::io::DuplexStream, tokio::task::JoinHandle<()>) {
        let router = Router::new().route("/", axum::routing::get(|| async { Body::new(Endless) }));
        let (client, server) = tokio::io::duplex(pipe_bytes);
        let (_stop, stop) = watch::channel(false);
        let slots = Arc::new(Semaphore::new(1));
        let peers = Arc::new(Peers::default());
        let peer = SocketAddr::from((Ipv4Addr::LOCALHOST, 1));
        let connection = Connection {
            listener: "test",
            peer,
            accepted: Instant::now(),
            limits,
            router,
            builder: builder(&limits),
            tls: None,
            stop,
            _slots: (
                slots.try_acquire_owned().unwrap(),
                peers.enter(peer.ip(), 4).unwrap(),
            ),
        };
        let served = tokio::spawn(async move {
            connection.serve_io(TokioIo::new(server)).await;
            drop(_stop);
        });
        (client, served)
    }

    #[tokio::test]
    async fn an_http1_client_that_never_reads_is_closed_by_the_send_deadline() {
        let stall = Duration::from_millis(300);
        let (mut client, served) = serve_endless(limits(stall, 1024), 8 << 10);
        let started = Instant::now();
        client
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        // Never read: the pipe and hyper's buffer fill, the body is not asked
        // for more, and the stall deadline (plus the close grace) ends it.
        tokio::time::timeout(Duration::from_secs(5), served)
            .await
            .expect("the connection closed")
            .unwrap();
        let took = started.elapsed();
        assert!(took >= stall, "not before the deadline: {took:?}");
        assert!(
            took < stall + CLOSE_GRACE + Duration::from_secs(2),
            "{took:?}"
        );
        // What was buffered can still be read, then the end.
        let mut rest = Vec::new();
        client.read_to_end(&mut rest).await.unwrap();
        assert!(!rest.is_empty());
    }

    #[tokio::test]
    async fn an_http1_client_that_reads_steadily_is_not_cut() {
        // 64 KiB/s at least after a 300 ms allowance; this client takes
        // 16 KiB every 50 ms (320 KiB/s) for two seconds, far past 300 ms.
        let (mut client, served) =
            serve_endless(limits(Duration::from_millis(300), 64 << 10), 8 << 10);
        client
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = vec![0u8; 16 << 10];
        let started = Instant::now();
        let mut read = 0usize;
        while started.elapsed() < Duration::from_secs(2) {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let n = client.read(&mut buf).await.unwrap();
            assert!(n > 0, "cut after {:?} and {read} bytes", started.elapsed());
            read += n;
        }
        assert!(!served.is_finished(), "the connection is still open");
        // Then it stops reading: closed like any other.
        tokio::time::timeout(Duration::from_secs(5), served)
            .await
            .expect("closed once it stopped reading")
            .unwrap();
    }

    #[test]
    fn the_send_allowance_drains_by_waiting_and_refills_by_bytes_taken_up_to_the_stall() {
        let a = Allowance {
            stall: Duration::from_secs(10),
            rate_min_bytes_per_s: 1000,
        };
        let s = Duration::from_secs;
        assert_eq!(a.after(s(10), s(4), 0), s(6));
        assert_eq!(a.after(s(6), s(1), 3000), s(8));
        assert_eq!(
            a.after(s(8), s(0), 1_000_000),
            s(10),
            "never above the stall"
        );
        assert_eq!(a.after(s(2), s(5), 1000), s(1), "drained, then refilled");
    }

    #[test]
    fn peers_are_capped_and_slots_come_back() {
        let peers = Arc::new(Peers::default());
        let a = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
        let b = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2));
        let first = peers.enter(a, 2).unwrap();
        let _second = peers.enter(a, 2).unwrap();
        assert!(peers.enter(a, 2).is_none(), "a third from the same peer");
        assert!(peers.enter(b, 2).is_some(), "another peer is not affected");
        drop(first);
        assert!(
            peers.enter(a, 2).is_some(),
            "a closed connection frees its slot"
        );
    }

    #[test]
    fn ipv6_peers_are_counted_by_their_64_prefix_and_mapped_ipv4_as_ipv4() {
        let one: Ipv6Addr = "2001:db8:1:2::1".parse().unwrap();
        let same_64: Ipv6Addr = "2001:db8:1:2:ffff::9".parse().unwrap();
        let other_64: Ipv6Addr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(PeerKey::of(one.into()), PeerKey::of(same_64.into()));
        assert_ne!(PeerKey::of(one.into()), PeerKey::of(other_64.into()));
        let mapped: Ipv6Addr = "::ffff:10.0.0.1".parse().unwrap();
        assert_eq!(
            PeerKey::of(mapped.into()),
            PeerKey::of(Ipv4Addr::new(10, 0, 0, 1).into())
        );
    }
}
