//! Guest stdout and stderr: forwarded to the caller as they are written, up to a cap.
//! Writing past the cap fails in the guest and marks the run as over its output limit.
//!
//! The stream is synchronous ([`OutputStream`]): a guest's write reaches the sink on the
//! guest's own thread, with no Tokio task between (WASI's default adapter for async
//! writers hands every write to a task on another thread).

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use tokio::io::AsyncWrite;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamError, StreamResult};

/// Receives output bytes as the guest writes them.
pub type OutputSink = Box<dyn FnMut(&[u8]) + Send>;

struct State {
    written: u64,
    cap: u64,
    sink: OutputSink,
}

/// A capped, forwarding output stream; clones share the same count and sink.
#[derive(Clone)]
pub(crate) struct CappedOutput {
    state: Arc<Mutex<State>>,
    exceeded: Arc<AtomicBool>,
}

impl CappedOutput {
    pub(crate) fn new(cap: u64, sink: OutputSink, exceeded: Arc<AtomicBool>) -> CappedOutput {
        CappedOutput {
            state: Arc::new(Mutex::new(State {
                written: 0,
                cap,
                sink,
            })),
            exceeded,
        }
    }
}

impl IsTerminal for CappedOutput {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl CappedOutput {
    /// Passes `buf` to the sink, unless it would go over the cap.
    fn forward(&self, buf: &[u8]) -> io::Result<usize> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.written + buf.len() as u64 > s.cap {
            self.exceeded.store(true, Ordering::SeqCst);
            return Err(io::Error::other("output limit reached"));
        }
        s.written += buf.len() as u64;
        (s.sink)(buf);
        Ok(buf.len())
    }
}

/// How much a guest may write at once (its writes are split to fit).
const WRITE_PERMIT: usize = 64 * 1024;

impl StdoutStream for CappedOutput {
    fn async_stream(&self) -> Box<dyn AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }

    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }
}

#[async_trait::async_trait]
impl Pollable for CappedOutput {
    /// Always ready: a write goes straight to the sink.
    async fn ready(&mut self) {}
}

#[async_trait::async_trait]
impl OutputStream for CappedOutput {
    fn write(&mut self, bytes: Bytes) -> StreamResult<()> {
        self.forward(&bytes)
            .map(|_| ())
            .map_err(|e| StreamError::LastOperationFailed(e.into()))
    }

    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }

    fn check_write(&mut self) -> StreamResult<usize> {
        Ok(WRITE_PERMIT)
    }
}

impl AsyncWrite for CappedOutput {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Poll::Ready(self.forward(buf))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}
