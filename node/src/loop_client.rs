//! The door to the event loop: [`LoopClient`] sends a [`Command`] over a bounded channel
//! and waits for its reply. Domain code (leases, jobs, ledger, team) is given a client,
//! never the loop itself or the whole [`crate::NodeHandle`].

use std::collections::HashSet;

use gpunode_protocol::advert::OfferFilter;
use gpunode_protocol::lease::{LeaseId, LeaseMessage, LeaseReply, LeaseTerms, Rejection};
use libp2p::{Multiaddr, PeerId};
use tokio::sync::{mpsc, oneshot};

use crate::lease::book::SignedRenewal;
use crate::lease::desk::LocalCancel;
use crate::lease::negotiate::{Proposal, ProviderAdvert};
use crate::lease::{LeaseOpError, LeaseRecord, LeaseSendError};
use crate::views::{NodeStatus, OfferSearch};
use crate::NodeError;

/// Requests to the loop; each carries the sender of its reply.
#[derive(Debug)]
pub(crate) enum Command {
    Status(oneshot::Sender<NodeStatus>),
    FindOffers {
        filter: OfferFilter,
        reply: oneshot::Sender<OfferSearch>,
    },
    Shutdown(oneshot::Sender<()>),
    /// Fetch the current adverts of these peers (no provider lookup).
    FindAdverts {
        peers: Vec<PeerId>,
        reply: oneshot::Sender<OfferSearch>,
    },
    SendLease {
        peer: PeerId,
        addrs: Vec<Multiaddr>,
        // Boxed, like the terms below: a proposal (request and terms) is several times
        // the size of most commands.
        message: Box<LeaseMessage>,
        reply: oneshot::Sender<Result<LeaseReply, LeaseSendError>>,
    },
    /// A proposal, sent as [`Command::SendLease`] sends a message; a grant of the
    /// proposed terms whose signature verifies is recorded by the loop as it arrives, as
    /// [`Command::RecordLease`] would (see [`crate::lease::negotiate::proposal_outcome`]),
    /// sparing the negotiator a visit to the loop and the wait for its answer.
    ProposeLease {
        peer: PeerId,
        addrs: Vec<Multiaddr>,
        proposal: Box<Proposal>,
        reply: oneshot::Sender<Result<ProposalReply, LeaseSendError>>,
    },
    RecordLease {
        terms: Box<LeaseTerms>,
        provider_sig: Vec<u8>,
        requester_sig: Vec<u8>,
        reply: oneshot::Sender<Result<LeaseRecord, LeaseOpError>>,
    },
    ApplyRenewal {
        signed: SignedRenewal,
        reply: oneshot::Sender<Result<LeaseRecord, LeaseOpError>>,
    },
    CancelLocal {
        prefix: String,
        reply: oneshot::Sender<Result<LocalCancel, Rejection>>,
    },
    ResolveLease {
        prefix: String,
        reply: oneshot::Sender<Result<LeaseRecord, LeaseOpError>>,
    },
    ListLeases(oneshot::Sender<Vec<LeaseRecord>>),
    /// Team mode: exactly these peers may connect.
    TeamAllowed {
        peers: HashSet<PeerId>,
    },
    /// These leases by id (`None` where unknown), in order.
    GetLeases {
        ids: Vec<LeaseId>,
        reply: oneshot::Sender<Vec<Option<LeaseRecord>>>,
    },
    IsConnected {
        peer: PeerId,
        reply: oneshot::Sender<bool>,
    },
    /// The providers whose records this node holds under a capability key.
    ProvidersHeld {
        key: Vec<u8>,
        reply: oneshot::Sender<Vec<PeerId>>,
    },
    /// How data would travel to `peer` now (`None`: not connected).
    PathTo {
        peer: PeerId,
        reply: oneshot::Sender<Option<crate::views::LinkPath>>,
    },
    /// `peer` withdraws its request queued here under `ticket`.
    WithdrawQueued {
        peer: PeerId,
        ticket: u128,
        reply: oneshot::Sender<bool>,
    },
    /// Every provider whose verified, unexpired advert this node holds, without asking
    /// anyone (the dashboard's network view).
    KnownProviders(oneshot::Sender<Vec<crate::views::ProviderView>>),
    /// The requests waiting in this provider's queue, in serving order.
    ProviderQueue(oneshot::Sender<Vec<crate::overview::QueuedRequestView>>),
    /// Whether this node has a connection to `peer` now, and the price (millicredits
    /// per GPU-hour) and GPUs in the peer's newest verified advert it holds, without
    /// asking the DHT: what a lease with a named provider needs, in one visit to the loop.
    Reach {
        peer: PeerId,
        reply: oneshot::Sender<(bool, Option<ProviderAdvert>)>,
    },
}

