//! The requester's side of a lease negotiation: ask candidates in order, check each
//! offer against what was asked, countersign the first firm one, and record the lease.
//!
//! [`Negotiator`] gets leases here; `candidates` picks whom to ask and in what order,
//! `offers` judges what they answer, and `held` renews and cancels leases once had.

mod candidates;
mod held;
mod offers;
mod propose;
mod reached;
mod recent;

use crate::lease::LeaseSendError;
use std::time::Duration;

use futures::future::BoxFuture;
use gpunode_protocol::lease::{
    Cancellation, LeaseId, LeaseMessage, LeaseReply, LeaseRequest, LeaseTerms, QueuePlace,
    RejectCode, Rejection, Requirements, LEASE_VERSION,
};
use gpunode_protocol::time::now_ms;
use gpunode_protocol::PeerId;
use libp2p::identity::Keypair;
use libp2p::Multiaddr;

use crate::loop_client::{LoopClient, ProposalReply};
use crate::views::{LeaseSpec, LeaseView};
use crate::NodeError;
use candidates::{describe, Candidate};

pub use offers::{check_offer, describe_place, rank, REPUTATION_FLOOR};
#[cfg(test)]
pub(crate) use propose::foreseen_terms;
pub(crate) use propose::proposal_outcome;
pub use propose::{Proposal, ProviderAdvert};

/// Why one provider did not grant a lease.
enum NotGranted {
    /// Refused, with the reason.
    Refused(String),
    /// Waits in its queue.
    Queued(QueuePlace),
}

impl NotGranted {
    /// What an answer other than the one hoped for means: the provider's refusal, the
    /// exchange's failure, or an answer out of turn.
    fn from_answer(answer: Result<LeaseReply, LeaseSendError>) -> NotGranted {
        match answer {
            Ok(LeaseReply::Rejected(r)) => NotGranted::Refused(r.message),
            Ok(other) => NotGranted::Refused(format!("unexpected answer {other:?}")),
            Err(e) => NotGranted::Refused(e.to_string()),
        }
    }
}

/// What a provider answered a proposal.
enum Proposed {
    /// The negotiation ends here: the proposed terms were granted and are recorded, or
    /// why there is no lease (a grant whose signature does not verify, say).
    Decided(Result<LeaseView, NotGranted>),
    /// It answered as to the request alone: an offer of other terms, or why not.
    Offered(Result<(LeaseTerms, Vec<u8>), NotGranted>),
    /// It could not read the proposal (it predates them): ask with the request alone.
    Unheard,
}

/// How long a lease request stays valid.
const REQUEST_TTL_MS: u64 = 30_000;

/// Why a lease could not be had, renewed or cancelled.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// The request itself is not usable.
    #[error("{0}")]
    Invalid(String),
    /// No provider offers what was asked.
    #[error("no provider offers {0}; see `gpunode offers` for what is available")]
    NoProviders(String),
    /// Every candidate refused or failed.
    #[error("no provider granted the lease:{}", .0.iter().map(|(p, m)| format!("\n  {p}: {m}")).collect::<String>())]
    AllRefused(Vec<(String, String)>),
    /// Nobody can grant it now; it waits in these providers' queues (the others refused).
    #[error("queued at {} provider(s):{}", .queued.len(), .queued.iter().map(|(p, q)| format!("\n  {p}: {}", describe_place(q))).chain(.refused.iter().map(|(p, m)| format!("\n  {p}: {m}"))).collect::<String>())]
    Queued {
        /// Provider and place.
        queued: Vec<(String, QueuePlace)>,
        /// Provider and why it refused.
        refused: Vec<(String, String)>,
    },
    /// The other party refused.
    #[error("{0}")]
    Refused(Rejection),
    /// No such lease, or not in a state for this.
    #[error("{0}")]
    NotFound(String),
    /// The node failed.
    #[error(transparent)]
    Node(#[from] NodeError),
}

/// The requester's side of lease negotiation: finds providers, negotiates, renews and
/// cancels, through the loop client and with this node's key.
#[derive(Debug, Clone)]
pub struct Negotiator {
    client: LoopClient,
    keypair: Keypair,
    peer_id: PeerId,
    /// Searches that led to a lease, reused for a moment (see [`recent`]).
    recent: std::sync::Arc<std::sync::Mutex<recent::RecentSearches>>,
    /// Named providers reached a moment ago, with their adverts (see [`reached`]).
    reached: std::sync::Arc<std::sync::Mutex<reached::Reached>>,
    /// Where reused offers get their providers' current reputation (the search's is
    /// what it was then: a provider caught cheating since must not stay first).
    accounts: Option<std::sync::Arc<crate::ledger::accounts::Accounts>>,
}

impl Negotiator {
    /// The event loop this negotiator reaches.
    pub(crate) fn loop_client(&self) -> &LoopClient {
        &self.client
    }

