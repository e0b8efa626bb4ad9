//! Start-up wiring: [`Node::start`] in named steps. Identity, store and ledger; the GPU
//! inventory; the swarm and its listeners; the handle; the local API; the stream router
//! with its handlers; the lease desk; then the event loop. Errors before the loop starts
//! leave nothing behind: no socket, no listener.

use std::sync::Arc;
use std::time::Duration;

use libp2p::{Multiaddr, PeerId, Swarm};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::event_loop::{self, EventLoop, LoopParts};
use crate::inventory::{self, GpuInventory, InventorySnapshot};
use crate::ledger::accounts::{Accounts, CreditPolicy};
use crate::ledger::LedgerWriter;
use crate::network::{self, NodeBehaviour};
use crate::poller::{host_cpu_cores, host_ram_bytes, poll_inventory, InventoryReader};
use crate::store::Store;
use crate::team::service::{Team, TeamStream, TeamStreams, TEAM_STREAM_LIMITS};
use crate::{adverts, api, config, jobs, lease, ledger, router, standings};
use crate::{Node, NodeConfig, NodeError, NodeHandle, NodeOptions, Role};

/// What is kept on disk: identity, store and the ledger over it.
struct State {
    keypair: libp2p::identity::Keypair,
    peer_id: PeerId,
    store: Store,
    accounts: Arc<Accounts>,
    ledger_writer: LedgerWriter,
}

impl Node {
    /// Starts a node. Errors leave nothing behind: no socket, no listener.
    pub async fn start(opts: NodeOptions) -> Result<Node, NodeError> {
        opts.config.validate()?;
        let config = &opts.config;
        let state = open_state(&opts)?;
        let lease_jobs = jobs::LeaseJobs::default();
        let reader = open_inventory(&opts, state.peer_id, &lease_jobs)?;
        let first_snapshot = reader.read().await;
        let team = Team::load(opts.data_dir.root().to_path_buf(), state.keypair.clone())?;
        let mut swarm = build_swarm(&opts, &state, team.as_ref())?;
        let metrics = crate::Metrics::new();
        swarm.behaviour_mut().per_ip.set_metrics(metrics.clone());
        let (commands_tx, commands_rx) = mpsc::channel(64);
        let executor = wasm_executor(&opts)?;
        let control = swarm.behaviour().stream.new_control();
        let history = open_history(&opts);
        let handle = NodeHandle::new(crate::handle::HandleParts {
            peer_id: state.peer_id,
            keypair: state.keypair.clone(),
            commands: commands_tx,
            control: control.clone(),
            executor: executor.clone(),
            metrics: metrics.clone(),
            accounts: state.accounts.clone(),
            team: team.clone(),
            allow_relayed_data: config.allow_relayed_data,
            history: history.clone(),
            machine_policy: crate::overview::MachinePolicy::of(config),
        });
        let (stop_tasks, stop_rx) = watch::channel(false);
        let mut tasks = spawn_local_servers(&opts, &handle, &stop_rx).await?;
        let bootstrap = bootstrap_addrs(config, team.as_ref());
        event_loop::dial_bootstrap(&mut swarm, &bootstrap);
        let State {
            keypair,
            store,
            accounts,
            ledger_writer,
            ..
        } = state;
        let (ended_tx, ended_rx) = mpsc::channel(8192);
        let services = Services {
            handle: &handle,
            team: team.as_ref(),
            executor,
            lease_jobs: &lease_jobs,
            stop: &stop_rx,
        };
        tasks.extend(services.spawn(&opts, control, ledger_writer, ended_rx)?);
        let (snap_tx, snap_rx) = mpsc::channel(4);
        let lending = reader.rules.hours.clone();
        let poller = poll_inventory(reader, config.inventory_poll, snap_tx, stop_rx);
        tasks.push(tokio::spawn(poller));
        let offer = local_offer(config, opts.role);
        let desk = build_desk(
            &opts,
            &store,
            &keypair,
            &first_snapshot,
            &offer,
            team.is_some(),
            lending,
        )?;
        let event_loop = EventLoop::new(LoopParts {
            alerts: config.alert_rules(),
            history,
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
            team,
            kad_server: opts.role == Role::Provider,
            bootstrap,
        });
        Ok(Node {
            handle,
            event_loop: tokio::spawn(event_loop.run()),
            stop_tasks,
            tasks,
            lease_jobs,
        })
    }
}

