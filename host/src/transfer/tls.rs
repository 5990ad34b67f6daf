//! Mutual TLS on the transfer link (`[server.transfer_tls]`): each side shows
//! a certificate of its own and accepts only a peer's that chains to the CA
//! the policy names; the link is then encrypted and integrity-protected end
//! to end, so a party on the path can neither read a tenant's KV nor change
//! a page and reseal its digests. The shared secret is still proven inside
//! the TLS session (the handshake of [`super::link`]): a certificate alone
//! does not pair.
//!
//! Without it the secret authenticates the peers but the frames travel in
//! the clear: keep such a link on loopback or a private network.

use crate::config::TransferTlsConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The decode side's TLS: a client that shows its certificate.
#[derive(Clone)]
pub struct ClientTls {
    connector: tokio_rustls::TlsConnector,
    /// The name a prefill peer's certificate must carry, when not each
    /// peer address's host.
    server_name: Option<String>,
}

/// The prefill side's TLS: a server that requires the peer's certificate.
#[derive(Clone)]
pub struct ServerTls {
    acceptor: tokio_rustls::TlsAcceptor,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no certificate in it", path.display()));
    }
    Ok(certs)
}

fn key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| format!("{}: {e}", path.display()))
}

fn roots(path: &Path) -> Result<Arc<rustls::RootCertStore>, String> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in certs(path)? {
        roots
            .add(cert)
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(Arc::new(roots))
}

impl ClientTls {
    /// From the policy's section (`resolve` makes its paths absolute).
    pub fn load(
        tls: &TransferTlsConfig,
        resolve: impl Fn(&Path) -> PathBuf,
    ) -> Result<ClientTls, String> {
        let config = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots(&resolve(&tls.ca_pem))?)
            .with_client_auth_cert(
                certs(&resolve(&tls.cert_pem))?,
                key(&resolve(&tls.key_pem))?,
            )
            .map_err(|e| format!("server.transfer_tls: {e}"))?;
        Ok(ClientTls {
            connector: tokio_rustls::TlsConnector::from(Arc::new(config)),
            server_name: tls.server_name.clone(),
        })
    }

    /// A TLS session over `stream` to the peer at `host` (or the
    /// configured name).
    pub async fn connect(
        &self,
        host: Option<&str>,
        stream: Box<dyn super::Stream>,
    ) -> std::io::Result<Box<dyn super::Stream>> {
        let name = self.server_name.as_deref().or(host).ok_or_else(|| {
            std::io::Error::other("server.transfer_tls.server_name is needed for a unix: peer")
        })?;
        let name = ServerName::try_from(name.to_string())
            .map_err(|e| std::io::Error::other(format!("{name:?}: {e}")))?;
        Ok(Box::new(self.connector.connect(name, stream).await?))
    }
}

impl ServerTls {
    /// From the policy's section (`resolve` makes its paths absolute).
    pub fn load(
        tls: &TransferTlsConfig,
        resolve: impl Fn(&Path) -> PathBuf,
    ) -> Result<ServerTls, String> {
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            roots(&resolve(&tls.ca_pem))?,
            provider(),
        )
        .build()
        .map_err(|e| format!("server.transfer_tls.ca_pem: {e}"))?;
        let config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_client_cert_verifier(verifier)
            .with_single_cert(
                certs(&resolve(&tls.cert_pem))?,
                key(&resolve(&tls.key_pem))?,
            )
            .map_err(|e| format!("server.transfer_tls: {e}"))?;
        Ok(ServerTls {
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
        })
    }

    /// The TLS session a decode peer opens on `stream` (its certificate
    /// checked against the CA).
    pub async fn accept(
        &self,
        stream: Box<dyn super::Stream>,
    ) -> std::io::Result<Box<dyn super::Stream>> {
        Ok(Box::new(self.acceptor.accept(stream).await?))
    }
}

/// The host part of a `HOST:PORT` address (an IPv6 literal without its
/// brackets), for the certificate's name.
pub fn host_of(addr: &str) -> &str {
    let host = addr.rsplit_once(':').map_or(addr, |(host, _)| host);
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

#[cfg(test)]
mod tests {
    use super::host_of;

    #[test]
    fn a_peer_address_names_its_host() {
        assert_eq!(host_of("127.0.0.1:9090"), "127.0.0.1");
        assert_eq!(host_of("prefill.internal:9090"), "prefill.internal");
        assert_eq!(host_of("[::1]:9090"), "::1");
    }
}
