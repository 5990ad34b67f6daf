//! A plugin call's stderr: the first [`STDERR_BYTES_MAX`](super::host::STDERR_BYTES_MAX)
//! bytes are kept for the log, the rest is dropped without failing the
//! guest (a write error would make a Rust guest's `eprintln!` panic: writing
//! a lot must not be a fault, only not be kept).

use bytes::Bytes;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use tokio::io::AsyncWrite;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi_io::poll::Pollable;
use wasmtime_wasi_io::streams::{OutputStream, StreamResult};

/// Bounded, never-failing stderr.
#[derive(Clone)]
pub struct CappedStderr {
    capacity: usize,
    kept: Arc<Mutex<Vec<u8>>>,
}

impl CappedStderr {
    /// Keeps at most `capacity` bytes.
    pub fn new(capacity: usize) -> CappedStderr {
        CappedStderr {
            capacity,
            kept: Arc::default(),
        }
    }

    /// What was kept.
    pub fn contents(&self) -> Vec<u8> {
        self.kept.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn keep(&self, bytes: &[u8]) {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        let room = self.capacity.saturating_sub(kept.len());
        kept.extend_from_slice(&bytes[..bytes.len().min(room)]);
    }
}

#[async_trait::async_trait]
impl Pollable for CappedStderr {
    async fn ready(&mut self) {}
}

#[async_trait::async_trait]
impl OutputStream for CappedStderr {
    fn write(&mut self, bytes: Bytes) -> StreamResult<()> {
        self.keep(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }

    fn check_write(&mut self) -> StreamResult<usize> {
        Ok(64 << 10)
    }
}

impl AsyncWrite for CappedStderr {
    fn poll_write(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.keep(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

impl IsTerminal for CappedStderr {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for CappedStderr {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}
