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

use anyhow::Context;
use gpunode_node::config::QueueOrder;
use gpunode_node::jobs::JobEvent;
use gpunode_node::NodeConfig;
use gpunode_protocol::advert::OfferFilter;

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
    let specs: Vec<Option<String>> = nodes
        .iter()
        .map(|n| Some(format!("{}x{}-16GB", n.gpus, n.model)))
        .collect();
    let mut config = TestNetConfig::new(specs);
    if order == QueueOrder::Fcfs {
        config.tweak = Some(fcfs);
    }
    let net = TestNet::start(config).await?;
    let mut clients = Vec::new();
    for _ in 0..cfg.users.max(1) {
        let c = net.new_client().await?;
        TestNet::wait_for_offers(
            &c.handle,
            &OfferFilter::default(),
            Duration::from_secs(60),
            |o| o.len() == nodes.len(),
        )
        .await
        .context("every provider's offer")?;
        clients.push(c);
    }
    let largest = nodes.iter().map(|n| n.gpus).max().unwrap_or(1);
    let total_gpus: u32 = nodes.iter().map(|n| n.gpus).sum();
    let out = tempfile::tempdir()?;
    let waiting = Arc::new(AtomicI64::new(0));
    let done = Arc::new(AtomicI64::new(0));
    // Sample leased GPUs while something waits.
    let providers: Vec<_> = net.nodes.iter().map(|n| n.handle.clone()).collect();
    let sampler = {
        let (waiting, done) = (waiting.clone(), done.clone());
        let n = jobs.len() as i64;
        tokio::spawn(async move {
            let (mut busy, mut all) = (0f64, 0f64);
            while done.load(AtomicOrdering::SeqCst) < n {
                if waiting.load(AtomicOrdering::SeqCst) > 0 {
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
    };
    let t0 = Instant::now();
    let first = jobs.first().map_or(0, |j| j.submit_ms);
    let mut runs = Vec::new();
    for (i, job) in jobs.iter().enumerate() {
        let user: usize = job.user.trim_start_matches("user").parse().unwrap_or(0);
        let handle = clients[user % clients.len()].handle.clone();
        let at = Duration::from_millis((job.submit_ms - first) * cfg.hour_ms / 3_600_000);
        let run = scaled_run(job, &cfg);
        let mut req = request(task("sleep.wat"), &out.path().join(i.to_string()));
        req.args = vec![run.to_string()];
        req.gpus = job.gpus.min(largest);
        req.wait = Some(true);
        req.timeout_ms = 2 * run + 5_000;
        let (waiting, done, user) = (waiting.clone(), done.clone(), job.user.clone());
        runs.push(tokio::spawn(async move {
            tokio::time::sleep_until((t0 + at).into()).await;
            let submitted = Instant::now();
            let view = handle.submit_job(req);
            let mut from = 0;
            // Counted as waiting from its first `Waiting` event (no provider could take
            // it at once) until it starts.
            let queued = std::sync::atomic::AtomicBool::new(false);
            let started = events_until(
                &handle,
                &view.job_id,
                &mut from,
                Duration::from_secs(3600),
                |e| {
                    if matches!(e, JobEvent::Waiting { .. })
                        && !queued.swap(true, AtomicOrdering::SeqCst)
                    {
                        waiting.fetch_add(1, AtomicOrdering::SeqCst);
                    }
                    matches!(e, JobEvent::Started { .. })
                },
            )
            .await
            .ok()
            .map(|_| Instant::now());
            if queued.load(AtomicOrdering::SeqCst) {
                waiting.fetch_sub(1, AtomicOrdering::SeqCst);
            }
            let events = until_end(&handle, &view.job_id, &mut from)
                .await
                .unwrap_or_default();
            done.fetch_add(1, AtomicOrdering::SeqCst);
            Timing {
                user,
                submitted,
                started,
                ended: Instant::now(),
                run: Duration::from_millis(run),
                ok: matches!(outcome(&events), Some(Ok(_))),
            }
        }));
    }
    let mut timings = Vec::new();
    for r in runs {
        timings.push(r.await?);
    }
    let utilization = sampler.await?;
    for mut c in clients {
        c.shutdown().await;
    }
    net.shutdown().await;

    let figures = WaitFigures::of(timings.iter().map(|t| {
        let started = t.started.unwrap_or(t.ended);
        (
            t.user.as_str(),
            started.duration_since(t.submitted).as_secs_f64(),
            t.run.as_secs_f64(),
            t.ended.duration_since(t.submitted).as_secs_f64(),
        )
    }));
    Ok(NetworkReport {
        order: match order {
            QueueOrder::Fair => "fair",
            QueueOrder::Fcfs => "fcfs",
        },
        jobs: timings.len(),
        succeeded: timings.iter().filter(|t| t.ok).count(),
        nodes: nodes.len(),
        gpus: total_gpus,
        utilization_while_waiting: utilization,
        mean_wait_s: figures.mean_wait_s,
        p95_wait_s: figures.p95_wait_s,
        mean_jct_s: figures.mean_jct_s,
        jain_index: figures.jain_index,
    })
}
