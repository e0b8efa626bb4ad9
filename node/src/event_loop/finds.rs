//! Offer queries: look up the providers of a capability key (of each shard of a shared
//! key, in parallel, each answer counted for every shard it names) and, as each
//! provider is
//! named, ask it for its advert directly (in parallel, over the connection the lookup
//! opened or a new one). A provider that cannot be reached now is left out (a lease
//! with it would fail too); one that does not serve its advert (an older build) is
//! looked up in the DHT instead. The provider lookup stops once [`SETTLED_ANSWERS`]
//! responses named providers, the last [`QUIET_ANSWERS`] named nobody new (unless one
//! was full, see [`FULL_ANSWER`]) and the [`CLOSEST_ANSWERED`] peers nearest the key
//! have answered, or once its responses pause, or once the query has named
//! [`MAX_PROVIDERS_PER_FIND`] providers; the query answers
//! when every advert is in (or a short grace after the first, when some providers stay
//! silent) with the adverts that match.
//! A peer our last dial to failed is not asked again at the same addresses: its advert
//! comes from the DHT, which holds its newest.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use gpunode_protocol::advert::{
    advert_record_key, peer_of_advert_key, shard_of, verify_advert, Advert, AdvertError,
    OfferFilter,
};
use gpunode_protocol::time::now_ms;
use libp2p::kad::{self, QueryId, RecordKey};
use libp2p::request_response::{self, OutboundRequestId};
use libp2p::PeerId;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::{EventLoop, FIND_TIMEOUT};
use crate::adverts::fetch::{AdvertAnswer, AdvertQuery};
use crate::views::{OfferSearch, OfferView};

/// Responses naming providers after which the provider lookup may stop, once the last
/// [`QUIET_ANSWERS`] of them named nobody new: the nodes near the key agree. The first
/// answers come from peers the lookup knew at its start, often a little away from the
/// key: such a peer was among the closest when the network was smaller and holds the
/// records of the providers that published then, not of later ones (whose walks found
/// closer peers). Three of those agreeing made about one lookup in 30 at 200 nodes miss a
/// provider or two, five (the last three quiet) one in 200; ten, the last five quiet,
/// missed none in 300 at 100 and 200 nodes, about half of a full walk's answers (a whole
/// walk, none missed either, waits on the slowest of the closest 20).
const SETTLED_ANSWERS: u32 = 10;
const QUIET_ANSWERS: u32 = 5;
/// The peers nearest the key (of those the lookup knows) that must have answered, failed
/// or timed out before agreement may stop it. Answers from further out agree on the
/// providers whose records reached them: at 200 nodes, lookups stopped on agreement alone
/// after 29 requests had missed four providers whose records only nodes 4th to 10th and
/// 13th nearest the key held (`docs/benchmarks.md`, "Publishing once more when the
/// network stops growing"). A near peer that is dead or slow is waited for at most
/// [`ANSWER_GAP`] past agreement: meanwhile Kademlia asks peers further out, whose
/// answers would otherwise keep the lookup going until the dead peer's dial failed.
/// It is also the most requests a lookup of one key keeps in flight once its walk has
/// stalled (`network.rs`): a walk stopped at these peers' answers has no use for more
/// (a shard's walk keeps fewer, [`SHARD_WALK_PARALLELISM`]).
pub(crate) const CLOSEST_ANSWERED: usize = 8;
/// A response naming this many providers may have left some out: a Kademlia node
/// answers with at most this many of the providers it holds for a key (a random choice,
/// see `crate::dht_store`). Once one does, the lookup does not stop early on agreement
/// but asks every node near the key, each naming its own random choice.
const FULL_ANSWER: usize = crate::network::PROVIDER_ANSWER_LIMIT;
/// Responses of its own a walk waits for before the nearest peers' answers may stop it
/// (Kademlia's α for a shard's walk, [`SHARD_WALK_PARALLELISM`]): they come from the
/// peers nearest its key that the node knows, and name the peers nearer still, which
/// the walk must then hear from (directly or through another walk). A peer that
/// answered another walk is not asked (its answer covered this key's providers), so
/// without these a walk could count as answered peers whose neighbours near its own key
/// it never learnt.
const OWN_ANSWERS: u32 = 2;
/// Requests each walk of a shared key's query keeps in flight, and once stalled
/// (Kademlia's α is 3, and a stalled provider walk's burst [`CLOSEST_ANSWERED`]): every
/// answer names the providers of every shard the answering node holds, so eight walks
/// asking three to eight peers at once mostly asked the same peers. With two, a walk's
/// next peer has often answered another walk already and is skipped, and one dead or
/// slow peer does not hold the walk: at 24 nodes a query sent about 50 requests
/// instead of 74 (`docs/benchmarks.md`, "Answers that cover every shard").
const SHARD_WALK_PARALLELISM: std::num::NonZeroUsize =
    std::num::NonZeroUsize::new(2).expect("nonzero");
