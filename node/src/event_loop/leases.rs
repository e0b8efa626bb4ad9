//! The event loop's lease side: inbound lease messages go to the lease desk, which
//! decides; the loop carries out what it says (store writes, jobs stopped, settlement,
//! republishing), and replies that bind (activated, granted, renewed, cancelled) wait
//! until one flush has made a whole batch durable (group commit), while offers and
//! refusals leave at once; answers to outbound messages are routed back to their
//! callers, except a grant of this node's own proposal, which is checked and recorded
//! here as it arrives ([`crate::lease::negotiate::proposal_outcome`]).

use gpunode_protocol::lease::{LeaseMessage, LeaseReply, RejectCode, Rejection};
use gpunode_protocol::time::now_ms;
use libp2p::request_response::{self, ResponseChannel};
use libp2p::swarm::dial_opts::{DialOpts, PeerCondition};
use libp2p::PeerId;

use super::EventLoop;
use crate::inventory::InventorySnapshot;
use crate::lease::book::SignedRenewal;
use crate::lease::codec::InboundLease;
use crate::lease::desk::LocalCancel;
use crate::lease::negotiate::{proposal_outcome, Proposal};
use crate::lease::{
    persist, Capacity, Effects, GpuSlot, LeaseOpError, LeaseRecord, LeaseSendError,
};
use crate::loop_client::ProposalReply;
use crate::network::refused_protocol;
use gpunode_protocol::gpu::GpuState;
use tokio::sync::oneshot;

type LeaseEvent = request_response::Event<InboundLease, LeaseReply>;

/// Where the answer to a lease message this node sent goes.
pub(super) enum Awaiting {
    /// To the caller, as it came.
    Reply(oneshot::Sender<Result<LeaseReply, LeaseSendError>>),
    /// A proposal's: see [`EventLoop::on_proposal_answer`].
    Proposal(Box<ProposalSent>),
}

/// A proposal sent, and who waits for what became of it.
pub(super) struct ProposalSent {
    /// The peer it went to: only that peer's grant is taken.
    to: PeerId,
    /// What was proposed.
    proposal: Proposal,
    /// The negotiator waiting for the outcome.
    reply: oneshot::Sender<Result<ProposalReply, LeaseSendError>>,
}

impl Awaiting {
    /// The message could not be delivered, or its answer not read.
    fn failed(self, error: LeaseSendError) {
        match self {
            Awaiting::Reply(reply) => {
                let _ = reply.send(Err(error));
            }
            Awaiting::Proposal(sent) => {
                let _ = sent.reply.send(Err(error));
            }
        }
    }
}

impl EventLoop {
    pub(super) fn on_lease_event(&mut self, event: LeaseEvent) {
        match event {
            request_response::Event::Message {
                peer,
                message:
                    request_response::Message::Request {
                        request, channel, ..
                    },
                ..
            } => self.on_lease_request(peer, request, channel),
            request_response::Event::Message {
                peer,
                message:
                    request_response::Message::Response {
                        request_id,
                        response,
                    },
                ..
            } => match self.lease_out.remove(&request_id) {
                Some(Awaiting::Reply(reply)) => {
                    let _ = reply.send(Ok(response));
                }
                Some(Awaiting::Proposal(sent)) => self.on_proposal_answer(peer, *sent, response),
                None => {}
            },
            request_response::Event::OutboundFailure {
                request_id,
                error,
                peer,
                ..
            } => {
                let transport = matches!(
                    error,
                    request_response::OutboundFailure::DialFailure
                        | request_response::OutboundFailure::ConnectionClosed
                        | request_response::OutboundFailure::Io(_)
                        | request_response::OutboundFailure::Timeout
                ) && !refused_protocol(&error);
                let reconnect =
                    transport && !matches!(error, request_response::OutboundFailure::DialFailure);
                if reconnect {
                    // The peer may have crashed and come back: drop every connection we
                    // think we have, so the next message dials afresh.
                    let _ = self.swarm.disconnect_peer_id(peer);
                }
                if let Some(awaiting) = self.lease_out.remove(&request_id) {
                    awaiting.failed(LeaseSendError {
                        peer,
                        reason: error.to_string(),
                        transport,
                    });
                }
            }
            request_response::Event::InboundFailure { peer, error, .. } => {
                tracing::debug!(%peer, "inbound lease stream failed: {error}");
                self.metrics.lease_rejected("stream_failure");
            }
            request_response::Event::ResponseSent { .. } => {}
        }
    }

