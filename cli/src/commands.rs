//! What each subcommand does: build the node's config from file and flags, then call the
//! node library or the daemon's local API.

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use gpunode_node::api::{ApiClient, OffersQuery};
use gpunode_node::config::{parse_multiaddr, ConfigError};
use gpunode_node::{DataDir, Node, NodeConfig, NodeOptions, NodeStatus, OfferView, Role};
use gpunode_protocol::advert::OfferFilter;
use gpunode_protocol::units::{parse_bytes, parse_duration};

use crate::output;
use crate::{
    Cli, Command, LeaseCancelArgs, LeaseCommand, LeaseRenewArgs, LeaseRequestArgs, LeasesArgs,
    NetworkArgs, OffersArgs, ReservationAction, ReservationsArgs, ServeArgs, StatusArgs,
};
use gpunode_node::api::RenewBody;
use gpunode_node::{CancelOutcome, LeaseSpec, LeaseView, NodeHandle};

pub async fn run(cli: Cli) -> Result<ExitCode> {
    let data_dir = match &cli.data_dir {
        Some(d) => DataDir::new(d),
        None => DataDir::default_location()?,
    };
    let config = load_config(&cli)?;
    match cli.command {
        Command::Serve(args) => serve(data_dir, config, args).await,
        Command::Offers(args) => offers(data_dir, config, args).await,
        Command::Status(args) => status(data_dir, args).await,
        Command::Lease(LeaseCommand::Request(args)) => lease_request(data_dir, config, args).await,
        Command::Lease(LeaseCommand::Renew(args)) => lease_renew(data_dir, config, args).await,
        Command::Lease(LeaseCommand::Cancel(args)) => lease_cancel(data_dir, config, args).await,
        Command::Leases(args) => leases(data_dir, config, args).await,
        Command::Reserve(args) => lease_request(data_dir, config, args.into()).await,
        Command::Reservations(ReservationsArgs {
            action: Some(ReservationAction::Cancel(args)),
            ..
        }) => lease_cancel(data_dir, config, args).await,
        Command::Reservations(ReservationsArgs {
            action: Some(ReservationAction::Renew(args)),
            ..
        }) => lease_renew(data_dir, config, args).await,
        Command::Reservations(ReservationsArgs { action: None, json }) => {
            reservations(data_dir, config, json).await
        }
        Command::Run(args) => crate::jobs::run(data_dir, config, args).await,
        Command::Jobs(args) => crate::jobs::jobs(data_dir, args.json).await,
        Command::Logs(args) => crate::jobs::logs(data_dir, args).await,
        Command::Cancel(args) => crate::jobs::cancel(data_dir, args).await,
        Command::Why(args) => crate::jobs::why(data_dir, args).await,
        Command::Ledger(args) => crate::ledger::ledger(data_dir, config, args).await,
        Command::Peers(args) => crate::ledger::peers(data_dir, config, args.json).await,
        Command::Team(cmd) => crate::team::team(data_dir, cmd).await,
        Command::Id => {
            let key = data_dir.load_or_create_identity()?;
            println!("{}", key.public().to_peer_id());
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn load_config(cli: &Cli) -> Result<NodeConfig> {
    Ok(match &cli.config {
        Some(path) => NodeConfig::load(path, true)?,
        None => match DataDir::default_config_file() {
            Some(path) => NodeConfig::load(&path, false)?,
            None => NodeConfig::default(),
        },
    })
}

fn init_logging(filter: &str) {
    // Kademlia warns about bootstrapping while a node has no peers yet; that is normal.
    let filter = std::env::var("RUST_LOG")
        .unwrap_or_else(|_| format!("{filter},libp2p_kad=error,libp2p_mdns=warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&filter)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

fn apply_network_args(config: &mut NodeConfig, net: &NetworkArgs) -> Result<(), ConfigError> {
    for b in &net.bootstrap {
        config.bootstrap.push(parse_multiaddr("bootstrap", b)?);
    }
    if net.no_mdns {
        config.mdns = false;
    }
    Ok(())
}

fn apply_serve_args(config: &mut NodeConfig, args: &ServeArgs) -> Result<(), ConfigError> {
    apply_network_args(config, &args.net)?;
    if !args.listen.is_empty() {
        config.listen = args
            .listen
            .iter()
            .map(|a| parse_multiaddr("listen", a))
            .collect::<Result<_, _>>()?;
    }
    if let Some(spec) = &args.simulate_gpus {
        config.simulate_gpus = Some(spec.clone());
    }
    if let Some(psk) = &args.team_psk {
        config.team_psk = Some(psk.clone());
    }
    if let Some(p) = args.price {
        config.price_per_gpu_hour = p;
    }
    if let Some(b) = &args.backends {
        config.backends = b.clone();
    }
    if let Some(m) = &args.metrics_addr {
        config.metrics_addr = Some(m.parse().map_err(|_| {
            ConfigError::Invalid(format!(
                "invalid --metrics-addr '{m}': expected IP:PORT such as 127.0.0.1:9464"
            ))
        })?);
    }
    let duration = |flag: &str, v: &str| {
        parse_duration(v).map_err(|e| ConfigError::Invalid(format!("invalid --{flag}: {e}")))
    };
    if let Some(t) = &args.advert_ttl {
        config.advert_ttl = duration("advert-ttl", t)?;
    }
    if let Some(t) = &args.inventory_poll {
        config.inventory_poll = duration("inventory-poll", t)?;
    }
    config.validate()
}

async fn serve(data_dir: DataDir, mut config: NodeConfig, args: ServeArgs) -> Result<ExitCode> {
    apply_serve_args(&mut config, &args)?;
    init_logging(&config.log);
    let mut opts = NodeOptions::new(config, data_dir.clone(), Role::Provider);
    opts.wasm_worker = wasm_worker();
    let node = Node::start(opts).await.context("cannot start the node")?;
    let handle = node.handle();
    tracing::info!(
        "gpunode {} serving as {} (data dir {})",
        env!("CARGO_PKG_VERSION"),
        handle.peer_id(),
        data_dir.root().display()
    );
    wait_for_stop_signal().await?;
    tracing::info!("shutting down: withdrawing advert and flushing the store");
    if tokio::time::timeout(Duration::from_secs(10), node.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("shutdown took over 10s; exiting anyway");
    }
    Ok(ExitCode::SUCCESS)
}

/// This binary, which doubles as the sandbox worker; `None` (guests on threads) if
/// its path cannot be found.
fn wasm_worker() -> Option<std::path::PathBuf> {
    std::env::current_exe().ok()
}

async fn wait_for_stop_signal() -> Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("cannot install SIGTERM handler")?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r.context("cannot listen for Ctrl-C")?,
        _ = term.recv() => {}
    }
    Ok(())
}

fn offer_filter(args: &OffersArgs) -> Result<OfferFilter> {
    let min_gpu_mem_bytes = match &args.min_gpu_mem {
        Some(s) => Some(parse_bytes(s).map_err(|e| anyhow::anyhow!("invalid --min-gpu-mem: {e}"))?),
        None => None,
    };
    Ok(OfferFilter {
        gpu_model: args.gpu_model.clone(),
        gpu_slice: args.slice.gpu_slice.clone(),
        min_gpu_mem_bytes,
        gpus: args.gpus,
        backend: args.backend.clone(),
    })
}

async fn offers(data_dir: DataDir, mut config: NodeConfig, args: OffersArgs) -> Result<ExitCode> {
    let filter = offer_filter(&args)?;
    let client = ApiClient::new(&data_dir.api_socket());
    let offers: Vec<OfferView> = if client.is_running().await {
        let q = OffersQuery {
            gpu_model: filter.gpu_model.clone(),
            gpu_slice: filter.gpu_slice.clone(),
            min_gpu_mem: filter.min_gpu_mem_bytes,
            gpus: filter.gpus,
            backend: filter.backend.clone(),
        };
        let query = serde_urlencoded_query(&q);
        client.get_json(&format!("/v1/offers{query}")).await?
    } else {
        let node = ClientNode::start(data_dir, &mut config, &args.net).await?;
        let offers = node.handle.find_offers(filter).await;
        node.stop().await;
        offers?
    };
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &offers)?;
        writeln!(out)?;
    } else {
        output::print_offers(&mut out, &offers)?;
    }
    Ok(ExitCode::SUCCESS)
}

fn serde_urlencoded_query(q: &OffersQuery) -> String {
    let mut parts = Vec::new();
    let enc = |s: &str| -> String {
        s.bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect()
    };
    if let Some(m) = &q.gpu_model {
        parts.push(format!("gpu_model={}", enc(m)));
    }
    if let Some(slice) = &q.gpu_slice {
        parts.push(format!("gpu_slice={}", enc(slice)));
    }
    if let Some(m) = q.min_gpu_mem {
        parts.push(format!("min_gpu_mem={m}"));
    }
    if let Some(n) = q.gpus {
        parts.push(format!("gpus={n}"));
    }
    if let Some(b) = &q.backend {
        parts.push(format!("backend={}", enc(b)));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!("?{}", parts.join("&"))
    }
}

/// A short-lived node for commands run without a daemon: same identity and store as
/// the daemon would use (the store lock keeps one owner), advertises nothing.
pub(crate) struct ClientNode {
    node: Node,
    pub(crate) handle: NodeHandle,
}

impl ClientNode {
    pub(crate) async fn start(
        data_dir: DataDir,
        config: &mut NodeConfig,
        net: &NetworkArgs,
    ) -> Result<ClientNode> {
        apply_network_args(config, net)?;
        let discover_for = parse_duration(&net.discover_for)
            .map_err(|e| anyhow::anyhow!("invalid --discover-for: {e}"))?;
        init_logging("warn");
        if config.bootstrap.is_empty() && !config.mdns {
            anyhow::bail!(
                "no daemon is running and there is no way to find peers: pass --bootstrap MULTIADDR or enable mDNS"
            );
        }
        let mut opts = NodeOptions::new(config.clone(), data_dir, Role::Client);
        opts.serve_api = false;
        opts.wasm_worker = wasm_worker();
        opts.inventory = Some(Arc::new(gpunode_node::inventory::NoGpus));
        let node = Node::start(opts)
            .await
            .context("cannot start a client node")?;
        let handle = node.handle();
        // Wait until a peer is in the routing table (or the discovery time is up), then
        // give the routing table a moment to fill from the first peers' answers.
        if handle.wait_for_routing(1, discover_for).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(300)).await;
        } else {
            eprintln!("warning: found no peers within {discover_for:?}; is any gpunode reachable?");
        }
        Ok(ClientNode { node, handle })
    }

    pub(crate) async fn stop(self) {
        self.node.shutdown().await;
    }
}