/// Most peers a query remembers as having answered for all its keys at once.
const ANSWERED_PEERS_MAX: usize = 1024;
/// How long the provider lookup may go without a new response, once one came, before it
/// stops: the peers it still waits for are slow or gone (a dead peer's QUIC handshake
/// takes seconds to time out).
const ANSWER_GAP: Duration = Duration::from_millis(250);
/// How long a query waits for silent providers once the lookup has settled and at least
/// one advert is in (a dead provider's dial can take seconds to fail): three times as
/// long as the first advert took, within these bounds.
const STRAGGLER_GRACE_MIN: Duration = Duration::from_millis(100);
const STRAGGLER_GRACE_MAX: Duration = Duration::from_secs(1);
/// How long a query started before the routing table has any peer waits for one.
const BOOTSTRAP_WAIT: Duration = Duration::from_secs(5);
/// Most providers one query asks for adverts. Once it has named this many, every walk of
/// the query stops (one answer of 64, `network::PROVIDER_ANSWER_LIMIT`, does it); a
/// hostile responder naming made-up providers cannot make a query dial more, though it
/// can crowd honest ones out (their adverts fail verification and are left out).
pub(super) const MAX_PROVIDERS_PER_FIND: usize = 64;

/// Whether a provider lookup whose answers agree may stop, `since_agreed` after they first
/// did: once the [`CLOSEST_ANSWERED`] nearest peers have answered, or [`ANSWER_GAP`] on.
fn may_stop(nearest_answered: bool, since_agreed: Duration) -> bool {
    nearest_answered || since_agreed >= ANSWER_GAP
}

/// One provider lookup of an offer query: a query for a shared key makes one per shard
/// (`gpunode_protocol::advert::SHARED_KEY_BITS`). A node answers a lookup of one shard
/// with the providers it holds of every shard (`crate::dht_store`), so each answer is
/// counted for every shard whose providers it names ([`PendingFind::agreements`]), and
/// a walk may stop once its shard's answers agree and the peers nearest its key have
/// answered it or, with every shard's providers, another walk.
struct ProviderWalk {
    query: QueryId,
    /// Its shard (its place in [`OfferFilter::lookup_keys`]); 0 for a single key.
    shard: usize,
    /// Responses it had of its own.
    own_answers: u32,
    /// When its shard's answers first agreed (it may stop once the nearest answered).
    agreed_at: Option<Instant>,
    /// When it stops if no further response comes.
    settles_at: Option<Instant>,
}

impl ProviderWalk {
    fn new(query: QueryId, shard: usize) -> ProviderWalk {
        ProviderWalk {
            query,
            shard,
            own_answers: 0,
            agreed_at: None,
            settles_at: None,
        }
    }
}

/// What one provider lookup's responses said so far.
#[derive(Debug, Default)]
struct Agreement {
    /// Responses that named providers, and how many in a row named nobody new.
    answers: u32,
    quiet_answers: u32,
    /// A response named [`FULL_ANSWER`] providers: others may exist.
    answer_was_full: bool,
}

impl Agreement {
    /// Takes note of a response that named `named` providers of this key (or shard),
    /// `new` of them not named before to the query, in an answer that was `full`.
    fn answered(&mut self, named: usize, new: bool, full: bool) {
        self.answer_was_full |= full;
        if named > 0 {
            self.answers += 1;
            if new {
                self.quiet_answers = 0;
            } else {
                self.quiet_answers += 1;
            }
        }
    }

    /// Whether the answers agree: enough named providers, the last few nobody new.
    fn agrees(&self) -> bool {
        !self.answer_was_full
            && self.answers >= SETTLED_ANSWERS
            && self.quiet_answers >= QUIET_ANSWERS
    }
}

/// An offer query in progress.
pub(super) struct PendingFind {
    filter: OfferFilter,
    reply: oneshot::Sender<OfferSearch>,
    providers: HashSet<PeerId>,
    dht_requests: u32,
    /// Responses that named providers, over all its walks.
    answers: u32,
    /// Its provider lookups still running; none once they all ended.
    walks: Vec<ProviderWalk>,
    /// What the answers said of each key looked up (each shard of a shared key).
    agreements: Vec<Agreement>,
    /// Peers whose answer named every provider they hold of every key looked up (at
    /// most [`ANSWERED_PEERS_MAX`]): a walk counts them among its nearest as answered.
    answered_peers: HashSet<PeerId>,
    /// Who answered so far (this node's own store as `None`; at most
    /// [`ANSWERED_PEERS_MAX`]): an answer repeated is counted once.
    heard_from: HashSet<Option<PeerId>>,
    providers_done: bool,
    /// Peers named by the caller, not by a provider lookup: one that cannot be reached
    /// directly may have no address we know but its advert's, so ask the DHT.
    named_peers: bool,
    /// Providers we could not reach whose DHT advert we are fetching, to try once more
    /// at the addresses it lists (a provider restarted on a new port).
    readdressing: HashSet<PeerId>,
    retried: HashSet<PeerId>,
    outstanding: usize,
    found: HashMap<PeerId, Advert>,
    started: Instant,
    /// How long the first advert took to arrive, and the provider lookup to end.
    first_advert_after: Option<Duration>,
    lookup_took: Option<Duration>,
    pub(super) deadline: Instant,
}

