//! The gpunode daemon as a library.
//!
//! [`Node::start`] makes (or loads) the identity in the data directory, opens the store,
//! picks the GPU inventory, builds the libp2p swarm, binds the listen addresses and the
//! local API socket, and spawns the event loop. A [`NodeHandle`] talks to the running
//! loop. The CLI, the testnet crate and tests all start nodes this way.
//!
//! This crate owns networking, adverts, GPU inventory, policies and the local API; it
//! uses `gpunode-protocol` for everything on the wire and never imports the CLI.

pub mod adverts;
pub mod alerts;
pub mod api;
pub mod config;
pub mod data_dir;
mod event_loop;
pub mod inbound;
pub mod inventory;
pub mod jobs;
pub mod lease;
pub mod ledger;
pub mod loop_client;
pub mod metrics;
pub mod network;
pub mod owner;
pub mod router;
pub mod standings;
pub mod store;
pub mod team;
pub mod views;

use std::sync::Arc;
use std::time::Duration;

use gpunode_protocol::advert::OfferFilter;
use libp2p::PeerId;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

pub use config::NodeConfig;
pub use data_dir::DataDir;
use event_loop::{EventLoop, LoopParts};
use inventory::{GpuInventory, InventorySnapshot};
pub use lease::negotiate::LeaseError;
pub use ledger::settle::{Accounts, Misbehaviour};
pub use loop_client::LoopClient;
pub use metrics::Metrics;
use store::Store;
pub use views::{CancelOutcome, LeaseSpec, LeaseView, NodeStatus, OfferSearch, OfferView};

/// Whether a node lends resources or only looks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Advertises its GPUs and serves the DHT (`gpunode serve`).
    Provider,
    /// A short-lived node that queries the network and advertises nothing.
    Client,
}

/// How to start a node.
pub struct NodeOptions {
    /// Configuration (file plus flags).
    pub config: NodeConfig,
    /// Where identity, store and socket live.
    pub data_dir: DataDir,
    /// Provider or client.
    pub role: Role,
    /// Use this inventory instead of detecting one (tests script simulated GPUs).
    pub inventory: Option<Arc<dyn GpuInventory>>,
    /// Serve the local API on the data dir's socket.
    pub serve_api: bool,
    /// Keep the store in memory only (large in-process test networks).
    pub ephemeral_store: bool,
    /// Run each wasm guest in a worker process started from this binary (which must
    /// answer `gpunode_sandbox::wasm::worker::WORKER_ARG`); `None` runs guests on
    /// threads of this process with epoch interruption.
    pub wasm_worker: Option<std::path::PathBuf>,
    /// Cheating switches, for test networks that check cheats are caught.
    pub misbehaviour: Misbehaviour,
}

impl NodeOptions {
    /// Options with defaults for everything but config and data dir.
    pub fn new(config: NodeConfig, data_dir: DataDir, role: Role) -> NodeOptions {
        NodeOptions {
            config,
            data_dir,
            role,
            inventory: None,
            serve_api: role == Role::Provider,
            ephemeral_store: false,
            wasm_worker: None,
            misbehaviour: Misbehaviour::default(),
        }
    }
}

