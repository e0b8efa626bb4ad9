//! The settlement protocol: claims travel from provider to requester on
//! [`SETTLE_PROTOCOL`] streams.
//!
//! Provider side: when a lease it provided ends, [`Accounts::make_claims`] writes a
//! receipt from the metered usage, signs it and keeps it as a claim (durably, so a crash
//! resends the very same receipt); [`run_claims`] sends claims to each requester in
//! batches and appends the countersigned ones to the ledger. The claim of a lease that
//! ran to its end waits up to [`super::claims::LINGER`] for others to the same
//! requester; any other goes at once, as do those of a requester for which a stream was
//! opened ahead (see below). Claims a requester refuses
//! stay as disputed claims: they count as its debt and cost it reputation; claims it does
//! not answer are retried with backoff. A claim known to be coming (a one-job lease whose
//! outputs are out) finds its stream already open and negotiated ([`StreamsAhead`]).
//!
//! Requester side: [`ClaimAnswers`] (a router handler) checks each claim
//! ([`super::checks`]), countersigns the good ones, appends them to the ledger, and
//! answers only after the write is on disk. A claim identical to one already settled gets
//! the same countersignature again (the provider may have crashed before storing it);
//! anything else for a settled lease is a duplicate.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::{AsyncReadExt, AsyncWriteExt};
use gpunode_protocol::receipt::{
    Claim, ReceiptRefusal, ReceiptRejection, SettleMsg, SettleReply, MAX_CLAIMS_PER_MESSAGE,
};
use libp2p::{PeerId, Stream, StreamProtocol};
use tokio::sync::{mpsc, watch};

use crate::lease::LeaseRecord;
use crate::loop_client::PeerLink;
use crate::router::framing;

use super::accounts::Accounts;

/// The settlement stream protocol.
pub const SETTLE_PROTOCOL: StreamProtocol = StreamProtocol::new("/gpunode/settle/1.0.0");
/// How long one settlement exchange may take.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(20);
/// First retry of an unanswered claim; doubles up to [`MAX_RETRY`].
const FIRST_RETRY: Duration = Duration::from_secs(5);
const MAX_RETRY: Duration = Duration::from_secs(600);
/// How often the provider looks for ended leases without a claim (missed notices).
const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// Most settlement streams answered at once.
const MAX_SETTLE_STREAMS: usize = 64;

/// How settle streams are bounded: each exchange as a whole, and how many at once.
pub const SETTLE_STREAM_LIMITS: crate::router::StreamLimits = crate::router::StreamLimits {
    max_handlers: MAX_SETTLE_STREAMS,
    first_message: crate::router::FIRST_MESSAGE_DEADLINE,
    exchange: Some(EXCHANGE_TIMEOUT),
};

/// Whether a peer may settle with this node.
pub type IsMember = Arc<dyn Fn(&PeerId) -> bool + Send + Sync>;

/// How long a settlement stream opened ahead is kept for its claim.
const AHEAD_FRESH: Duration = Duration::from_secs(5);
/// How long a claim waits for a stream still being opened ahead before opening its own.
const AHEAD_WAIT: Duration = Duration::from_secs(2);
/// Most settlement streams held open ahead at once (one per requester).
const MAX_AHEAD: usize = 64;

/// Provider side: settlement streams opened ahead of a claim known to be coming, one per
/// requester, so the claim does not wait for a stream's protocol negotiation (a round
/// trip) after the lease ended. A stream not used within [`AHEAD_FRESH`] is dropped.
pub struct StreamsAhead {
    link: PeerLink,
    open: Arc<std::sync::Mutex<HashMap<PeerId, AheadStream>>>,
    /// Told when a stream starts opening: its requester's claims are due at once.
    opened: tokio::sync::Notify,
}

/// A stream being opened, or opened, ahead: when it was asked for and where it arrives.
type AheadStream = (tokio::time::Instant, tokio::sync::oneshot::Receiver<Stream>);

impl StreamsAhead {
    /// Streams opened through `link`.
    pub fn new(link: PeerLink) -> StreamsAhead {
        StreamsAhead {
            link,
            open: Arc::default(),
            opened: tokio::sync::Notify::new(),
        }
    }