    /// A negotiator for the node with `keypair`, reaching its loop through `client`.
    pub fn new(client: LoopClient, keypair: Keypair) -> Negotiator {
        Negotiator {
            peer_id: keypair.public().to_peer_id(),
            client,
            keypair,
            recent: Default::default(),
            reached: Default::default(),
            accounts: None,
        }
    }

    /// This negotiator, ranking reused offers by the current reputations in `accounts`.
    pub fn scored_by(
        mut self,
        accounts: std::sync::Arc<crate::ledger::accounts::Accounts>,
    ) -> Negotiator {
        self.accounts = Some(accounts);
        self
    }

    /// Sends one lease message to `peer` (dialling `addrs` when not connected) and waits
    /// for the answer.
    pub async fn send_lease(
        &self,
        peer: PeerId,
        addrs: Vec<Multiaddr>,
        message: LeaseMessage,
    ) -> Result<Result<LeaseReply, LeaseSendError>, NodeError> {
        self.retrying(peer, addrs, |addrs| {
            Box::pin(self.client.send_lease(peer, addrs, message.clone()))
        })
        .await
    }

    /// Calls `send` with where to reach `peer`, again (up to three times in all) when it
    /// fails in transport, with the addresses of the peer's newest advert.
    async fn retrying<'a, T>(
        &'a self,
        peer: PeerId,
        mut addrs: Vec<Multiaddr>,
        send: impl Fn(Vec<Multiaddr>) -> BoxFuture<'a, Result<Result<T, LeaseSendError>, NodeError>>,
    ) -> Result<Result<T, LeaseSendError>, NodeError> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let answer = send(addrs.clone()).await?;
            match answer {
                // A dial already under way to an address the peer no longer uses, or a
                // connection that died with the peer (a crash and restart), fails an
                // attempt; the next one opens a fresh connection.
                Err(e) if attempt < 3 && e.transport => {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    // The addresses we dialled may be out of date: a peer that has just
                    // started advertises its private addresses until it learns it is
                    // behind NAT, then its relayed ones. Its newest advert says where
                    // it listens now.
                    if !addrs.is_empty() {
                        let fresh = self.addresses_of(peer).await;
                        if !fresh.is_empty() {
                            addrs = fresh;
                        }
                    }
                }
                other => return Ok(other),
            }
        }
    }

    /// Current adverts of known peers (for their addresses and offers).
    pub async fn find_adverts(
        &self,
        peers: Vec<PeerId>,
    ) -> Result<Vec<crate::OfferView>, NodeError> {
        Ok(self.client.find_adverts(peers).await?.offers)
    }

    /// Finds a provider (or asks the named one), negotiates and records a lease.
    pub async fn request_lease(&self, spec: LeaseSpec) -> Result<LeaseView, LeaseError> {
        self.request_lease_and(spec, &|_| {}).await
    }

    /// As [`Negotiator::request_lease`], calling `accepting` with the provider each time
    /// an offer is accepted, before the provider answers: the caller can get ready for
    /// a lease there meanwhile (a job's stream opens while the acceptance travels).
    pub async fn request_lease_and(
        &self,
        spec: LeaseSpec,
        accepting: &(dyn Fn(PeerId) + Send + Sync),
    ) -> Result<LeaseView, LeaseError> {
        let max_price = price_limit(&spec)?;
        let mut reuse = true;
        loop {
            let found = self.candidates(&spec, max_price, reuse).await?;
            let candidates: Vec<Candidate> = found
                .candidates
                .into_iter()
                .filter(|c| !spec.exclude.contains(&c.peer.to_string()))
                .collect();
            let order: Vec<String> = candidates.iter().map(|c| c.peer.to_string()).collect();
            let result = if candidates.is_empty() {
                Err(LeaseError::NoProviders(describe(&spec)))
            } else {
                self.ask_in_turn(candidates, &spec, max_price, accepting)
                    .await
            };
            let again = match found.search {
                Some(search) => self.learn(search, &order, &result),
                None => false,
            };
            if !again {
                return result;
            }
            reuse = false;
        }
    }

    /// Keeps or forgets `search` after the lease it led to (`result`; `order`: whom it
    /// asked, in turn) and says whether to search afresh: a reused answer whose
    /// providers all refused, queued the request or were excluded.
    fn learn(
        &self,
        search: candidates::Search,
        order: &[String],
        result: &Result<LeaseView, LeaseError>,
    ) -> bool {
        let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        match result {
            Ok(view) => {
                if !search.reused {
                    recent.keep(search.filter.clone(), search.offers, search.at);
                }
                // Those asked before the winner refused or failed just now, and the
                // winner's GPUs are taken: the next run asks others first.
                let asked_before: Vec<String> = order
                    .iter()
                    .take_while(|p| **p != view.provider)
                    .cloned()
                    .collect();
                let leased: Vec<String> = view.gpus.iter().map(|g| g.uuid.clone()).collect();
                recent.granted(
                    &search.filter,
                    search.at,
                    &asked_before,
                    &view.provider,
                    &leased,
                );
                false
            }
            Err(
                LeaseError::NoProviders(_) | LeaseError::AllRefused(_) | LeaseError::Queued { .. },
            ) if search.reused => {
                recent.forget(&search.filter, search.at);
                true
            }
            Err(_) => {
                recent.forget(&search.filter, search.at);
                false
            }
        }
    }

    /// Asks each candidate in turn until one grants the lease; otherwise says who
    /// queued it (soonest start first) and who refused.
    async fn ask_in_turn(
        &self,
        candidates: Vec<Candidate>,
        spec: &LeaseSpec,
        max_price: Option<u64>,
        accepting: &(dyn Fn(PeerId) + Send + Sync),
    ) -> Result<LeaseView, LeaseError> {
        let mut refusals = Vec::new();
        let mut queued = Vec::new();
        for Candidate {
            peer,
            addrs,
            advertised,
        } in candidates
        {
            let max_price = match (max_price, advertised.as_ref().map(|a| a.price)) {
                (Some(m), Some(a)) => Some(m.min(a)),
                (m, a) => m.or(a),
            };
            let provider = (peer, addrs, advertised.as_ref());
            match self
                .negotiate_with(provider, spec, max_price, accepting)
                .await?
            {
                Ok(view) => return Ok(view),
                Err(NotGranted::Refused(why)) => refusals.push((peer.to_string(), why)),
                Err(NotGranted::Queued(place)) => queued.push((peer.to_string(), place)),
            }
        }
        if queued.is_empty() {
            return Err(LeaseError::AllRefused(refusals));
        }
        // Soonest start first.
        queued.sort_by_key(|(_, q)| (q.estimated_start_ms.unwrap_or(u64::MAX), q.position));
        Err(LeaseError::Queued {
            queued,
            refused: refusals,
        })
    }

    /// Negotiates with one provider (where to reach it, what it advertised): the
    /// request, its offer checked, our acceptance (`accepting` told as it goes out), and
    /// the lease recorded. When the provider's terms can be foreseen from its advert,
    /// the request carries them, countersigned, and a provider that would offer exactly
    /// those grants the lease in one round trip; one that offers other terms is answered
    /// as any offer is, and one that predates proposals gets the request alone.
    async fn negotiate_with(
        &self,
        (peer, addrs, advertised): (PeerId, Vec<Multiaddr>, Option<&ProviderAdvert>),
        spec: &LeaseSpec,
        max_price: Option<u64>,
        accepting: &(dyn Fn(PeerId) + Send + Sync),
    ) -> Result<Result<LeaseView, NotGranted>, NodeError> {
        let req = self.lease_request(spec, max_price);
        let foreseen = advertised.and_then(|a| propose::foreseen_terms(&req, peer, a, now_ms()));
        let offer = match foreseen {
            Some(terms) => {
                accepting(peer);
                let proposed = self.propose(peer, addrs.clone(), &req, terms).await;
                if !matches!(proposed, Ok(Proposed::Decided(Ok(_)))) {
                    // Its advert did not foresee the answer: ask the loop next time.
                    self.reached().forget(&peer);
                }
                match proposed? {
                    Proposed::Decided(view) => return Ok(view),
                    Proposed::Offered(offer) => offer,
                    Proposed::Unheard => self.ask_offer(peer, addrs.clone(), &req).await?,
                }
            }
            None => {
                self.reached().forget(&peer);
                self.ask_offer(peer, addrs.clone(), &req).await?
            }
        };
        let (terms, provider_sig) = match offer {
            Ok(offer) => offer,
            Err(not) => return Ok(Err(not)),
        };
        if let Err(r) = check_offer(&req, &peer, &terms, &provider_sig, now_ms()) {
            return Ok(Err(NotGranted::Refused(format!(
                "offer refused: {}",
                r.message
            ))));
        }
        // Again when it was told as the proposal went out: the connection may have
        // opened only for that proposal (an earlier opening is replaced).
        accepting(peer);
        let requester_sig = match self.accept(peer, addrs, &terms, &provider_sig).await? {
            Ok(sig) => sig,
            Err(not) => return Ok(Err(not)),
        };
        self.record(terms, provider_sig, requester_sig).await
    }

    fn reached(&self) -> std::sync::MutexGuard<'_, reached::Reached> {
        self.reached.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a lease both parties signed (the provider's signature checked, ours made
    /// here) and gives its view.
    async fn record(
        &self,
        terms: LeaseTerms,
        provider_sig: Vec<u8>,
        requester_sig: Vec<u8>,
    ) -> Result<Result<LeaseView, NotGranted>, NodeError> {
        let record = self
            .client
            .record_lease(terms, provider_sig, requester_sig)
            .await?;
        Ok(record
            .map(|r| LeaseView::with_signatures(&r, (true, true)))
            .map_err(|e| NotGranted::Refused(e.to_string())))
    }

    /// Sends `req` with the `terms` we foresaw, countersigned: the lease when `peer`
    /// granted them, its offer when it offers other terms, or that it did not
    /// understand the proposal (a provider that predates them).
    async fn propose(
        &self,
        peer: PeerId,
        addrs: Vec<Multiaddr>,
        req: &LeaseRequest,
        terms: LeaseTerms,
    ) -> Result<Proposed, NodeError> {
        let requester_sig = match terms.sign(&self.keypair) {
            Ok(s) => s,
            Err(e) => return Ok(Proposed::Decided(Err(NotGranted::Refused(e.to_string())))),
        };
        let proposal = Proposal {
            request: req.clone(),
            terms: terms.clone(),
            requester_sig,
        };
        let answer = self
            .retrying(peer, addrs.clone(), |addrs| {
                Box::pin(self.client.propose_lease(peer, addrs, proposal.clone()))
            })
            .await?;
        let answer = match answer {
            // Granted, checked and recorded by the loop as the answer arrived.
            Ok(ProposalReply::Recorded(record)) => {
                let taken = record
                    .map(|r| LeaseView::with_signatures(&r, (true, true)))
                    .map_err(|e| NotGranted::Refused(e.to_string()));
                if taken.is_err() {
                    // The provider holds a lease we could not record: it is told to
                    // let it go.
                    self.withdraw(peer, addrs, terms.lease_id).await;
                }
                return Ok(Proposed::Decided(taken));
            }
            Ok(ProposalReply::Answered(answer)) => Ok(answer),
            Err(e) => Err(e),
        };
        Ok(match answer {
            // A grant the loop did not take: its signature is not the provider's over
            // the proposed terms.
            Ok(LeaseReply::Granted { lease_id, .. }) if lease_id == terms.lease_id => {
                self.withdraw(peer, addrs, lease_id).await;
                Proposed::Decided(Err(NotGranted::Refused(
                    "grant refused: the provider's signature does not verify over the proposed terms"
                        .into(),
                )))
            }
            Ok(LeaseReply::Offer {
                terms,
                provider_sig,
            }) => Proposed::Offered(Ok((terms, provider_sig))),
            Ok(LeaseReply::Queued(place)) => Proposed::Offered(Err(NotGranted::Queued(place))),
            Ok(LeaseReply::Rejected(r)) if r.code == RejectCode::Malformed => Proposed::Unheard,
            other => Proposed::Offered(Err(NotGranted::from_answer(other))),
        })
    }

    /// Cancels, as its requester, a lease `peer` granted that this node did not take
    /// (its grant did not verify, or could not be recorded), so the provider does not
    /// hold it, unused, until its end. Its answer changes nothing here.
    async fn withdraw(&self, peer: PeerId, addrs: Vec<Multiaddr>, lease_id: LeaseId) {
        let cancellation = Cancellation {
            lease_id,
            by: self.peer_id,
            at_ms: now_ms(),
        };
        let Ok(signature) = cancellation.sign(&self.keypair) else {
            return;
        };
        let message = LeaseMessage::Cancel {
            cancellation,
            signature,
        };
        if let Err(e) = self.send_lease(peer, addrs, message).await {
            tracing::debug!(%peer, lease = %lease_id, "cannot withdraw from a refused grant: {e}");
        }
    }

    /// The request for `spec` at `max_price`, sent now and valid for [`REQUEST_TTL_MS`].
    fn lease_request(&self, spec: &LeaseSpec, max_price: Option<u64>) -> LeaseRequest {
        let now = now_ms();
        LeaseRequest {
            version: LEASE_VERSION,
            requester: self.peer_id,
            requester_key: self.keypair.public().encode_protobuf(),
            nonce: rand::random(),
            requirements: Requirements {
                gpus: spec.gpus,
                gpu_model: spec.gpu_model.clone(),
                gpu_slice: spec.gpu_slice.clone(),
                min_gpu_mem_bytes: spec.min_gpu_mem_bytes,
                cpus: spec.cpus,
                mem_bytes: spec.mem_bytes,
                backend: spec.backend.clone(),
                kind: spec.kind,
            },
            duration_ms: spec.duration_ms,
            max_price_per_gpu_hour_millicredits: max_price,
            sent_at_ms: now,
            expires_at_ms: now + REQUEST_TTL_MS,
            ticket: spec.ticket,
            start_at_ms: spec.start_at_ms,
        }
    }

    /// Sends `req` to `peer`: its offer (terms and signature), or why there is none.
    async fn ask_offer(
        &self,
        peer: PeerId,
        addrs: Vec<Multiaddr>,
        req: &LeaseRequest,
    ) -> Result<Result<(LeaseTerms, Vec<u8>), NotGranted>, NodeError> {
        let answer = self
            .send_lease(peer, addrs, LeaseMessage::Request(req.clone()))
            .await?;
        Ok(match answer {
            Ok(LeaseReply::Offer {
                terms,
                provider_sig,
            }) => Ok((terms, provider_sig)),
            Ok(LeaseReply::Queued(place)) => Err(NotGranted::Queued(place)),
            other => Err(NotGranted::from_answer(other)),
        })
    }

    /// Countersigns the checked offer and sends the acceptance: our signature once
    /// `peer` activated the lease, or why it did not.
    async fn accept(
        &self,
        peer: PeerId,
        addrs: Vec<Multiaddr>,
        terms: &LeaseTerms,
        provider_sig: &[u8],
    ) -> Result<Result<Vec<u8>, NotGranted>, NodeError> {
        let requester_sig = match terms.sign(&self.keypair) {
            Ok(s) => s,
            Err(e) => return Ok(Err(NotGranted::Refused(e.to_string()))),
        };
        let accept = LeaseMessage::Accept {
            terms: terms.clone(),
            provider_sig: provider_sig.to_vec(),
            requester_sig: requester_sig.clone(),
        };
        Ok(match self.send_lease(peer, addrs, accept).await? {
            Ok(LeaseReply::Activated { lease_id }) if lease_id == terms.lease_id => {
                Ok(requester_sig)
            }
            other => Err(NotGranted::from_answer(other)),
        })
    }
}