pub(crate) fn print_json<T: serde::Serialize>(value: &T) -> Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, value)?;
    writeln!(out)?;
    Ok(())
}

fn print_lease_view(view: &LeaseView, json: bool) -> Result<ExitCode> {
    if json {
        print_json(view)?;
    } else {
        output::print_lease(&mut std::io::stdout().lock(), view)?;
    }
    Ok(ExitCode::SUCCESS)
}

pub(crate) fn parse_size(flag: &str, v: &str) -> Result<u64> {
    parse_bytes(v).map_err(|e| anyhow::anyhow!("invalid --{flag}: {e}"))
}

pub(crate) fn parse_time(flag: &str, v: &str) -> Result<Duration> {
    parse_duration(v).map_err(|e| anyhow::anyhow!("invalid --{flag}: {e}"))
}

async fn lease_request(
    data_dir: DataDir,
    mut config: NodeConfig,
    args: LeaseRequestArgs,
) -> Result<ExitCode> {
    let spec = LeaseSpec {
        peer: args.provider.peer.clone(),
        gpus: args.provider.gpus,
        gpu_model: args.gpu_model.clone(),
        gpu_slice: args.slice.gpu_slice.clone(),
        min_gpu_mem_bytes: args
            .size
            .min_gpu_mem
            .as_deref()
            .map(|m| parse_size("min-gpu-mem", m))
            .transpose()?,
        cpus: args.size.cpus,
        mem_bytes: parse_size("mem", &args.size.mem)?,
        backend: args.backend.clone(),
        duration_ms: parse_time("duration", &args.duration)?.as_millis() as u64,
        max_price: args.price.max_price,
        exclude: Vec::new(),
        kind: if args.batch {
            gpunode_protocol::team::JobKind::Batch
        } else {
            gpunode_protocol::team::JobKind::Interactive
        },
        ticket: None,
        start_at_ms: args
            .at
            .as_deref()
            .map(|t| {
                gpunode_protocol::time::parse_utc(t)
                    .map_err(|e| anyhow::anyhow!("invalid --at: {e}"))
            })
            .transpose()?,
    };
    if let Some(at) = spec.start_at_ms {
        if at <= gpunode_protocol::time::now_ms() {
            anyhow::bail!(
                "invalid --at: {} is not in the future",
                gpunode_protocol::time::format_utc(at)
            );
        }
    }
    if spec.duration_ms == 0 {
        anyhow::bail!("invalid --duration: a lease must last longer than 0");
    }
    let client = ApiClient::new(&data_dir.api_socket());
    let view: LeaseView = if client.is_running().await {
        client.post_json("/v1/leases", &spec).await?
    } else {
        let node = ClientNode::start(data_dir, &mut config, &args.net).await?;
        let r = node.handle.request_lease(spec).await;
        node.stop().await;
        r?
    };
    print_lease_view(&view, args.json)
}

