//! Replays the Alibaba GPU cluster trace (`../shared/data/traces/`) through providers'
//! queues, once under the node's fair rule and once under first come first served, on
//! the same sample of the trace's nodes, in virtual time.
//!
//! Each sampled trace node is one provider with its own [`gpunode_sched::Queue`] and
//! [`gpunode_sched::FairShare`], exactly as a node keeps them. A job, when submitted,
//! waits at every provider large enough for it (as `gpunode run --wait` asks every
//! candidate) and starts at the first whose plan starts it now; the others drop it. A job
//! declares a timeout of twice its real run time (users overestimate) and ends after its
//! real run time. Virtual time means requesters see changes at once: the network replay
//! (`testnet bench trace-network`) measures the same rules with real nodes and polling.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use anyhow::{bail, Context};
use gpunode_sched::{FairShare, GpuTimeline, Order, Queue, Request, Standing, Ticket};
use serde::Serialize;

/// One job of the trace.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceJob {
    /// The trace's pod name.
    pub name: String,
    /// Submit time, ms from the trace's start.
    pub submit_ms: u64,
    /// Real run time, ms.
    pub run_ms: u64,
    /// Whole GPUs (a fractional request counts as one GPU).
    pub gpus: u32,
    /// Tenant, assigned from a hash of the name.
    pub user: String,
}

/// One GPU node of the trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceNode {
    /// The trace's serial.
    pub name: String,
    /// GPUs.
    pub gpus: u32,
    /// GPU model.
    pub model: String,
}

fn columns(header: &str, wanted: &[&str]) -> anyhow::Result<Vec<usize>> {
    let names: Vec<&str> = header.trim().split(',').collect();
    wanted
        .iter()
        .map(|w| {
            names
                .iter()
                .position(|n| n == w)
                .with_context(|| format!("the trace has no '{w}' column"))
        })
        .collect()
}

/// FNV-1a, so users are the same on every machine.
fn user_of(name: &str, users: u32) -> String {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    format!("user{}", h % users.max(1) as u64)
}

/// The jobs that ran on GPUs (scheduled, with a deletion time and at least one GPU),
/// by submit time; users assigned round a hash of the name.
pub fn load_jobs(path: &Path, users: u32) -> anyhow::Result<Vec<TraceJob>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut lines = text.lines();
    let header = lines.next().context("the trace is empty")?;
    let c = columns(
        header,
        &[
            "name",
            "num_gpu",
            "creation_time",
            "scheduled_time",
            "deletion_time",
        ],
    )?;
    let mut jobs = Vec::new();
    for (n, line) in lines.enumerate() {
        let f: Vec<&str> = line.split(',').collect();
        let field = |i: usize| f.get(c[i]).copied().unwrap_or("").trim();
        let num = |i: usize| -> anyhow::Result<Option<u64>> {
            let v = field(i);
            if v.is_empty() {
                return Ok(None);
            }
            v.parse()
                .map(Some)
                .with_context(|| format!("line {}: '{v}' is not a number", n + 2))
        };
        let (Some(gpus), Some(created), Some(scheduled), Some(deleted)) =
            (num(1)?, num(2)?, num(3)?, num(4)?)
        else {
            continue;
        };
        if gpus == 0 || deleted <= scheduled {
            continue;
        }
        jobs.push(TraceJob {
            name: field(0).to_string(),
            submit_ms: created * 1000,
            run_ms: (deleted - scheduled) * 1000,
            gpus: gpus as u32,
            user: user_of(field(0), users),
        });
    }
    jobs.sort_by_key(|j| j.submit_ms);
    if jobs.is_empty() {
        bail!("{} holds no GPU job that ran", path.display());
    }
    Ok(jobs)
}

