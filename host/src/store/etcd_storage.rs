//! [`Storage`] on etcd v3, for many servers on one control plane
//! (`[store] backend = "etcd"`).
//!
//! Every key lives under the operator's prefix (`[store.etcd] prefix`), so
//! one etcd can hold several clusters' stores, and a key outside it is never
//! read. A commit is one etcd transaction: its expectations are the
//! transaction's compares (a value equal, or a key absent: version 0), its
//! writes the transaction's operations, so it lands whole or not at all, and
//! etcd acknowledges it only once a quorum of members has it on disk.
//!
//! The store's callers are synchronous (the control plane runs them where it
//! may block), and etcd's client is asynchronous: the client runs on a
//! runtime of its own (one thread), and every call waits for its answer
//! at most `timeout_ms`, so an etcd that answers slowly, or an endpoint that
//! is not etcd at all, costs a caller that long and never more — and the
//! request path never calls the store (it authenticates against the
//! registry in memory, and usage is flushed from a task of its own).
//!
//! The watch ([`Storage::watch`]) follows one key and reports each change
//! and each loss or return of the connection as a [`Watched`] value; a
//! server reloads what it needs from the store when it ticks. Reloading, not
//! replaying events, is what makes a compaction or a long outage harmless:
//! after a reconnect the reload reads the store as it is.

use super::{Entry, Expect, Storage, StoreError, Watched, Write};
use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, GetOptions, Identity, PutOptions,
    SortOrder, SortTarget, TlsOptions, Txn, TxnOp,
};
use serde::Deserialize;
use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

/// etcd's own default for `--max-txn-ops`.
pub const TXN_OPS_MAX: usize = 128;
/// etcd's own default for `--max-request-bytes` (1.5 MiB).
pub const REQUEST_BYTES_MAX: usize = 1_572_864;
/// What a transaction's request carries besides its keys and values
/// (framing, the compares): kept free below `request_bytes_max`.
const REQUEST_OVERHEAD_BYTES: usize = 16 << 10;
/// How long a server's announcement outlives its last keep-alive, seconds.
const ANNOUNCE_TTL_S: i64 = 10;
/// How often an announcement's lease is kept alive.
const ANNOUNCE_EVERY: Duration = Duration::from_secs(3);
/// The longest wait between two attempts to watch again after a failure.
const REWATCH_BACKOFF_MAX: Duration = Duration::from_secs(2);

/// `[store.etcd]`: where the shared store is.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EtcdOptions {
    /// Client URLs of the etcd members (`http://` or `https://`).
    pub endpoints: Vec<String>,
    /// Every key of this store starts with it.
    pub prefix: String,
    /// The longest one etcd call may take, milliseconds.
    pub timeout_ms: u64,
    /// Most operations one transaction may hold: etcd's `--max-txn-ops`.
    pub txn_ops_max: usize,
    /// Largest request etcd takes: its `--max-request-bytes`. A plugin's
    /// component is stored in one commit with its record, so this bounds
    /// the components the cluster takes.
    pub request_bytes_max: usize,
    /// The CA that signed the members' certificates (TLS when set).
    pub ca_file: Option<PathBuf>,
    /// This server's client certificate and key, for etcd's client
    /// certificate authentication.
    pub cert_file: Option<PathBuf>,
    /// The client certificate's key.
    pub key_file: Option<PathBuf>,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        EtcdOptions {
            endpoints: vec!["http://127.0.0.1:2379".into()],
            prefix: "bulkhead/".into(),
            timeout_ms: 2000,
            txn_ops_max: TXN_OPS_MAX,
            request_bytes_max: REQUEST_BYTES_MAX,
            ca_file: None,
            cert_file: None,
            key_file: None,
        }
    }
}

/// The store's keys on an etcd cluster.
pub struct EtcdStorage {
    client: Client,
    /// The client's own runtime: taken and shut down when the storage drops
    /// (dropping a runtime inside another one's thread would panic).
    runtime: Option<tokio::runtime::Runtime>,
    prefix: Vec<u8>,
    timeout: Duration,
    txn_ops_max: usize,
    request_bytes_max: usize,
    /// For messages.
    endpoints: String,
}