/// What became of a proposal sent with [`LoopClient::propose_lease`].
#[derive(Debug)]
pub enum ProposalReply {
    /// The provider granted the proposed terms and its signature verifies: the lease as
    /// this node recorded it, durably, or why it could not be recorded.
    Recorded(Result<LeaseRecord, LeaseOpError>),
    /// Any other answer, as the provider gave it (a grant here was not taken).
    Answered(LeaseReply),
}

/// A cloneable client of the event loop.
#[derive(Debug, Clone)]
pub struct LoopClient {
    commands: mpsc::Sender<Command>,
}

impl LoopClient {
    pub(crate) fn new(commands: mpsc::Sender<Command>) -> LoopClient {
        LoopClient { commands }
    }

    /// Sends the command `make` builds and waits for its reply.
    pub(crate) async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> Result<T, NodeError> {
        let (tx, rx) = oneshot::channel();
        self.commands
            .send(make(tx))
            .await
            .map_err(|_| NodeError::Stopped)?;
        rx.await.map_err(|_| NodeError::Stopped)
    }

    /// Sends a command that has no reply.
    pub(crate) async fn tell(&self, command: Command) {
        let _ = self.commands.send(command).await;
    }

    /// Whether this node has a connection to `peer` now.
    pub async fn is_connected(&self, peer: PeerId) -> Result<bool, NodeError> {
        self.ask(|reply| Command::IsConnected { peer, reply }).await
    }

    /// The providers whose records this node holds under the capability key `key`.
    pub async fn providers_held(&self, key: Vec<u8>) -> Result<Vec<PeerId>, NodeError> {
        self.ask(|reply| Command::ProvidersHeld { key, reply })
            .await
    }

    /// How data would travel to `peer` now (`None`: not connected).
    pub async fn path_to(&self, peer: PeerId) -> Result<Option<crate::views::LinkPath>, NodeError> {
        self.ask(|reply| Command::PathTo { peer, reply }).await
    }

    /// Whether this node has a connection to `peer` now, and the price and GPUs in
    /// `peer`'s newest verified advert this node holds.
    pub async fn reach(&self, peer: PeerId) -> Result<(bool, Option<ProviderAdvert>), NodeError> {
        self.ask(|reply| Command::Reach { peer, reply }).await
    }

    /// Every provider whose verified advert this node holds (no lookup).
    pub async fn known_providers(&self) -> Result<Vec<crate::views::ProviderView>, NodeError> {
        self.ask(Command::KnownProviders).await
    }

    /// The requests waiting in this provider's queue.
    pub async fn provider_queue(
        &self,
    ) -> Result<Vec<crate::overview::QueuedRequestView>, NodeError> {
        self.ask(Command::ProviderQueue).await
    }

    /// Providers whose verified, unexpired adverts match `filter`.
    pub async fn search_offers(&self, filter: OfferFilter) -> Result<OfferSearch, NodeError> {
        self.ask(|reply| Command::FindOffers { filter, reply })
            .await
    }

    /// The current adverts of these peers.
    pub async fn find_adverts(&self, peers: Vec<PeerId>) -> Result<OfferSearch, NodeError> {
        self.ask(|reply| Command::FindAdverts { peers, reply })
            .await
    }

    /// Sends one lease message to `peer` (dialling `addrs` if not connected).
    pub async fn send_lease(
        &self,
        peer: PeerId,
        addrs: Vec<Multiaddr>,
        message: LeaseMessage,
    ) -> Result<Result<LeaseReply, LeaseSendError>, NodeError> {
        self.ask(|reply| Command::SendLease {
            peer,
            addrs,
            message: Box::new(message),
            reply,
        })
        .await
    }

    /// Sends `proposal` to `peer` (dialling `addrs` when not connected); a grant of its
    /// terms, signed by `peer`, is recorded durably before the answer comes back.
    pub async fn propose_lease(
        &self,
        peer: PeerId,
        addrs: Vec<Multiaddr>,
        proposal: Proposal,
    ) -> Result<Result<ProposalReply, LeaseSendError>, NodeError> {
        self.ask(|reply| Command::ProposeLease {
            peer,
            addrs,
            proposal: Box::new(proposal),
            reply,
        })
        .await
    }