/// The most `spec` may cost, millicredits per GPU-hour, once it is known to ask for a
/// duration and a usable price.
fn price_limit(spec: &LeaseSpec) -> Result<Option<u64>, LeaseError> {
    if spec.duration_ms == 0 {
        return Err(LeaseError::Invalid(
            "a lease needs a duration, e.g. --duration 30m".into(),
        ));
    }
    match spec.max_price {
        Some(p) if !(p.is_finite() && p >= 0.0) => {
            Err(LeaseError::Invalid(format!("invalid maximum price {p}")))
        }
        Some(p) => Ok(Some((p * 1000.0).round() as u64)),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loop_client::Command;
    use crate::views::{OfferSearch, OfferView};
    use gpunode_protocol::advert::OfferFilter;
    use std::time::Instant;
    use tokio::sync::mpsc;

    pub(super) fn offer_at(peer: PeerId, addrs: &[&str]) -> OfferView {
        OfferView {
            peer_id: peer.to_string(),
            gpus: Vec::new(),
            cpu_cores: 1,
            ram_bytes: 0,
            backends: Vec::new(),
            price_per_gpu_hour: 0.0,
            simulated: true,
            seq: 3,
            issued_at_ms: 0,
            expires_at_ms: u64::MAX,
            listen_addrs: addrs.iter().map(|a| a.to_string()).collect(),
            rtt_ms: None,
            reputation: None,
        }
    }

    /// A peer that had just started when we read its advert listed addresses it no
    /// longer uses (private ones, before it learnt it is behind NAT): after the dial
    /// fails, the next attempt goes to the addresses of its newest advert.
    #[tokio::test]
    async fn a_failed_dial_is_retried_at_the_addresses_of_the_newest_advert() {
        let (tx, mut rx) = mpsc::channel(8);
        let negotiator = Negotiator::new(LoopClient::new(tx), Keypair::generate_ed25519());
        let provider = PeerId::random();
        let old: Multiaddr = "/ip4/192.168.11.2/udp/4170/quic-v1".parse().unwrap();
        let relayed = "/ip4/198.51.100.2/udp/4170/quic-v1/p2p/12D3KooWLNvLPJoMh3H4NbzvY77QWRydafF2jZTbs1WwV9ppmj9g/p2p-circuit";
        let lease_id = LeaseId([7; 16]);
        let fake_loop = tokio::spawn(async move {
            let mut dialled = Vec::new();
            while let Some(command) = rx.recv().await {
                match command {
                    Command::SendLease { addrs, reply, .. } => {
                        dialled.push(addrs);
                        let answer = if dialled.len() == 1 {
                            Err(LeaseSendError {
                                peer: provider,
                                reason: "Handshake with the remote timed out".into(),
                                transport: true,
                            })
                        } else {
                            Ok(LeaseReply::Cancelled { lease_id })
                        };
                        let _ = reply.send(answer);
                    }
                    Command::IsConnected { reply, .. } => {
                        let _ = reply.send(false);
                    }
                    Command::FindAdverts { reply, .. } => {
                        let _ = reply.send(OfferSearch {
                            offers: vec![offer_at(provider, &[relayed])],
                            providers: 1,
                            dht_requests: 1,
                        });
                    }
                    other => panic!("unexpected command {other:?}"),
                }
            }
            dialled
        });
        let message = LeaseMessage::Cancel {
            cancellation: Cancellation {
                lease_id,
                by: negotiator.peer_id,
                at_ms: 0,
            },
            signature: Vec::new(),
        };
        let answer = negotiator
            .send_lease(provider, vec![old.clone()], message)
            .await
            .unwrap();
        assert_eq!(answer, Ok(LeaseReply::Cancelled { lease_id }));
        drop(negotiator);
        let dialled = fake_loop.await.unwrap();
        assert_eq!(
            dialled,
            vec![vec![old], vec![relayed.parse::<Multiaddr>().unwrap()]]
        );
    }

    /// A search's answer kept after a lease is used for the next run without a
    /// search; when nobody in it grants the lease, the negotiator forgets it, searches
    /// afresh and asks the fresh answer's providers, and keeps nothing that failed.
    #[tokio::test]
    async fn a_reused_search_that_grants_nothing_is_forgotten_and_searched_afresh() {
        let (tx, mut rx) = mpsc::channel(8);
        let negotiator = Negotiator::new(LoopClient::new(tx), Keypair::generate_ed25519());
        let kept_provider = PeerId::random();
        let fresh_provider = PeerId::random();
        let spec = LeaseSpec::new(0, 60_000);
        let filter = OfferFilter {
            gpus: Some(0),
            backend: Some(spec.backend.clone()),
            ..OfferFilter::default()
        };
        let addr = "/ip4/127.0.0.1/udp/4170/quic-v1";
        negotiator.recent.lock().unwrap().keep(
            filter.clone(),
            vec![offer_at(kept_provider, &[addr])],
            Instant::now(),
        );
        let full = || LeaseReply::Rejected(Rejection::new(RejectCode::NoCapacity, "full"));
        let fake_loop = tokio::spawn(async move {
            let (mut searches, mut asked) = (0, Vec::new());
            while let Some(command) = rx.recv().await {
                match command {
                    Command::FindOffers { reply, .. } => {
                        searches += 1;
                        let _ = reply.send(OfferSearch {
                            offers: vec![offer_at(fresh_provider, &[addr])],
                            providers: 1,
                            dht_requests: 1,
                        });
                    }
                    Command::SendLease { peer, reply, .. } => {
                        asked.push(peer);
                        let _ = reply.send(Ok(full()));
                    }
                    Command::ProposeLease { peer, reply, .. } => {
                        asked.push(peer);
                        let _ = reply.send(Ok(ProposalReply::Answered(full())));
                    }
                    Command::IsConnected { reply, .. } => {
                        let _ = reply.send(false);
                    }
                    other => panic!("unexpected command {other:?}"),
                }
            }
            (searches, asked)
        });
        let err = negotiator
            .request_lease(spec)
            .await
            .expect_err("everyone refuses");
        assert!(matches!(err, LeaseError::AllRefused(_)), "{err}");
        let now = Instant::now();
        assert!(negotiator
            .recent
            .lock()
            .unwrap()
            .get(&filter, now)
            .is_none());
        drop(negotiator);
        let (searches, asked) = fake_loop.await.unwrap();
        // The kept answer first, without a search; then one search and its provider.
        assert_eq!(asked, vec![kept_provider, fresh_provider]);
        assert_eq!(searches, 1);
    }

    /// The lease messages a requester sent to a fake provider (with [`provider_key`])
    /// whose answer to each is `answer`, with that provider's advert known and a
    /// connection up (as for `--peer` with a provider in view), and how many leases the
    /// requester recorded (in a real book).
    async fn negotiate_against(
        answer: impl Fn(&LeaseMessage) -> LeaseReply + Send + 'static,
    ) -> (Result<LeaseView, LeaseError>, Vec<LeaseMessage>, usize) {
        negotiate_recording(answer, record_in).await
    }

    /// As [`negotiate_against`], with the requester's leases stored by `store` (the
    /// count is of those it stored).
    async fn negotiate_recording(
        answer: impl Fn(&LeaseMessage) -> LeaseReply + Send + 'static,
        store: impl Fn(
                &mut crate::lease::LeaseBook,
                LeaseTerms,
                Vec<u8>,
                Vec<u8>,
            ) -> Result<crate::lease::LeaseRecord, crate::lease::LeaseOpError>
            + Send
            + 'static,
    ) -> (Result<LeaseView, LeaseError>, Vec<LeaseMessage>, usize) {
        let (negotiator, mut rx, me, spec) = asking_the_fake_provider();
        let fake_loop = tokio::spawn(async move {
            let (mut sent, mut recorded) = (Vec::new(), 0);
            let mut book = requester_book(me);
            while let Some(command) = rx.recv().await {
                match command {
                    Command::Reach { reply, .. } => {
                        let _ = reply.send((true, Some(fake_provider_advert())));
                    }
                    Command::SendLease { message, reply, .. } => {
                        let _ = reply.send(Ok(answer(&message)));
                        sent.push(*message);
                    }
                    // As the real loop does (`proposal_outcome`): a grant of the
                    // proposed terms that verifies is recorded, anything else goes
                    // back as it came.
                    Command::ProposeLease {
                        peer,
                        proposal,
                        reply,
                        ..
                    } => {
                        let message = proposal.message();
                        let outcome = proposal_outcome(
                            &peer,
                            &peer,
                            *proposal,
                            answer(&message),
                            |t, p, r| {
                                let stored = store(&mut book, t, p, r);
                                recorded += usize::from(stored.is_ok());
                                stored
                            },
                        );
                        let _ = reply.send(Ok(outcome));
                        sent.push(message);
                    }
                    Command::RecordLease {
                        terms,
                        provider_sig,
                        requester_sig,
                        reply,
                    } => {
                        let stored = store(&mut book, *terms, provider_sig, requester_sig);
                        recorded += usize::from(stored.is_ok());
                        let _ = reply.send(stored);
                    }
                    other => panic!("unexpected command {other:?}"),
                }
            }
            (sent, recorded)
        });
        let result = negotiator.request_lease(spec).await;
        drop(negotiator);
        let (sent, recorded) = fake_loop.await.unwrap();
        (result, sent, recorded)
    }

    /// A negotiator reaching a fake loop (the receiver), its peer id, and a spec that
    /// names the fake provider (with [`provider_key`]).
    fn asking_the_fake_provider() -> (Negotiator, mpsc::Receiver<Command>, PeerId, LeaseSpec) {
        let (tx, rx) = mpsc::channel(8);
        let key = Keypair::generate_ed25519();
        let me = key.public().to_peer_id();
        let negotiator = Negotiator::new(LoopClient::new(tx), key);
        let mut spec = LeaseSpec::new(0, 60_000);
        spec.peer = Some(provider_key().public().to_peer_id().to_string());
        (negotiator, rx, me, spec)
    }

    /// An empty requester's book for `me`.
    fn requester_book(me: PeerId) -> crate::lease::LeaseBook {
        crate::lease::LeaseBook::new(
            me,
            crate::lease::LeasePolicy::default(),
            crate::lease::Capacity::default(),
        )
    }

    /// The fake provider's advert: the default price, no GPUs.
    fn fake_provider_advert() -> ProviderAdvert {
        ProviderAdvert {
            price: crate::lease::LeasePolicy::default().price_per_gpu_hour_millicredits,
            gpus: Vec::new(),
        }
    }

    /// Records a lease as the requester's loop does, in `book`.
    fn record_in(
        book: &mut crate::lease::LeaseBook,
        terms: LeaseTerms,
        provider_sig: Vec<u8>,
        requester_sig: Vec<u8>,
    ) -> Result<crate::lease::LeaseRecord, crate::lease::LeaseOpError> {
        let id = terms.lease_id;
        book.record_requester_lease(terms, provider_sig, requester_sig, now_ms())
            .map(|()| book.get(&id).cloned().expect("recorded"))
    }

    /// The fake provider's key in the negotiations above.
    fn provider_key() -> &'static Keypair {
        static KEY: std::sync::OnceLock<Keypair> = std::sync::OnceLock::new();
        KEY.get_or_init(Keypair::generate_ed25519)
    }

    /// Lease after lease from one named provider asks the loop where it is once, not
    /// once a lease; after an answer its advert did not foresee (a refusal here, which
    /// stands: the provider is not asked twice), or after a second, the loop is asked
    /// again.
    #[tokio::test(start_paused = true)]
    async fn a_provider_reached_a_moment_ago_is_not_asked_of_the_loop_again() {
        let (negotiator, mut rx, me, spec) = asking_the_fake_provider();
        let refuse = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reaches = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (refusing, reached) = (refuse.clone(), reaches.clone());
        tokio::spawn(async move {
            let mut book = requester_book(me);
            while let Some(command) = rx.recv().await {
                match command {
                    Command::Reach { reply, .. } => {
                        reached.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        let _ = reply.send((true, Some(fake_provider_advert())));
                    }
                    Command::ProposeLease {
                        peer,
                        proposal,
                        reply,
                        ..
                    } => {
                        let answer = if refusing.load(std::sync::atomic::Ordering::SeqCst) {
                            LeaseReply::Rejected(gpunode_protocol::lease::Rejection::new(
                                RejectCode::NoCapacity,
                                "busy",
                            ))
                        } else {
                            LeaseReply::Granted {
                                lease_id: proposal.terms.lease_id,
                                provider_sig: proposal.terms.sign(provider_key()).unwrap(),
                            }
                        };
                        let outcome =
                            proposal_outcome(&peer, &peer, *proposal, answer, |t, p, r| {
                                record_in(&mut book, t, p, r)
                            });
                        let _ = reply.send(Ok(outcome));
                    }
                    other => panic!("unexpected command {other:?}"),
                }
            }
        });
        let reaches_now = || reaches.load(std::sync::atomic::Ordering::SeqCst);
        for _ in 0..3 {
            negotiator
                .request_lease(spec.clone())
                .await
                .expect("granted");
        }
        assert_eq!(reaches_now(), 1, "three leases, one question to the loop");

        // A refusal stands (the provider is not asked twice), and the advert is
        // forgotten.
        refuse.store(true, std::sync::atomic::Ordering::SeqCst);
        negotiator
            .request_lease(spec.clone())
            .await
            .expect_err("refused");
        assert_eq!(reaches_now(), 1);
        refuse.store(false, std::sync::atomic::Ordering::SeqCst);
        negotiator
            .request_lease(spec.clone())
            .await
            .expect("granted");
        assert_eq!(reaches_now(), 2, "asked again after the refusal");

        tokio::time::advance(reached::REACHED_FRESH).await;
        negotiator
            .request_lease(spec.clone())
            .await
            .expect("granted");
        assert_eq!(reaches_now(), 3, "asked again after a second");
    }

    /// A provider that grants the proposal: one message, and the lease recorded with
    /// the proposed terms and the provider's signature.
    #[tokio::test]
    async fn a_granted_proposal_is_a_lease_after_one_message() {
        let (result, sent, recorded) = negotiate_against(|m| match m {
            LeaseMessage::Propose { terms, .. } => LeaseReply::Granted {
                lease_id: terms.lease_id,
                provider_sig: terms.sign(provider_key()).unwrap(),
            },
            other => panic!("unexpected {other:?}"),
        })
        .await;
        let view = result.expect("granted");
        let [LeaseMessage::Propose { terms, .. }] = &sent[..] else {
            panic!("expected one proposal, sent {sent:?}");
        };
        assert_eq!(view.lease_id, terms.lease_id.to_string());
        assert_eq!(recorded, 1);
    }

    /// A grant whose signature is not the provider's (over the proposed terms) is
    /// refused and never recorded, and the provider is told to let the lease go.
    #[tokio::test]
    async fn a_grant_signed_by_another_key_is_refused_and_withdrawn() {
        let (result, sent, recorded) = negotiate_against(|m| match m {
            LeaseMessage::Propose { terms, .. } => LeaseReply::Granted {
                lease_id: terms.lease_id,
                provider_sig: terms.sign(&Keypair::generate_ed25519()).unwrap(),
            },
            LeaseMessage::Cancel { cancellation, .. } => LeaseReply::Cancelled {
                lease_id: cancellation.lease_id,
            },
            other => panic!("unexpected {other:?}"),
        })
        .await;
        let err = result.expect_err("a forged grant");
        assert!(err.to_string().contains("signature"), "{err}");
        assert_eq!(recorded, 0);
        assert_withdrawn(&sent);
    }

    /// `sent` is a proposal, then the requester's signed cancellation of its lease.
    fn assert_withdrawn(sent: &[LeaseMessage]) {
        let [LeaseMessage::Propose { terms, .. }, LeaseMessage::Cancel {
            cancellation,
            signature,
        }] = sent
        else {
            panic!("expected the proposal and a cancellation, sent {sent:?}");
        };
        assert_eq!(cancellation.lease_id, terms.lease_id);
        assert_eq!(cancellation.by, terms.requester);
        cancellation
            .verify(signature)
            .expect("signed by the requester");
    }

    /// A grant the requester cannot record (its store fails) is not a lease: the
    /// negotiation fails with the store's error and the provider is told, with the
    /// requester's signature, to let the lease go.
    #[tokio::test]
    async fn a_grant_that_cannot_be_recorded_is_withdrawn() {
        let (result, sent, recorded) = negotiate_recording(
            |m| match m {
                LeaseMessage::Propose { terms, .. } => LeaseReply::Granted {
                    lease_id: terms.lease_id,
                    provider_sig: terms.sign(provider_key()).unwrap(),
                },
                LeaseMessage::Cancel { cancellation, .. } => LeaseReply::Cancelled {
                    lease_id: cancellation.lease_id,
                },
                other => panic!("unexpected {other:?}"),
            },
            |_, _, _, _| Err(crate::lease::LeaseOpError::Store("disk full".into())),
        )
        .await;
        let err = result.expect_err("nothing recorded");
        assert!(err.to_string().contains("disk full"), "{err}");
        assert_eq!(recorded, 0);
        assert_withdrawn(&sent);
    }

    /// A provider that predates proposals refuses one as malformed: the requester
    /// sends the same request alone (same nonce), accepts the offer and records it.
    #[tokio::test]
    async fn a_provider_that_cannot_read_proposals_gets_the_request_alone() {
        let (result, sent, recorded) = negotiate_against(|m| match m {
            LeaseMessage::Propose { .. } => LeaseReply::Rejected(Rejection::new(
                RejectCode::Malformed,
                "cannot decode: unknown variant",
            )),
            LeaseMessage::Request(req) => {
                let mut book = crate::lease::LeaseBook::new(
                    provider_key().public().to_peer_id(),
                    crate::lease::LeasePolicy::default(),
                    crate::lease::Capacity::default(),
                );
                let (terms, provider_sig) = book
                    .on_request(
                        &req.requester,
                        req,
                        LeaseId([4; 16]),
                        provider_key(),
                        now_ms(),
                    )
                    .expect("offer");
                LeaseReply::Offer {
                    terms,
                    provider_sig,
                }
            }
            LeaseMessage::Accept { terms, .. } => LeaseReply::Activated {
                lease_id: terms.lease_id,
            },
            other => panic!("unexpected {other:?}"),
        })
        .await;
        let view = result.expect("leased the old way");
        assert_eq!(view.lease_id, LeaseId([4; 16]).to_string());
        let [LeaseMessage::Propose { request, .. }, LeaseMessage::Request(again), LeaseMessage::Accept { .. }] =
            &sent[..]
        else {
            panic!("expected a proposal, the request, an acceptance; sent {sent:?}");
        };
        assert_eq!(request, again, "the same request, nonce and all");
        assert_eq!(recorded, 1);
    }
}