/// The trace's GPU nodes.
pub fn load_nodes(path: &Path) -> anyhow::Result<Vec<TraceNode>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut lines = text.lines();
    let header = lines.next().context("the node list is empty")?;
    let c = columns(header, &["sn", "gpu", "model"])?;
    let mut nodes = Vec::new();
    for (n, line) in lines.enumerate() {
        let f: Vec<&str> = line.split(',').collect();
        let field = |i: usize| f.get(c[i]).copied().unwrap_or("").trim();
        let gpus: u32 = field(1)
            .parse()
            .with_context(|| format!("node line {}: bad gpu count '{}'", n + 2, field(1)))?;
        if gpus > 0 {
            nodes.push(TraceNode {
                name: field(0).to_string(),
                gpus,
                model: field(2).to_string(),
            });
        }
    }
    Ok(nodes)
}

/// A scaled sample of the node list with about `target_gpus` GPUs: every k-th node (k =
/// the trace's GPUs / `target_gpus`), so the mix of node sizes is the trace's.
pub fn sample_nodes(nodes: &[TraceNode], target_gpus: u32) -> Vec<TraceNode> {
    let total: u32 = nodes.iter().map(|n| n.gpus).sum();
    let stride = (total as f64 / target_gpus.max(1) as f64).max(1.0);
    let mut out = Vec::new();
    let mut at = 0.0;
    while (at as usize) < nodes.len() {
        out.push(nodes[at as usize].clone());
        at += stride;
    }
    out
}

/// The figures of one replay.
#[derive(Debug, Clone, Serialize)]
pub struct ReplayReport {
    /// `fair` or `fcfs`.
    pub order: &'static str,
    /// Jobs replayed.
    pub jobs: usize,
    /// Providers.
    pub nodes: usize,
    /// GPUs in all.
    pub gpus: u32,
    /// Busy GPU time over all GPU time, counted only while some job waited.
    pub utilization_while_waiting: f64,
    /// Busy GPU time over the GPU time a waiting job could have used (GPUs of nodes
    /// large enough for some waiting job), while some job waited.
    pub usable_utilization_while_waiting: f64,
    /// Mean wait, trace seconds.
    pub mean_wait_s: f64,
    /// 95th percentile wait, trace seconds.
    pub p95_wait_s: f64,
    /// Mean completion time (wait + run), trace seconds.
    pub mean_jct_s: f64,
    /// Jain's fairness index over users of (run time / time in system), 1 = fair.
    pub jain_index: f64,
    /// Jobs that never started (larger than any node).
    pub unplaced: usize,
}

/// Wait figures of a replay.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WaitFigures {
    /// Mean wait, s.
    pub mean_wait_s: f64,
    /// 95th percentile wait, s.
    pub p95_wait_s: f64,
    /// Mean completion time (wait + run), s.
    pub mean_jct_s: f64,
    /// Jain's fairness index over users of (run time / time in system), 1 = fair.
    pub jain_index: f64,
}

impl WaitFigures {
    /// From each job's user, wait, run time and time in system (s).
    pub fn of<'a>(jobs: impl IntoIterator<Item = (&'a str, f64, f64, f64)>) -> WaitFigures {
        let mut waits = Vec::new();
        let mut jct_sum = 0.0;
        let mut per_user: HashMap<&str, Vec<f64>> = HashMap::new();
        for (user, wait, run, in_system) in jobs {
            waits.push(wait);
            jct_sum += in_system;
            let share = if wait + run > 0.0 {
                run / (wait + run)
            } else {
                1.0
            };
            per_user.entry(user).or_default().push(share);
        }
        waits.sort_by(f64::total_cmp);
        let n = waits.len().max(1) as f64;
        let xs: Vec<f64> = per_user
            .values()
            .map(|v| v.iter().sum::<f64>() / v.len() as f64)
            .collect();
        let s: f64 = xs.iter().sum();
        let s2: f64 = xs.iter().map(|x| x * x).sum();
        WaitFigures {
            mean_wait_s: waits.iter().sum::<f64>() / n,
            p95_wait_s: waits
                .get(((waits.len() as f64 * 0.95) as usize).min(waits.len().saturating_sub(1)))
                .copied()
                .unwrap_or(0.0),
            mean_jct_s: jct_sum / n,
            jain_index: if s2 == 0.0 {
                1.0
            } else {
                s * s / (xs.len() as f64 * s2)
            },
        }
    }
}