async fn lease_renew(
    data_dir: DataDir,
    mut config: NodeConfig,
    args: LeaseRenewArgs,
) -> Result<ExitCode> {
    let extend = parse_time("for", &args.extend)?;
    let client = ApiClient::new(&data_dir.api_socket());
    let view: LeaseView = if client.is_running().await {
        let body = RenewBody {
            extend_ms: extend.as_millis() as u64,
        };
        client
            .post_json(
                &format!("/v1/leases/{}/renew", url_segment(&args.id)),
                &body,
            )
            .await?
    } else {
        let node = ClientNode::start(data_dir, &mut config, &args.net).await?;
        let r = node.handle.renew_lease(&args.id, extend).await;
        node.stop().await;
        r?
    };
    print_lease_view(&view, args.json)
}

async fn lease_cancel(
    data_dir: DataDir,
    mut config: NodeConfig,
    args: LeaseCancelArgs,
) -> Result<ExitCode> {
    let client = ApiClient::new(&data_dir.api_socket());
    let outcome: CancelOutcome = if client.is_running().await {
        client
            .post_json(
                &format!("/v1/leases/{}/cancel", url_segment(&args.id)),
                &serde_json::json!({}),
            )
            .await?
    } else {
        let node = ClientNode::start(data_dir, &mut config, &args.net).await?;
        let r = node.handle.cancel_lease(&args.id).await;
        node.stop().await;
        r?
    };
    if args.json {
        print_json(&outcome)?;
    } else {
        println!(
            "Lease {} cancelled; its resources are released.",
            outcome.lease.lease_id
        );
        match (&outcome.peer_notified, &outcome.peer_error) {
            (true, _) => println!("The other party acknowledged the cancellation."),
            (false, Some(e)) => println!("The other party was not notified: {e}"),
            (false, None) => println!("The other party was not notified."),
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Starts this node's identity and store without any network (no bootstrap, no mDNS),
/// for commands that only read local state while no daemon runs.
pub(crate) async fn offline_node(data_dir: DataDir, config: NodeConfig) -> Result<Node> {
    let mut config = config;
    config.bootstrap.clear();
    config.mdns = false;
    let mut opts = NodeOptions::new(config, data_dir, Role::Client);
    opts.serve_api = false;
    opts.inventory = Some(Arc::new(gpunode_node::inventory::NoGpus));
    Node::start(opts)
        .await
        .context("cannot open this node's store")
}

/// Every lease, from the daemon or (when none runs) the store.
async fn lease_list(data_dir: DataDir, config: NodeConfig) -> Result<Vec<LeaseView>> {
    let client = ApiClient::new(&data_dir.api_socket());
    if client.is_running().await {
        return Ok(client.get_json("/v1/leases").await?);
    }
    let node = offline_node(data_dir, config).await?;
    let r = node.handle().list_leases().await;
    node.shutdown().await;
    Ok(r?)
}

async fn leases(data_dir: DataDir, config: NodeConfig, args: LeasesArgs) -> Result<ExitCode> {
    let views = lease_list(data_dir, config).await?;
    if args.json {
        print_json(&views)?;
    } else {
        output::print_leases(&mut std::io::stdout().lock(), &views)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `gpunode reservations`: leases that start later.
async fn reservations(data_dir: DataDir, config: NodeConfig, json: bool) -> Result<ExitCode> {
    let views: Vec<LeaseView> = lease_list(data_dir, config)
        .await?
        .into_iter()
        .filter(|l| l.state == gpunode_node::lease::LeaseState::Reserved)
        .collect();
    if json {
        print_json(&views)?;
    } else if views.is_empty() {
        println!("No reservations. Book GPUs for later with `gpunode reserve --gpus 1 --at \"YYYY-MM-DD HH:MM\" --for 2h`.");
    } else {
        output::print_leases(&mut std::io::stdout().lock(), &views)?;
    }
    Ok(ExitCode::SUCCESS)
}

pub(crate) fn url_segment(id: &str) -> String {
    id.chars().filter(|c| c.is_ascii_alphanumeric()).collect()
}

async fn status(data_dir: DataDir, args: StatusArgs) -> Result<ExitCode> {
    let client = ApiClient::new(&data_dir.api_socket());
    if !client.is_running().await {
        let id = data_dir
            .load_identity()?
            .map(|k| k.public().to_peer_id().to_string())
            .unwrap_or_else(|| "(no identity yet)".to_string());
        if args.json {
            println!(
                "{}",
                serde_json::json!({"peer_id": id, "running": false, "data_dir": data_dir.root()})
            );
        } else {
            println!("Peer ID:   {id}");
            println!("Data dir:  {}", data_dir.root().display());
            println!("Daemon:    not running (start it with `gpunode serve`)");
        }
        return Ok(ExitCode::from(1));
    }
    let status: NodeStatus = client.get_json("/v1/status").await?;
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &status)?;
        writeln!(out)?;
    } else {
        output::print_status(&mut out, &status)?;
    }
    Ok(ExitCode::SUCCESS)
}