    /// Starts opening a settlement stream to `peer` for a claim about to be made.
    pub fn open(&self, peer: PeerId) {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        open.retain(|_, (at, _)| at.elapsed() < AHEAD_FRESH);
        if open.len() >= MAX_AHEAD && !open.contains_key(&peer) {
            return;
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (link, held) = (self.link.clone(), self.open.clone());
        let asked = tokio::time::Instant::now();
        tokio::spawn(async move {
            if let Ok(stream) = link.open_stream(peer, SETTLE_PROTOCOL).await {
                let _ = tx.send(stream);
            }
            // Unused by then: dropped, which closes it.
            tokio::time::sleep_until(asked + AHEAD_FRESH).await;
            let mut held = held.lock().unwrap_or_else(|p| p.into_inner());
            if held.get(&peer).is_some_and(|(at, _)| *at == asked) {
                held.remove(&peer);
            }
        });
        open.insert(peer, (asked, rx));
        self.opened.notify_one();
    }

    /// Whether a fresh stream to `peer` is opening or open: a claim to it is awaited.
    fn awaited(&self, peer: &PeerId) -> bool {
        self.open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(peer)
            .is_some_and(|(at, _)| at.elapsed() < AHEAD_FRESH)
    }

    /// The stream opened ahead to `peer`, if one is fresh (waiting for it while it
    /// opens), or a new one.
    async fn stream_to(&self, peer: PeerId) -> Result<Stream, crate::NodeError> {
        let ahead = self
            .open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&peer);
        if let Some((at, rx)) = ahead {
            if at.elapsed() < AHEAD_FRESH {
                if let Ok(Ok(stream)) = tokio::time::timeout(AHEAD_WAIT, rx).await {
                    self.link.metrics().settle_streams_ahead_used.inc();
                    return Ok(stream);
                }
            }
        }
        self.link.open_stream(peer, SETTLE_PROTOCOL).await
    }
}

/// Requester side of settlement: answers the claims providers send (see
/// [`SETTLE_STREAM_LIMITS`]).
pub struct ClaimAnswers {
    /// This node's ledger.
    pub accounts: Arc<Accounts>,
    /// The node's leases, streams and metrics.
    pub link: PeerLink,
    /// Whether a peer may settle with this node (a member, when in a team).
    pub is_member: IsMember,
}

impl crate::router::StreamHandler for ClaimAnswers {
    fn handle(
        self: Arc<Self>,
        peer: PeerId,
        stream: Stream,
        gate: crate::router::StreamGate,
    ) -> futures::future::BoxFuture<'static, ()> {
        Box::pin(async move { answer_stream(&self, peer, stream, &gate).await })
    }
}

/// Answers each batch of claims on `stream`; the first must come within the gate's
/// deadline (a stream opened ahead, or by a peer that sends nothing, does not keep a
/// handler for the whole exchange's time).
async fn answer_stream(
    answers: &ClaimAnswers,
    peer: PeerId,
    stream: Stream,
    gate: &crate::router::StreamGate,
) {
    let (accounts, link) = (&answers.accounts, &answers.link);
    let (mut r, mut w) = AsyncReadExt::split(stream);
    if !(answers.is_member)(&peer) {
        tracing::debug!(%peer, "settlement from a non-member of the team refused");
        let _ = w.close().await;
        return;
    }
    let mut first = true;
    loop {
        let read = if std::mem::take(&mut first) {
            gate.first_message::<_, SettleMsg>(&mut r).await
        } else {
            framing::read_message::<_, SettleMsg>(&mut r).await
        };
        let reply = match read {
            Ok(SettleMsg::Claims(claims)) if claims.len() > MAX_CLAIMS_PER_MESSAGE => {
                SettleReply::Refused(ReceiptRejection::new(
                    ReceiptRefusal::Invalid,
                    format!("at most {MAX_CLAIMS_PER_MESSAGE} claims per message"),
                ))
            }
            Ok(SettleMsg::Claims(claims)) => {
                SettleReply::Results(accounts.answer_claims(link, peer, claims).await)
            }
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            // Silent past the deadline (counted by the gate).
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => break,
            Err(e) => {
                link.metrics().receipt_rejected("malformed");
                SettleReply::Refused(ReceiptRejection::new(
                    ReceiptRefusal::Invalid,
                    format!("malformed settlement message: {e}"),
                ))
            }
        };
        let refused = matches!(reply, SettleReply::Refused(_));
        if framing::write_message(&mut w, &reply).await.is_err() || w.flush().await.is_err() {
            break;
        }
        if refused {
            break;
        }
    }
    let _ = w.close().await;
}

