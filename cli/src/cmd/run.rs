//! `gpunode run`: turn the flags into a job request, submit it to the daemon (or to a
//! short-lived client node when none runs), follow it, and exit with the task's own
//! exit code.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Result;
use gpunode_node::jobs::{ContainerRequest, JobRequest, JobSummary};
use gpunode_node::{DataDir, NodeConfig};

use crate::args::RunArgs;
use crate::cmd::follow::{follow, outcome_words, End, Until};
use crate::helpers::{absolute, job_kind, parse_size, parse_size_opt, parse_time};
use crate::output;
use crate::target::Target;

/// Why `run --detach` fails without a daemon.
const DETACH_NEEDS_DAEMON: &str =
    "--detach needs a running daemon to keep the job going: start `gpunode serve` first";

/// `gpunode run`.
pub async fn run(data_dir: DataDir, config: NodeConfig, args: RunArgs) -> Result<ExitCode> {
    let req = job_request(&args)?;
    let target = if args.detach {
        Target::Daemon(Target::require_daemon(&data_dir, DETACH_NEEDS_DAEMON).await?)
    } else {
        Target::daemon_or_network(data_dir, config, &args.net).await?
    };
    let view = target.submit(req).await?;
    if args.detach {
        println!("{}", view.job_id);
        eprintln!(
            "job {} submitted; follow it with `gpunode logs --follow {}`",
            view.job_id, view.job_id
        );
        return Ok(ExitCode::SUCCESS);
    }
    let quiet = args.quiet;
    // Without the summary line nothing waits for the receipt: the daemon settles it.
    let until = if quiet {
        Until::Outputs
    } else {
        Until::Settled
    };
    let result = follow(&target, &view.job_id, (quiet, until), true).await;
    target.close().await;
    match result? {
        End::Finished(summary) => {
            if !quiet {
                eprintln!("{}", summary_line(&view.job_id, &summary));
            }
            Ok(ExitCode::from(summary.exit_code.clamp(0, 255) as u8))
        }
        End::Failed(error) => anyhow::bail!("job {} failed: {error}", view.job_id),
    }
}

/// The job the flags describe, with every path made absolute.
fn job_request(args: &RunArgs) -> Result<JobRequest> {
    let env = env_pairs(&args.env)?;
    let (module, container, task_args) = if is_container(args) {
        container_task(args)?
    } else {
        wasm_task(args)?
    };
    let (output_dir, per_job) = match &args.output {
        Some(dir) => (absolute(dir)?, false),
        None => (absolute(Path::new("gpunode-out"))?, true),
    };
    let timeout = parse_time("timeout", &args.timeout)?;
    if timeout.is_zero() {
        anyhow::bail!("invalid --timeout: it must be longer than 0");
    }
    Ok(JobRequest {
        module,
        container,
        inputs: args
            .input
            .iter()
            .map(|p| absolute(p))
            .collect::<Result<_>>()?,
        output_dir,
        output_per_job: per_job,
        args: task_args,
        env,
        gpus: args.gpus,
        gpu_model: args.gpu_model.clone(),
        gpu_slice: args.slice.gpu_slice.clone(),
        cpus: args.cpus,
        mem_bytes: parse_size("mem", &args.mem)?,
        timeout_ms: timeout.as_millis() as u64,
        max_price: args.price.max_price,
        peer: args.peer.clone(),
        retries: args.retries,
        fuel: args.fuel,
        replicas: args.replicas,
        reservation: args.reservation.clone(),
        max_output_bytes: parse_size_opt("max-output", args.max_output.as_deref())?,
        max_output_files: args.max_output_files,
        allow_relayed_data: args.allow_relayed_data,
        wait: match (args.wait, args.no_wait) {
            (true, _) => Some(true),
            (_, true) => Some(false),
            _ => None,
        },
        kind: job_kind(args.batch),
    })
}

/// `--env NAME=VALUE` flags as pairs.
fn env_pairs(flags: &[String]) -> Result<Vec<(String, String)>> {
    let mut env = Vec::new();
    for kv in flags {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| anyhow::anyhow!("invalid --env '{kv}': expected NAME=VALUE"))?;
        if k.is_empty() {
            anyhow::bail!("invalid --env '{kv}': the name is empty");
        }
        env.push((k.to_string(), v.to_string()));
    }
    Ok(env)
}

/// `--backend container`, or no `--backend` but `--image` or `--host-env`.
fn is_container(args: &RunArgs) -> bool {
    args.backend.as_deref() == Some("container")
        || (args.backend.is_none() && (args.image.is_some() || args.host_env))
}