/// The services that run beside the event loop, and what they share.
struct Services<'a> {
    handle: &'a NodeHandle,
    team: Option<&'a Arc<Team>>,
    executor: Arc<gpunode_sandbox::WasmExecutor>,
    lease_jobs: &'a jobs::LeaseJobs,
    stop: &'a watch::Receiver<bool>,
}

impl Services<'_> {
    /// The team's upkeep, the ledger writer, settlement of ended leases (`ended`), and
    /// the stream router with settlement, team and (for a provider) job streams.
    fn spawn(
        self,
        opts: &NodeOptions,
        control: libp2p_stream::Control,
        ledger_writer: LedgerWriter,
        ended: mpsc::Receiver<crate::lease::LeaseRecord>,
    ) -> Result<Vec<JoinHandle<()>>, NodeError> {
        let (handle, stop) = (self.handle, self.stop);
        let mut tasks = Vec::new();
        if let Some(t) = self.team {
            let run = crate::team::service::run(t.clone(), handle.link().clone(), stop.clone());
            tasks.push(tokio::spawn(run));
        }
        tasks.push(tokio::spawn(ledger_writer.run(stop.clone())));
        let accounts = handle.accounts();
        let mut router = router::Router::new(control, handle.metrics().clone());
        route_settlement_and_team(&mut router, handle, accounts, self.team)?;
        router.route(
            crate::lease::turns::TURN_PROTOCOL,
            "queue_turn",
            crate::lease::turns::TURN_STREAM_LIMITS,
            Arc::new(crate::lease::turns::TurnNotices {
                turns: handle.queue_turns().clone(),
                client: handle.loop_client().clone(),
                metrics: handle.metrics().clone(),
            }),
        )?;
        let link = handle.link().clone();
        let ahead = Arc::new(ledger::settle::StreamsAhead::new(link.clone()));
        let claims =
            ledger::settle::run_claims(accounts.clone(), link, ahead.clone(), ended, stop.clone());
        tasks.push(tokio::spawn(claims));
        if opts.role == Role::Provider {
            let parts = (self.executor, self.lease_jobs, ahead);
            let service = job_service(opts, handle, parts, self.team)?;
            let limits = jobs::provider::JOB_STREAM_LIMITS;
            let mut variants: Vec<(libp2p::StreamProtocol, Arc<dyn router::StreamHandler>)> =
                vec![(jobs::JOB_PROTOCOL, service.clone())];
            if !opts.misbehaviour.first_job_protocol_only {
                let ending = Arc::new(jobs::provider::LeaseEndingJobs(service));
                variants.push((jobs::JOB_ENDS_LEASE_PROTOCOL, ending));
            }
            router.route_variants("job", limits, variants)?;
        }
        tasks.push(tokio::spawn(router.serve(stop.clone())));
        Ok(tasks)
    }
}

/// Identity, store and the ledger over it.
fn open_state(opts: &NodeOptions) -> Result<State, NodeError> {
    let config = &opts.config;
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
        CreditPolicy {
            allowance_millicredits: (config.allowance * 1000.0).round() as u64,
            debt_limit_millicredits: (config.debt_limit * 1000.0).round() as u64,
            min_reputation: config.min_reputation,
            new_peers_on_credit_per_day: config.new_peers_on_credit_per_day,
        },
        opts.misbehaviour,
    )?;
    Ok(State {
        keypair,
        peer_id,
        store,
        accounts,
        ledger_writer,
    })
}