/// What a query does with a provider named to it.
#[derive(Debug, PartialEq, Eq)]
enum Named {
    /// Ask it for its advert.
    New,
    /// Already asked (or this node itself).
    Known,
    /// The query has asked [`MAX_PROVIDERS_PER_FIND`] providers already.
    OverBound,
}

impl PendingFind {
    /// When the first of its provider lookups stops if no further response comes.
    pub(super) fn lookup_settles_at(&self) -> Option<Instant> {
        self.walks.iter().filter_map(|w| w.settles_at).min()
    }

    /// Takes note of `peer`, named as a provider (`local` is this node).
    fn name(&mut self, peer: PeerId, local: &PeerId) -> Named {
        if peer == *local || self.providers.contains(&peer) {
            Named::Known
        } else if self.providers.len() >= MAX_PROVIDERS_PER_FIND {
            Named::OverBound
        } else {
            self.providers.insert(peer);
            Named::New
        }
    }

    /// How many of `providers` each key of the query's lookup names, and how many of
    /// those it had not named before: a single key's all, a shared key's by shard.
    /// This node itself (`local`) is not counted.
    fn tally(&self, providers: &HashSet<PeerId>, local: &PeerId) -> Vec<(usize, usize)> {
        let mut tally = vec![(0, 0); self.agreements.len()];
        for peer in providers.iter().filter(|p| *p != local) {
            let key = if tally.len() > 1 {
                shard_of(peer) as usize
            } else {
                0
            };
            if let Some((named, new)) = tally.get_mut(key) {
                *named += 1;
                *new += usize::from(!self.providers.contains(peer));
            }
        }
        tally
    }

    /// Counts an answer (tallied by [`Self::tally`]; `full` when it named as many as an
    /// answer may) for each key whose providers it names, once per answering peer (this
    /// node's own store is `None`) unless it names someone new: each of a shared key's
    /// walks is answered from the local store first, and a peer asked by several walks
    /// answers each the same, which must not make one answer look like several agreeing.
    /// A peer whose answer was not full answered for every key of the query.
    fn count_answer(&mut self, source: Option<PeerId>, tally: &[(usize, usize)], full: bool) {
        let names_new = tally.iter().any(|(_, new)| *new > 0);
        let repeat = self.heard_from.contains(&source);
        if repeat && !names_new {
            return;
        }
        if !repeat && self.heard_from.len() < ANSWERED_PEERS_MAX {
            self.heard_from.insert(source);
        }
        for (agreement, (named, new)) in self.agreements.iter_mut().zip(tally) {
            agreement.answered(*named, *new > 0, full);
        }
        if let Some(peer) = source.filter(|_| !full) {
            if self.answered_peers.len() < ANSWERED_PEERS_MAX {
                self.answered_peers.insert(peer);
            }
        }
    }

    /// Whether `peer` was already given its second try; marks it as being given one.
    fn second_try_used(&mut self, peer: PeerId) -> bool {
        if self.retried.contains(&peer) {
            return true;
        }
        self.retried.insert(peer);
        self.readdressing.insert(peer);
        false
    }

    fn new(filter: OfferFilter, reply: oneshot::Sender<OfferSearch>) -> PendingFind {
        PendingFind {
            filter,
            reply,
            providers: HashSet::new(),
            dht_requests: 0,
            answers: 0,
            walks: Vec::new(),
            agreements: Vec::new(),
            answered_peers: HashSet::new(),
            heard_from: HashSet::new(),
            providers_done: false,
            named_peers: false,
            readdressing: HashSet::new(),
            retried: HashSet::new(),
            outstanding: 0,
            found: HashMap::new(),
            started: Instant::now(),
            first_advert_after: None,
            lookup_took: None,
            deadline: Instant::now() + FIND_TIMEOUT,
        }
    }
}

/// How long a failed dial keeps a peer's advert fetches on the DHT.
const UNREACHABLE_FOR: Duration = Duration::from_secs(30);
/// At most this many peers are remembered as unreachable.
const UNREACHABLE_MAX: usize = 4096;

/// Peers our last dial to failed, and when (bounded; entries last [`UNREACHABLE_FOR`]).
#[derive(Debug, Default)]
pub(super) struct Unreachable(HashMap<PeerId, Instant>);

impl Unreachable {
    /// A dial to `peer` failed at `now`.
    pub(super) fn dial_failed(&mut self, peer: PeerId, now: Instant) {
        if self.0.len() >= UNREACHABLE_MAX {
            self.0
                .retain(|_, at| now.duration_since(*at) < UNREACHABLE_FOR);
        }
        if self.0.len() < UNREACHABLE_MAX || self.0.contains_key(&peer) {
            self.0.insert(peer, now);
        }
    }

    /// `peer` is connected.
    pub(super) fn reached(&mut self, peer: &PeerId) {
        self.0.remove(peer);
    }

    /// Whether a dial to `peer` failed within [`UNREACHABLE_FOR`] of `now`.
    pub(super) fn recently(&self, peer: &PeerId, now: Instant) -> bool {
        self.0
            .get(peer)
            .is_some_and(|at| now.duration_since(*at) < UNREACHABLE_FOR)
    }
}

