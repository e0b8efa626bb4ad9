//! `gpunode run`, `jobs`, `logs` and `cancel`: submit a job to the daemon (or to a
//! short-lived client node when none runs), follow its events, print its output as it
//! arrives, show transfer progress, and exit with the task's own exit code.

use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use gpunode_node::api::ApiClient;
use gpunode_node::jobs::table::EventPage;
use gpunode_node::jobs::{ContainerRequest, JobEvent, JobRequest, JobSummary, JobView};
use gpunode_node::{DataDir, NodeConfig, NodeHandle};
use gpunode_protocol::job::JobOutcome;
use indicatif::{ProgressBar, ProgressStyle};

use crate::commands::{parse_size, parse_time, print_json, url_segment, ClientNode};
use crate::output;
use crate::{JobArgs, LogsArgs, RunArgs, WhyArgs};

/// Where job calls go: the daemon's API, or an in-process node.
enum JobClient {
    Daemon(ApiClient),
    Local(Box<NodeHandle>),
}

/// How long one events request waits for something new.
const POLL_WAIT_MS: u64 = 1000;

impl JobClient {
    async fn submit(&self, req: JobRequest) -> Result<JobView> {
        Ok(match self {
            JobClient::Daemon(c) => c.post_json("/v1/jobs", &req).await?,
            JobClient::Local(h) => h.submit_job(req),
        })
    }

    async fn events(&self, id: &str, from: usize, wait_ms: u64) -> Result<EventPage> {
        Ok(match self {
            JobClient::Daemon(c) => {
                c.get_json(&format!(
                    "/v1/jobs/{}/events?from={from}&wait_ms={wait_ms}",
                    url_segment(id)
                ))
                .await?
            }
            JobClient::Local(h) => h
                .job_events(id, from, Duration::from_millis(wait_ms))
                .await
                .map_err(anyhow::Error::msg)?,
        })
    }

    async fn cancel(&self, id: &str) -> Result<()> {
        match self {
            JobClient::Daemon(c) => {
                let _: serde_json::Value = c
                    .post_json(
                        &format!("/v1/jobs/{}/cancel", url_segment(id)),
                        &serde_json::json!({}),
                    )
                    .await?;
            }
            JobClient::Local(h) => {
                h.cancel_job(id).map_err(anyhow::Error::msg)?;
            }
        }
        Ok(())
    }
}

fn absolute(p: &Path) -> Result<PathBuf> {
    if p.is_absolute() {
        return Ok(p.to_path_buf());
    }
    Ok(std::env::current_dir()
        .context("cannot read the current directory")?
        .join(p))
}

fn job_request(args: &RunArgs) -> Result<JobRequest> {
    let mut env = Vec::new();
    for kv in &args.env {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| anyhow::anyhow!("invalid --env '{kv}': expected NAME=VALUE"))?;
        if k.is_empty() {
            anyhow::bail!("invalid --env '{kv}': the name is empty");
        }
        env.push((k.to_string(), v.to_string()));
    }
    let container = args.backend.as_deref() == Some("container")
        || (args.backend.is_none() && (args.image.is_some() || args.host_env));
    let (module, container, task_args) = if container {
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
        (shown, Some(request), Vec::new())
    } else {
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
        (module, None, args.args.clone())
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
        max_output_bytes: args
            .max_output
            .as_deref()
            .map(|v| parse_size("max-output", v))
            .transpose()?,
        max_output_files: args.max_output_files,
        wait: match (args.wait, args.no_wait) {
            (true, _) => Some(true),
            (_, true) => Some(false),
            _ => None,
        },
        kind: if args.batch {
            gpunode_protocol::team::JobKind::Batch
        } else {
            gpunode_protocol::team::JobKind::Interactive
        },
    })
}

