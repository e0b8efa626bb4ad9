//! `gpunode serve`: fold the serve flags over the config, run the provider node until
//! Ctrl-C or SIGTERM, then shut it down.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use gpunode_node::config::{parse_multiaddr, ConfigError};
use gpunode_node::{DataDir, Node, NodeConfig, NodeOptions, Role};
use gpunode_protocol::units::parse_duration;

use crate::args::ServeArgs;
use crate::helpers::{init_logging, wasm_worker};
use crate::target::apply_network_args;

/// `gpunode serve`.
pub async fn serve(data_dir: DataDir, mut config: NodeConfig, args: ServeArgs) -> Result<ExitCode> {
    apply_serve_args(&mut config, &args)?;
    init_logging(&config.log);
    let mut opts = NodeOptions::new(config.clone(), data_dir.clone(), Role::Provider);
    opts.wasm_worker = wasm_worker();
    let node = Node::start(opts).await.context("cannot start the node")?;
    let handle = node.handle();
    tracing::info!(
        "gpunode {} serving as {} (data dir {}, allocator {})",
        env!("CARGO_PKG_VERSION"),
        handle.peer_id(),
        data_dir.root().display(),
        gpunode_node::allocator::name()
    );
    let (stop_dashboard, dashboard_stopped) = tokio::sync::watch::channel(false);
    let dashboard = start_dashboard(&config, &handle, dashboard_stopped).await;
    crate::systemd::notify(&format!("READY=1\nSTATUS=serving as {}", handle.peer_id()));
    wait_for_stop_signal().await?;
    crate::systemd::notify("STOPPING=1");
    let _ = stop_dashboard.send(true);
    if let Some(task) = dashboard {
        let _ = tokio::time::timeout(Duration::from_secs(2), task).await;
    }
    tracing::info!("shutting down: withdrawing advert and flushing the store");
    if tokio::time::timeout(Duration::from_secs(10), node.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("shutdown took over 10s; exiting anyway");
    }
    Ok(ExitCode::SUCCESS)
}

/// Starts the web dashboard where the config says. A port in use is not fatal: the
/// node serves without a dashboard and says how to move it.
async fn start_dashboard(
    config: &NodeConfig,
    handle: &gpunode_node::NodeHandle,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Option<tokio::task::JoinHandle<()>> {
    if !config.dashboard {
        return None;
    }
    let listener = match gpunode_dashboard::bind(config.dashboard_addr).await {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(
                "no dashboard: cannot listen on {} ({e}); set dashboard_addr in the config \
                 (port 0 picks a free one) or dashboard = false",
                config.dashboard_addr
            );
            return None;
        }
    };
    let addr = listener.local_addr().ok()?;
    let token = gpunode_dashboard::new_token();
    handle.set_dashboard_url(gpunode_dashboard::url(addr, &token));
    tracing::info!("dashboard on http://{addr}/ (`gpunode dashboard` prints its link)");
    let serve = gpunode_dashboard::serve(listener, handle.clone(), token, stop);
    Some(tokio::spawn(serve))
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
    if args.no_dashboard {
        config.dashboard = false;
    }
    if let Some(a) = &args.dashboard_addr {
        config.dashboard_addr = a.parse().map_err(|_| {
            ConfigError::Invalid(format!(
                "invalid --dashboard-addr '{a}': expected IP:PORT such as 127.0.0.1:4171"
            ))
        })?;
    }
    if let Some(t) = &args.inventory_poll {
        config.inventory_poll = duration("inventory-poll", t)?;
    }
    config.validate()
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