struct Provider {
    queue: Queue,
    fair: FairShare,
    /// When each GPU's lease ends (declared), or 0 when free.
    lease_end: Vec<u64>,
    /// Which job each GPU runs.
    running: Vec<Option<usize>>,
}

/// Knobs of a replay.
#[derive(Debug, Clone, Copy)]
pub struct ReplayConfig {
    /// Declared timeout = real run time x this.
    pub overestimate: f64,
    /// Fair-share half-life, trace ms.
    pub half_life_ms: u64,
    /// Requests placed per plan.
    pub depth: usize,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        ReplayConfig {
            overestimate: 2.0,
            half_life_ms: 24 * 3_600_000,
            depth: 32,
        }
    }
}

/// Replays `jobs` on `nodes` with every provider ordering its queue by `order`.
pub fn replay(
    jobs: &[TraceJob],
    nodes: &[TraceNode],
    order: Order,
    cfg: ReplayConfig,
) -> ReplayReport {
    let mut sim = Replay::new(jobs, nodes, order, cfg);
    while let Some(t) = sim.next_event() {
        sim.measure_until(t);
        sim.now = t;
        sim.end_finished();
        sim.queue_arrivals();
        sim.start_planned();
    }
    sim.report(order)
}

/// GPU time summed while some job waited (GPU x trace ms).
#[derive(Debug, Default)]
struct Areas {
    busy: f64,
    total: f64,
    usable: f64,
    usable_busy: f64,
}

/// One replay in progress: the providers, which jobs started when, what waits where.
struct Replay<'a> {
    jobs: &'a [TraceJob],
    nodes: &'a [TraceNode],
    cfg: ReplayConfig,
    providers: Vec<Provider>,
    total_gpus: u32,
    start: Vec<Option<u64>>,
    /// (end, provider, job)
    ends: BTreeSet<(u64, usize, usize)>,
    waiting: BTreeSet<usize>,
    queued_at: HashMap<usize, Vec<usize>>,
    next_job: usize,
    now: u64,
    busy: u32,
    areas: Areas,
}

