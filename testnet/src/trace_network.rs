//! Replays a compressed slice of the Alibaba GPU trace on real nodes on 127.0.0.1: one
//! provider per sampled trace node (simulated GPUs of the trace's count and model), one
//! client node per user, and every trace job submitted as `gpunode run --wait` of a sleep
//! task at its compressed submit time. The same slice runs once with every provider's
//! `queue_order = "fair"` and once with `"fcfs"`.
//!
//! Time is compressed (`hour_ms` of wall time per trace hour) and long jobs are capped
//! (`max_run_ms`), so the slice fits in minutes; figures are in wall-clock seconds.

use std::sync::atomic::{AtomicI64, Ordering as AtomicOrdering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpunode_node::config::QueueOrder;
use gpunode_node::jobs::{JobEvent, JobRequest};
use gpunode_node::{NodeConfig, NodeHandle};

use crate::jobs::{events_until, outcome, request, task, until_end};
use crate::trace_replay::{TraceJob, TraceNode, WaitFigures};
use crate::{TestNet, TestNetConfig};

/// Knobs of a network replay.
#[derive(Debug, Clone, Copy)]
pub struct NetworkReplay {
    /// Jobs replayed (the busiest window of this many consecutive jobs).
    pub jobs: usize,
    /// Client nodes; job `i` is submitted by user `hash(name) % users`.
    pub users: u32,
    /// Wall milliseconds per trace hour.
    pub hour_ms: u64,
    /// Longest job, wall ms.
    pub max_run_ms: u64,
}

/// The figures of one network replay (wall-clock seconds).
#[derive(Debug, Clone, serde::Serialize)]
pub struct NetworkReport {
    /// `fair` or `fcfs`.
    pub order: &'static str,
    /// Jobs replayed.
    pub jobs: usize,
    /// Jobs that ended well.
    pub succeeded: usize,
    /// Providers.
    pub nodes: usize,
    /// GPUs in all.
    pub gpus: u32,
    /// GPUs under lease over all GPUs, sampled every 50 ms while some job was queued
    /// (had been told no provider could take it at once).
    pub utilization_while_waiting: f64,
    /// Mean wait from submit to start, s.
    pub mean_wait_s: f64,
    /// 95th percentile wait, s.
    pub p95_wait_s: f64,
    /// Mean submit-to-end time, s.
    pub mean_jct_s: f64,
    /// Jain's index over users of run time / time in system.
    pub jain_index: f64,
}

/// The `n` consecutive jobs with the most GPU time (capped as replayed) per second of
/// submit span: the window with the most contention.
pub fn busiest_window(jobs: &[TraceJob], n: usize, cfg: &NetworkReplay) -> Vec<TraceJob> {
    let n = n.min(jobs.len()).max(1);
    let load = |w: &[TraceJob]| {
        let work: f64 = w
            .iter()
            .map(|j| j.gpus as f64 * scaled_run(j, cfg) as f64)
            .sum();
        let span =
            (w[w.len() - 1].submit_ms - w[0].submit_ms) as f64 * cfg.hour_ms as f64 / 3_600_000.0;
        work / span.max(1_000.0)
    };
    let best = (0..=jobs.len() - n)
        .max_by(|a, b| load(&jobs[*a..*a + n]).total_cmp(&load(&jobs[*b..*b + n])))
        .unwrap_or(0);
    jobs[best..best + n].to_vec()
}

fn scaled_run(j: &TraceJob, cfg: &NetworkReplay) -> u64 {
    (j.run_ms * cfg.hour_ms / 3_600_000).clamp(50, cfg.max_run_ms)
}

fn fcfs(_: usize, c: &mut NodeConfig) {
    c.queue_order = QueueOrder::Fcfs;
}

fn easy(_: usize, c: &mut NodeConfig) {
    c.queue_order = QueueOrder::Easy;
}

/// When one job was submitted, started and ended.
struct Timing {
    user: String,
    submitted: Instant,
    started: Option<Instant>,
    ended: Instant,
    run: Duration,
    ok: bool,
}

/// Replays `jobs` (a window from [`busiest_window`]) on providers made from `nodes`.
pub async fn replay_network(
    jobs: &[TraceJob],
    nodes: &[TraceNode],
    order: QueueOrder,
    cfg: NetworkReplay,
) -> anyhow::Result<NetworkReport> {
    let net = start_network(nodes, order, cfg.users).await?;
    let largest = nodes.iter().map(|n| n.gpus).max().unwrap_or(1);
    let total_gpus: u32 = nodes.iter().map(|n| n.gpus).sum();
    let out = tempfile::tempdir()?;
    let progress = Progress::default();
    let sampler = sample_utilization(&net, total_gpus, progress.clone(), jobs.len());
    let t0 = Instant::now();
    let first = jobs.first().map_or(0, |j| j.submit_ms);
    let clients = net.clients();
    let mut runs = Vec::new();
    for (i, job) in jobs.iter().enumerate() {
        let user: usize = job.user.trim_start_matches("user").parse().unwrap_or(0);
        let handle = clients[user % clients.len()].handle.clone();
        let at = t0 + Duration::from_millis((job.submit_ms - first) * cfg.hour_ms / 3_600_000);
        let run = scaled_run(job, &cfg);
        let req = request(task("sleep.wat"), &out.path().join(i.to_string()))
            .args([run.to_string()])
            .gpus(job.gpus.min(largest))
            .wait(true)
            .timeout_ms(2 * run + 5_000);
        let (user, run) = (job.user.clone(), Duration::from_millis(run));
        runs.push(tokio::spawn(run_job(
            handle,
            req,
            at,
            user,
            run,
            progress.clone(),
        )));
    }
    let mut timings = Vec::new();
    for r in runs {
        timings.push(r.await?);
    }
    let utilization = sampler.await?;
    net.shutdown().await;
    Ok(report(
        order,
        &timings,
        nodes.len(),
        total_gpus,
        utilization,
    ))
}

/// One provider per trace node (all FCFS for `QueueOrder::Fcfs`) and `users` clients
/// that see every provider's offer.
async fn start_network(
    nodes: &[TraceNode],
    order: QueueOrder,
    users: u32,
) -> anyhow::Result<TestNet> {
    let specs: Vec<Option<String>> = nodes
        .iter()
        .map(|n| Some(format!("{}x{}-16GB", n.gpus, n.model)))
        .collect();
    let mut net = TestNet::configured(TestNetConfig::new(specs))
        .with_clients(users.max(1) as usize)
        .clients_see_offers(Duration::from_secs(60));
    match order {
        QueueOrder::Fcfs => net = net.tweak(fcfs),
        QueueOrder::Easy => net = net.tweak(easy),
        QueueOrder::Fair => {}
    }
    net.start().await
}

/// Jobs waiting in queues now, and jobs ended, across the replay's tasks.
#[derive(Debug, Clone, Default)]
struct Progress {
    waiting: Arc<AtomicI64>,
    done: Arc<AtomicI64>,
}

/// Samples leased GPUs every 50 ms while something waits, until `jobs` jobs ended;
/// the task's answer is the leased share.
fn sample_utilization(
    net: &TestNet,
    total_gpus: u32,
    progress: Progress,
    jobs: usize,
) -> tokio::task::JoinHandle<f64> {
    let providers: Vec<_> = net.nodes.iter().map(|n| n.handle.clone()).collect();
    let n = jobs as i64;
    tokio::spawn(async move {
        let (mut busy, mut all) = (0f64, 0f64);
        while progress.done.load(AtomicOrdering::SeqCst) < n {
            if progress.waiting.load(AtomicOrdering::SeqCst) > 0 {
                let leased: i64 = providers
                    .iter()
                    .map(|h| h.metrics().leased_gpus.get())
                    .sum();
                busy += leased as f64;
                all += total_gpus as f64;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if all > 0.0 {
            busy / all
        } else {
            1.0
        }
    })
}

/// Submits `user`'s `req` (a task of `run`) at `at` and follows it to its end, counting
/// it as waiting from its first `Waiting` event (no provider could take it at once)
/// until it starts.
async fn run_job(
    handle: NodeHandle,
    req: JobRequest,
    at: Instant,
    user: String,
    run: Duration,
    progress: Progress,
) -> Timing {
    tokio::time::sleep_until(at.into()).await;
    let submitted = Instant::now();
    let view = handle.submit_job(req);
    let mut from = 0;
    let queued = std::sync::atomic::AtomicBool::new(false);
    let started = events_until(
        &handle,
        &view.job_id,
        &mut from,
        Duration::from_secs(3600),
        |e| {
            if matches!(e, JobEvent::Waiting { .. }) && !queued.swap(true, AtomicOrdering::SeqCst) {
                progress.waiting.fetch_add(1, AtomicOrdering::SeqCst);
            }
            matches!(e, JobEvent::Started { .. })
        },
    )
    .await
    .ok()
    .map(|_| Instant::now());
    if queued.load(AtomicOrdering::SeqCst) {
        progress.waiting.fetch_sub(1, AtomicOrdering::SeqCst);
    }
    let events = until_end(&handle, &view.job_id, &mut from)
        .await
        .unwrap_or_default();
    progress.done.fetch_add(1, AtomicOrdering::SeqCst);
    let ok = match outcome(&events) {
        Some(Ok(_)) => true,
        Some(Err(e)) => {
            eprintln!("job {} of {user} failed: {e}", view.job_id);
            false
        }
        None => {
            eprintln!("job {} of {user} did not end", view.job_id);
            false
        }
    };
    Timing {
        user,
        submitted,
        started,
        ended: Instant::now(),
        run,
        ok,
    }
}

/// The figures of a replay from its jobs' timings.
fn report(
    order: QueueOrder,
    timings: &[Timing],
    nodes: usize,
    gpus: u32,
    utilization: f64,
) -> NetworkReport {
    let figures = WaitFigures::of(timings.iter().map(|t| {
        let started = t.started.unwrap_or(t.ended);
        (
            t.user.as_str(),
            started.duration_since(t.submitted).as_secs_f64(),
            t.run.as_secs_f64(),
            t.ended.duration_since(t.submitted).as_secs_f64(),
        )
    }));
    NetworkReport {
        order: match order {
            QueueOrder::Fair => "fair",
            QueueOrder::Fcfs => "fcfs",
            QueueOrder::Easy => "fcfs+easy",
        },
        jobs: timings.len(),
        succeeded: timings.iter().filter(|t| t.ok).count(),
        nodes,
        gpus,
        utilization_while_waiting: utilization,
        mean_wait_s: figures.mean_wait_s,
        p95_wait_s: figures.p95_wait_s,
        mean_jct_s: figures.mean_jct_s,
        jain_index: figures.jain_index,
    }
}