    /// Records, durably, a lease a provider activated for this node.
    pub async fn record_lease(
        &self,
        terms: LeaseTerms,
        provider_sig: Vec<u8>,
        requester_sig: Vec<u8>,
    ) -> Result<Result<LeaseRecord, LeaseOpError>, NodeError> {
        self.ask(|reply| Command::RecordLease {
            terms: Box::new(terms),
            provider_sig,
            requester_sig,
            reply,
        })
        .await
    }

    /// Applies, durably, a renewal both parties signed.
    pub async fn apply_renewal(
        &self,
        signed: SignedRenewal,
    ) -> Result<Result<LeaseRecord, LeaseOpError>, NodeError> {
        self.ask(|reply| Command::ApplyRenewal { signed, reply })
            .await
    }

    /// Cancels a lease on this node's initiative.
    pub async fn cancel_local(
        &self,
        prefix: String,
    ) -> Result<Result<LocalCancel, Rejection>, NodeError> {
        self.ask(|reply| Command::CancelLocal { prefix, reply })
            .await
    }

    /// `peer` withdraws its request queued here under `ticket`; whether it was there.
    pub async fn withdraw_queued(&self, peer: PeerId, ticket: u128) -> Result<bool, NodeError> {
        self.ask(|reply| Command::WithdrawQueued {
            peer,
            ticket,
            reply,
        })
        .await
    }

    /// The lease with this id or unique id prefix.
    pub async fn resolve_lease(
        &self,
        prefix: String,
    ) -> Result<Result<LeaseRecord, LeaseOpError>, NodeError> {
        self.ask(|reply| Command::ResolveLease { prefix, reply })
            .await
    }

    /// A lease by id, if this node has it.
    pub async fn lease(&self, id: &LeaseId) -> Result<Option<LeaseRecord>, NodeError> {
        Ok(self.leases_by_id(vec![*id]).await?.pop().flatten())
    }

    /// Every lease this node knows.
    pub async fn list_leases(&self) -> Result<Vec<LeaseRecord>, NodeError> {
        self.ask(Command::ListLeases).await
    }

    /// These leases by id (`None` where unknown), in order, in one trip.
    pub async fn leases_by_id(
        &self,
        ids: Vec<LeaseId>,
    ) -> Result<Vec<Option<LeaseRecord>>, NodeError> {
        self.ask(|reply| Command::GetLeases { ids, reply }).await
    }

    /// The loop's part of the node's status.
    pub async fn status(&self) -> Result<NodeStatus, NodeError> {
        self.ask(Command::Status).await
    }

    /// Team mode: lets exactly `peers` connect.
    pub async fn set_team_allowed(&self, peers: HashSet<PeerId>) {
        self.tell(Command::TeamAllowed { peers }).await
    }

    /// Asks the loop to withdraw the advert, flush and stop.
    pub async fn shutdown(&self) -> Result<(), NodeError> {
        self.ask(Command::Shutdown).await
    }
}

/// What a domain service uses to reach peers: the loop, raw streams, and the metrics
/// it reports to.
#[derive(Clone)]
pub struct PeerLink {
    client: LoopClient,
    control: libp2p_stream::Control,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
}

impl std::fmt::Debug for PeerLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerLink").finish_non_exhaustive()
    }
}

impl PeerLink {
    /// A link over `client` and `control`, reporting to `metrics`.
    pub fn new(
        client: LoopClient,
        control: libp2p_stream::Control,
        metrics: std::sync::Arc<crate::metrics::Metrics>,
    ) -> PeerLink {
        PeerLink {
            client,
            control,
            metrics,
        }
    }

    /// The door to the event loop.
    pub fn client(&self) -> &LoopClient {
        &self.client
    }

    /// The node's metrics.
    pub fn metrics(&self) -> &std::sync::Arc<crate::metrics::Metrics> {
        &self.metrics
    }

    /// A control for raw streams of any protocol.
    pub fn control(&self) -> libp2p_stream::Control {
        self.control.clone()
    }

    /// Opens a stream of `protocol` to `peer`.
    pub async fn open_stream(
        &self,
        peer: PeerId,
        protocol: libp2p::StreamProtocol,
    ) -> Result<libp2p::Stream, NodeError> {
        self.control
            .clone()
            .open_stream(peer, protocol.clone())
            .await
            .map_err(|e| NodeError::Stream {
                protocol: protocol.to_string(),
                reason: e.to_string(),
            })
    }

    /// The peers this node is connected to now (none if the loop has stopped).
    pub async fn connected_peers(&self) -> Vec<PeerId> {
        match self.client.status().await {
            Ok(status) => status
                .connected_peers
                .iter()
                .filter_map(|p| p.parse().ok())
                .collect(),
            Err(_) => Vec::new(),
        }
    }
}
