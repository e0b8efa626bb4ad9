//! [`NodeHandle`]: the facade the local API, the CLI and tests use. It holds the doors
//! of the node's rooms (the loop client, the negotiator, the requester, the accounts,
//! the team) and delegates to them; no domain module receives it.

use std::sync::Arc;
use std::time::Duration;

use gpunode_protocol::advert::OfferFilter;
use libp2p::PeerId;
use tokio::sync::mpsc;

use crate::loop_client::{Command, PeerLink};
use crate::{jobs, lease, ledger, team};
use crate::{
    Accounts, CancelOutcome, LeaseError, LeaseSpec, LeaseView, LoopClient, Metrics, NodeError,
    NodeStatus, OfferSearch, OfferView,
};

/// What a handle is made of (see [`crate::Node::start`]).
pub(crate) struct HandleParts {
    pub peer_id: PeerId,
    pub keypair: libp2p::identity::Keypair,
    pub commands: mpsc::Sender<Command>,
    pub control: libp2p_stream::Control,
    pub executor: Arc<gpunode_sandbox::WasmExecutor>,
    pub metrics: Arc<Metrics>,
    pub accounts: Arc<Accounts>,
    pub team: Option<Arc<team::service::Team>>,
    /// Job data may go through a team relay when no direct connection is possible.
    pub allow_relayed_data: bool,
    /// This machine's GPU samples and alerts.
    pub history: crate::history::SharedHistory,
    /// The owner's rules, as the dashboard shows them.
    pub machine_policy: crate::overview::MachinePolicy,
}

/// A cloneable handle to a running node.
#[derive(Clone, Debug)]
pub struct NodeHandle {
    peer_id: PeerId,
    link: PeerLink,
    negotiator: lease::negotiate::Negotiator,
    /// This user's jobs.
    jobs: jobs::table::JobTable,
    /// Runs this user's jobs.
    requester: jobs::requester::Requester,
    accounts: Arc<Accounts>,
    team: Option<Arc<team::service::Team>>,
    history: crate::history::SharedHistory,
    machine_policy: Arc<crate::overview::MachinePolicy>,
    /// Where the web dashboard answers, once it listens.
    dashboard_url: Arc<std::sync::OnceLock<String>>,
}

impl NodeHandle {
    /// The handle over `parts`.
    pub(crate) fn new(parts: HandleParts) -> NodeHandle {
        let client = LoopClient::new(parts.commands);
        let negotiator = lease::negotiate::Negotiator::new(client.clone(), parts.keypair)
            .scored_by(parts.accounts.clone());
        NodeHandle {
            peer_id: parts.peer_id,
            link: PeerLink::new(client, parts.control.clone(), parts.metrics.clone()),
            requester: jobs::requester::Requester::new(
                negotiator.clone(),
                parts.accounts.clone(),
                (parts.control, parts.metrics),
                parts.executor,
                parts.team.is_some(),
            )
            .allow_relayed_data(parts.allow_relayed_data),
            negotiator,
            jobs: jobs::table::JobTable::default(),
            accounts: parts.accounts,
            team: parts.team,
            history: parts.history,
            machine_policy: Arc::new(parts.machine_policy),
            dashboard_url: Arc::default(),
        }
    }

    /// This machine's GPU samples and latest alerts.
    pub fn history(&self) -> &crate::history::SharedHistory {
        &self.history
    }

    /// The owner's rules for this machine.
    pub fn machine_policy(&self) -> &crate::overview::MachinePolicy {
        &self.machine_policy
    }

    /// Records where the web dashboard answers (once; later calls are ignored).
    pub fn set_dashboard_url(&self, url: String) {
        let _ = self.dashboard_url.set(url);
    }

    /// The requests waiting in this provider's queue, in serving order (requesters
    /// outside our team named only by their place).
    pub async fn provider_queue(
        &self,
    ) -> Result<Vec<crate::overview::QueuedRequestView>, NodeError> {
        self.link.client().provider_queue().await
    }

    /// Every provider whose verified advert this node holds, without a lookup.
    pub async fn known_providers(&self) -> Result<Vec<crate::views::ProviderView>, NodeError> {
        self.link.client().known_providers().await
    }

