//! Queue turns: when GPUs free up for a request waiting in a provider's queue, the
//! provider tells its requester at once, over [`TURN_PROTOCOL`], instead of leaving the
//! GPUs idle until the requester's next poll.
//!
//! The notice is [`NOTICE_BYTES`] bytes: a version byte and the request's 16-byte
//! ticket, which only the requester and the providers it asked know. A notice can only
//! make a requester ask again early; it never grants or costs anything. So the requester
//! acts on one only for a ticket it waits under, from a provider whose last answer said
//! the ticket is queued there, and no sooner than [`MIN_ASK_GAP`] after its last ask (a
//! provider sending notices in a loop cannot make it ask in a loop). A lost notice
//! costs only time: the requester still asks again at its poll interval.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::{AsyncReadExt, AsyncWriteExt};
use libp2p::{PeerId, Stream, StreamProtocol};
use tokio::sync::Notify;

use crate::metrics::Metrics;
use crate::router::{StreamGate, StreamHandler, StreamLimits};

/// Protocol name of queue-turn notices.
pub const TURN_PROTOCOL: StreamProtocol = StreamProtocol::new("/gpunode/queue-turn/1.0.0");

/// The only notice version this build sends and reads.
const NOTICE_VERSION: u8 = 1;

/// A notice on the wire: version, then the ticket (big-endian).
pub const NOTICE_BYTES: usize = 17;

/// How long sending one notice may take, dial included.
const SEND_TIMEOUT: Duration = Duration::from_secs(2);

/// The least time between two asks of one waiting job, however many notices arrive.
pub const MIN_ASK_GAP: Duration = Duration::from_millis(25);

/// Inbound notices: a few at a time, each read within a second.
pub const TURN_STREAM_LIMITS: StreamLimits = StreamLimits {
    max_handlers: 32,
    first_message: Duration::from_secs(1),
    exchange: Some(Duration::from_secs(2)),
};

/// The bytes of the notice for `ticket`.
pub fn encode_notice(ticket: u128) -> [u8; NOTICE_BYTES] {
    let mut out = [0u8; NOTICE_BYTES];
    out[0] = NOTICE_VERSION;
    out[1..].copy_from_slice(&ticket.to_be_bytes());
    out
}

/// The ticket in a notice, or why it is not one.
pub fn decode_notice(bytes: &[u8]) -> Result<u128, &'static str> {
    match bytes {
        [NOTICE_VERSION, ticket @ ..] if ticket.len() == 16 => {
            let mut t = [0u8; 16];
            t.copy_from_slice(ticket);
            Ok(u128::from_be_bytes(t))
        }
        [NOTICE_VERSION, ..] => Err("a notice is 17 bytes"),
        _ => Err("unknown notice version"),
    }
}

/// Provider side: tells `peer` that its request queued under `ticket` would start now.
/// Failures are only logged (the requester's poll covers them).
pub async fn send_turn(
    control: libp2p_stream::Control,
    peer: PeerId,
    ticket: u128,
    metrics: Arc<Metrics>,
) {
    let mut control = control;
    let send = async {
        let mut stream = control
            .open_stream(peer, TURN_PROTOCOL)
            .await
            .map_err(|e| e.to_string())?;
        stream
            .write_all(&encode_notice(ticket))
            .await
            .map_err(|e| e.to_string())?;
        stream.close().await.map_err(|e| e.to_string())
    };
    match tokio::time::timeout(SEND_TIMEOUT, send).await {
        Ok(Ok(())) => metrics.queue_turn("sent"),
        Ok(Err(e)) => {
            metrics.queue_turn("send_failed");
            tracing::debug!(%peer, "cannot tell a queued requester its turn came: {e}");
        }
        Err(_) => {
            metrics.queue_turn("send_failed");
            tracing::debug!(%peer, "telling a queued requester its turn came timed out");
        }
    }
}

/// Why a notice was not acted on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ignored {
    /// No job here waits under this ticket.
    UnknownTicket,
    /// The job waits, but not in the sender's queue.
    NotQueuedThere,
}

impl Ignored {
    /// The metrics label.
    pub fn label(self) -> &'static str {
        match self {
            Ignored::UnknownTicket => "unknown_ticket",
            Ignored::NotQueuedThere => "not_queued_there",
        }
    }
}

struct Waiter {
    /// Providers whose queue holds the ticket, as their last answers said.
    providers: HashSet<PeerId>,
    notify: Arc<Notify>,
}

/// Requester side: the tickets this node's jobs wait under, and who may wake them.
#[derive(Default)]
pub struct Turns {
    waiting: Mutex<HashMap<u128, Waiter>>,
}

impl std::fmt::Debug for Turns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Turns").finish_non_exhaustive()
    }
}