/// `gpunode run`.
pub async fn run(data_dir: DataDir, mut config: NodeConfig, args: RunArgs) -> Result<ExitCode> {
    let req = job_request(&args)?;
    let api = ApiClient::new(&data_dir.api_socket());
    let mut local = None;
    let client = if api.is_running().await {
        JobClient::Daemon(api)
    } else if args.detach {
        anyhow::bail!(
            "--detach needs a running daemon to keep the job going: start `gpunode serve` first"
        );
    } else {
        let node = ClientNode::start(data_dir, &mut config, &args.net).await?;
        let handle = node.handle.clone();
        local = Some(node);
        JobClient::Local(Box::new(handle))
    };
    let view = client.submit(req).await?;
    if args.detach {
        println!("{}", view.job_id);
        eprintln!(
            "job {} submitted; follow it with `gpunode logs --follow {}`",
            view.job_id, view.job_id
        );
        return Ok(ExitCode::SUCCESS);
    }
    let quiet = args.quiet;
    let result = follow(&client, &view.job_id, quiet, true).await;
    if let Some(node) = local {
        node.stop().await;
    }
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

enum End {
    Finished(Box<JobSummary>),
    Failed(String),
}

/// Progress bars for large transfers, one per file, only on a terminal.
struct Bars {
    enabled: bool,
    bars: HashMap<(String, String), ProgressBar>,
}

impl Bars {
    fn update(&mut self, direction: &str, name: &str, done: u64, total: u64) {
        if !self.enabled {
            return;
        }
        let bar = self
            .bars
            .entry((direction.to_string(), name.to_string()))
            .or_insert_with(|| {
                let bar = ProgressBar::new(total);
                if let Ok(style) = ProgressStyle::with_template(
                    "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
                ) {
                    bar.set_style(style.progress_chars("=> "));
                }
                bar.set_message(format!("{direction} {name}"));
                bar
            });
        bar.set_position(done);
        if done >= total {
            bar.finish_and_clear();
        }
    }

    fn clear(&mut self) {
        for bar in self.bars.values() {
            bar.finish_and_clear();
        }
    }
}

/// Follows a job's events to its end, printing output; Ctrl-C cancels it when
/// `cancel_on_interrupt`.
async fn follow(
    client: &JobClient,
    job_id: &str,
    quiet: bool,
    cancel_on_interrupt: bool,
) -> Result<End> {
    let mut bars = Bars {
        enabled: !quiet && std::io::stderr().is_terminal(),
        bars: HashMap::new(),
    };
    let mut from = 0;
    let mut interrupted = false;
    let mut ctrl_c = Box::pin(tokio::signal::ctrl_c());
    loop {
        let page = tokio::select! {
            p = client.events(job_id, from, POLL_WAIT_MS) => Some(p?),
            _ = &mut ctrl_c, if cancel_on_interrupt => None,
        };
        let Some(page) = page else {
            if interrupted {
                anyhow::bail!("interrupted; job {job_id} may still be stopping");
            }
            interrupted = true;
            eprintln!("gpunode: cancelling job {job_id} (Ctrl-C again to leave it)");
            client.cancel(job_id).await.ok();
            ctrl_c = Box::pin(tokio::signal::ctrl_c());
            continue;
        };
        from = page.next;
        let mut out = std::io::stdout().lock();
        let mut err = std::io::stderr().lock();
        let mut end = None;
        for event in page.events {
            match event {
                JobEvent::Stdout { data } => {
                    out.write_all(&data)?;
                }
                JobEvent::Stderr { data } => {
                    err.write_all(&data)?;
                }
                JobEvent::Progress {
                    direction,
                    name,
                    done,
                    total,
                } => bars.update(&direction, &name, done, total),
                JobEvent::Leased {
                    provider, lease_id, ..
                } if !quiet => {
                    writeln!(
                        err,
                        "gpunode: leased from {} (lease {})",
                        output::short_peer(&provider),
                        &lease_id[..8.min(lease_id.len())]
                    )?;
                }
                JobEvent::Retrying {
                    provider,
                    reason,
                    attempt,
                } => {
                    writeln!(
                        err,
                        "gpunode: provider {} failed ({reason}); retrying elsewhere (attempt {attempt})",
                        output::short_peer(&provider)
                    )?;
                }
                JobEvent::Waiting { reasons, .. } => {
                    writeln!(
                        err,
                        "gpunode: no provider can take the job now; waiting (Ctrl-C to give up):"
                    )?;
                    for (provider, reason) in &reasons {
                        let who = if provider == "-" {
                            "no provider".to_string()
                        } else {
                            output::short_peer(provider)
                        };
                        writeln!(err, "  {who}: {reason}")?;
                    }
                }
                JobEvent::Finished { summary } => end = Some(End::Finished(summary)),
                JobEvent::Failed { error } => end = Some(End::Failed(error)),
                _ => {}
            }
        }
        out.flush()?;
        err.flush()?;
        if let Some(end) = end {
            bars.clear();
            return Ok(end);
        }
        if page.done {
            bars.clear();
            return Ok(End::Failed("the job ended without a result".into()));
        }
    }
}

fn outcome_words(outcome: &JobOutcome) -> String {
    match outcome {
        JobOutcome::Exited(c) => format!("exited {c}"),
        JobOutcome::Trapped(t) => format!("trapped ({t})"),
        JobOutcome::TimedOut => "timed out".into(),
        JobOutcome::OutOfFuel => "ran out of fuel".into(),
        JobOutcome::OutOfMemory => "ran out of memory".into(),
        JobOutcome::OutputTooLarge(w) => format!("output too large ({w})"),
        JobOutcome::Cancelled => "cancelled".into(),
        JobOutcome::Preempted => "preempted by the GPU's owner".into(),
    }
}

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
    if !s.replicas.is_empty() {
        let agree = s.replicas.iter().filter(|r| r.agrees).count();
        if agree == s.replicas.len() {
            line.push_str(&format!(
                "\ngpunode: {} replicas agree (outputs {})",
                agree,
                &s.output_digest[..s.output_digest.len().min(16)]
            ));
        } else {
            for r in s.replicas.iter().filter(|r| !r.agrees) {
                line.push_str(&format!(
                    "\ngpunode: replica mismatch: provider {} returned different outputs; {} of {} replicas agree on the result kept",
                    output::short_peer(&r.provider),
                    agree,
                    s.replicas.len()
                ));
            }
        }
    }
    line
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

fn daemon(data_dir: &DataDir) -> ApiClient {
    ApiClient::new(&data_dir.api_socket())
}

async fn require_daemon(data_dir: &DataDir) -> Result<ApiClient> {
    let api = daemon(data_dir);
    if !api.is_running().await {
        anyhow::bail!(
            "no gpunode daemon is running with this data dir: jobs live in the daemon (start it with `gpunode serve`, submit with `gpunode run --detach`)"
        );
    }
    Ok(api)
}

/// `gpunode jobs`.
pub async fn jobs(data_dir: DataDir, json: bool) -> Result<ExitCode> {
    let api = require_daemon(&data_dir).await?;
    let views: Vec<JobView> = api.get_json("/v1/jobs").await?;
    if json {
        print_json(&views)?;
    } else {
        output::print_jobs(&mut std::io::stdout().lock(), &views)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `gpunode logs`.
pub async fn logs(data_dir: DataDir, args: LogsArgs) -> Result<ExitCode> {
    let client = JobClient::Daemon(require_daemon(&data_dir).await?);
    if args.follow {
        return match follow(&client, &args.job, true, false).await? {
            End::Finished(s) => Ok(ExitCode::from(s.exit_code.clamp(0, 255) as u8)),
            End::Failed(e) => anyhow::bail!("job {} failed: {e}", args.job),
        };
    }
    let mut from = 0;
    loop {
        let page = client.events(&args.job, from, 0).await?;
        let mut out = std::io::stdout().lock();
        let mut err = std::io::stderr().lock();
        for event in &page.events {
            match event {
                JobEvent::Stdout { data } => out.write_all(data)?,
                JobEvent::Stderr { data } => err.write_all(data)?,
                _ => {}
            }
        }
        if page.next == from || page.done {
            return Ok(ExitCode::SUCCESS);
        }
        from = page.next;
    }
}

/// `gpunode cancel`.
pub async fn cancel(data_dir: DataDir, args: JobArgs) -> Result<ExitCode> {
    let client = JobClient::Daemon(require_daemon(&data_dir).await?);
    client.cancel(&args.job).await?;
    println!("Job {} is being cancelled.", args.job);
    Ok(ExitCode::SUCCESS)
}

/// `gpunode why JOB`.
pub async fn why(data_dir: DataDir, args: WhyArgs) -> Result<ExitCode> {
    let api = require_daemon(&data_dir).await?;
    let views: Vec<JobView> = api.get_json("/v1/jobs").await?;
    let found: Vec<&JobView> = views
        .iter()
        .filter(|j| j.job_id.starts_with(&args.job))
        .collect();
    let job = match found.as_slice() {
        [one] => *one,
        [] => anyhow::bail!("no job {} here; `gpunode jobs` lists them", args.job),
        _ => anyhow::bail!(
            "'{}' starts more than one job id; give more of it",
            args.job
        ),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(job)?);
    } else {
        print!("{}", explain(job, gpunode_protocol::time::now_ms()));
    }
    Ok(ExitCode::SUCCESS)
}

/// A job's state in sentences: for a waiting job, what each provider said and what
/// would make it run sooner.
pub fn explain(j: &JobView, now: u64) -> String {
    use gpunode_node::jobs::JobState;
    let id = &j.job_id;
    let on = |p: &Option<String>| p.as_deref().map(output::short_peer).unwrap_or_default();
    match j.state {
        JobState::Waiting => {
            let Some(w) = &j.waiting else {
                return format!("Job {id} is waiting for a provider.\n");
            };
            let mut s = format!(
                "Job {id} has been waiting for a provider for {}: none can take it now.\n",
                gpunode_protocol::units::format_age(Duration::from_millis(
                    now.saturating_sub(w.since_ms)
                ))
            );
            if let Some((provider, q)) = &w.queue {
                let when = match q.estimated_start_ms {
                    Some(t) if t > now => format!(
                        "is estimated to start in {} (at {})",
                        gpunode_protocol::units::format_age(Duration::from_millis(t - now)),
                        output::format_utc(t)
                    ),
                    Some(_) => "should start any moment".to_string(),
                    None => "has no estimated start yet".to_string(),
                };
                s.push_str(&format!(
                    "Its best place is at {}: position {} of {} in its queue; it {when}.\n",
                    output::short_peer(provider),
                    q.position,
                    q.of
                ));
            }
            for (provider, reason) in &w.reasons {
                let who = if provider == "-" {
                    "no provider".to_string()
                } else {
                    output::short_peer(provider)
                };
                s.push_str(&format!("  {who}: {reason}\n"));
            }
            s.push_str(&format!(
                "It starts as soon as one can: it asks again every few seconds. To start sooner, ask for less (fewer GPUs, another model: see `gpunode offers`), or cancel it with `gpunode cancel {id}`.\n"
            ));
            s
        }
        JobState::Leasing => format!("Job {id} is asking providers for a lease right now.\n"),
        JobState::Uploading => format!(
            "Job {id} has a lease on {} and is sending its files.\n",
            on(&j.provider)
        ),
        JobState::Running => format!("Job {id} is running on {}.\n", on(&j.provider)),
        JobState::Finished => format!(
            "Job {id} ran on {} and {}.\n",
            on(&j.provider),
            j.summary
                .as_ref()
                .map_or("ended".to_string(), |s| outcome_words(&s.outcome))
        ),
        JobState::Failed => format!(
            "Job {id} could not run: {}\n",
            j.error.as_deref().unwrap_or("no reason recorded")
        ),
        JobState::Cancelled => format!("Job {id} was cancelled.\n"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpunode_node::jobs::{JobState, Waiting};

    fn view(state: JobState) -> JobView {
        serde_json::from_value(serde_json::json!({
            "job_id": "a1b2c3d4e5f60708",
            "module": "t.wasm",
            "args": [],
            "state": state,
            "provider": null,
            "lease_id": null,
            "submitted_ms": 0,
            "ended_ms": null,
            "summary": null,
            "error": null,
            "log_bytes_dropped": 0
        }))
        .expect("view")
    }

    #[test]
    fn why_names_each_providers_reason_and_what_would_help() {
        let mut j = view(JobState::Waiting);
        j.waiting = Some(Waiting {
            since_ms: 1_000,
            reasons: vec![
                (
                    "12D3KooWAbCdEfGhIjKlMnOpQrStUvWxYz1234567890abcdef".into(),
                    "no GPU free; 0 of 1 GPUs free".into(),
                ),
                (
                    "-".into(),
                    "no provider offers 2 GPU(s) of model H100".into(),
                ),
            ],
            queue: None,
        });
        let text = explain(&j, 181_000);
        assert!(text.contains("waiting for a provider for 3m"), "{text}");
        assert!(text.contains(": no GPU free; 0 of 1 GPUs free"), "{text}");
        assert!(
            text.contains("no provider: no provider offers 2 GPU(s)"),
            "{text}"
        );
        assert!(text.contains("gpunode cancel a1b2c3d4e5f60708"), "{text}");
        assert!(!text.contains("best place"), "{text}");

        // Queued: its best place and estimated start come first.
        j.waiting.as_mut().expect("waiting").queue = Some((
            "12D3KooWAbCdEfGhIjKlMnOpQrStUvWxYz1234567890abcdef".into(),
            gpunode_protocol::lease::QueuePlace {
                position: 2,
                of: 3,
                estimated_start_ms: Some(481_000),
                reason: "GPU 0 is leased until 00:08:01 UTC".into(),
            },
        ));
        let text = explain(&j, 181_000);
        assert!(
            text.contains("position 2 of 3 in its queue; it is estimated to start in 5m"),
            "{text}"
        );
        assert!(text.contains("1970-01-01 00:08:01 UTC"), "{text}");
        let mut failed = view(JobState::Failed);
        failed.error = Some("the module is not a WASI command".into());
        assert_eq!(
            explain(&failed, 0),
            "Job a1b2c3d4e5f60708 could not run: the module is not a WASI command\n"
        );
    }
}