    /// This node's jobs waiting in providers' queues.
    pub fn queue_turns(&self) -> &Arc<crate::lease::turns::Turns> {
        self.requester.turns()
    }

    /// How domain services reach peers: the loop, raw streams, metrics.
    pub fn link(&self) -> &PeerLink {
        &self.link
    }

    /// The node's peer id.
    pub fn peer_id(&self) -> PeerId {
        self.peer_id
    }

    /// The node's metrics.
    pub fn metrics(&self) -> &Arc<Metrics> {
        self.link.metrics()
    }

    /// The node's team, when it is in one.
    pub fn team(&self) -> Option<&Arc<team::service::Team>> {
        self.team.as_ref()
    }

    /// A control for raw streams of any protocol.
    pub fn stream_control(&self) -> libp2p_stream::Control {
        self.link.control()
    }

    /// Tells the event loop who may connect (team mode): the others are dropped and
    /// their leases cancelled.
    pub async fn set_team_allowed(&self, peers: std::collections::HashSet<PeerId>) {
        self.link.client().set_team_allowed(peers).await;
    }

    /// The node's ledger, reputation and usage meters.
    pub fn accounts(&self) -> &Arc<Accounts> {
        &self.accounts
    }

    /// The door to the event loop.
    pub fn loop_client(&self) -> &LoopClient {
        self.link.client()
    }

    /// The requester's side of lease negotiation.
    pub fn negotiator(&self) -> &lease::negotiate::Negotiator {
        &self.negotiator
    }

    /// Finds a provider (or asks the named one), negotiates and records a lease.
    pub async fn request_lease(&self, spec: LeaseSpec) -> Result<LeaseView, LeaseError> {
        self.negotiator.request_lease(spec).await
    }

    /// Extends an active lease this node holds as requester by `extend`.
    pub async fn renew_lease(
        &self,
        prefix: &str,
        extend: Duration,
    ) -> Result<LeaseView, LeaseError> {
        self.negotiator.renew_lease(prefix, extend).await
    }

    /// Cancels a lease (either side): released here at once, then the other party is told.
    pub async fn cancel_lease(&self, prefix: &str) -> Result<CancelOutcome, LeaseError> {
        self.negotiator.cancel_lease(prefix).await
    }

    /// Every lease on this node, either side, newest first.
    pub async fn list_leases(&self) -> Result<Vec<LeaseView>, NodeError> {
        self.negotiator.list_leases().await
    }

    /// Sends one lease message to `peer` and waits for the answer.
    pub async fn send_lease(
        &self,
        peer: PeerId,
        addrs: Vec<libp2p::Multiaddr>,
        message: gpunode_protocol::lease::LeaseMessage,
    ) -> Result<Result<gpunode_protocol::lease::LeaseReply, lease::LeaseSendError>, NodeError> {
        self.negotiator.send_lease(peer, addrs, message).await
    }

    /// Current adverts of known peers (for their addresses and offers).
    pub async fn find_adverts(&self, peers: Vec<PeerId>) -> Result<Vec<OfferView>, NodeError> {
        self.negotiator.find_adverts(peers).await
    }

    /// What admins and members ask of the team, when this node is in one.
    pub fn team_service(&self) -> Result<team::service::TeamService, team::TeamOpError> {
        let team = self.team.clone().ok_or(team::TeamOpError::NoTeam)?;
        Ok(team::service::TeamService::new(team, self.link.clone()))
    }

    /// Issues an invite token (admins only).
    pub async fn team_invite(
        &self,
        role: gpunode_protocol::team::Role,
        uses: u32,
        expires_ms: u64,
        bootstrap: Vec<String>,
    ) -> Result<gpunode_protocol::team::InviteToken, team::TeamOpError> {
        self.team_service()?
            .invite(role, uses, expires_ms, bootstrap)
            .await
    }

    /// An invite token whose bootstrap addresses are this node's reachable addresses.
    pub async fn team_invite_here(
        &self,
        role: gpunode_protocol::team::Role,
        uses: u32,
        expires_ms: u64,
    ) -> Result<gpunode_protocol::team::InviteToken, team::TeamOpError> {
        self.team_service()?
            .invite_here(role, uses, expires_ms)
            .await
    }