    fn on_lease_request(
        &mut self,
        peer: PeerId,
        request: InboundLease,
        channel: ResponseChannel<LeaseReply>,
    ) {
        self.metrics.lease_messages.inc();
        let proposal = matches!(request, InboundLease::Message(LeaseMessage::Propose { .. }));
        let (reply, effects) = self
            .desk
            .on_message(&peer, request, &self.standings, now_ms());
        if proposal {
            self.metrics.lease_proposal(match &reply {
                LeaseReply::Granted { .. } => "granted",
                LeaseReply::Offer { .. } => "offered",
                LeaseReply::Queued(_) => "queued",
                _ => "refused",
            });
        }
        if let LeaseReply::Rejected(r) = &reply {
            tracing::debug!(%peer, "lease message rejected: {}", r.message);
            self.metrics.lease_rejected(r.code.label());
        }
        self.carry_out(effects);
        if binds(&reply) {
            self.lease_replies.push((channel, reply));
        } else {
            let _ = self
                .swarm
                .behaviour_mut()
                .lease
                .send_response(channel, reply);
        }
    }

    /// Does what the desk said, in order: stop and pause jobs, write the changes (and
    /// flush when asked), settle ended leases, record quota use, republish, tell queued
    /// requesters their turn came.
    pub(super) fn carry_out(&mut self, effects: Effects) {
        for id in &effects.preempt {
            let jobs = self.lease_jobs.preempt(id);
            tracing::info!(lease = %id, jobs, "lease preempted: its jobs are stopped");
            self.metrics.leases_preempted.inc();
        }
        for (id, paused) in &effects.pause {
            self.lease_jobs.pause(id, *paused);
        }
        if let Err(e) = persist::write(&self.store, self.desk.book(), &effects.writes) {
            tracing::error!("cannot store lease changes: {e}");
        }
        for (user, entry) in &effects.fair_share {
            if let Err(e) = persist::write_fair_share(&self.store, user, entry.as_ref()) {
                tracing::warn!("cannot store fair-share usage: {e}");
            }
        }
        if effects.flush_now {
            if let Err(e) = self.store.flush() {
                tracing::error!("cannot flush lease changes: {e}");
            }
        }
        for record in effects.settle {
            if let Err(e) = self.ended_leases.try_send(record) {
                // The settlement task sweeps for ended leases it missed.
                tracing::debug!("settlement queue full: {e}");
            }
        }
        for id in &effects.ended {
            let stopped = self.lease_jobs.end_lease(id);
            if stopped > 0 {
                tracing::info!(lease = %id, "lease ended: stopped {stopped} job(s)");
            }
        }
        if let Some(team) = &self.team {
            for (peer, at, gpus, ms) in effects.quota {
                team.record_grant(peer, at, gpus, ms);
            }
        }
        let book = self.desk.book();
        let (gpus, _, _) = book.committed_totals();
        self.metrics.leased_gpus.set(gpus as i64);
        self.metrics.leases_active.set(book.active_count() as i64);
        if effects.republish {
            self.schedule_publish(std::time::Duration::from_millis(20), true);
        }
        for (peer, ticket) in effects.turns {
            let control = self.swarm.behaviour().stream.new_control();
            let metrics = self.metrics.clone();
            tokio::spawn(crate::lease::turns::send_turn(
                control, peer, ticket, metrics,
            ));
        }
    }

    /// Makes the batch durable, then sends every reply waiting for it.
    pub(super) fn flush_lease_replies(&mut self) {
        if self.lease_replies.is_empty() {
            return;
        }
        if let Err(e) = self.store.flush() {
            tracing::error!("cannot flush the store; lease replies withheld: {e}");
            self.lease_replies.clear();
            return;
        }
        for (channel, reply) in self.lease_replies.drain(..) {
            let _ = self
                .swarm
                .behaviour_mut()
                .lease
                .send_response(channel, reply);
        }
    }

    /// Lease deadlines that passed: holds released, leases completed.
    pub(super) fn tick_leases(&mut self) {
        let effects = self.desk.tick(now_ms());
        self.carry_out(effects);
    }

    /// Sends a proposal; its answer goes to [`EventLoop::on_proposal_answer`].
    pub(super) fn propose_lease(
        &mut self,
        peer: PeerId,
        addrs: Vec<libp2p::Multiaddr>,
        proposal: Proposal,
        reply: oneshot::Sender<Result<ProposalReply, LeaseSendError>>,
    ) {
        let message = proposal.message();
        let sent = ProposalSent {
            to: peer,
            proposal,
            reply,
        };
        self.send_lease(peer, addrs, message, Awaiting::Proposal(Box::new(sent)));
    }

    /// A proposal's answer: a grant of its terms signed by the provider is recorded
    /// here and now (durably), without a trip back to the negotiator and another here
    /// (`proposal_outcome` decides); any other answer goes back as it came. A grant for
    /// a negotiator that has stopped waiting (its job was cancelled) is not recorded,
    /// as before the loop recorded grants: nothing here would use the lease.
    fn on_proposal_answer(&mut self, from: PeerId, sent: ProposalSent, answer: LeaseReply) {
        if sent.reply.is_closed() {
            tracing::debug!(peer = %from, "a proposal's answer came after its negotiator left");
            return;
        }
        let reply = proposal_outcome(&sent.to, &from, sent.proposal, answer, |t, p, r| {
            self.record_requester_lease(t, p, r)
        });
        let _ = sent.reply.send(Ok(reply));
    }

