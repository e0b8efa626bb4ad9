//! Guest stdout and stderr: forwarded to the caller as they are written, up to a cap.
//! Writing past the cap fails in the guest and marks the run as over its output limit.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::io::AsyncWrite;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};

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

impl StdoutStream for CappedOutput {
    fn async_stream(&self) -> Box<dyn AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

impl AsyncWrite for CappedOutput {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.written + buf.len() as u64 > s.cap {
            self.exceeded.store(true, Ordering::SeqCst);
            return Poll::Ready(Err(io::Error::other("output limit reached")));
        }
        s.written += buf.len() as u64;
        (s.sink)(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}