/// The GPU history the dashboard plots: on disk in the data dir (in memory for an
/// ephemeral store); a file that cannot be read is set aside with a warning.
fn open_history(opts: &NodeOptions) -> crate::history::SharedHistory {
    let step = opts.config.history_step.as_millis() as u64;
    let history = if opts.ephemeral_store {
        crate::history::GpuHistory::in_memory(step)
    } else {
        let path = opts.data_dir.root().join(crate::history::HISTORY_FILE);
        let (history, error) = crate::history::GpuHistory::open(&path, step);
        if let Some(e) = error {
            tracing::warn!("{e}");
        }
        history
    };
    crate::history::SharedHistory::new(history)
}

/// The GPU inventory (given, none for a client, or detected) with the owner's rules.
fn open_inventory(
    opts: &NodeOptions,
    peer_id: PeerId,
    lease_jobs: &jobs::LeaseJobs,
) -> Result<Arc<InventoryReader>, NodeError> {
    let config = &opts.config;
    let inventory: Arc<dyn GpuInventory> = match &opts.inventory {
        Some(inv) => inv.clone(),
        None if opts.role == Role::Client => Arc::new(inventory::NoGpus),
        None => Arc::from(inventory::detect(
            config.simulate_gpus.as_deref(),
            &peer_id.to_string(),
        )?),
    };
    Ok(Arc::new(InventoryReader::new(
        inventory,
        config
            .owner_rules()
            .map_err(|e| NodeError::Config(config::ConfigError::Invalid(e)))?,
        lease_jobs.clone(),
    )))
}

/// The swarm, listening where the config says (a client on ephemeral ports).
fn build_swarm(
    opts: &NodeOptions,
    state: &State,
    team: Option<&Arc<Team>>,
) -> Result<Swarm<NodeBehaviour>, NodeError> {
    let config = &opts.config;
    let listen: Vec<Multiaddr> = if opts.role == Role::Client {
        vec![
            "/ip4/0.0.0.0/udp/0/quic-v1".parse().expect("valid"),
            "/ip4/0.0.0.0/tcp/0".parse().expect("valid"),
        ]
    } else {
        config.listen.clone()
    };
    let mut swarm = network::build_swarm(
        state.keypair.clone(),
        &network::SwarmSettings {
            mdns: config.mdns,
            idle_connection_timeout: config.idle_connection_timeout,
            provider_record_ttl: config.advert_ttl * 2,
            server: opts.role == Role::Provider,
            team: team.map(|t| (t.state().team, t.allowed())),
            tcp_psk: config.tcp_psk()?,
            limits: network::ConnectionCaps {
                total: config.max_connections,
                per_peer: config.max_connections_per_peer,
                per_ip: config.max_connections_per_ip,
                pending_incoming: config.max_pending_connections,
            },
            relay: network::RelaySettings {
                always: config.relay,
                circuit_duration: config.relay_circuit_duration,
                circuit_bytes: config.relay_circuit_bytes,
                max_circuits: config.relay_max_circuits,
                max_reservations: config.relay_max_reservations,
            },
            upnp: opts.role != Role::Client
                && config.upnp_wanted()
                && listens_beyond_loopback(&listen),
        },
    )?;
    for addr in &listen {
        swarm
            .listen_on(addr.clone())
            .map_err(|e| NodeError::Listen {
                addr: addr.to_string(),
                reason: listen_error_reason(&e),
            })?;
    }
    Ok(swarm)
}