/// Offer queries that arrived while the routing table was still empty.
#[derive(Default)]
pub(super) struct ParkedFinds {
    waiting: Vec<(OfferFilter, oneshot::Sender<OfferSearch>)>,
    until: Option<Instant>,
}

impl ParkedFinds {
    /// When the parked queries start even without a peer.
    pub(super) fn deadline(&self) -> Option<Instant> {
        self.until
    }

    /// Whether any query waits.
    pub(super) fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }
}

/// Stops each walk of `find` whose key's answers agree, once the peers nearest its key
/// have answered (it or, for all keys at once, another walk; and it has had answers
/// of its own, [`OWN_ANSWERS`]) or [`ANSWER_GAP`] after they first agreed. First, each
/// walk of a shared key takes the peers that answered for all keys as answered, and
/// does not ask them (a single key's walk has asked them itself).
/// `ending` is the walk whose last response this was, if it was.
fn stop_agreed_walks(
    find: &mut PendingFind,
    kad: &mut kad::Behaviour<crate::dht_store::DhtStore>,
    ending: (QueryId, bool),
) {
    let shared = find.agreements.len() > 1;
    for walk in &mut find.walks {
        let Some(mut q) = kad.query_mut(&walk.query) else {
            continue;
        };
        if shared {
            q.mark_answered(&find.answered_peers);
        }
        let agrees = find
            .agreements
            .get(walk.shard)
            .is_some_and(Agreement::agrees);
        if !agrees || ending == (walk.query, true) {
            continue;
        }
        let agreed_at = *walk.agreed_at.get_or_insert_with(Instant::now);
        let nearest = walk.own_answers >= OWN_ANSWERS
            && q.closest_answered(CLOSEST_ANSWERED, &find.answered_peers);
        if may_stop(nearest, agreed_at.elapsed()) {
            q.finish();
        }
    }
}

impl EventLoop {
    /// Starts an offer query, or parks it (at most [`BOOTSTRAP_WAIT`]) while the node is
    /// new and knows no peer yet, so a `run` right after start does not find nothing.
    pub(super) fn start_find(&mut self, filter: OfferFilter, reply: oneshot::Sender<OfferSearch>) {
        let young = self.started_at.elapsed() < BOOTSTRAP_WAIT;
        if young && self.routing_table_size() == 0 {
            let until = self.started_at + BOOTSTRAP_WAIT;
            self.parked_finds.until = Some(until);
            self.parked_finds.waiting.push((filter, reply));
            return;
        }
        self.look_up_providers(filter, reply);
    }

    fn look_up_providers(&mut self, filter: OfferFilter, reply: oneshot::Sender<OfferSearch>) {
        let id = self.next_find;
        self.next_find += 1;
        let mut find = PendingFind::new(filter, reply);
        let keys = find.filter.lookup_keys();
        let shared = keys.len() > 1;
        for (shard, key) in keys.into_iter().enumerate() {
            find.agreements.push(Agreement::default());
            let query = self
                .swarm
                .behaviour_mut()
                .kad
                .get_providers(RecordKey::new(&key));
            self.provider_queries.insert(query, id);
            if shared {
                // Each answer covers every shard (see `ProviderWalk`): few requests at a
                // time each, so that a walk's next peer is often one another walk has
                // heard from already, and is skipped.
                if let Some(mut q) = self.swarm.behaviour_mut().kad.query_mut(&query) {
                    q.set_parallelism(SHARD_WALK_PARALLELISM, Some(SHARD_WALK_PARALLELISM));
                }
            }
            find.walks.push(ProviderWalk::new(query, shard));
        }
        self.finds.insert(id, find);
    }

    /// Stops the provider lookups that heard nothing new for [`ANSWER_GAP`]; they end
    /// with the providers named so far.
    pub(super) fn settle_quiet_lookups(&mut self, now: Instant) {
        let quiet: Vec<QueryId> = self
            .finds
            .values_mut()
            .flat_map(|f| f.walks.iter_mut())
            .filter(|w| w.settles_at.is_some_and(|t| t <= now))
            .map(|w| {
                w.settles_at = None;
                w.query
            })
            .collect();
        for query in quiet {
            if let Some(mut q) = self.swarm.behaviour_mut().kad.query_mut(&query) {
                q.finish();
            }
        }
    }

    /// Starts the parked queries: the routing table has a peer, or the wait is over.
    pub(super) fn release_parked_finds(&mut self) {
        self.parked_finds.until = None;
        for (filter, reply) in std::mem::take(&mut self.parked_finds.waiting) {
            self.look_up_providers(filter, reply);
        }
    }

    /// Fetches the adverts of known peers, as the second half of an offer query.
    pub(super) fn start_advert_fetch(
        &mut self,
        peers: Vec<PeerId>,
        reply: oneshot::Sender<OfferSearch>,
    ) {
        let id = self.next_find;
        self.next_find += 1;
        let mut find = PendingFind::new(OfferFilter::default(), reply);
        find.providers_done = true;
        find.named_peers = true;
        self.finds.insert(id, find);
        for peer in peers {
            self.fetch_advert(id, peer);
        }
        self.maybe_complete(id);
    }

