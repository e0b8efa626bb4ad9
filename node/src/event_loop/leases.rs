//! The event loop's lease side: inbound lease messages go through the lease book, the
//! changes are written to the store, and replies wait until one flush has made a whole
//! batch durable (group commit); outbound messages are routed back to their callers.

use gpunode_protocol::lease::{
    Cancellation, LeaseId, LeaseMessage, LeaseReply, RejectCode, Rejection,
};
use gpunode_protocol::time::now_ms;
use libp2p::request_response::{self, ResponseChannel};
use libp2p::PeerId;

use super::queue::Decision;
use super::EventLoop;
use crate::inventory::InventorySnapshot;
use crate::lease::book::SignedRenewal;
use crate::lease::codec::InboundLease;
use crate::lease::{persist, Capacity, GpuSlot, LeaseRecord};
use gpunode_protocol::gpu::GpuState;

type LeaseEvent = request_response::Event<InboundLease, LeaseReply>;

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
                message:
                    request_response::Message::Response {
                        request_id,
                        response,
                    },
                ..
            } => {
                if let Some(reply) = self.lease_out.remove(&request_id) {
                    let _ = reply.send(Ok(response));
                }
            }
            request_response::Event::OutboundFailure {
                request_id,
                error,
                peer,
                ..
            } => {
                if matches!(
                    error,
                    request_response::OutboundFailure::ConnectionClosed
                        | request_response::OutboundFailure::Io(_)
                        | request_response::OutboundFailure::Timeout
                ) {
                    // The peer may have crashed and come back: drop every connection we
                    // think we have, so the next message dials afresh.
                    let _ = self.swarm.disconnect_peer_id(peer);
                }
                if let Some(reply) = self.lease_out.remove(&request_id) {
                    let _ = reply.send(Err(format!("peer {peer} did not answer: {error}")));
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
        let now = now_ms();
        let committed_before = self.leases.advertised();
        // In a team every lease message is from a member, checked here and not only by
        // the connection allow-list (which also lets invite join identities in).
        let not_member = self.team.as_ref().is_some_and(|t| !t.is_member(&peer));
        let reply = match request {
            _ if not_member => LeaseReply::Rejected(Rejection::new(
                RejectCode::PeerNotAllowed,
                "not a member of this team (no valid certificate, or revoked)",
            )),
            InboundLease::Invalid(r) => LeaseReply::Rejected(r),
            InboundLease::Message(LeaseMessage::Request(req)) => {
                let id = LeaseId(
                    self.accounts
                        .misbehaviour
                        .fixed_lease_id
                        .unwrap_or_else(rand::random),
                );
                // A reservation is judged by the hours it will run in.
                let start = req.start_at_ms.filter(|at| *at > now).unwrap_or(now);
                let hours = self
                    .owner
                    .lending
                    .check(req.duration_ms, start)
                    .map_err(|m| Rejection::new(RejectCode::LendingHours, m));
                let policy = hours.and_then(|()| match &self.team {
                    Some(team) => team
                        .check_lease(
                            &peer,
                            req.requirements.kind,
                            req.requirements.gpus,
                            req.duration_ms,
                            start,
                        )
                        .map_err(|m| Rejection::new(RejectCode::TeamPolicy, m)),
                    None => Ok(()),
                });
                let admitted = policy.and_then(|()| {
                    self.accounts.admit(
                        &peer,
                        self.leases.exposure(&peer),
                        self.leases.max_amount_for(&req),
                        self.team.as_ref().and_then(|t| t.allowance_millicredits()),
                    )
                });
                let checked = admitted.and_then(|()| self.leases.check_request(&peer, &req, now));
                match checked.map(|()| self.queue_decision(&peer, &req, now)) {
                    Err(r) => {
                        self.queue_refused(&req);
                        LeaseReply::Rejected(r)
                    }
                    Ok(Decision::Queued(place)) => LeaseReply::Queued(place),
                    Ok(Decision::Refused(r)) => LeaseReply::Rejected(r),
                    Ok(Decision::Grant(prefer)) => match self.leases.on_request_preferring(
                        &peer,
                        &req,
                        id,
                        &self.keypair,
                        now,
                        &prefer,
                    ) {
                        Ok((terms, provider_sig)) => {
                            self.queue_granted(&peer, &req, now);
                            LeaseReply::Offer {
                                terms,
                                provider_sig,
                            }
                        }
                        Err(r) => {
                            // Out of CPU or RAM: a queued request keeps its place
                            // (one without a ticket never keeps one).
                            if r.code != RejectCode::NoCapacity || req.ticket.is_none() {
                                self.queue_refused(&req);
                            }
                            LeaseReply::Rejected(r)
                        }
                    },
                }
            }
            InboundLease::Message(LeaseMessage::Accept {
                terms,
                provider_sig,
                requester_sig,
            }) => {
                match self
                    .leases
                    .on_accept(&peer, &terms, &provider_sig, &requester_sig, now)
                {
                    Ok(lease_id) => {
                        if let Some(team) = &self.team {
                            team.record_grant(
                                peer,
                                now,
                                terms.gpus.len() as u32,
                                terms.end_ms.saturating_sub(terms.start_ms),
                            );
                        }
                        LeaseReply::Activated { lease_id }
                    }
                    Err(r) => LeaseReply::Rejected(r),
                }
            }
            InboundLease::Message(LeaseMessage::Renew { renewal, signature }) => {
                let hours = self
                    .owner
                    .lending
                    .check(renewal.new_end_ms.saturating_sub(now), now)
                    .map_err(|m| Rejection::new(RejectCode::LendingHours, m));
                // A renewal is more GPU time: it counts against the team quotas like a
                // new lease of the added time.
                let added = self.leases.get(&renewal.lease_id).map(|l| {
                    (
                        l.terms.gpus.len() as u32,
                        renewal.new_end_ms.saturating_sub(l.terms.end_ms),
                    )
                });
                let policy = hours.and_then(|()| match (&self.team, added) {
                    (Some(team), Some((gpus, extra_ms))) if extra_ms > 0 => team
                        .check_lease(
                            &peer,
                            gpunode_protocol::team::JobKind::Interactive,
                            gpus,
                            extra_ms,
                            now,
                        )
                        .map_err(|m| Rejection::new(RejectCode::TeamPolicy, m)),
                    _ => Ok(()),
                });
                match policy.and_then(|()| {
                    self.leases
                        .on_renew(&peer, &renewal, &signature, &self.keypair, now)
                }) {
                    Ok(provider_sig) => {
                        if let (Some(team), Some((gpus, extra_ms))) = (&self.team, added) {
                            team.record_grant(peer, now, gpus, extra_ms);
                        }
                        LeaseReply::Renewed {
                            lease_id: renewal.lease_id,
                            new_end_ms: renewal.new_end_ms,
                            provider_sig,
                        }
                    }
                    Err(r) => LeaseReply::Rejected(r),
                }
            }
            InboundLease::Message(LeaseMessage::Cancel {
                cancellation,
                signature,
            }) => match self.leases.on_cancel(&peer, &cancellation, &signature, now) {
                Ok(()) => LeaseReply::Cancelled {
                    lease_id: cancellation.lease_id,
                },
                Err(r) => LeaseReply::Rejected(r),
            },
        };
        if let LeaseReply::Rejected(r) = &reply {
            tracing::debug!(%peer, "lease message rejected: {}", r.message);
            self.metrics.lease_rejected(r.code.label());
        }
        self.persist_leases();
        self.after_lease_change(&committed_before);
        self.lease_replies.push((channel, reply));
    }

    /// Writes pending lease changes to the store (durable at the next flush).
    pub(super) fn persist_leases(&mut self) {
        if let Err(e) = self.write_lease_changes() {
            tracing::error!("cannot store lease changes: {e}");
        }
    }

    /// Writes lease changes and stops the jobs of every lease that ended.
    fn write_lease_changes(&mut self) -> Result<(), crate::store::StoreError> {
        let ended = persist::write_changes(&self.store, &mut self.leases)?;
        let now = now_ms();
        for id in ended {
            if let Some(record) = self.leases.get(&id).cloned() {
                if record.role == crate::lease::LeaseRole::Provider {
                    self.queue_lease_ended(
                        &record.terms.requester,
                        record.terms.gpus.len() as u32,
                        record.terms.end_ms,
                        now,
                    );
                    if let Err(e) = self.ended_leases.try_send(record.clone()) {
                        // The settlement task sweeps for ended leases it missed.
                        tracing::debug!(lease = %id, "settlement queue full: {e}");
                    }
                }
            }
            let stopped = self.lease_jobs.end_lease(&id);
            if stopped > 0 {
                tracing::info!(lease = %id, "lease ended: stopped {stopped} job(s)");
            }
        }
        Ok(())
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

    /// Updates gauges and re-advertises when the set of leased GPUs changed.
    pub(super) fn after_lease_change(&mut self, committed_before: &crate::lease::book::Advertised) {
        let (gpus, _, _) = self.leases.committed_totals();
        self.metrics.leased_gpus.set(gpus as i64);
        self.metrics
            .leases_active
            .set(self.leases.active_count() as i64);
        if self.leases.advertised() != *committed_before {
            self.schedule_publish(std::time::Duration::from_millis(20), true);
        }
    }

    /// Lease deadlines that passed: holds released, leases completed.
    pub(super) fn tick_leases(&mut self) {
        let before = self.leases.advertised();
        if !self.leases.tick(now_ms()).is_empty() {
            self.persist_leases();
            if let Err(e) = self.store.flush() {
                tracing::error!("cannot flush lease expiries: {e}");
            }
        } else {
            self.persist_leases();
        }
        self.after_lease_change(&before);
    }

    /// Sends a lease message and hands the answer to `reply`.
    pub(super) fn send_lease(
        &mut self,
        peer: PeerId,
        addrs: Vec<libp2p::Multiaddr>,
        message: LeaseMessage,
        reply: tokio::sync::oneshot::Sender<Result<LeaseReply, String>>,
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
        }
        let id = self
            .swarm
            .behaviour_mut()
            .lease
            .send_request_with_addresses(&peer, InboundLease::Message(message), addrs);
        self.lease_out.insert(id, reply);
    }

    /// Records a lease the provider activated for us, durably.
    pub(super) fn record_requester_lease(
        &mut self,
        terms: gpunode_protocol::lease::LeaseTerms,
        provider_sig: Vec<u8>,
        requester_sig: Vec<u8>,
    ) -> Result<LeaseRecord, String> {
        let id = terms.lease_id;
        self.leases
            .record_requester_lease(terms, provider_sig, requester_sig, now_ms())?;
        self.persist_durably()?;
        self.leases
            .get(&id)
            .cloned()
            .ok_or_else(|| "lease vanished".to_string())
    }

    /// Applies a renewal both parties signed, durably.
    pub(super) fn apply_renewal(&mut self, signed: SignedRenewal) -> Result<LeaseRecord, String> {
        let id = signed.renewal.lease_id;
        self.leases
            .apply_renewal(signed, now_ms())
            .map_err(|r| r.message)?;
        self.persist_durably()?;
        self.leases
            .get(&id)
            .cloned()
            .ok_or_else(|| "lease vanished".to_string())
    }

    /// Cancels a lease on our own initiative: signed, applied and stored; the caller
    /// tells the other party.
    pub(super) fn cancel_local(&mut self, prefix: &str) -> Result<super::LocalCancel, Rejection> {
        let id = self
            .leases
            .resolve(prefix)
            .map_err(|m| Rejection::new(RejectCode::UnknownLease, m))?;
        let cancellation = Cancellation {
            lease_id: id,
            by: self.local_peer,
            at_ms: now_ms(),
        };
        let signature = cancellation
            .sign(&self.keypair)
            .map_err(|e| Rejection::new(RejectCode::BadSignature, e.to_string()))?;
        let before = self.leases.advertised();
        self.leases
            .on_cancel(&self.local_peer, &cancellation, &signature, now_ms())?;
        self.persist_durably()
            .map_err(|m| Rejection::new(RejectCode::WrongState, m))?;
        self.after_lease_change(&before);
        let record = self
            .leases
            .get(&id)
            .cloned()
            .ok_or_else(|| Rejection::new(RejectCode::UnknownLease, "lease vanished"))?;
        Ok((record, cancellation, signature))
    }

    fn persist_durably(&mut self) -> Result<(), String> {
        self.write_lease_changes().map_err(|e| e.to_string())?;
        self.store.flush().map_err(|e| e.to_string())
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