impl EtcdStorage {
    /// Connects to the cluster of `options`; the first call must answer
    /// within its timeout, so a start against an etcd that is away fails
    /// with the endpoints named.
    pub fn connect(options: &EtcdOptions) -> Result<EtcdStorage, StoreError> {
        let endpoints = options.endpoints.join(",");
        let open_error = |cause: String| StoreError::Open {
            path: format!("etcd {endpoints}"),
            cause,
        };
        if options.endpoints.is_empty() {
            return Err(open_error("[store.etcd] endpoints is empty".into()));
        }
        if options.prefix.is_empty() {
            return Err(open_error(
                "[store.etcd] prefix is empty (every key of the store needs one)".into(),
            ));
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("bulkhead-etcd")
            .enable_all()
            .build()
            .map_err(|e| open_error(format!("cannot start its client thread: {e}")))?;
        let timeout = Duration::from_millis(options.timeout_ms.max(1));
        let mut connect = ConnectOptions::new()
            .with_connect_timeout(timeout)
            .with_timeout(timeout)
            .with_keep_alive(Duration::from_secs(5), timeout);
        if let Some(ca) = &options.ca_file {
            let read = |path: &PathBuf| {
                std::fs::read(path).map_err(|e| open_error(format!("{}: {e}", path.display())))
            };
            let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(read(ca)?));
            match (&options.cert_file, &options.key_file) {
                (Some(cert), Some(key)) => {
                    tls = tls.identity(Identity::from_pem(read(cert)?, read(key)?));
                }
                (None, None) => {}
                _ => {
                    return Err(open_error(
                        "[store.etcd] cert_file and key_file go together".into(),
                    ))
                }
            }
            connect = connect.with_tls(tls);
        }
        let list = options.endpoints.clone();
        let client = runtime
            .block_on(async {
                tokio::time::timeout(timeout, Client::connect(list, Some(connect))).await
            })
            .map_err(|_| open_error(format!("no answer within {} ms", timeout.as_millis())))?
            .map_err(|e| open_error(e.to_string()))?;
        let storage = EtcdStorage {
            client,
            runtime: Some(runtime),
            prefix: options.prefix.as_bytes().to_vec(),
            timeout,
            txn_ops_max: options.txn_ops_max.max(2),
            request_bytes_max: options.request_bytes_max,
            endpoints: endpoints.clone(),
        };
        // Connecting is lazy: one read proves an etcd answers there.
        storage
            .get(b"meta/format")
            .map_err(|e| open_error(e.to_string()))?;
        Ok(storage)
    }

    fn runtime(&self) -> &tokio::runtime::Runtime {
        self.runtime
            .as_ref()
            .expect("the runtime lives as long as the storage")
    }

    /// Runs `call` on the client's runtime and waits at most the timeout for it.
    fn run<T: Send + 'static>(
        &self,
        what: &str,
        call: impl Future<Output = Result<T, etcd_client::Error>> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let timeout = self.timeout;
        self.runtime().spawn(async move {
            let _ = tx.send(tokio::time::timeout(timeout, call).await);
        });
        let unavailable = |cause: String| {
            StoreError::Unavailable(format!("etcd {}: {what}: {cause}", self.endpoints))
        };
        match rx.recv() {
            Ok(Ok(Ok(value))) => Ok(value),
            Ok(Ok(Err(error))) => Err(unavailable(error.to_string())),
            Ok(Err(_)) => Err(unavailable(format!(
                "no answer within {} ms",
                timeout.as_millis()
            ))),
            Err(_) => Err(unavailable("the client stopped".into())),
        }
    }

    fn full(&self, key: &[u8]) -> Vec<u8> {
        [self.prefix.as_slice(), key].concat()
    }

    /// A key as the store knows it; None for one outside the prefix (never
    /// returned by a range under it, but a foreign writer is no reason to
    /// panic).
    fn strip(&self, key: &[u8]) -> Option<Vec<u8>> {
        key.strip_prefix(self.prefix.as_slice()).map(<[u8]>::to_vec)
    }
}

/// The first key after every key starting with `prefix` (etcd's range end).
fn range_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // All 0xff (or empty): to the end of the key space.
    vec![0]
}