    /// Asks `peer` for its advert on behalf of query `id`, once per query.
    fn fetch_advert(&mut self, id: u64, peer: PeerId) {
        let Some(find) = self.finds.get_mut(&id) else {
            return;
        };
        match find.name(peer, &self.local_peer) {
            Named::New => {}
            Named::Known => return,
            Named::OverBound => {
                self.metrics.advert_rejected("too_many_providers");
                return;
            }
        }
        find.outstanding += 1;
        let stale = !self.connections.contains_key(&peer)
            && self.unreachable.recently(&peer, Instant::now());
        tracing::debug!(%peer, from_dht = stale, "fetching an advert");
        if stale {
            // Dialling it again would try the same addresses (those its last advert
            // gave, or the routing table's) and wait out the same timeout.
            self.fetch_advert_from_dht(id, peer);
        } else {
            self.send_advert_request(id, peer);
        }
    }

    fn send_advert_request(&mut self, id: u64, peer: PeerId) {
        let request = self
            .swarm
            .behaviour_mut()
            .advert
            .send_request(&peer, AdvertQuery);
        self.advert_fetches.insert(request, (id, peer));
    }

    /// Looks `peer`'s advert up in the DHT, for a provider that does not serve it.
    fn fetch_advert_from_dht(&mut self, id: u64, peer: PeerId) {
        if !self.finds.contains_key(&id) {
            return;
        }
        let q = self
            .swarm
            .behaviour_mut()
            .kad
            .get_record(RecordKey::new(&advert_record_key(&peer)));
        self.record_queries.insert(q, (id, peer));
    }

    pub(super) fn on_providers(
        &mut self,
        query: QueryId,
        result: Result<kad::GetProvidersOk, kad::GetProvidersError>,
        last: bool,
        requests: u32,
    ) {
        let Some(&id) = self.provider_queries.get(&query) else {
            return;
        };
        if let Ok(kad::GetProvidersOk::FoundProviders {
            providers, source, ..
        }) = result
        {
            let named = providers.len();
            let tally = self
                .finds
                .get(&id)
                .map(|f| f.tally(&providers, &self.local_peer));
            for peer in providers {
                self.fetch_advert(id, peer);
            }
            if let (Some(find), Some(tally)) = (self.finds.get_mut(&id), tally) {
                find.answers += u32::from(named > 0);
                if find.providers.len() >= MAX_PROVIDERS_PER_FIND {
                    // Nobody more would be asked: the query's walks have done their job
                    // (a shared key's eight can name hundreds between them).
                    let kad = &mut self.swarm.behaviour_mut().kad;
                    for walk in &mut find.walks {
                        if let Some(mut q) = kad.query_mut(&walk.query) {
                            q.finish();
                        }
                    }
                } else {
                    find.count_answer(source, &tally, named >= FULL_ANSWER);
                    if let Some(walk) = find.walks.iter_mut().find(|w| w.query == query) {
                        walk.own_answers += u32::from(source.is_some());
                        if !find.providers.is_empty() {
                            walk.settles_at = Some(Instant::now() + ANSWER_GAP);
                        }
                    }
                    let kad = &mut self.swarm.behaviour_mut().kad;
                    stop_agreed_walks(find, kad, (query, last));
                }
            }
        }
        if !last {
            return;
        }
        self.provider_queries.remove(&query);
        if let Some(find) = self.finds.get_mut(&id) {
            find.dht_requests += requests;
            find.walks.retain(|w| w.query != query);
            if find.walks.is_empty() {
                find.providers_done = true;
                find.lookup_took = Some(find.started.elapsed());
            }
        }
        self.maybe_complete(id);
    }

    /// What the advert protocol reports: a peer asking for our advert, or the answer to
    /// one of our fetches.
    pub(super) fn on_advert_event(
        &mut self,
        event: request_response::Event<AdvertQuery, AdvertAnswer>,
    ) {
        match event {
            request_response::Event::Message {
                message: request_response::Message::Request { channel, .. },
                ..
            } => {
                let own = self.own.as_ref().and_then(|o| o.record.clone());
                let _ = self
                    .swarm
                    .behaviour_mut()
                    .advert
                    .send_response(channel, AdvertAnswer(own));
            }
            request_response::Event::Message {
                message:
                    request_response::Message::Response {
                        request_id,
                        response,
                    },
                ..
            } => self.on_fetched_advert(request_id, response),
            request_response::Event::OutboundFailure {
                request_id, error, ..
            } => {
                let Some((id, peer)) = self.advert_fetches.remove(&request_id) else {
                    return;
                };
                // A peer that speaks no advert fetch is looked up in the DHT, and so is one
                // the caller named (its advert says where it listens). (Builds older than
                // the fetch stored their adverts under a key this build no longer reads:
                // for those the lookup finds nothing, and they are left out.)
                // A provider the lookup named that we cannot reach now is left out: a
                // lease with it would fail the same way, after its own timeout.
                let Some(find) = self.finds.get_mut(&id) else {
                    return;
                };
                let unsupported = crate::network::refused_protocol(&error);
                if find.named_peers || unsupported {
                    self.fetch_advert_from_dht(id, peer);
                } else if !find.second_try_used(peer) {
                    tracing::debug!(%peer, "advert fetch failed ({error}); trying its advertised addresses");
                    self.fetch_advert_from_dht(id, peer);
                } else {
                    tracing::debug!(%peer, "advert fetch failed: {error}");
                    self.advert_resolved(id, 0);
                }
            }
            _ => {}
        }
    }