/// Whether any address in `listen` can be reached from another machine (a router's
/// port mapping is pointless, and its search not sent, when none can).
fn listens_beyond_loopback(listen: &[Multiaddr]) -> bool {
    listen.iter().any(|a| {
        a.iter().any(|p| match p {
            libp2p::multiaddr::Protocol::Ip4(ip) => !ip.is_loopback(),
            libp2p::multiaddr::Protocol::Ip6(ip) => !ip.is_loopback(),
            _ => false,
        })
    })
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

/// The wasm executor: guests in worker processes, or on threads of this process.
fn wasm_executor(opts: &NodeOptions) -> Result<Arc<gpunode_sandbox::WasmExecutor>, NodeError> {
    let isolation = match &opts.wasm_worker {
        Some(binary) => gpunode_sandbox::Isolation::Process(binary.clone()),
        None => gpunode_sandbox::Isolation::Thread,
    };
    gpunode_sandbox::WasmExecutor::with_isolation(&opts.data_dir.module_cache_dir(), isolation)
        .map(Arc::new)
        .map_err(|e| NodeError::Sandbox(e.to_string()))
}

/// The local API on the data dir's socket and `/metrics`, when configured.
async fn spawn_local_servers(
    opts: &NodeOptions,
    handle: &NodeHandle,
    stop_rx: &watch::Receiver<bool>,
) -> Result<Vec<JoinHandle<()>>, NodeError> {
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
    if let Some(addr) = opts.config.metrics_addr {
        let listener =
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| NodeError::Listen {
                    addr: addr.to_string(),
                    reason: e.to_string(),
                })?;
        tasks.push(tokio::spawn(api::serve_metrics(
            listener,
            handle.metrics().clone(),
            stop_rx.clone(),
        )));
    }
    Ok(tasks)
}

/// The configured bootstrap peers and the team's.
fn bootstrap_addrs(config: &NodeConfig, team: Option<&Arc<Team>>) -> Vec<Multiaddr> {
    let mut bootstrap = config.bootstrap.clone();
    if let Some(t) = team {
        bootstrap.extend(t.state().bootstrap.iter().filter_map(|a| a.parse().ok()));
    }
    bootstrap
}

/// Settlement claims from providers, and the team's join, sync and renewal streams.
fn route_settlement_and_team(
    router: &mut router::Router,
    handle: &NodeHandle,
    accounts: &Arc<Accounts>,
    team: Option<&Arc<Team>>,
) -> Result<(), NodeError> {
    let is_member: ledger::settle::IsMember = match team {
        Some(t) => {
            let t = t.clone();
            Arc::new(move |p: &PeerId| t.is_member(p))
        }
        None => Arc::new(|_: &PeerId| true),
    };
    router.route(
        ledger::settle::SETTLE_PROTOCOL,
        "settle",
        ledger::settle::SETTLE_STREAM_LIMITS,
        Arc::new(ledger::settle::ClaimAnswers {
            accounts: accounts.clone(),
            link: handle.link().clone(),
            is_member,
        }),
    )?;
    if let Some(t) = team {
        for kind in TeamStream::ALL {
            router.route(
                kind.protocol(t),
                kind.metrics_name(),
                TEAM_STREAM_LIMITS,
                Arc::new(TeamStreams {
                    team: t.clone(),
                    link: handle.link().clone(),
                    kind,
                }),
            )?;
        }
    }
    Ok(())
}