impl Storage for EtcdStorage {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        let mut kv = self.client.kv_client();
        let key = self.full(key);
        let response = self.run("get", async move { kv.get(key, None).await })?;
        Ok(response.kvs().first().map(|kv| kv.value().to_vec()))
    }

    fn scan(
        &self,
        prefix: &[u8],
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<Entry>, StoreError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let full_prefix = self.full(prefix);
        let start = match after {
            // Just after `after`, when that is inside the prefix.
            Some(after) if after >= prefix => [self.full(after), vec![0]].concat(),
            _ => full_prefix.clone(),
        };
        let options = GetOptions::new()
            .with_range(range_end(&full_prefix))
            .with_limit(i64::try_from(limit).unwrap_or(i64::MAX));
        let mut kv = self.client.kv_client();
        let response = self.run("scan", async move { kv.get(start, Some(options)).await })?;
        Ok(response
            .kvs()
            .iter()
            .filter_map(|kv| self.strip(kv.key()).map(|k| (k, kv.value().to_vec())))
            .collect())
    }

    fn last(&self, prefix: &[u8]) -> Result<Option<Entry>, StoreError> {
        let full_prefix = self.full(prefix);
        let options = GetOptions::new()
            .with_range(range_end(&full_prefix))
            .with_sort(SortTarget::Key, SortOrder::Descend)
            .with_limit(1);
        let mut kv = self.client.kv_client();
        let response = self.run(
            "last",
            async move { kv.get(full_prefix, Some(options)).await },
        )?;
        Ok(response
            .kvs()
            .first()
            .and_then(|kv| self.strip(kv.key()).map(|k| (k, kv.value().to_vec()))))
    }

    fn commit_if(&self, expect: &[Expect], writes: Vec<Write>) -> Result<(), StoreError> {
        if writes.len() > self.txn_ops_max {
            return Err(StoreError::Io(format!(
                "a commit of {} writes is over etcd's --max-txn-ops ({}, [store.etcd] txn_ops_max)",
                writes.len(),
                self.txn_ops_max
            )));
        }
        let bytes: usize = writes.iter().map(Write::bytes).sum::<usize>()
            + expect
                .iter()
                .map(|e| e.key.len() + e.value.as_ref().map_or(0, Vec::len))
                .sum::<usize>()
            + (writes.len() + expect.len()) * self.prefix.len();
        if bytes > self.commit_bytes_max() {
            return Err(StoreError::Io(format!(
                "a commit of {bytes} bytes is over what etcd takes in one request ({} bytes, etcd's --max-request-bytes, [store.etcd] request_bytes_max, less {REQUEST_OVERHEAD_BYTES} for framing)",
                self.request_bytes_max
            )));
        }
        let compares: Vec<Compare> = expect
            .iter()
            .map(|e| match &e.value {
                Some(value) => Compare::value(self.full(&e.key), CompareOp::Equal, value.clone()),
                None => Compare::version(self.full(&e.key), CompareOp::Equal, 0),
            })
            .collect();
        // etcd refuses a transaction that writes one key twice: the last
        // write of each key is the batch's effect.
        let mut last: std::collections::BTreeMap<Vec<u8>, Option<Vec<u8>>> = Default::default();
        for write in writes {
            match write {
                Write::Put { key, value } => last.insert(key, Some(value)),
                Write::Delete { key } => last.insert(key, None),
            };
        }
        let operations: Vec<TxnOp> = last
            .into_iter()
            .map(|(key, value)| match value {
                Some(value) => TxnOp::put(self.full(&key), value, None),
                None => TxnOp::delete(self.full(&key), None),
            })
            .collect();
        let txn = Txn::new().when(compares).and_then(operations);
        let mut kv = self.client.kv_client();
        let response = self.run("commit", async move { kv.txn(txn).await })?;
        if response.succeeded() {
            Ok(())
        } else {
            Err(StoreError::Conflict)
        }
    }

    fn writes_max(&self) -> usize {
        self.txn_ops_max
    }

    fn commit_bytes_max(&self) -> usize {
        self.request_bytes_max
            .saturating_sub(REQUEST_OVERHEAD_BYTES)
    }

    fn shared(&self) -> bool {
        true
    }

    fn watch(&self, key: &[u8]) -> Option<tokio::sync::watch::Receiver<Watched>> {
        let (tx, rx) = tokio::sync::watch::channel(Watched {
            changes: 0,
            connected: true,
        });
        let client = self.client.clone();
        let key = self.full(key);
        let endpoints = self.endpoints.clone();
        self.runtime()
            .spawn(follow(client, key, tx, self.timeout, endpoints));
        Some(rx)
    }

    fn announce(&self, key: &[u8], value: tokio::sync::watch::Receiver<Vec<u8>>) {
        let client = self.client.clone();
        let key = self.full(key);
        let endpoints = self.endpoints.clone();
        self.runtime()
            .spawn(keep_announced(client, key, value, self.timeout, endpoints));
    }
}