    fn on_fetched_advert(&mut self, request: OutboundRequestId, answer: AdvertAnswer) {
        let Some((id, peer)) = self.advert_fetches.remove(&request) else {
            return;
        };
        if let Some(bytes) = answer.0 {
            // A peer answering with someone else's advert, or garbage, is refused and
            // counted by the book; its DHT copy would be the same peer's word.
            self.accept_advert(id, &peer, &bytes);
        }
        self.advert_resolved(id, 0);
    }

    /// Verifies `bytes` as `peer`'s advert and keeps it for query `id`; a copy older than
    /// one we have seen is replaced by the newer one. Whether it was accepted.
    fn accept_advert(&mut self, id: u64, peer: &PeerId, bytes: &[u8]) -> bool {
        let now = now_ms();
        let accepted = match self.book.accept(bytes, peer, now) {
            Err(AdvertError::Stale { .. }) => self.book.latest(peer, now).cloned().ok_or(()),
            other => other.map_err(|_| ()),
        };
        let Ok(advert) = accepted else {
            return false;
        };
        tracing::debug!(%peer, seq = advert.seq, addrs = ?advert.listen_addrs, "advert accepted");
        if let Some(find) = self.finds.get_mut(&id) {
            if find.found.get(peer).is_none_or(|a| a.seq < advert.seq) {
                find.found.insert(*peer, advert);
            }
            find.first_advert_after
                .get_or_insert(find.started.elapsed());
        }
        true
    }

    /// One provider's advert is settled (found, absent or refused).
    fn advert_resolved(&mut self, id: u64, dht_requests: u32) {
        if let Some(find) = self.finds.get_mut(&id) {
            find.dht_requests += dht_requests;
            find.outstanding = find.outstanding.saturating_sub(1);
        }
        self.maybe_complete(id);
    }

    pub(super) fn on_record(
        &mut self,
        query: QueryId,
        result: Result<kad::GetRecordOk, kad::GetRecordError>,
        last: bool,
        requests: u32,
    ) {
        let Some(&(id, peer)) = self.record_queries.get(&query) else {
            return;
        };
        let mut resolved = last;
        if let Ok(kad::GetRecordOk::FoundRecord(found)) = result {
            let for_peer = peer_of_advert_key(found.record.key.as_ref()) == Some(peer);
            let readdress = self
                .finds
                .get_mut(&id)
                .is_some_and(|f| f.readdressing.remove(&peer));
            if for_peer && readdress {
                self.record_queries.remove(&query);
                if let Some(mut q) = self.swarm.behaviour_mut().kad.query_mut(&query) {
                    q.finish();
                }
                self.fetch_again_at_advertised_addresses(id, peer, &found.record.value);
                return;
            }
            if for_peer && self.accept_advert(id, &peer, &found.record.value) {
                // A valid advert answers the question; stop asking further peers.
                if let Some(mut q) = self.swarm.behaviour_mut().kad.query_mut(&query) {
                    q.finish();
                }
                resolved = true;
            }
        }
        if resolved {
            self.record_queries.remove(&query);
            self.advert_resolved(id, requests);
        }
    }

    /// Asks `peer` for its advert once more, at the addresses its (verified) DHT advert
    /// lists; without a valid advert it is left out.
    fn fetch_again_at_advertised_addresses(&mut self, id: u64, peer: PeerId, bytes: &[u8]) {
        let Ok(advert) = verify_advert(bytes, &peer, now_ms()) else {
            self.advert_resolved(id, 0);
            return;
        };
        for addr in advert.listen_addrs.iter().filter_map(|a| a.parse().ok()) {
            self.swarm.add_peer_address(peer, addr);
        }
        self.send_advert_request(id, peer);
    }

    /// Answers query `id` when the lookup has settled and every advert is in; once some
    /// advert is in, silent providers get a grace (see [`STRAGGLER_GRACE_MIN`]).
    fn maybe_complete(&mut self, id: u64) {
        let Some(find) = self.finds.get_mut(&id) else {
            return;
        };
        if !find.providers_done {
            return;
        }
        if find.outstanding == 0 {
            self.complete_find(id);
        } else if let Some(first) = find.first_advert_after {
            let grace = (first * 3).clamp(STRAGGLER_GRACE_MIN, STRAGGLER_GRACE_MAX);
            find.deadline = find.deadline.min(Instant::now() + grace);
        }
    }

