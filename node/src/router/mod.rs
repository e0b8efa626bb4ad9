//! The one door for inbound streams: every stream protocol the node serves (jobs,
//! settlement, team join, sync and renewal) is a [`StreamHandler`] registered with the
//! [`Router`], which accepts its streams, bounds how many are handled at once and how
//! long a peer may stay silent or take in all ([`StreamLimits`]), and stops in order: no new
//! streams, then a grace period for the running handlers, then the rest are aborted.
//! [`framing`] is the message framing all of them speak. Streams that arrive while the
//! router is busy wait for it, up to 64 per protocol, in the stream behaviour (our copy
//! of libp2p-stream, `vendor/README.md`), so each one it refuses is counted.

pub mod framing;
mod gate;

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::StreamExt;
use libp2p::{PeerId, Stream, StreamProtocol};
use tokio::sync::watch;
use tokio::task::AbortHandle;

pub use gate::{StreamGate, FIRST_MESSAGE_DEADLINE};

use crate::metrics::Metrics;

/// How long running handlers may take to finish once the node stops.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// How one protocol's inbound streams are bounded.
#[derive(Debug, Clone, Copy)]
pub struct StreamLimits {
    /// Streams handled at once; past it a new stream is dropped unread.
    pub max_handlers: usize,
    /// How long the peer may take to send its first message.
    pub first_message: Duration,
    /// How long one whole exchange may take (`None`: as long as the handler needs, e.g.
    /// a job's run).
    pub exchange: Option<Duration>,
}

/// The server side of one stream protocol.
pub trait StreamHandler: Send + Sync + 'static {
    /// Serves one stream `peer` opened; `gate` reads its first message within the
    /// deadline.
    fn handle(
        self: Arc<Self>,
        peer: PeerId,
        stream: Stream,
        gate: StreamGate,
    ) -> BoxFuture<'static, ()>;
}

/// A protocol could not be registered.
#[derive(Debug, thiserror::Error)]
#[error("cannot accept {protocol} streams: {reason}")]
pub struct RouteError {
    protocol: String,
    reason: String,
}

struct Route {
    /// One handler per protocol the route serves, in the order registered.
    handlers: Vec<Arc<dyn StreamHandler>>,
    gate: StreamGate,
    exchange: Option<Duration>,
}

/// Accepts the registered protocols' streams and hands each to its handler.
pub struct Router {
    control: libp2p_stream::Control,
    metrics: Arc<Metrics>,
    routes: Vec<Route>,
    /// Streams as they come: (route, handler within it, peer, stream).
    incoming: Vec<futures::stream::BoxStream<'static, (usize, usize, PeerId, Stream)>>,
}

impl Router {
    /// A router accepting streams through `control`.
    pub fn new(control: libp2p_stream::Control, metrics: Arc<Metrics>) -> Router {
        Router {
            control,
            metrics,
            routes: Vec::new(),
            incoming: Vec::new(),
        }
    }

    /// Serves `protocol` with `handler` under `limits`; `name` labels its metrics.
    pub fn route(
        &mut self,
        protocol: StreamProtocol,
        name: &'static str,
        limits: StreamLimits,
        handler: Arc<dyn StreamHandler>,
    ) -> Result<(), RouteError> {
        self.route_variants(name, limits, vec![(protocol, handler)])
    }

    /// Serves variants of one exchange (each protocol with its handler) under one set
    /// of `limits`: their streams share one gate, so a peer gains no room by opening
    /// every variant.
    pub fn route_variants(
        &mut self,
        name: &'static str,
        limits: StreamLimits,
        variants: Vec<(StreamProtocol, Arc<dyn StreamHandler>)>,
    ) -> Result<(), RouteError> {
        let index = self.routes.len();
        let mut handlers = Vec::with_capacity(variants.len());
        let mut incoming = Vec::with_capacity(variants.len());
        for (variant, (protocol, handler)) in variants.into_iter().enumerate() {
            let accepted = self
                .control
                .accept(protocol.clone())
                .map_err(|e| RouteError {
                    protocol: protocol.to_string(),
                    reason: e.to_string(),
                })?;
            handlers.push(handler);
            incoming.push(
                accepted
                    .map(move |(peer, s)| (index, variant, peer, s))
                    .boxed(),
            );
        }
        self.routes.push(Route {
            handlers,
            gate: StreamGate::new(
                name,
                limits.max_handlers,
                limits.first_message,
                self.metrics.clone(),
            ),
            exchange: limits.exchange,
        });
        self.incoming.extend(incoming);
        Ok(())
    }

    /// Serves until `stop` turns true, then stops in order (see the module doc).
    ///
    /// Handlers run as tasks of their own: if this task is aborted (a crash, in a test
    /// network) they finish their exchanges as they would if the node had shut down.
    pub async fn serve(self, mut stop: watch::Receiver<bool>) {
        let Router {
            routes, incoming, ..
        } = self;
        let mut incoming = futures::stream::select_all(incoming);
        let mut running: Vec<AbortHandle> = Vec::new();
        loop {
            tokio::select! {
                next = incoming.next() => match next {
                    Some((index, variant, peer, stream)) => {
                        if let Some(task) = Self::dispatch(&routes[index], variant, peer, stream) {
                            running.retain(|h| !h.is_finished());
                            running.push(tokio::spawn(task).abort_handle());
                        }
                    }
                    None => break,
                },
                _ = stop.changed() => break,
            }
        }
        // No new streams from here: the protocols are no longer accepted.
        drop(incoming);
        let deadline = tokio::time::Instant::now() + SHUTDOWN_GRACE;
        while running.iter().any(|h| !h.is_finished()) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for handler in running.iter().filter(|h| !h.is_finished()) {
            tracing::debug!("a stream handler still running at shutdown: aborted");
            handler.abort();
        }
    }

    /// The handler's work for one stream, holding a slot of its gate; `None` when all
    /// slots are taken (the stream is dropped unread and counted as `busy`).
    fn dispatch(
        route: &Route,
        variant: usize,
        peer: PeerId,
        stream: Stream,
    ) -> Option<BoxFuture<'static, ()>> {
        let permit = route.gate.enter()?;
        let work = route.handlers[variant]
            .clone()
            .handle(peer, stream, route.gate.clone());
        let exchange = route.exchange;
        Some(Box::pin(async move {
            match exchange {
                Some(limit) => {
                    let _ = tokio::time::timeout(limit, work).await;
                }
                None => work.await,
            }
            drop(permit);
        }))
    }
}

#[cfg(test)]
#[path = "router_tests.rs"]
mod tests;