/// Watches `key` until every receiver is gone, watching again after each
/// failure (with a backoff), and telling `tx` of changes and of the
/// connection's state.
async fn follow(
    mut client: Client,
    key: Vec<u8>,
    tx: tokio::sync::watch::Sender<Watched>,
    timeout: Duration,
    endpoints: String,
) {
    let mut backoff = Duration::from_millis(100);
    let set_connected = |connected: bool| {
        tx.send_if_modified(|w| {
            let changed = w.connected != connected;
            if changed {
                w.connected = connected;
                // Lost or regained: whoever follows reloads.
                w.changes += 1;
            }
            changed
        });
    };
    loop {
        if tx.is_closed() {
            return;
        }
        let started = tokio::time::timeout(timeout, client.watch(key.clone(), None)).await;
        let (_watcher, mut stream) = match started {
            Ok(Ok(pair)) => pair,
            Ok(Err(error)) => {
                tracing::warn!(etcd = %endpoints, %error, "the store's watch failed; retrying");
                set_connected(false);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(REWATCH_BACKOFF_MAX);
                continue;
            }
            Err(_) => {
                tracing::warn!(etcd = %endpoints, "the store's watch did not start in time; retrying");
                set_connected(false);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(REWATCH_BACKOFF_MAX);
                continue;
            }
        };
        // A reconnect may have missed changes: reload once.
        backoff = Duration::from_millis(100);
        if tx.borrow().connected {
            tx.send_modify(|w| w.changes += 1);
        } else {
            set_connected(true);
        }
        loop {
            // A member that goes away without closing its connection is
            // noticed by the channel's keep-alive (5 s, then `timeout_ms`),
            // which ends this stream with an error.
            let message = tokio::select! {
                message = stream.message() => message,
                () = tx.closed() => return,
            };
            match message {
                Ok(Some(response)) => {
                    if response.canceled() {
                        tracing::warn!(etcd = %endpoints, reason = response.cancel_reason(), "the store's watch was cancelled; watching again");
                        break;
                    }
                    if !response.events().is_empty() {
                        tx.send_modify(|w| w.changes += 1);
                    }
                }
                Ok(None) => break,
                Err(error) => {
                    tracing::warn!(etcd = %endpoints, %error, "the store's watch ended; watching again");
                    break;
                }
            }
        }
        set_connected(false);
        tokio::time::sleep(backoff).await;
    }
}

/// Keeps `key` holding the latest `value` under a lease kept alive every few
/// seconds; a lease lost (etcd restored from a backup, a long outage) is
/// granted again and the key put again.
async fn keep_announced(
    mut client: Client,
    key: Vec<u8>,
    mut value: tokio::sync::watch::Receiver<Vec<u8>>,
    timeout: Duration,
    endpoints: String,
) {
    loop {
        let granted = tokio::time::timeout(timeout, async {
            let lease = client.lease_grant(ANNOUNCE_TTL_S, None).await?.id();
            let bytes = value.borrow_and_update().clone();
            client
                .put(
                    key.clone(),
                    bytes,
                    Some(PutOptions::new().with_lease(lease)),
                )
                .await?;
            Ok::<_, etcd_client::Error>(lease)
        })
        .await;
        let lease = match granted {
            Ok(Ok(lease)) => lease,
            Ok(Err(error)) => {
                tracing::debug!(etcd = %endpoints, %error, "announcing this server failed; retrying");
                tokio::time::sleep(ANNOUNCE_EVERY).await;
                continue;
            }
            Err(_) => {
                tokio::time::sleep(ANNOUNCE_EVERY).await;
                continue;
            }
        };
        loop {
            tokio::select! {
                changed = value.changed() => {
                    if changed.is_err() {
                        // The server is stopping: let the lease go now.
                        let _ = tokio::time::timeout(timeout, client.lease_revoke(lease)).await;
                        return;
                    }
                    let bytes = value.borrow_and_update().clone();
                    let put = tokio::time::timeout(
                        timeout,
                        client.put(key.clone(), bytes, Some(PutOptions::new().with_lease(lease))),
                    )
                    .await;
                    if !matches!(put, Ok(Ok(_))) {
                        break;
                    }
                }
                () = tokio::time::sleep(ANNOUNCE_EVERY) => {
                    let alive = tokio::time::timeout(timeout, async {
                        let (mut keeper, mut stream) = client.lease_keep_alive(lease).await?;
                        keeper.keep_alive().await?;
                        Ok::<_, etcd_client::Error>(stream.message().await?.map_or(0, |r| r.ttl()))
                    })
                    .await;
                    if !matches!(alive, Ok(Ok(ttl)) if ttl > 0) {
                        break;
                    }
                }
            }
        }
    }
}

impl Drop for EtcdStorage {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::range_end;

    #[test]
    fn range_end_is_the_first_key_after_the_prefix() {
        assert_eq!(range_end(b"bulkhead/tenant/"), b"bulkhead/tenant0".to_vec());
        assert_eq!(range_end(b"a\xff"), b"b".to_vec());
        assert_eq!(range_end(b"\xff\xff"), vec![0]);
    }
}
