//! `gpunode lease request|renew|cancel`, `leases`, `reserve` and `reservations`: signed
//! leases, now or for later, through the daemon or a short-lived client node.

use std::process::ExitCode;

use anyhow::Result;
use gpunode_node::api::RenewBody;
use gpunode_node::lease::LeaseState;
use gpunode_node::{CancelOutcome, DataDir, LeaseSpec, LeaseView, NodeConfig};
use gpunode_protocol::time::{format_utc, now_ms, parse_utc};

use crate::args::{LeaseCancelArgs, LeaseRenewArgs, LeaseRequestArgs, LeasesArgs};
use crate::helpers::{job_kind, parse_size, parse_size_opt, parse_time, print_json, url_segment};
use crate::output;
use crate::target::Target;

/// `gpunode lease request` (and `gpunode reserve`, which is one with `--at`).
pub async fn request(
    data_dir: DataDir,
    config: NodeConfig,
    args: LeaseRequestArgs,
) -> Result<ExitCode> {
    let spec = lease_spec(&args)?;
    let view: LeaseView = match Target::daemon_or_network(data_dir, config, &args.net).await? {
        Target::Daemon(api) => api.post_json("/v1/leases", &spec).await?,
        Target::Local(node) => node.once(async |h| h.request_lease(spec).await).await?,
    };
    print_lease_view(&view, args.json)
}

/// The lease the flags ask for, checked: it starts in the future and lasts.
fn lease_spec(args: &LeaseRequestArgs) -> Result<LeaseSpec> {
    let spec = LeaseSpec {
        peer: args.provider.peer.clone(),
        gpus: args.provider.gpus,
        gpu_model: args.gpu_model.clone(),
        gpu_slice: args.slice.gpu_slice.clone(),
        min_gpu_mem_bytes: parse_size_opt("min-gpu-mem", args.size.min_gpu_mem.as_deref())?,
        cpus: args.size.cpus,
        mem_bytes: parse_size("mem", &args.size.mem)?,
        backend: args.backend.clone(),
        duration_ms: parse_time("duration", &args.duration)?.as_millis() as u64,
        max_price: args.price.max_price,
        exclude: Vec::new(),
        kind: job_kind(args.batch),
        ticket: None,
        start_at_ms: args
            .at
            .as_deref()
            .map(|t| parse_utc(t).map_err(|e| anyhow::anyhow!("invalid --at: {e}")))
            .transpose()?,
    };
    if let Some(at) = spec.start_at_ms {
        if at <= now_ms() {
            anyhow::bail!("invalid --at: {} is not in the future", format_utc(at));
        }
    }
    if spec.duration_ms == 0 {
        anyhow::bail!("invalid --duration: a lease must last longer than 0");
    }
    Ok(spec)
}

/// `gpunode lease renew` and `gpunode reservations renew`.
pub async fn renew(
    data_dir: DataDir,
    config: NodeConfig,
    args: LeaseRenewArgs,
) -> Result<ExitCode> {
    let extend = parse_time("for", &args.extend)?;
    let view: LeaseView = match Target::daemon_or_network(data_dir, config, &args.net).await? {
        Target::Daemon(api) => {
            let body = RenewBody {
                extend_ms: extend.as_millis() as u64,
            };
            let path = format!("/v1/leases/{}/renew", url_segment(&args.id));
            api.post_json(&path, &body).await?
        }
        Target::Local(node) => {
            node.once(async |h| h.renew_lease(&args.id, extend).await)
                .await?
        }
    };
    print_lease_view(&view, args.json)
}

/// `gpunode lease cancel` and `gpunode reservations cancel`.
pub async fn cancel(
    data_dir: DataDir,
    config: NodeConfig,
    args: LeaseCancelArgs,
) -> Result<ExitCode> {
    let outcome: CancelOutcome =
        match Target::daemon_or_network(data_dir, config, &args.net).await? {
            Target::Daemon(api) => {
                let path = format!("/v1/leases/{}/cancel", url_segment(&args.id));
                api.post_json(&path, &serde_json::json!({})).await?
            }
            Target::Local(node) => node.once(async |h| h.cancel_lease(&args.id).await).await?,
        };
    if args.json {
        print_json(&outcome)?;
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "Lease {} cancelled; its resources are released.",
        outcome.lease.lease_id
    );
    match (&outcome.peer_notified, &outcome.peer_error) {
        (true, _) => println!("The other party acknowledged the cancellation."),
        (false, Some(e)) => println!("The other party was not notified: {e}"),
        (false, None) => println!("The other party was not notified."),
    }
    Ok(ExitCode::SUCCESS)
}

/// `gpunode leases`.
pub async fn leases(data_dir: DataDir, config: NodeConfig, args: LeasesArgs) -> Result<ExitCode> {
    let views = lease_list(data_dir, config).await?;
    if args.json {
        print_json(&views)?;
    } else {
        output::print_leases(&mut std::io::stdout().lock(), &views)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `gpunode reservations`: leases that start later.
pub async fn reservations(data_dir: DataDir, config: NodeConfig, json: bool) -> Result<ExitCode> {
    let views: Vec<LeaseView> = lease_list(data_dir, config)
        .await?
        .into_iter()
        .filter(|l| l.state == LeaseState::Reserved)
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

/// Every lease, from the daemon or (when none runs) the store.
async fn lease_list(data_dir: DataDir, config: NodeConfig) -> Result<Vec<LeaseView>> {
    Ok(match Target::daemon_or_store(data_dir, config).await? {
        Target::Daemon(api) => api.get_json("/v1/leases").await?,
        Target::Local(node) => node.once(async |h| h.list_leases().await).await?,
    })
}

fn print_lease_view(view: &LeaseView, json: bool) -> Result<ExitCode> {
    if json {
        print_json(view)?;
    } else {
        output::print_lease(&mut std::io::stdout().lock(), view)?;
    }
    Ok(ExitCode::SUCCESS)
}