    pub(super) fn complete_find(&mut self, id: u64) {
        let Some(find) = self.finds.remove(&id) else {
            return;
        };
        self.provider_queries.retain(|_, f| *f != id);
        self.advert_fetches.retain(|_, (f, _)| *f != id);
        let kad = &mut self.swarm.behaviour_mut().kad;
        self.record_queries.retain(|q, (f, _)| {
            if *f == id {
                if let Some(mut q) = kad.query_mut(q) {
                    q.finish();
                }
                false
            } else {
                true
            }
        });
        tracing::debug!(
            took = ?find.started.elapsed(),
            lookup = ?find.lookup_took,
            first_advert = ?find.first_advert_after,
            providers = find.providers.len(),
            answers = find.answers,
            adverts = find.found.len(),
            dht_requests = find.dht_requests,
            "offer query answered"
        );
        let now = now_ms();
        let mut offers: Vec<OfferView> = find
            .found
            .values()
            .filter(|a| a.expires_at_ms > now && a.matches(&find.filter))
            .map(|a| {
                let mut o = OfferView::from(a);
                o.rtt_ms = self
                    .rtts
                    .get(&a.publisher)
                    .map(|d| d.as_secs_f64() * 1000.0);
                o.reputation = Some(self.accounts.reputation.score(&a.publisher));
                o
            })
            .collect();
        offers.sort_by(|a, b| {
            a.price_per_gpu_hour
                .total_cmp(&b.price_per_gpu_hour)
                .then_with(|| a.peer_id.cmp(&b.peer_id))
        });
        let _ = find.reply.send(OfferSearch {
            offers,
            providers: find.providers.len(),
            dht_requests: find.dht_requests,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Agreeing answers stop a lookup once the nearest peers have answered; a dead or
    /// slow one among them holds it for at most [`ANSWER_GAP`].
    #[test]
    fn agreement_stops_a_lookup_once_the_nearest_answered_or_a_short_wait_is_over() {
        assert!(may_stop(true, Duration::ZERO));
        assert!(!may_stop(false, Duration::ZERO));
        assert!(!may_stop(false, ANSWER_GAP - Duration::from_millis(1)));
        assert!(may_stop(false, ANSWER_GAP));
    }

    /// A key's answers agree after ten that named providers, the last five naming
    /// nobody new, and none full (a full one may have left some out).
    #[test]
    fn a_key_agrees_after_enough_quiet_answers_unless_one_was_full() {
        let mut key = Agreement::default();
        for _ in 0..5 {
            key.answered(3, true, false);
            assert!(!key.agrees());
        }
        key.answered(0, false, false);
        assert!(!key.agrees(), "a response naming nobody is no answer");
        for _ in 0..4 {
            key.answered(3, false, false);
            assert!(!key.agrees());
        }
        key.answered(3, false, false);
        assert!(key.agrees());
        key.answered(1, true, false);
        assert!(!key.agrees(), "a new provider restarts the count");
        let mut full = Agreement::default();
        full.answered(FULL_ANSWER, true, true);
        for _ in 0..20 {
            full.answered(3, false, false);
            assert!(!full.agrees());
        }
    }

    /// A shared key's answer counts for each shard whose providers it names, new or
    /// not; a single key's for that key; this node itself never.
    #[test]
    fn an_answer_is_tallied_by_the_shard_of_each_provider_it_names() {
        let local = PeerId::random();
        let peers: Vec<PeerId> = (0..40).map(|_| PeerId::random()).collect();
        let (tx, _rx) = oneshot::channel();
        let mut shared = PendingFind::new(OfferFilter::default(), tx);
        shared.agreements = (0..8).map(|_| Agreement::default()).collect();
        shared.providers.extend(peers[..10].iter().copied());
        let answer: HashSet<PeerId> = peers.iter().copied().chain([local]).collect();
        let tally = shared.tally(&answer, &local);
        assert_eq!(tally.len(), 8);
        for (shard, (named, new)) in tally.iter().enumerate() {
            let of_shard =
                |ps: &[PeerId]| ps.iter().filter(|p| shard_of(p) as usize == shard).count();
            assert_eq!(*named, of_shard(&peers));
            assert_eq!(*new, of_shard(&peers[10..]));
        }
        let (tx, _rx) = oneshot::channel();
        let mut single = PendingFind::new(OfferFilter::default(), tx);
        single.agreements = vec![Agreement::default()];
        assert_eq!(single.tally(&answer, &local), vec![(40, 40)]);
    }

    /// The same answer twice (the local store answering each walk, or a peer asked by
    /// two walks) counts once, unless it names someone new; a full one makes its peer
    /// no stand-in for the other walks.
    #[test]
    fn a_repeated_answer_counts_once_unless_it_names_someone_new() {
        let (tx, _rx) = oneshot::channel();
        let mut find = PendingFind::new(OfferFilter::default(), tx);
        find.agreements = (0..8).map(|_| Agreement::default()).collect();
        let quiet = vec![(3, 0); 8];
        for _ in 0..8 {
            find.count_answer(None, &quiet, false);
        }
        assert_eq!(
            find.agreements[0].answers, 1,
            "the local store's eight answers"
        );
        let peer = PeerId::random();
        find.count_answer(Some(peer), &quiet, false);
        find.count_answer(Some(peer), &quiet, false);
        assert_eq!(find.agreements[0].answers, 2);
        let mut news = quiet.clone();
        news[5] = (3, 1);
        find.count_answer(Some(peer), &news, false);
        assert_eq!(find.agreements[5].answers, 3, "new names count");
        assert_eq!(find.agreements[5].quiet_answers, 0);
        assert!(find.answered_peers.contains(&peer));
        let crowded = PeerId::random();
        find.count_answer(Some(crowded), &quiet, true);
        assert!(
            !find.answered_peers.contains(&crowded),
            "a full answer left some out"
        );
        for _ in 0..20 {
            find.count_answer(Some(PeerId::random()), &quiet, false);
        }
        assert!(
            !find.agreements[0].agrees(),
            "one full answer was among them"
        );
        let (tx, _rx) = oneshot::channel();
        let mut agreeing = PendingFind::new(OfferFilter::default(), tx);
        agreeing.agreements = vec![Agreement::default()];
        for _ in 0..12 {
            agreeing.count_answer(Some(peer), &[(3, 0)], false);
        }
        assert!(!agreeing.agreements[0].agrees(), "one peer is not ten");
        for _ in 0..9 {
            agreeing.count_answer(Some(PeerId::random()), &[(3, 0)], false);
        }
        assert!(agreeing.agreements[0].agrees());
    }

    /// A flood of answering peers (each answer from another machine) leaves the query's
    /// memory of them bounded.
    #[test]
    fn the_peers_a_query_remembers_are_bounded() {
        let (tx, _rx) = oneshot::channel();
        let mut find = PendingFind::new(OfferFilter::default(), tx);
        find.agreements = (0..8).map(|_| Agreement::default()).collect();
        for _ in 0..ANSWERED_PEERS_MAX + 500 {
            find.count_answer(Some(PeerId::random()), &[(0, 0); 8], false);
        }
        assert_eq!(find.answered_peers.len(), ANSWERED_PEERS_MAX);
        assert_eq!(find.heard_from.len(), ANSWERED_PEERS_MAX);
    }

    /// Kademlia (as libp2p hashes keys) places each provider nearer its own shard of a
    /// shared key than any other shard, so its records go to its own neighbours, and a
    /// query for the key looks up every shard.
    #[test]
    fn a_provider_is_nearest_its_own_shard_of_a_shared_key() {
        use gpunode_protocol::advert::shard_of;
        use kad::KBucketKey;
        for filter in [
            OfferFilter::default(),
            OfferFilter {
                gpus: Some(1),
                ..OfferFilter::default()
            },
        ] {
            let shards = filter.lookup_keys();
            assert_eq!(shards.len(), 8);
            for _ in 0..100 {
                let peer = PeerId::random();
                let own = KBucketKey::from(peer);
                let distance = |key: &Vec<u8>| own.distance(&KBucketKey::new(RecordKey::new(key)));
                let mine = &shards[shard_of(&peer) as usize];
                assert!(shards
                    .iter()
                    .filter(|k| *k != mine)
                    .all(|k| distance(mine) < distance(k)));
            }
        }
    }

    #[test]
    fn a_query_asks_a_bounded_number_of_providers_once_each() {
        let (tx, _rx) = oneshot::channel();
        let mut find = PendingFind::new(OfferFilter::default(), tx);
        let local = PeerId::random();
        assert_eq!(find.name(local, &local), Named::Known, "never itself");
        let first = PeerId::random();
        assert_eq!(find.name(first, &local), Named::New);
        assert_eq!(find.name(first, &local), Named::Known, "once each");
        for _ in 1..MAX_PROVIDERS_PER_FIND {
            assert_eq!(find.name(PeerId::random(), &local), Named::New);
        }
        // A responder naming made-up providers without end gets no more dials.
        for _ in 0..1_000 {
            assert_eq!(find.name(PeerId::random(), &local), Named::OverBound);
        }
        assert_eq!(find.providers.len(), MAX_PROVIDERS_PER_FIND);
        assert_eq!(find.name(first, &local), Named::Known);
    }

    #[test]
    fn a_failed_dial_sends_advert_fetches_to_the_dht_for_a_while_and_the_memory_is_bounded() {
        let mut unreachable = Unreachable::default();
        let t0 = Instant::now();
        let peer = PeerId::random();
        assert!(!unreachable.recently(&peer, t0));
        unreachable.dial_failed(peer, t0);
        assert!(unreachable.recently(&peer, t0 + UNREACHABLE_FOR / 2));
        assert!(!unreachable.recently(&peer, t0 + UNREACHABLE_FOR));
        unreachable.reached(&peer);
        assert!(!unreachable.recently(&peer, t0));

        // Dials failing to ever more peers (a lookup naming made-up ones) stop adding
        // entries at the bound, and old entries make room again.
        for _ in 0..UNREACHABLE_MAX + 100 {
            unreachable.dial_failed(PeerId::random(), t0);
        }
        assert_eq!(unreachable.0.len(), UNREACHABLE_MAX);
        let later = t0 + UNREACHABLE_FOR;
        unreachable.dial_failed(peer, later);
        assert!(unreachable.recently(&peer, later));
        assert_eq!(unreachable.0.len(), 1);
    }
}
