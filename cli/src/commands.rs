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
use crate::{Cli, Command, NetworkArgs, OffersArgs, ServeArgs, StatusArgs};

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
    let node = Node::start(NodeOptions::new(config, data_dir.clone(), Role::Provider))
        .await
        .context("cannot start the node")?;
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
        min_gpu_mem_bytes,
        gpus: args.gpus,
        backend: args.backend.clone(),
    })
}

async fn offers(data_dir: DataDir, mut config: NodeConfig, args: OffersArgs) -> Result<ExitCode> {
    let filter = offer_filter(&args)?;
    let discover_for = parse_duration(&args.discover_for)
        .map_err(|e| anyhow::anyhow!("invalid --discover-for: {e}"))?;
    let client = ApiClient::new(&data_dir.api_socket());
    let offers: Vec<OfferView> = if client.is_running().await {
        let q = OffersQuery {
            gpu_model: filter.gpu_model.clone(),
            min_gpu_mem: filter.min_gpu_mem_bytes,
            gpus: filter.gpus,
            backend: filter.backend.clone(),
        };
        let query = serde_urlencoded_query(&q);
        client.get_json(&format!("/v1/offers{query}")).await?
    } else {
        apply_network_args(&mut config, &args.net)?;
        init_logging("warn");
        if config.bootstrap.is_empty() && !config.mdns {
            anyhow::bail!(
                "no daemon is running and there is no way to find peers: pass --bootstrap MULTIADDR or enable mDNS"
            );
        }
        query_with_client_node(data_dir, config, filter, discover_for).await?
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
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => (b as char).to_string(),
                _ => format!("%{b:02X}"),
            })
            .collect()
    };
    if let Some(m) = &q.gpu_model {
        parts.push(format!("gpu_model={}", enc(m)));
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

/// Starts a short-lived client node, waits until it has found peers, asks, and stops.
async fn query_with_client_node(
    data_dir: DataDir,
    config: NodeConfig,
    filter: OfferFilter,
    discover_for: Duration,
) -> Result<Vec<OfferView>> {
    let mut opts = NodeOptions::new(config, data_dir, Role::Client);
    opts.serve_api = false;
    opts.inventory = Some(Arc::new(gpunode_node::inventory::NoGpus));
    let node = Node::start(opts).await.context("cannot start a client node")?;
    let handle = node.handle();
    // Wait until a peer is in the routing table (or the discovery time is up), then
    // give the routing table a moment to fill from the first peers' answers.
    let found = handle.wait_for_routing(1, discover_for).await.is_ok();
    if found {
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let offers = if found {
        handle.find_offers(filter).await?
    } else {
        eprintln!("warning: found no peers within {discover_for:?}; is any gpunode reachable?");
        Vec::new()
    };
    node.shutdown().await;
    Ok(offers)
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