/// Provider side: makes claims for leases that end and settles them with their
/// requesters, until `stop`.
pub async fn run_claims(
    accounts: Arc<Accounts>,
    link: PeerLink,
    ahead: Arc<StreamsAhead>,
    mut ended: mpsc::Receiver<LeaseRecord>,
    mut stop: watch::Receiver<bool>,
) {
    let (done_tx, mut done_rx) = mpsc::channel::<(PeerId, bool)>(256);
    let mut in_flight: HashSet<PeerId> = HashSet::new();
    let mut backoff: HashMap<PeerId, (tokio::time::Instant, Duration)> = HashMap::new();
    let mut sweep = tokio::time::interval(SWEEP_EVERY);
    let mut retry = tokio::time::interval(Duration::from_secs(1));
    // When the next lingering claim falls due.
    let mut next_due: Option<tokio::time::Instant> = None;
    loop {
        let lingering = async {
            match next_due {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            rec = ended.recv() => match rec {
                Some(first) => {
                    let mut batch = vec![first];
                    while let Ok(r) = ended.try_recv() {
                        batch.push(r);
                    }
                    let a = accounts.clone();
                    let _ = tokio::task::spawn_blocking(move || a.make_claims(&batch)).await;
                }
                None => return,
            },
            _ = sweep.tick() => {
                if let Ok(leases) = link.client().list_leases().await {
                    let a = accounts.clone();
                    let _ = tokio::task::spawn_blocking(move || a.make_claims(&leases)).await;
                }
            }
            Some((peer, ok)) = done_rx.recv() => {
                in_flight.remove(&peer);
                if ok {
                    backoff.remove(&peer);
                } else {
                    let next = backoff.get(&peer).map_or(FIRST_RETRY, |(_, d)| (*d * 2).min(MAX_RETRY));
                    backoff.insert(peer, (tokio::time::Instant::now() + next, next));
                }
            }
            _ = accounts.metered.jobs_done.notified() => {
                let deferred: Vec<LeaseRecord> = std::mem::take(
                    &mut *accounts.deferred.lock().unwrap_or_else(|p| p.into_inner()),
                );
                // Every job's end wakes this; most leases waited for none.
                if !deferred.is_empty() {
                    let a = accounts.clone();
                    let _ = tokio::task::spawn_blocking(move || a.make_claims(&deferred)).await;
                }
            }
            _ = retry.tick() => {}
            _ = lingering => {}
            _ = ahead.opened.notified() => {}
            _ = stop.changed() => return,
        }
        let now = tokio::time::Instant::now();
        // A requester whose claim is awaited (a stream opened ahead for it: a one-job
        // lease whose job ran to the lease's end) gets its claims at once.
        let (due, next) = accounts.due_peers(now, |peer| ahead.awaited(peer));
        next_due = next;
        for peer in due {
            if in_flight.contains(&peer) || backoff.get(&peer).is_some_and(|(at, _)| *at > now) {
                continue;
            }
            let claims = accounts.waiting_claims(&peer, MAX_CLAIMS_PER_MESSAGE);
            in_flight.insert(peer);
            let (a, ahead, done) = (accounts.clone(), ahead.clone(), done_tx.clone());
            tokio::spawn(async move {
                let ok = send_claims(&a, &ahead, peer, claims).await;
                let _ = done.send((peer, ok)).await;
            });
        }
    }
}

/// One exchange with a requester; true when it answered.
async fn send_claims(
    accounts: &Accounts,
    ahead: &StreamsAhead,
    peer: PeerId,
    claims: Vec<Claim>,
) -> bool {
    let exchange = async {
        let stream = ahead.stream_to(peer).await?;
        let (mut r, mut w) = AsyncReadExt::split(stream);
        framing::write_message(&mut w, &SettleMsg::Claims(claims.clone()))
            .await
            .map_err(crate::NodeError::Exchange)?;
        w.flush().await.map_err(crate::NodeError::Exchange)?;
        let reply = framing::read_message::<_, SettleReply>(&mut r)
            .await
            .map_err(crate::NodeError::Exchange)?;
        let _ = w.close().await;
        Ok::<_, crate::NodeError>(reply)
    };
    match tokio::time::timeout(EXCHANGE_TIMEOUT, exchange).await {
        Ok(Ok(SettleReply::Results(results))) if results.len() == claims.len() => {
            accounts.on_results(peer, claims, results).await;
            true
        }
        Ok(Ok(SettleReply::Refused(r))) => {
            tracing::warn!(%peer, "settlement refused: {}", r.message);
            false
        }
        Ok(Ok(_)) => {
            tracing::warn!(%peer, "settlement answer does not match the claims sent");
            false
        }
        Ok(Err(e)) => {
            tracing::debug!(%peer, "settlement failed: {e}");
            false
        }
        Err(_) => {
            tracing::debug!(%peer, "settlement timed out");
            false
        }
    }
}