impl<'a> Replay<'a> {
    fn new(
        jobs: &'a [TraceJob],
        nodes: &'a [TraceNode],
        order: Order,
        cfg: ReplayConfig,
    ) -> Replay<'a> {
        let providers = nodes
            .iter()
            .map(|n| Provider {
                queue: Queue::new(order, u64::MAX),
                fair: FairShare::new(cfg.half_life_ms),
                lease_end: vec![0; n.gpus as usize],
                running: vec![None; n.gpus as usize],
            })
            .collect();
        Replay {
            jobs,
            nodes,
            cfg,
            providers,
            total_gpus: nodes.iter().map(|n| n.gpus).sum(),
            start: vec![None; jobs.len()],
            ends: BTreeSet::new(),
            waiting: BTreeSet::new(),
            queued_at: HashMap::new(),
            next_job: 0,
            now: 0,
            busy: 0,
            areas: Areas::default(),
        }
    }

    /// The job's declared timeout.
    fn declared(&self, j: &TraceJob) -> u64 {
        ((j.run_ms as f64 * self.cfg.overestimate) as u64)
            .max(j.run_ms)
            .max(1000)
    }

    /// The next arrival or end; `None` when nothing is left to happen.
    fn next_event(&self) -> Option<u64> {
        let next_arrival = self.jobs.get(self.next_job).map(|j| j.submit_ms);
        let next_end = self.ends.first().map(|e| e.0);
        match (next_arrival, next_end) {
            (None, None) => None,
            (a, e) => Some(a.unwrap_or(u64::MAX).min(e.unwrap_or(u64::MAX))),
        }
    }

    /// Adds the GPU time from now to `t` to the areas, if some job waits.
    fn measure_until(&mut self, t: u64) {
        if self.waiting.is_empty() {
            return;
        }
        let dt = (t - self.now) as f64;
        self.areas.busy += self.busy as f64 * dt;
        self.areas.total += self.total_gpus as f64 * dt;
        let need = self
            .waiting
            .iter()
            .map(|j| self.jobs[*j].gpus)
            .min()
            .unwrap_or(0);
        let (mut usable, mut usable_busy) = (0u32, 0u32);
        for (node, prov) in self.nodes.iter().zip(&self.providers) {
            if node.gpus >= need {
                usable += node.gpus;
                usable_busy += prov.running.iter().filter(|r| r.is_some()).count() as u32;
            }
        }
        self.areas.usable += usable as f64 * dt;
        self.areas.usable_busy += usable_busy as f64 * dt;
    }

    /// Frees the GPUs of the jobs that ended by now, and refunds their unused time.
    fn end_finished(&mut self) {
        while let Some(&(end, p, j)) = self.ends.first() {
            if end > self.now {
                break;
            }
            self.ends.pop_first();
            // Charged the declared time at the start; give back what was not used.
            let job = &self.jobs[j];
            let unused = self.declared(job).saturating_sub(job.run_ms);
            let prov = &mut self.providers[p];
            for g in 0..prov.running.len() {
                if prov.running[g] == Some(j) {
                    prov.running[g] = None;
                    prov.lease_end[g] = 0;
                    self.busy -= 1;
                }
            }
            prov.fair
                .charge(&job.user, -((unused * job.gpus as u64) as f64), self.now);
        }
    }

    /// Queues every job submitted by now at every provider large enough for it.
    fn queue_arrivals(&mut self) {
        while let Some(job) = self.jobs.get(self.next_job) {
            if job.submit_ms > self.now {
                break;
            }
            let declared = self.declared(job);
            let mut at = Vec::new();
            for (p, node) in self.nodes.iter().enumerate() {
                if node.gpus >= job.gpus {
                    self.providers[p].queue.upsert(
                        Request {
                            ticket: Ticket(self.next_job as u128),
                            user: job.user.clone(),
                            gpus: job.gpus,
                            eligible: (0..node.gpus).collect(),
                            duration_ms: declared,
                            standing: Standing::default(),
                        },
                        self.now,
                    );
                    at.push(p);
                }
            }
            if !at.is_empty() {
                self.waiting.insert(self.next_job);
                self.queued_at.insert(self.next_job, at);
            }
            self.next_job += 1;
        }
    }

    /// Providers start what their plans start now, until nothing changes.
    fn start_planned(&mut self) {
        loop {
            let mut started_any = false;
            for p in 0..self.providers.len() {
                started_any |= self.start_on(p);
            }
            if !started_any {
                break;
            }
        }
    }

    /// Starts what provider `p`'s plan starts now; whether it started any.
    fn start_on(&mut self, p: usize) -> bool {
        if self.providers[p].queue.is_empty() {
            return false;
        }
        let now = self.now;
        let timeline: Vec<GpuTimeline> = self.providers[p]
            .lease_end
            .iter()
            .enumerate()
            .map(|(g, end)| GpuTimeline {
                index: g as u32,
                free_at: Some((*end).max(now).min(u64::MAX / 4)),
                reserved: Vec::new(),
            })
            .collect();
        let plan =
            self.providers[p]
                .queue
                .plan(&timeline, &self.providers[p].fair, now, self.cfg.depth);
        let mut started_any = false;
        for place in plan.starting_now(now) {
            let j = place.ticket.0 as usize;
            if self.start[j].is_some() {
                continue;
            }
            self.start[j] = Some(now);
            self.waiting.remove(&j);
            for q in self.queued_at.remove(&j).unwrap_or_default() {
                self.providers[q].queue.remove(&place.ticket);
            }
            let job = &self.jobs[j];
            let declared = self.declared(job);
            let prov = &mut self.providers[p];
            for g in &place.gpus {
                prov.running[*g as usize] = Some(j);
                prov.lease_end[*g as usize] = now + declared;
                self.busy += 1;
            }
            prov.fair
                .charge(&job.user, (declared * job.gpus as u64) as f64, now);
            self.ends.insert((now + job.run_ms, p, j));
            started_any = true;
        }
        started_any
    }

    /// The figures, once nothing is left to happen.
    fn report(self, order: Order) -> ReplayReport {
        let mut unplaced = 0;
        let mut samples = Vec::with_capacity(self.jobs.len());
        for (j, job) in self.jobs.iter().enumerate() {
            let Some(s) = self.start[j] else {
                unplaced += 1;
                continue;
            };
            let wait = (s - job.submit_ms) as f64 / 1000.0;
            let run = job.run_ms as f64 / 1000.0;
            samples.push((job.user.as_str(), wait, run, wait + run));
        }
        let figures = WaitFigures::of(samples);
        let ratio = |part: f64, whole: f64| if whole > 0.0 { part / whole } else { 1.0 };
        ReplayReport {
            order: match order {
                Order::Fair => "fair",
                Order::Fcfs => "fcfs",
                Order::Easy => "fcfs+easy",
            },
            jobs: self.jobs.len(),
            nodes: self.nodes.len(),
            gpus: self.total_gpus,
            utilization_while_waiting: ratio(self.areas.busy, self.areas.total),
            usable_utilization_while_waiting: ratio(self.areas.usable_busy, self.areas.usable),
            mean_wait_s: figures.mean_wait_s,
            p95_wait_s: figures.p95_wait_s,
            mean_jct_s: figures.mean_jct_s,
            jain_index: figures.jain_index,
            unplaced,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(name: &str, submit_s: u64, run_s: u64, gpus: u32) -> TraceJob {
        TraceJob {
            name: name.into(),
            submit_ms: submit_s * 1000,
            run_ms: run_s * 1000,
            gpus,
            user: name.into(),
        }
    }

    #[test]
    fn backfill_beats_fcfs_on_a_blocked_head() {
        let nodes = vec![TraceNode {
            name: "n0".into(),
            gpus: 2,
            model: "T4".into(),
        }];
        // One GPU busy for 100 s; a 2-GPU job must wait for it; short 1-GPU jobs behind
        // it can use the other GPU meanwhile, under the fair rule only.
        let jobs = vec![
            job("long", 0, 100, 1),
            job("wide", 1, 50, 2),
            job("s1", 2, 10, 1),
            job("s2", 3, 10, 1),
            job("s3", 4, 10, 1),
        ];
        let cfg = ReplayConfig {
            overestimate: 1.0,
            ..ReplayConfig::default()
        };
        let fair = replay(&jobs, &nodes, Order::Fair, cfg);
        let fcfs = replay(&jobs, &nodes, Order::Fcfs, cfg);
        assert_eq!((fair.unplaced, fcfs.unplaced), (0, 0));
        assert!(fair.mean_wait_s < fcfs.mean_wait_s, "{fair:?} {fcfs:?}");
        // FCFS: the wide job starts at 100 s on both GPUs, the short ones after it.
        assert!(
            (fcfs.mean_wait_s - (0.0 + 99.0 + 148.0 + 147.0 + 156.0) / 5.0).abs() < 1e-6,
            "{fcfs:?}"
        );
        // Fair: the short ones go first on the free GPU, one after another, and the wide
        // job still starts at 100 s: backfill did not delay it.
        assert!(
            (fair.mean_wait_s - (0.0 + 99.0 + 0.0 + 9.0 + 18.0) / 5.0).abs() < 1e-6,
            "{fair:?}"
        );
        assert_eq!(fair.p95_wait_s, 99.0, "the wide job's wait is the longest");
        // EASY backfill: the short ones also pass the wide one here, because each ends
        // before the wide job's reservation.
        let easy = replay(&jobs, &nodes, Order::Easy, cfg);
        assert!(
            (easy.mean_wait_s - (0.0 + 99.0 + 0.0 + 9.0 + 18.0) / 5.0).abs() < 1e-6,
            "{easy:?}"
        );
    }

    #[test]
    fn traces_without_the_needed_columns_say_which() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("jobs.csv");
        std::fs::write(&path, "name,num_gpu\nx,1\n").expect("write");
        let err = load_jobs(&path, 4).unwrap_err().to_string();
        assert!(err.contains("creation_time"), "{err}");
        std::fs::write(
            &path,
            "name,num_gpu,creation_time,scheduled_time,deletion_time\nx,one,0,0,5\n",
        )
        .expect("write");
        let err = load_jobs(&path, 4).unwrap_err().to_string();
        assert!(err.contains("line 2") && err.contains("'one'"), "{err}");
    }
}