impl Turns {
    /// Registers a job waiting under `ticket`; it is forgotten when the returned
    /// [`TurnWait`] is dropped.
    pub fn register(self: &Arc<Self>, ticket: u128) -> TurnWait {
        let notify = Arc::new(Notify::new());
        self.lock().insert(
            ticket,
            Waiter {
                providers: HashSet::new(),
                notify: notify.clone(),
            },
        );
        TurnWait {
            turns: self.clone(),
            ticket,
            notify,
        }
    }

    /// A notice from `from` for `ticket`: wakes its job if it waits in `from`'s queue.
    pub fn notice(&self, from: &PeerId, ticket: u128) -> Result<(), Ignored> {
        let waiting = self.lock();
        let waiter = waiting.get(&ticket).ok_or(Ignored::UnknownTicket)?;
        if !waiter.providers.contains(from) {
            return Err(Ignored::NotQueuedThere);
        }
        waiter.notify.notify_one();
        Ok(())
    }

    /// Jobs waiting now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no job waits.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u128, Waiter>> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One job's registration (see [`Turns::register`]).
pub struct TurnWait {
    turns: Arc<Turns>,
    ticket: u128,
    notify: Arc<Notify>,
}

impl TurnWait {
    /// The providers whose queues hold the ticket now (from the latest answers).
    pub fn queued_at(&self, providers: impl IntoIterator<Item = PeerId>) {
        if let Some(w) = self.turns.lock().get_mut(&self.ticket) {
            w.providers = providers.into_iter().collect();
        }
    }

    /// Until a notice is acted on (one that came while nobody waited counts).
    pub async fn notified(&self) {
        self.notify.notified().await
    }
}

impl Drop for TurnWait {
    fn drop(&mut self) {
        self.turns.lock().remove(&self.ticket);
    }
}

/// Serves [`TURN_PROTOCOL`]: reads one notice and hands it to [`Turns`].
pub struct TurnNotices {
    /// The node's waiting jobs.
    pub turns: Arc<Turns>,
    /// Where notices are counted.
    pub metrics: Arc<Metrics>,
}

impl StreamHandler for TurnNotices {
    fn handle(
        self: Arc<Self>,
        peer: PeerId,
        mut stream: Stream,
        _gate: StreamGate,
    ) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            let mut buf = Vec::with_capacity(NOTICE_BYTES + 1);
            let mut limited = (&mut stream).take(NOTICE_BYTES as u64 + 1);
            let read = limited.read_to_end(&mut buf);
            let first = TURN_STREAM_LIMITS.first_message;
            let result = match tokio::time::timeout(first, read).await {
                Err(_) => {
                    self.metrics.stream_refused("queue_turn", "silent");
                    return;
                }
                Ok(Err(_)) => Err("the stream broke"),
                Ok(Ok(_)) => decode_notice(&buf),
            };
            let label = match result {
                Ok(ticket) => match self.turns.notice(&peer, ticket) {
                    Ok(()) => "woke",
                    Err(why) => why.label(),
                },
                Err(why) => {
                    tracing::debug!(%peer, "malformed queue-turn notice: {why}");
                    "malformed"
                }
            };
            self.metrics.queue_turn(label);
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_round_trip_and_malformed_ones_are_refused() {
        let t = 0x0123_4567_89ab_cdef_0011_2233_4455_6677u128;
        assert_eq!(decode_notice(&encode_notice(t)), Ok(t));
        let bytes = encode_notice(t);
        assert!(decode_notice(&bytes[..16]).is_err(), "short");
        let mut long = bytes.to_vec();
        long.push(0);
        assert!(decode_notice(&long).is_err(), "long");
        let mut other = bytes;
        other[0] = 2;
        assert!(decode_notice(&other).is_err(), "unknown version");
        assert!(decode_notice(&[]).is_err(), "empty");
    }

    #[tokio::test]
    async fn only_a_provider_queueing_the_ticket_wakes_its_job() {
        let turns = Arc::new(Turns::default());
        let (queueing, stranger) = (PeerId::random(), PeerId::random());
        let wait = turns.register(7);
        assert_eq!(turns.notice(&queueing, 7), Err(Ignored::NotQueuedThere));
        wait.queued_at([queueing]);
        assert_eq!(turns.notice(&stranger, 7), Err(Ignored::NotQueuedThere));
        assert_eq!(turns.notice(&queueing, 8), Err(Ignored::UnknownTicket));
        assert_eq!(turns.notice(&queueing, 7), Ok(()));
        // The notice that came while nobody waited is kept for the next wait.
        tokio::time::timeout(Duration::from_secs(5), wait.notified())
            .await
            .expect("woken");
        drop(wait);
        assert!(turns.is_empty(), "a job that stops waiting is forgotten");
        assert_eq!(turns.notice(&queueing, 7), Err(Ignored::UnknownTicket));
    }
}