/// What a job runs: the path shown for it, the container (if any), the task's arguments.
type Task = (PathBuf, Option<ContainerRequest>, Vec<String>);

/// A container job: an image archive or the provider's system, and the command after `--`.
fn container_task(args: &RunArgs) -> Result<Task> {
    if let Some(task) = &args.task {
        anyhow::bail!(
            "a container job takes no TASK file ({}): put the command after --, e.g. gpunode run --image img.tar -- python train.py",
            task.display()
        );
    }
    let image = args.image.as_deref().map(absolute).transpose()?;
    match &image {
        Some(path) if !path.is_file() => {
            anyhow::bail!("image archive {} does not exist", path.display())
        }
        None if !args.host_env => anyhow::bail!(
            "a container job needs --image ARCHIVE (docker save, OCI archive) or --host-env"
        ),
        None if args.args.is_empty() => anyhow::bail!(
            "--host-env needs a command after --, e.g. gpunode run --host-env -- nvidia-smi"
        ),
        _ => {}
    }
    let shown = image
        .clone()
        .unwrap_or_else(|| PathBuf::from(args.args.first().cloned().unwrap_or_default()));
    let request = ContainerRequest {
        image,
        command: args.args.clone(),
    };
    Ok((shown, Some(request), Vec::new()))
}

/// A wasm job: the TASK file and the arguments after `--`.
fn wasm_task(args: &RunArgs) -> Result<Task> {
    if args.image.is_some() || args.host_env {
        anyhow::bail!("--image and --host-env are for --backend container");
    }
    let Some(task) = &args.task else {
        anyhow::bail!(
            "give a TASK file (.wasm or .wat), or run a container with --image ARCHIVE or --host-env"
        );
    };
    let module = absolute(task)?;
    if !module.is_file() {
        anyhow::bail!(
            "task file {} does not exist (give a .wasm or .wat file)",
            task.display()
        );
    }
    Ok((module, None, args.args.clone()))
}

/// The line printed when a job ends: outcome, provider, time, GPU use, cost, outputs,
/// and whether replicas agreed.
fn summary_line(job_id: &str, s: &JobSummary) -> String {
    let outputs = if s.outputs.is_empty() {
        String::new()
    } else {
        format!(
            "; {} output file(s) in {}",
            s.outputs.len(),
            display_path(&s.output_dir)
        )
    };
    let retries = if s.attempts > 1 {
        format!(" after {} attempts", s.attempts)
    } else {
        String::new()
    };
    let receipt = match s.receipt.as_str() {
        "settled" | "" => String::new(),
        "pending" => " (estimate: receipt pending)".to_string(),
        other => format!(" (estimate: {other})"),
    };
    let gpu = match &s.gpu {
        Some(g) => format!(
            ", GPU {:.1}s (peak {})",
            g.gpu_ms as f64 / 1000.0,
            gpunode_protocol::units::format_bytes(g.peak_memory_bytes)
        ),
        None => String::new(),
    };
    let mut line = format!(
        "gpunode: job {job_id} {} on {} in {:.2}s{gpu}{retries}, cost {} credits{receipt}{outputs}",
        outcome_words(&s.outcome),
        output::short_peer(&s.provider),
        s.wall_ms as f64 / 1000.0,
        format_credits(s.cost)
    );
    line.push_str(&replica_lines(s));
    line
}

/// Whether the replicas agreed, one line each for those that did not; empty without
/// replicas.
fn replica_lines(s: &JobSummary) -> String {
    if s.replicas.is_empty() {
        return String::new();
    }
    let agree = s.replicas.iter().filter(|r| r.agrees).count();
    if agree == s.replicas.len() {
        return format!(
            "\ngpunode: {} replicas agree (outputs {})",
            agree,
            &s.output_digest[..s.output_digest.len().min(16)]
        );
    }
    s.replicas
        .iter()
        .filter(|r| !r.agrees)
        .map(|r| {
            format!(
                "\ngpunode: replica mismatch: provider {} returned different outputs; {} of {} replicas agree on the result kept",
                output::short_peer(&r.provider),
                agree,
                s.replicas.len()
            )
        })
        .collect()
}

/// Credits with enough digits to show small amounts (a second on one GPU).
fn format_credits(c: f64) -> String {
    if c == 0.0 || c >= 0.01 {
        format!("{c:.2}")
    } else {
        format!("{c:.6}")
    }
}

fn display_path(p: &Path) -> String {
    match std::env::current_dir()
        .ok()
        .and_then(|cwd| p.strip_prefix(cwd).ok().map(Path::to_path_buf))
    {
        Some(rel) => format!("./{}", rel.display()),
        None => p.display().to_string(),
    }
}
