//! [`StreamGate`]: per inbound stream protocol, how many handlers run at once and how
//! long a peer may take to send its first message. A peer opening thousands of idle
//! streams takes at most `max_handlers` slots, each for at most `first_message`, and the
//! node keeps serving everyone else.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use futures::AsyncRead;
use serde::de::DeserializeOwned;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::metrics::Metrics;

/// How long a peer may take to send the first message on a stream it opened.
pub const FIRST_MESSAGE_DEADLINE: Duration = Duration::from_secs(10);

/// Bounds for one inbound stream protocol.
#[derive(Debug, Clone)]
pub struct StreamGate {
    protocol: &'static str,
    permits: Arc<Semaphore>,
    first_message: Duration,
    metrics: Arc<Metrics>,
}

impl StreamGate {
    /// At most `max_handlers` streams of `protocol` served at once, each sending its
    /// first message within `first_message`.
    pub fn new(
        protocol: &'static str,
        max_handlers: usize,
        first_message: Duration,
        metrics: Arc<Metrics>,
    ) -> StreamGate {
        StreamGate {
            protocol,
            permits: Arc::new(Semaphore::new(max_handlers)),
            first_message,
            metrics,
        }
    }

    /// A slot for one more inbound stream, held until the handler ends; `None` when
    /// all are taken (the stream is to be dropped at once; counted as `busy`).
    pub fn enter(&self) -> Option<OwnedSemaphorePermit> {
        let permit = self.permits.clone().try_acquire_owned().ok();
        if permit.is_none() {
            self.metrics.stream_refused(self.protocol, "busy");
        }
        permit
    }

    /// Reads the stream's first message, which must arrive within the deadline
    /// (otherwise counted as `silent` and refused with `TimedOut`).
    pub async fn first_message<R: AsyncRead + Unpin, T: DeserializeOwned>(
        &self,
        r: &mut R,
    ) -> io::Result<T> {
        match tokio::time::timeout(self.first_message, super::framing::read_message(r)).await {
            Ok(m) => m,
            Err(_) => {
                self.metrics.stream_refused(self.protocol, "silent");
                Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "no message within {} ms of opening the stream",
                        self.first_message.as_millis()
                    ),
                ))
            }
        }
    }

    /// Handlers free now.
    pub fn available(&self) -> usize {
        self.permits.available_permits()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::task::{Context, Poll};

    /// In paused time: the deadline is the real one, and the test does not wait for it.
    #[tokio::test(start_paused = true)]
    async fn busy_and_silent_streams_are_refused_and_counted() {
        let metrics = Metrics::new();
        let gate = StreamGate::new("test", 2, FIRST_MESSAGE_DEADLINE, metrics.clone());
        let a = gate.enter().expect("first");
        let _b = gate.enter().expect("second");
        assert!(gate.enter().is_none(), "a third handler waits for nobody");
        assert_eq!(metrics.stream_refused_count("test", "busy"), 1);
        drop(a);
        assert!(gate.enter().is_some(), "a slot frees when its handler ends");

        // A stream that never says anything is given up at the deadline, not before.
        let opened = tokio::time::Instant::now();
        let err = gate
            .first_message::<_, String>(&mut Silent)
            .await
            .expect_err("silent");
        assert_eq!(opened.elapsed(), FIRST_MESSAGE_DEADLINE);
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(metrics.stream_refused_count("test", "silent"), 1);
    }

    /// A stream whose peer opened it and never writes.
    struct Silent;

    impl AsyncRead for Silent {
        fn poll_read(
            self: std::pin::Pin<&mut Self>,
            _cx: &mut Context<'_>,
            _buf: &mut [u8],
        ) -> Poll<io::Result<usize>> {
            Poll::Pending
        }
    }
}