    /// Admits a known peer id without a token (admins only) and tells the members.
    pub async fn team_add(
        &self,
        peer: PeerId,
        role: gpunode_protocol::team::Role,
    ) -> Result<(), team::TeamOpError> {
        self.team_service()?.add(peer, role).await
    }

    /// Sets the team policy from its file text (admins only) and tells the members.
    pub async fn team_set_policy(&self, text: &str) -> Result<u64, team::TeamOpError> {
        self.team_service()?.set_policy(text).await
    }

    /// Revokes a member (admins only).
    pub async fn team_revoke(&self, peer: PeerId) -> Result<(), team::TeamOpError> {
        self.team_service()?.revoke(peer).await
    }

    /// The team as `gpunode team members` shows it.
    pub async fn team_view(&self) -> Result<team::service::TeamView, team::TeamOpError> {
        Ok(self.team_service()?.view().await)
    }

    /// Balances, the `recent` newest entries and unsettled claims.
    pub fn ledger_view(&self, recent: usize) -> Result<ledger::views::LedgerView, NodeError> {
        Ok(self.accounts.ledger_view(recent)?)
    }

    /// Checks the whole ledger chain; with `reuse`, the last check's report when the
    /// chain has not grown since.
    pub async fn verify_ledger(
        &self,
        reuse: bool,
    ) -> Result<ledger::chain::VerifyReport, NodeError> {
        Ok(self.accounts.verify_ledger(reuse).await?)
    }

    /// Every ledger entry in `format`.
    pub async fn export_ledger(
        &self,
        format: ledger::views::ExportFormat,
    ) -> Result<String, NodeError> {
        Ok(self.accounts.export_ledger(format).await?)
    }

    /// The balance after each ledger entry, thinned to about `points` rows.
    pub async fn balance_history(
        &self,
        points: usize,
    ) -> Result<crate::overview::BalanceHistory, NodeError> {
        Ok(self.accounts.balance_history(points).await?)
    }

    /// This machine: GPUs now, their plots over `range`, jobs run for peers, alerts and
    /// the owner's rules.
    pub async fn machine_view(
        &self,
        range: crate::overview::PlotRange,
    ) -> Result<crate::overview::MachineView, NodeError> {
        let status = self.status().await?;
        let (plots, mut alerts, step_ms) = self.history.read(|h| {
            (
                crate::overview::plots(h, range),
                h.alerts().iter().cloned().collect::<Vec<_>>(),
                h.step_ms(),
            )
        });
        alerts.reverse();
        Ok(crate::overview::MachineView {
            peer_id: status.peer_id,
            inventory: status.inventory,
            running_jobs: status.running_jobs,
            alerts,
            policy: (*self.machine_policy).clone(),
            range,
            step_ms,
            plots,
        })
    }

    /// Busy share by day over the last 30 days.
    pub fn utilization(&self) -> crate::overview::UtilizationReport {
        self.history
            .read(|h| crate::overview::utilization(h, self.peer_id.to_string()))
    }

    /// Every peer with a reputation record or a balance here.
    pub fn peers_view(&self) -> Vec<ledger::views::PeerView> {
        self.accounts.peers_view()
    }

    /// A lease by id, if this node has it.
    pub async fn lease(
        &self,
        id: &gpunode_protocol::lease::LeaseId,
    ) -> Result<Option<lease::LeaseRecord>, NodeError> {
        self.link.client().lease(id).await
    }

    /// Starts a job in the background; follow it with [`NodeHandle::job_events`].
    pub fn submit_job(&self, mut req: jobs::JobRequest) -> jobs::JobView {
        let table = self.jobs.clone();
        let (job_id, cancel) = table.insert(&req);
        req.output_dir = if req.output_per_job {
            req.output_dir.join(&job_id)
        } else {
            jobs::outputs::final_dir(&req.output_dir, &job_id)
        };
        req.output_per_job = false;
        let requester = self.requester.clone();
        let id = job_id.clone();
        tokio::spawn(async move {
            let t = table.clone();
            let idc = id.clone();
            let mut events = move |e: jobs::JobEvent| t.push(&idc, e);
            let result = requester.run_job(req, &mut events, cancel).await;
            let end = match result {
                Ok(summary) => jobs::JobEvent::Finished {
                    summary: Box::new(summary),
                },
                Err(e) => jobs::JobEvent::Failed {
                    error: e.to_string(),
                },
            };
            table.push(&id, end);
        });
        self.jobs.get(&job_id).expect("the job was just inserted")
    }

