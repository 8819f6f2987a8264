//! TLS for the API (`[tls]` in rewind.toml): the certificate chain and private key from PEM
//! files, and a listener that completes each handshake beside the accept loop, so that a
//! client that opens a connection and says nothing holds up no one else.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

/// How long a client has to complete its handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Handshakes under way at once; past them, new connections wait to be accepted.
pub const MAX_HANDSHAKES: usize = 256;

/// Why the certificate or key cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("[tls] {what} {path}: {message}")]
    Pem {
        what: &'static str,
        path: String,
        message: String,
    },
    #[error("[tls]: the key does not fit the certificate, or neither can be used: {0}")]
    Config(#[from] rustls::Error),
}

/// The TLS configuration for the certificate chain in `cert` and the private key in `key`
/// (PEM).
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let pem = |what, path: &Path, message: String| TlsError::Pem {
        what,
        path: path.display().to_string(),
        message,
    };
    let chain = CertificateDer::pem_file_iter(cert)
        .map_err(|e| pem("cert", cert, e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem("cert", cert, e.to_string()))?;
    if chain.is_empty() {
        return Err(pem("cert", cert, "no CERTIFICATE in it".to_owned()));
    }
    // Never the key's bytes in an error: only what is wrong with them.
    let private = PrivateKeyDer::from_pem_file(key).map_err(|e| pem("key", key, e.to_string()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, private)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Connections on a TCP listener, each handed on once its TLS handshake completed. A
/// handshake that fails or takes longer than [`HANDSHAKE_TIMEOUT`] drops its connection
/// (said at debug level: port scanners are common).
#[derive(Debug)]
pub struct TlsListener {
    local: SocketAddr,
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    accepting: tokio::task::JoinHandle<()>,
}

impl TlsListener {
    pub fn new(listener: TcpListener, config: Arc<rustls::ServerConfig>) -> std::io::Result<Self> {
        let local = listener.local_addr()?;
        let acceptor = TlsAcceptor::from(config);
        let (done, ready) = mpsc::channel(MAX_HANDSHAKES);
        let accepting = tokio::spawn(accept(listener, acceptor, done));
        Ok(Self {
            local,
            ready,
            accepting,
        })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

async fn accept(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    done: mpsc::Sender<(TlsStream<TcpStream>, SocketAddr)>,
) {
    let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
    loop {
        let Ok(permit) = Arc::clone(&handshakes).acquire_owned().await else {
            return;
        };
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors, say: wait rather than spin.
                tracing::warn!("accepting a connection: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let (acceptor, done) = (acceptor.clone(), done.clone());
        tokio::spawn(async move {
            let _permit = permit;
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(stream)) => {
                    let _ = done.send((stream, peer)).await;
                }
                Ok(Err(e)) => tracing::debug!(%peer, "TLS handshake failed: {e}"),
                Err(_) => {
                    tracing::debug!(%peer, "TLS handshake took longer than {HANDSHAKE_TIMEOUT:?}")
                }
            }
        });
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(connection) => connection,
            // The accept loop ended (it only does when the listener is dropped).
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}