/// Why a node could not start or answer.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// Data directory or identity problem.
    #[error(transparent)]
    DataDir(#[from] data_dir::DataDirError),
    /// Store problem.
    #[error(transparent)]
    Store(#[from] store::StoreError),
    /// Configuration problem.
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    /// Simulated GPU spec problem.
    #[error(transparent)]
    Inventory(#[from] inventory::SpecError),
    /// Swarm setup problem.
    #[error(transparent)]
    Network(#[from] network::NetworkSetupError),
    /// An address could not be bound.
    #[error("cannot listen on {addr}: {reason}. Is another gpunode running? Choose another address with --listen")]
    Listen {
        /// The address.
        addr: String,
        /// The OS error.
        reason: String,
    },
    /// The local API could not start.
    #[error(transparent)]
    Api(#[from] api::ApiError),
    /// The sandbox or job service could not start.
    #[error("cannot set up the sandbox: {0}")]
    Sandbox(String),
    /// A stream to a peer could not be opened.
    #[error("cannot open a {protocol} stream: {reason}")]
    Stream {
        /// The stream protocol.
        protocol: String,
        /// Why not.
        reason: String,
    },
    /// An exchange with a peer failed on the wire.
    #[error("{0}")]
    Exchange(#[from] std::io::Error),
    /// The ledger could not be opened.
    #[error(transparent)]
    Ledger(#[from] ledger::LedgerError),
    /// The team files could not be used.
    #[error(transparent)]
    Team(#[from] team::TeamOpError),
    /// A stream protocol could not be served.
    #[error(transparent)]
    Route(#[from] router::RouteError),
    /// The node has stopped.
    #[error("the node has stopped")]
    Stopped,
}

/// A cloneable handle to a running node.
#[derive(Clone, Debug)]
pub struct NodeHandle {
    peer_id: PeerId,
    client: LoopClient,
    link: loop_client::PeerLink,
    negotiator: lease::negotiate::Negotiator,
    metrics: Arc<Metrics>,
    /// This user's jobs.
    jobs: jobs::table::JobTable,
    /// Runs this user's jobs.
    requester: jobs::requester::Requester,
    accounts: Arc<Accounts>,
    team: Option<Arc<team::service::Team>>,
}

impl NodeHandle {
    /// The node's peer id.
    pub fn peer_id(&self) -> PeerId {
        self.peer_id
    }

    /// The node's metrics.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
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
        self.client.set_team_allowed(peers).await;
    }

    /// The node's ledger, reputation and usage meters.
    pub fn accounts(&self) -> &Arc<Accounts> {
        &self.accounts
    }

    /// The door to the event loop.
    pub fn loop_client(&self) -> &LoopClient {
        &self.client
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
    ) -> Result<Result<gpunode_protocol::lease::LeaseReply, String>, NodeError> {
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

    /// Checks the whole ledger chain.
    pub async fn verify_ledger(&self) -> Result<ledger::chain::VerifyReport, NodeError> {
        Ok(self.accounts.verify_ledger().await?)
    }

    /// Every ledger entry in `format`.
    pub async fn export_ledger(
        &self,
        format: ledger::views::ExportFormat,
    ) -> Result<String, NodeError> {
        Ok(self.accounts.export_ledger(format).await?)
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
        self.client.lease(id).await
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
        self.client.leases_by_id(ids).await
    }

    /// Every lease this node knows, with its signatures.
    pub async fn list_lease_records(&self) -> Result<Vec<lease::LeaseRecord>, NodeError> {
        self.client.list_leases().await
    }

    /// This user's jobs, newest first.
    pub fn list_jobs(&self) -> Vec<jobs::JobView> {
        self.jobs.list()
    }

    /// One job by id or unique prefix.
    pub fn get_job(&self, prefix: &str) -> Result<jobs::JobView, String> {
        self.jobs.get(prefix)
    }

    /// Stops a job; returns its id.
    pub fn cancel_job(&self, prefix: &str) -> Result<String, String> {
        self.jobs.cancel(prefix)
    }

    /// A job's events from position `from`, waiting up to `wait` for new ones.
    pub async fn job_events(
        &self,
        prefix: &str,
        from: usize,
        wait: Duration,
    ) -> Result<jobs::table::EventPage, String> {
        self.jobs.events(prefix, from, wait).await
    }

    /// The node's status.
    pub async fn status(&self) -> Result<NodeStatus, NodeError> {
        let mut status = self.client.status().await?;
        status.team = self.team.as_ref().map(|t| t.state().team.to_string());
        Ok(status)
    }

    /// Providers whose verified, unexpired adverts match `filter`.
    pub async fn find_offers(&self, filter: OfferFilter) -> Result<Vec<OfferView>, NodeError> {
        Ok(self.search_offers(filter).await?.offers)
    }

    /// Like [`NodeHandle::find_offers`], with the number of providers and DHT requests.
    pub async fn search_offers(&self, filter: OfferFilter) -> Result<OfferSearch, NodeError> {
        self.client.search_offers(filter).await
    }

    /// Asks the node to withdraw its advert, flush and stop.
    pub async fn shutdown(&self) -> Result<(), NodeError> {
        self.client.shutdown().await
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

/// A running node: its handle and its tasks.
pub struct Node {
    handle: NodeHandle,
    event_loop: JoinHandle<()>,
    stop_tasks: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    lease_jobs: jobs::LeaseJobs,
}

impl Node {
    /// Starts a node. Errors leave nothing behind: no socket, no listener.
    pub async fn start(opts: NodeOptions) -> Result<Node, NodeError> {
        let config = opts.config;
        config.validate()?;
        let keypair = opts.data_dir.load_or_create_identity()?;
        let peer_id = keypair.public().to_peer_id();
        let store = if opts.ephemeral_store {
            Store::temporary()?
        } else {
            Store::open(&opts.data_dir.store_dir())?
        };
        let (accounts, ledger_writer) = Accounts::open(
            store.clone(),
            keypair.clone(),
            ledger::settle::CreditPolicy {
                allowance_millicredits: (config.allowance * 1000.0).round() as u64,
                debt_limit_millicredits: (config.debt_limit * 1000.0).round() as u64,
                min_reputation: config.min_reputation,
                new_peers_on_credit_per_day: config.new_peers_on_credit_per_day,
            },
            opts.misbehaviour,
        )?;
        let inventory: Arc<dyn GpuInventory> = match opts.inventory {
            Some(inv) => inv,
            None if opts.role == Role::Client => Arc::new(inventory::NoGpus),
            None => Arc::from(inventory::detect(
                config.simulate_gpus.as_deref(),
                &peer_id.to_string(),
            )?),
        };
        let lease_jobs = jobs::LeaseJobs::default();
        let reader = Arc::new(InventoryReader {
            inventory,
            rules: config
                .owner_rules()
                .map_err(|e| NodeError::Config(config::ConfigError::Invalid(e)))?,
            lease_jobs: lease_jobs.clone(),
            last_read: std::sync::Mutex::new(None),
        });
        let first_snapshot = reader.read().await;

        let team = team::service::Team::load(opts.data_dir.root().to_path_buf(), keypair.clone())?;
        let mut swarm = network::build_swarm(
            keypair.clone(),
            &network::SwarmSettings {
                mdns: config.mdns,
                idle_connection_timeout: config.idle_connection_timeout,
                provider_record_ttl: config.advert_ttl * 2,
                server: opts.role == Role::Provider,
                team: team.as_ref().map(|t| (t.state().team, t.allowed())),
                tcp_psk: config.tcp_psk()?,
                limits: network::ConnectionCaps {
                    total: config.max_connections,
                    per_peer: config.max_connections_per_peer,
                    per_ip: config.max_connections_per_ip,
                    pending_incoming: config.max_pending_connections,
                },
            },
        )?;
        let listen = if opts.role == Role::Client {
            vec![
                "/ip4/0.0.0.0/udp/0/quic-v1".parse().expect("valid"),
                "/ip4/0.0.0.0/tcp/0".parse().expect("valid"),
            ]
        } else {
            config.listen.clone()
        };
        for addr in &listen {
            swarm
                .listen_on(addr.clone())
                .map_err(|e| NodeError::Listen {
                    addr: addr.to_string(),
                    reason: listen_error_reason(&e),
                })?;
        }

        let metrics = Metrics::new();
        swarm.behaviour_mut().per_ip.set_metrics(metrics.clone());
        let (commands_tx, commands_rx) = mpsc::channel(64);
        let isolation = match &opts.wasm_worker {
            Some(binary) => gpunode_sandbox::Isolation::Process(binary.clone()),
            None => gpunode_sandbox::Isolation::Thread,
        };
        let executor = Arc::new(
            gpunode_sandbox::WasmExecutor::with_isolation(
                &opts.data_dir.module_cache_dir(),
                isolation,
            )
            .map_err(|e| NodeError::Sandbox(e.to_string()))?,
        );
        let control = swarm.behaviour().stream.new_control();
        let negotiator = lease::negotiate::Negotiator::new(
            LoopClient::new(commands_tx.clone()),
            keypair.clone(),
        );
        let handle = NodeHandle {
            peer_id,
            client: LoopClient::new(commands_tx.clone()),
            link: loop_client::PeerLink::new(
                LoopClient::new(commands_tx.clone()),
                control.clone(),
                metrics.clone(),
            ),
            negotiator: negotiator.clone(),
            requester: jobs::requester::Requester::new(
                negotiator,
                accounts.clone(),
                control.clone(),
                executor.clone(),
                team.is_some(),
            ),
            metrics: metrics.clone(),
            jobs: jobs::table::JobTable::default(),
            accounts: accounts.clone(),
            team: team.clone(),
        };
        let (stop_tasks, stop_rx) = watch::channel(false);
        let mut tasks = Vec::new();
        if opts.serve_api {
            let listener = api::bind_socket(&opts.data_dir.api_socket())?;
            tasks.push(tokio::spawn(api::serve_unix(
                listener,
                opts.data_dir.api_socket(),
                handle.clone(),
                stop_rx.clone(),
            )));
        }
        if let Some(addr) = config.metrics_addr {
            let listener =
                tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(|e| NodeError::Listen {
                        addr: addr.to_string(),
                        reason: e.to_string(),
                    })?;
            tasks.push(tokio::spawn(api::serve_metrics(
                listener,
                metrics.clone(),
                stop_rx.clone(),
            )));
        }

        let mut bootstrap = config.bootstrap.clone();
        if let Some(t) = &team {
            bootstrap.extend(t.state().bootstrap.iter().filter_map(|a| a.parse().ok()));
            tasks.push(tokio::spawn(team::service::run(
                t.clone(),
                handle.link.clone(),
                stop_rx.clone(),
            )));
        }
        event_loop::dial_bootstrap(&mut swarm, &bootstrap);

        tasks.push(tokio::spawn(ledger_writer.run(stop_rx.clone())));
        let mut router = router::Router::new(control.clone(), metrics.clone());
        router.route(
            ledger::settle::SETTLE_PROTOCOL,
            "settle",
            ledger::settle::SETTLE_STREAM_LIMITS,
            Arc::new(ledger::settle::ClaimAnswers {
                accounts: accounts.clone(),
                link: handle.link.clone(),
                is_member: match &team {
                    Some(t) => {
                        let t = t.clone();
                        Arc::new(move |p: &PeerId| t.is_member(p))
                    }
                    None => Arc::new(|_: &PeerId| true),
                },
            }),
        )?;
        if let Some(t) = &team {
            for kind in team::service::TeamStream::ALL {
                router.route(
                    kind.protocol(t),
                    kind.metrics_name(),
                    team::service::TEAM_STREAM_LIMITS,
                    Arc::new(team::service::TeamStreams {
                        team: t.clone(),
                        link: handle.link.clone(),
                        kind,
                    }),
                )?;
            }
        }
        let (ended_tx, ended_rx) = mpsc::channel(8192);
        tasks.push(tokio::spawn(ledger::settle::run_claims(
            accounts.clone(),
            handle.link.clone(),
            ended_rx,
            stop_rx.clone(),
        )));

        if opts.role == Role::Provider {
            let cores = config.cpu_cores.unwrap_or_else(host_cpu_cores).max(1);
            let blobs = jobs::blobs::BlobCache::open(&opts.data_dir.blob_dir(), config.blob_cache)
                .map_err(|e| {
                    NodeError::Sandbox(format!(
                        "cannot open blob cache {}: {e}",
                        opts.data_dir.blob_dir().display()
                    ))
                })?;
            let containers = if config.backends.iter().any(|b| b == "container") {
                let runtime = jobs::containers::ContainerRuntime::open(
                    &opts.data_dir.job_root(),
                    &opts.data_dir.image_dir(),
                    config.allow_host_env,
                    config.max_image_bytes,
                )
                .map_err(NodeError::Sandbox)?;
                Some(Arc::new(runtime))
            } else {
                None
            };
            // Container jobs may run as uids of their own: their directories go under
            // the job root, which they can reach (see `DataDir::job_root`).
            let jobs_dir = match containers {
                Some(_) => opts.data_dir.container_jobs_dir(),
                None => opts.data_dir.jobs_dir(),
            };
            let service = Arc::new(jobs::provider::JobService {
                client: handle.client.clone(),
                metrics: metrics.clone(),
                accounts: accounts.clone(),
                executor: executor.clone(),
                containers,
                blobs: Arc::new(blobs),
                jobs_dir: jobs_dir.clone(),
                lease_jobs: lease_jobs.clone(),
                slots: jobs::slots::Slots::new(cores),
                total_slots: cores,
                max_job_bytes: config.max_job_bytes,
                standings: standings::PeerStandings::new(team.clone(), accounts.clone()),
            });
            // Working directories left by a crash are stale: their jobs are gone.
            let _ = std::fs::remove_dir_all(&jobs_dir);
            router.route(
                jobs::JOB_PROTOCOL,
                "job",
                jobs::provider::JOB_STREAM_LIMITS,
                service,
            )?;
        }

        tasks.push(tokio::spawn(router.serve(stop_rx.clone())));

        let (snap_tx, snap_rx) = mpsc::channel(4);
        let lending = reader.rules.hours.clone();
        tasks.push(tokio::spawn(poll_inventory(
            reader,
            config.inventory_poll,
            snap_tx,
            stop_rx,
        )));

        let offer = (opts.role == Role::Provider).then(|| {
            (
                adverts::LocalOffer {
                    cpu_cores: config.cpu_cores.unwrap_or_else(host_cpu_cores),
                    ram_bytes: config.ram.unwrap_or_else(host_ram_bytes),
                    backends: config.backends.clone(),
                    price_per_gpu_hour_millicredits: (config.price_per_gpu_hour * 1000.0).round()
                        as u64,
                },
                config.advert_ttl,
            )
        });
        let policy = lease::LeasePolicy {
            max_duration_ms: config.max_lease_duration.as_millis() as u64,
            // What the advert says, unless a test network's cheat charges more.
            price_per_gpu_hour_millicredits: ((config.price_per_gpu_hour * 1000.0).round() as u64)
                .saturating_mul(opts.misbehaviour.overcharge.max(1)),
            backends: config.backends.clone(),
            max_gpus_per_peer: config.max_gpus_per_peer.unwrap_or_else(|| {
                lease::policy::default_max_gpus_per_peer(first_snapshot.gpus.len(), team.is_some())
            }),
            allow_peers: config.allow_peers.clone(),
            deny_peers: config.deny_peers.clone(),
            offer_window_ms: config.offer_window.as_millis() as u64,
            retention_ms: config.lease_retention.as_millis() as u64,
        };
        let capacity = match &offer {
            Some((o, _)) => event_loop::capacity_from(&first_snapshot, o.cpu_cores, o.ram_bytes),
            None => lease::Capacity::default(),
        };
        let (stored_leases, stored_nonces) = lease::persist::load(&store)?;
        let mut leases = lease::LeaseBook::restore(
            peer_id,
            policy,
            capacity,
            stored_leases,
            stored_nonces,
            gpunode_protocol::time::now_ms(),
        );
        let restored = leases.take_changes();
        lease::persist::write(&store, &leases, &restored)?;
        store.flush()?;
        let desk = lease::LeaseDesk::new(lease::desk::DeskParts {
            book: leases,
            keypair: keypair.clone(),
            order: config.queue_order.into(),
            fair_share: lease::persist::load_fair_share(&store),
            lending,
            owner: (config.owner_policy, config.owner_grace.as_millis() as u64),
            fixed_lease_id: opts.misbehaviour.fixed_lease_id,
        });
        let event_loop = EventLoop::new(LoopParts {
            alerts: config.alert_rules(),
            swarm,
            keypair,
            commands: commands_rx,
            snapshots: snap_rx,
            store,
            metrics,
            inventory: first_snapshot,
            offer,
            desk,
            lease_jobs: lease_jobs.clone(),
            accounts,
            ended_leases: ended_tx,
            kad_protocol: match &team {
                Some(t) => t.state().kad_protocol(),
                None => network::KAD_PROTOCOL,
            },
            team: team.clone(),
        });
        let event_loop = tokio::spawn(event_loop.run());
        Ok(Node {
            handle,
            event_loop,
            stop_tasks,
            tasks,
            lease_jobs,
        })
    }

    /// A handle to the node.
    pub fn handle(&self) -> NodeHandle {
        self.handle.clone()
    }

    /// Graceful stop: withdraw the advert, flush the store, close the API.
    pub async fn shutdown(self) {
        self.lease_jobs.end_all();
        let _ = self.handle.shutdown().await;
        let _ = self.event_loop.await;
        let _ = self.stop_tasks.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
    }

    /// Stops the node abruptly, as a crash would: nothing is withdrawn.
    pub fn abort(self) {
        self.lease_jobs.end_all();
        self.event_loop.abort();
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn listen_error_reason(e: &libp2p::TransportError<std::io::Error>) -> String {
    match e {
        libp2p::TransportError::MultiaddrNotSupported(a) => {
            format!(
                "address {a} is not supported (use /ip4/IP/tcp/PORT or /ip4/IP/udp/PORT/quic-v1)"
            )
        }
        libp2p::TransportError::Other(io) => io.to_string(),
    }
}

/// Reads the inventory and applies the owner's rules: which GPU processes are jobs',
/// lending hours, the memory cap.
struct InventoryReader {
    inventory: Arc<dyn GpuInventory>,
    rules: owner::OwnerRules,
    lease_jobs: jobs::LeaseJobs,
    /// When the last snapshot was read: each one meters the time since.
    last_read: std::sync::Mutex<Option<std::time::Instant>>,
}

impl InventoryReader {
    async fn read(&self) -> InventorySnapshot {
        let inv = self.inventory.clone();
        let mut snap = match tokio::task::spawn_blocking(move || inv.snapshot()).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                tracing::warn!("{e}");
                InventorySnapshot {
                    gpus: Vec::new(),
                    driver_version: None,
                    source: "none".into(),
                }
            }
            Err(_) => InventorySnapshot {
                gpus: Vec::new(),
                driver_version: None,
                source: "none".into(),
            },
        };
        let now = std::time::Instant::now();
        let since = self
            .last_read
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .replace(now)
            .map_or(0, |t| now.duration_since(t).as_millis() as u64);
        let job_pids = self.lease_jobs.meter(&snap, since);
        self.rules
            .apply(&mut snap, &job_pids, gpunode_protocol::time::now_ms());
        snap
    }
}

async fn poll_inventory(
    reader: Arc<InventoryReader>,
    every: Duration,
    out: mpsc::Sender<InventorySnapshot>,
    mut stop: watch::Receiver<bool>,
) {
    let mut last: Option<InventorySnapshot> = None;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.changed() => return,
        }
        let snap = reader.read().await;
        if last.as_ref() != Some(&snap) {
            last = Some(snap.clone());
            if out.send(snap).await.is_err() {
                return;
            }
        }
    }
}

fn host_cpu_cores() -> u32 {
    std::thread::available_parallelism()
        .map(|n| n.get() as u32)
        .unwrap_or(1)
}

fn host_ram_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}