    /// Opens a raw stream of the job protocol to `peer` (for tools and tests that speak
    /// the protocol themselves; jobs normally go through [`NodeHandle::submit_job`]).
    pub async fn open_job_stream(&self, peer: PeerId) -> Result<libp2p::Stream, NodeError> {
        self.open_stream(peer, jobs::JOB_PROTOCOL).await
    }

    /// Opens a stream of `protocol` to `peer`.
    pub async fn open_stream(
        &self,
        peer: PeerId,
        protocol: libp2p::StreamProtocol,
    ) -> Result<libp2p::Stream, NodeError> {
        self.link.open_stream(peer, protocol).await
    }

    /// These leases by id (`None` where unknown), in order, in one trip to the loop.
    pub async fn leases_by_id(
        &self,
        ids: Vec<gpunode_protocol::lease::LeaseId>,
    ) -> Result<Vec<Option<lease::LeaseRecord>>, NodeError> {
        self.link.client().leases_by_id(ids).await
    }

    /// Every lease this node knows, with its signatures.
    pub async fn list_lease_records(&self) -> Result<Vec<lease::LeaseRecord>, NodeError> {
        self.link.client().list_leases().await
    }

    /// This user's jobs, newest first.
    pub fn list_jobs(&self) -> Vec<jobs::JobView> {
        self.jobs.list()
    }

    /// One job by id or unique prefix.
    pub fn get_job(&self, prefix: &str) -> Result<jobs::JobView, jobs::table::JobLookupError> {
        self.jobs.get(prefix)
    }

    /// Stops a job; returns its id.
    pub fn cancel_job(&self, prefix: &str) -> Result<String, jobs::table::JobLookupError> {
        self.jobs.cancel(prefix)
    }

    /// A job's events from position `from`, waiting up to `wait` for new ones.
    pub async fn job_events(
        &self,
        prefix: &str,
        from: usize,
        wait: Duration,
    ) -> Result<jobs::table::EventPage, jobs::table::JobLookupError> {
        self.jobs.events(prefix, from, wait).await
    }

    /// Like [`NodeHandle::job_events`], not woken by events of the kinds in `skip`.
    pub async fn job_events_skipping(
        &self,
        prefix: &str,
        from: usize,
        wait: Duration,
        skip: &jobs::table::Skip,
    ) -> Result<jobs::table::EventPage, jobs::table::JobLookupError> {
        self.jobs.events_skipping(prefix, from, wait, skip).await
    }

    /// The providers whose records this node holds under the capability key `key`, as
    /// its DHT store has them, expired records included (to see where a lookup should
    /// have found a provider). A provider holds its own record.
    pub async fn providers_held(&self, key: Vec<u8>) -> Result<Vec<PeerId>, NodeError> {
        self.link.client().providers_held(key).await
    }

    /// The node's status.
    pub async fn status(&self) -> Result<NodeStatus, NodeError> {
        let mut status = self.link.client().status().await?;
        status.team = self.team.as_ref().map(|t| t.state().team.to_string());
        status.dashboard_url = self.dashboard_url.get().cloned();
        Ok(status)
    }

    /// Providers whose verified, unexpired adverts match `filter`.
    pub async fn find_offers(&self, filter: OfferFilter) -> Result<Vec<OfferView>, NodeError> {
        Ok(self.search_offers(filter).await?.offers)
    }

    /// Like [`NodeHandle::find_offers`], with the number of providers and DHT requests.
    pub async fn search_offers(&self, filter: OfferFilter) -> Result<OfferSearch, NodeError> {
        self.link.client().search_offers(filter).await
    }

    /// Asks the node to withdraw its advert, flush and stop.
    pub async fn shutdown(&self) -> Result<(), NodeError> {
        self.link.client().shutdown().await
    }

    /// Waits until the node has at least `peers` peers in its routing table.
    pub async fn wait_for_routing(&self, peers: usize, timeout: Duration) -> Result<(), NodeError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if self.status().await?.routing_table_size >= peers {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(NodeError::Stopped);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