    /// Sends a lease message; its answer goes where `awaiting` says.
    pub(super) fn send_lease(
        &mut self,
        peer: PeerId,
        addrs: Vec<libp2p::Multiaddr>,
        message: LeaseMessage,
        awaiting: Awaiting,
    ) {
        if !addrs.is_empty() && !self.connections.contains_key(&peer) {
            // The addresses come from the peer's newest signed advert: they replace what
            // the routing table remembers (a restarted peer may listen elsewhere now), so
            // no dial to a stale address holds our request up.
            let kad = &mut self.swarm.behaviour_mut().kad;
            kad.remove_peer(&peer);
            for addr in &addrs {
                kad.add_address(&peer, addr.clone());
            }
            // Dialled here, whatever else is dialling the peer: a dial still under way to
            // the addresses of an older advert would otherwise carry the request, and
            // its failure would fail the request too.
            let dial = DialOpts::peer_id(peer)
                .addresses(addrs.clone())
                .condition(PeerCondition::Always)
                .build();
            if let Err(e) = self.swarm.dial(dial) {
                tracing::debug!(%peer, "cannot dial the advertised addresses: {e}");
            }
        }
        let id = self
            .swarm
            .behaviour_mut()
            .lease
            .send_request_with_addresses(&peer, InboundLease::Message(message), addrs);
        self.lease_out.insert(id, awaiting);
    }

    /// Records a lease the provider activated for us, durably.
    pub(super) fn record_requester_lease(
        &mut self,
        terms: gpunode_protocol::lease::LeaseTerms,
        provider_sig: Vec<u8>,
        requester_sig: Vec<u8>,
    ) -> Result<LeaseRecord, LeaseOpError> {
        let (result, effects) =
            self.desk
                .record_requester_lease(terms, provider_sig, requester_sig, now_ms());
        self.carry_out_durably(effects)?;
        result
    }

    /// Applies a renewal both parties signed, durably.
    pub(super) fn apply_renewal(
        &mut self,
        signed: SignedRenewal,
    ) -> Result<LeaseRecord, LeaseOpError> {
        let (result, effects) = self.desk.apply_renewal(signed, now_ms());
        self.carry_out_durably(effects)?;
        result
    }

    /// Cancels a lease on our own initiative: signed, applied and stored; the caller
    /// tells the other party.
    pub(super) fn cancel_local(&mut self, prefix: &str) -> Result<LocalCancel, Rejection> {
        let (result, effects) = self.desk.cancel_local(prefix, now_ms());
        self.carry_out_durably(effects)
            .map_err(|e| Rejection::new(RejectCode::WrongState, e.to_string()))?;
        result
    }

    /// [`Self::carry_out`], failing when the changes could not be made durable.
    fn carry_out_durably(&mut self, mut effects: Effects) -> Result<(), LeaseOpError> {
        effects.flush_now = false;
        self.carry_out(effects);
        self.store
            .flush()
            .map_err(|e| LeaseOpError::Store(e.to_string()))
    }
}

/// What a provider can lend, from its inventory and configured CPU and RAM.
pub(crate) fn capacity_from(snapshot: &InventorySnapshot, cpus: u32, mem_bytes: u64) -> Capacity {
    Capacity {
        gpus: snapshot
            .gpus
            .iter()
            .map(|g| GpuSlot {
                index: g.index,
                uuid: g.uuid.clone(),
                model: g.name.clone(),
                memory_bytes: g.memory_total_bytes,
                available: g.state == GpuState::Idle,
            })
            .collect(),
        cpus,
        mem_bytes,
    }
}

/// Whether `reply` acknowledges a change both sides rely on (an active, granted,
/// renewed or cancelled lease), so it may leave only once the change is durable. An
/// offer binds nothing until its accept, which is written and flushed before
/// `Activated` leaves: a crash before the next flush loses the hold (the accept is then
/// refused as `unknown_lease` and the requester asks again) and the request's nonce (a
/// replay of it gets an offer that only the requester could accept). A refusal or a
/// queue place changes nothing durable. These go out at once, without waiting for a
/// flush.
fn binds(reply: &LeaseReply) -> bool {
    match reply {
        LeaseReply::Activated { .. }
        | LeaseReply::Granted { .. }
        | LeaseReply::Renewed { .. }
        | LeaseReply::Cancelled { .. } => true,
        LeaseReply::Offer { .. } | LeaseReply::Rejected(_) | LeaseReply::Queued(_) => false,
    }
}