/// A provider's job service: blob cache, containers where enabled, CPU slots; `parts`
/// are the sandbox, the jobs by lease and the settlement streams opened ahead.
fn job_service(
    opts: &NodeOptions,
    handle: &NodeHandle,
    parts: (
        Arc<gpunode_sandbox::WasmExecutor>,
        &jobs::LeaseJobs,
        Arc<ledger::settle::StreamsAhead>,
    ),
    team: Option<&Arc<Team>>,
) -> Result<Arc<jobs::provider::JobService>, NodeError> {
    let (executor, lease_jobs, settle_ahead) = parts;
    let (config, data_dir) = (&opts.config, &opts.data_dir);
    let cores = config.cpu_cores.unwrap_or_else(host_cpu_cores).max(1);
    let blobs =
        jobs::blobs::BlobCache::open(&data_dir.blob_dir(), config.blob_cache).map_err(|e| {
            NodeError::Sandbox(format!(
                "cannot open blob cache {}: {e}",
                data_dir.blob_dir().display()
            ))
        })?;
    let containers = if config.backends.iter().any(|b| b == "container") {
        let runtime = jobs::containers::ContainerRuntime::open(
            &data_dir.job_root(),
            &data_dir.image_dir(),
            config.allow_host_env,
            config.max_image_bytes,
        )
        .map_err(NodeError::Sandbox)?;
        Some(Arc::new(runtime))
    } else {
        None
    };
    // Container jobs may run as uids of their own: their directories go under the job
    // root, which they can reach (see `DataDir::job_root`).
    let jobs_dir = match containers {
        Some(_) => data_dir.container_jobs_dir(),
        None => data_dir.jobs_dir(),
    };
    // Working directories left by a crash are stale (their jobs are gone): removed here.
    let job_dirs = jobs::provider::JobDirs::open(jobs_dir);
    if config.backends.iter().any(|b| b == "wasm") {
        // A worker process started ahead of need per CPU slot: a task skips the start.
        executor.keep_workers_ready(cores as usize);
    }
    let accounts = handle.accounts().clone();
    Ok(Arc::new(jobs::provider::JobService {
        client: handle.loop_client().clone(),
        metrics: handle.metrics().clone(),
        accounts: accounts.clone(),
        executor,
        containers,
        blobs: Arc::new(blobs),
        job_dirs,
        lease_jobs: lease_jobs.clone(),
        slots: jobs::slots::Slots::new(cores),
        total_slots: cores,
        max_job_bytes: config.max_job_bytes,
        standings: standings::PeerStandings::new(team.cloned(), accounts),
        settle_ahead,
    }))
}

/// What a provider advertises besides its GPUs; `None` for a client.
fn local_offer(config: &NodeConfig, role: Role) -> Option<(adverts::LocalOffer, Duration)> {
    (role == Role::Provider).then(|| {
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
    })
}

/// The lease desk: the book restored from the store (what restoring changed is written
/// back at once), the queue order and fair share, lending hours (from the inventory's
/// owner rules) and the owner's policy.
fn build_desk(
    opts: &NodeOptions,
    store: &Store,
    keypair: &libp2p::identity::Keypair,
    first_snapshot: &InventorySnapshot,
    offer: &Option<(adverts::LocalOffer, Duration)>,
    in_team: bool,
    lending: crate::owner::LendingHours,
) -> Result<lease::LeaseDesk, NodeError> {
    let config = &opts.config;
    let policy = lease::LeasePolicy {
        max_duration_ms: config.max_lease_duration.as_millis() as u64,
        // What the advert says, unless a test network's cheat charges more.
        price_per_gpu_hour_millicredits: ((config.price_per_gpu_hour * 1000.0).round() as u64)
            .saturating_mul(opts.misbehaviour.overcharge.max(1)),
        backends: config.backends.clone(),
        max_gpus_per_peer: config.max_gpus_per_peer.unwrap_or_else(|| {
            lease::policy::default_max_gpus_per_peer(first_snapshot.gpus.len(), in_team)
        }),
        allow_peers: config.allow_peers.clone(),
        deny_peers: config.deny_peers.clone(),
        offer_window_ms: config.offer_window.as_millis() as u64,
        retention_ms: config.lease_retention.as_millis() as u64,
    };
    let capacity = match offer {
        Some((o, _)) => event_loop::capacity_from(first_snapshot, o.cpu_cores, o.ram_bytes),
        None => lease::Capacity::default(),
    };
    let (stored_leases, stored_nonces) = lease::persist::load(store)?;
    let mut book = lease::LeaseBook::restore(
        keypair.public().to_peer_id(),
        policy,
        capacity,
        stored_leases,
        stored_nonces,
        gpunode_protocol::time::now_ms(),
    );
    let restored = book.take_changes();
    lease::persist::write(store, &book, &restored)?;
    store.flush()?;
    Ok(lease::LeaseDesk::new(lease::desk::DeskParts {
        book,
        keypair: keypair.clone(),
        order: config.queue_order.into(),
        fair_share: lease::persist::load_fair_share(store),
        lending,
        owner: (config.owner_policy, config.owner_grace.as_millis() as u64),
        fixed_lease_id: opts.misbehaviour.fixed_lease_id,
    }))
}
