//! Queue turns: when GPUs free up for a request waiting in a provider's queue, the
//! provider tells its requester at once, over [`TURN_PROTOCOL`], instead of leaving the
//! GPUs idle until the requester's next poll.
//!
//! The notice is [`NOTICE_BYTES`] bytes: a kind byte and the request's 16-byte ticket,
//! which only the requester and the providers it asked know. The same protocol carries
//! the other way a requester's withdrawal: it took another provider's offer, so the
//! providers still queueing it free its place at once instead of 3 s later (and tell
//! the requests that now start); a peer can withdraw only its own request. A notice can only
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

/// Kind byte of "your turn came" (provider to requester).
const TURN: u8 = 1;
/// Kind byte of "I no longer wait here" (requester to provider).
const WITHDRAW: u8 = 2;

/// A notice on the wire: kind, then the ticket (big-endian).
pub const NOTICE_BYTES: usize = 17;

/// What a notice says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Notice {
    /// The request queued under this ticket would start now.
    Turn(u128),
    /// The sender withdraws its request queued under this ticket.
    Withdraw(u128),
}

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

/// The bytes of the notice that `ticket`'s turn came.
pub fn encode_notice(ticket: u128) -> [u8; NOTICE_BYTES] {
    encode(TURN, ticket)
}

/// The bytes of the withdrawal of the request queued under `ticket`.
pub fn encode_withdrawal(ticket: u128) -> [u8; NOTICE_BYTES] {
    encode(WITHDRAW, ticket)
}

fn encode(kind: u8, ticket: u128) -> [u8; NOTICE_BYTES] {
    let mut out = [0u8; NOTICE_BYTES];
    out[0] = kind;
    out[1..].copy_from_slice(&ticket.to_be_bytes());
    out
}

/// What a notice says, or why it is not one.
pub fn decode_notice(bytes: &[u8]) -> Result<Notice, &'static str> {
    let [kind, ticket @ ..] = bytes else {
        return Err("an empty notice");
    };
    let ticket: [u8; 16] = ticket.try_into().map_err(|_| "a notice is 17 bytes")?;
    let ticket = u128::from_be_bytes(ticket);
    match *kind {
        TURN => Ok(Notice::Turn(ticket)),
        WITHDRAW => Ok(Notice::Withdraw(ticket)),
        _ => Err("unknown notice kind"),
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
    match send_notice(control, peer, encode_notice(ticket)).await {
        Ok(()) => metrics.queue_turn("sent"),
        Err(e) => {
            metrics.queue_turn("send_failed");
            tracing::debug!(%peer, "cannot tell a queued requester its turn came: {e}");
        }
    }
}

/// Requester side: tells `peer` that the request queued there under `ticket` is
/// withdrawn. Failures are only logged (the place goes stale in 3 s anyway).
pub async fn send_withdrawal(control: libp2p_stream::Control, peer: PeerId, ticket: u128) {
    if let Err(e) = send_notice(control, peer, encode_withdrawal(ticket)).await {
        tracing::debug!(%peer, "cannot withdraw a queued request: {e}");
    }
}

async fn send_notice(
    mut control: libp2p_stream::Control,
    peer: PeerId,
    bytes: [u8; NOTICE_BYTES],
) -> Result<(), String> {
    let send = async {
        let mut stream = control
            .open_stream(peer, TURN_PROTOCOL)
            .await
            .map_err(|e| e.to_string())?;
        stream.write_all(&bytes).await.map_err(|e| e.to_string())?;
        stream.close().await.map_err(|e| e.to_string())
    };
    tokio::time::timeout(SEND_TIMEOUT, send)
        .await
        .map_err(|_| "timed out".to_string())?
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

    /// The ticket.
    pub fn ticket(&self) -> u128 {
        self.ticket
    }

    /// The providers whose queues hold the ticket, as their last answers said.
    pub fn queued_at_now(&self) -> Vec<PeerId> {
        self.turns
            .lock()
            .get(&self.ticket)
            .map(|w| w.providers.iter().copied().collect())
            .unwrap_or_default()
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

/// Serves [`TURN_PROTOCOL`]: reads one notice and hands a turn to [`Turns`], a
/// withdrawal to the lease desk.
pub struct TurnNotices {
    /// The node's waiting jobs.
    pub turns: Arc<Turns>,
    /// The event loop (its desk takes withdrawals).
    pub client: crate::loop_client::LoopClient,
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
            let read = {
                let mut limited = (&mut stream).take(NOTICE_BYTES as u64 + 1);
                let first = TURN_STREAM_LIMITS.first_message;
                tokio::time::timeout(first, limited.read_to_end(&mut buf)).await
            };
            let result = match read {
                Err(_) if buf.is_empty() => {
                    self.metrics.stream_refused("queue_turn", "silent");
                    return;
                }
                // Bytes came but the close did not, in time: what came is judged as it
                // is (a busy sender's close may just be late).
                Err(_) => decode_notice(&buf),
                Ok(Err(_)) => Err("the stream broke"),
                Ok(Ok(_)) => decode_notice(&buf),
            };
            let label = match result {
                Ok(Notice::Turn(ticket)) => match self.turns.notice(&peer, ticket) {
                    Ok(()) => "woke",
                    Err(why) => why.label(),
                },
                Ok(Notice::Withdraw(ticket)) => {
                    match self.client.withdraw_queued(peer, ticket).await {
                        Ok(true) => "withdrawn",
                        // Not queued here, or the node is stopping.
                        _ => "withdraw_not_queued",
                    }
                }
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
        assert_eq!(decode_notice(&encode_notice(t)), Ok(Notice::Turn(t)));
        assert_eq!(
            decode_notice(&encode_withdrawal(t)),
            Ok(Notice::Withdraw(t))
        );
        let bytes = encode_notice(t);
        assert!(decode_notice(&bytes[..16]).is_err(), "short");
        let mut long = bytes.to_vec();
        long.push(0);
        assert!(decode_notice(&long).is_err(), "long");
        let mut other = bytes;
        other[0] = 3;
        assert!(decode_notice(&other).is_err(), "unknown kind");
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
