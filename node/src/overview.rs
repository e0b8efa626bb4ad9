//! The views behind the web dashboard, served on the local API like every other view:
//! the machine (GPU plots, jobs run for peers, alerts, the owner's rules), the
//! utilization report (busy share by day, with a CSV export) and the balance over time.
//! Each answer is bounded, whatever the history or ledger holds.

use serde::{Deserialize, Serialize};

use crate::history::{day_label, GpuHistory, Sample, REPORT_DAYS};
use crate::NodeConfig;

/// The owner's rules for this machine, as configured.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MachinePolicy {
    /// When GPUs are lent (`lend`; empty: always).
    pub lend: Vec<String>,
    /// The UTC offset the windows are in.
    pub lend_utc_offset: String,
    /// How much of each GPU's memory is lent (`None`: all).
    pub lend_gpu_memory: Option<String>,
    /// What happens to a job when the owner's own process appears.
    pub owner_policy: String,
    /// Seconds a job gets to stop when the owner comes back.
    pub owner_grace_s: f64,
    /// Credits per GPU-hour.
    pub price_per_gpu_hour: f64,
}

impl MachinePolicy {
    /// The rules in `config`.
    pub fn of(config: &NodeConfig) -> MachinePolicy {
        MachinePolicy {
            lend: config.lend.clone(),
            lend_utc_offset: config.lend_utc_offset.clone(),
            lend_gpu_memory: config.lend_gpu_memory.clone(),
            owner_policy: format!("{:?}", config.owner_policy).to_lowercase(),
            owner_grace_s: config.owner_grace.as_secs_f64(),
            price_per_gpu_hour: config.price_per_gpu_hour,
        }
    }
}

/// A request waiting in this provider's queue (`GET /v1/queue`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QueuedRequestView {
    /// 1 = served next.
    pub position: u32,
    /// Requests waiting in all.
    pub of: u32,
    /// The requester's peer id when it is in our team; otherwise only its place.
    pub requester: String,
    /// GPUs asked for.
    pub gpus: u32,
    /// Declared time, ms.
    pub duration_ms: u64,
    /// When it joined the queue, unix ms.
    pub waiting_since_ms: u64,
    /// When it would start if nothing changed (`None`: not foreseeable).
    pub estimated_start_ms: Option<u64>,
    /// Why it does not start now.
    pub reason: String,
}

/// Which plot `GET /v1/machine` returns.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PlotRange {
    /// The last hour, one sample a step.
    #[default]
    Hour,
    /// The last day, one sample a minute.
    Day,
}

/// One GPU's plot: its samples as rows `[t_ms, util %, memory MiB, °C, W, lent, busy]`
/// (°C and W are `null` when the driver does not report them; lent and busy are 0/1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuPlot {
    /// Stable identifier.
    pub uuid: String,
    /// Product name.
    pub name: String,
    /// Total memory, bytes.
    pub memory_total_bytes: u64,
    /// Simulated (test network): its readings are not a real GPU's.
    pub simulated: bool,
    /// The samples, oldest first.
    pub samples: Vec<[Option<u64>; 7]>,
}

/// `GET /v1/machine`: this machine as its owner watches it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MachineView {
    /// This node.
    pub peer_id: String,
    /// The GPUs now, as the inventory reads them.
    pub inventory: crate::inventory::InventorySnapshot,
    /// Jobs running here for peers, with their GPU use.
    pub running_jobs: Vec<crate::jobs::RunningJobView>,
    /// The latest alerts, newest first.
    pub alerts: Vec<crate::history::AlertRecord>,
    /// Lending hours and owner policy.
    pub policy: MachinePolicy,
    /// `hour` or `day`.
    pub range: PlotRange,
    /// Milliseconds between samples of the hour plot.
    pub step_ms: u64,
    /// One plot per GPU.
    pub plots: Vec<GpuPlot>,
}

fn sample_row(s: &Sample) -> [Option<u64>; 7] {
    [
        Some(s.t_ms),
        Some(s.util.into()),
        Some(s.mem_used_mib.into()),
        s.temp_c.map(u64::from),
        s.power_w.map(u64::from),
        Some(s.lent.into()),
        Some(s.busy.into()),
    ]
}

/// The plots of `range` from `history`.
pub fn plots(history: &GpuHistory, range: PlotRange) -> Vec<GpuPlot> {
    history
        .gpus()
        .iter()
        .map(|g| GpuPlot {
            uuid: g.uuid.clone(),
            name: g.name.clone(),
            memory_total_bytes: g.memory_total_bytes,
            simulated: g.simulated,
            samples: match range {
                PlotRange::Hour => g.hour.iter().map(sample_row).collect(),
                PlotRange::Day => g.day.iter().map(sample_row).collect(),
            },
        })
        .collect()
}

/// One day of one GPU (or of all of them) in the utilization report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DayShare {
    /// `YYYY-MM-DD`, UTC.
    pub date: String,
    /// Share of the sampled time it was busy, percent.
    pub busy_percent: f64,
    /// Share of the sampled time a lease held it, percent.
    pub lent_percent: f64,
    /// Hours sampled that day (less than 24 when the node was off).
    pub hours_sampled: f64,
}

/// One GPU's days.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuDays {
    /// Stable identifier.
    pub uuid: String,
    /// Product name.
    pub name: String,
    /// Simulated (test network).
    pub simulated: bool,
    /// Oldest first, at most 30.
    pub days: Vec<DayShare>,
}

/// "From X% to Y%": the mean busy share of the first week recorded against the last.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Headline {
    /// Mean busy share over the first days recorded (up to 7), percent.
    pub from_percent: f64,
    /// Mean busy share over the last days recorded (up to 7), percent.
    pub to_percent: f64,
    /// Days averaged at each end.
    pub days_each: usize,
}

/// `GET /v1/utilization`: busy share by day over the last 30 days.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UtilizationReport {
    /// This node.
    pub peer_id: String,
    /// Each GPU.
    pub gpus: Vec<GpuDays>,
    /// All of this machine's GPUs together.
    pub machine: Vec<DayShare>,
    /// The whole team's GPUs as this node saw them (its own and the members' adverts);
    /// empty outside a team.
    pub team: Vec<DayShare>,
    /// The headline (the team's when in one, else this machine's), once two days or
    /// more are recorded.
    pub headline: Option<Headline>,
}

fn share(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        (part as f64 * 1000.0 / whole as f64).round() / 10.0
    }
}

/// The report from `history`.
pub fn utilization(history: &GpuHistory, peer_id: String) -> UtilizationReport {
    let mut totals: std::collections::BTreeMap<u32, (u64, u64, u64, u64)> = Default::default();
    let gpus = history
        .gpus()
        .iter()
        .map(|g| GpuDays {
            uuid: g.uuid.clone(),
            name: g.name.clone(),
            simulated: g.simulated,
            days: g
                .days
                .iter()
                .map(|d| {
                    let t = totals.entry(d.day).or_default();
                    t.0 += u64::from(d.samples);
                    t.1 += u64::from(d.busy);
                    t.2 += u64::from(d.lent);
                    t.3 += d.sampled_ms;
                    DayShare {
                        date: day_label(d.day),
                        busy_percent: share(d.busy.into(), d.samples.into()),
                        lent_percent: share(d.lent.into(), d.samples.into()),
                        hours_sampled: d.sampled_ms as f64 / 3_600_000.0,
                    }
                })
                .collect(),
        })
        .collect();
    let gpu_count = history.gpus().len().max(1) as f64;
    let machine: Vec<DayShare> = totals
        .iter()
        .rev()
        .take(REPORT_DAYS)
        .rev()
        .map(|(day, (samples, busy, lent, ms))| DayShare {
            date: day_label(*day),
            busy_percent: share(*busy, *samples),
            lent_percent: share(*lent, *samples),
            hours_sampled: *ms as f64 / 3_600_000.0 / gpu_count,
        })
        .collect();
    let team: Vec<DayShare> = history
        .team_days()
        .iter()
        .map(|d| DayShare {
            date: day_label(d.day),
            busy_percent: share(d.busy.into(), d.samples.into()),
            lent_percent: share(d.lent.into(), d.samples.into()),
            hours_sampled: d.sampled_ms as f64 / 3_600_000.0,
        })
        .collect();
    let basis = if team.is_empty() { &machine } else { &team };
    let headline = (basis.len() >= 2).then(|| {
        let days_each = (basis.len() / 2).min(7);
        let mean = |days: &[DayShare]| {
            (days.iter().map(|d| d.busy_percent).sum::<f64>() / days.len() as f64 * 10.0).round()
                / 10.0
        };
        Headline {
            from_percent: mean(&basis[..days_each]),
            to_percent: mean(&basis[basis.len() - days_each..]),
            days_each,
        }
    });
    UtilizationReport {
        peer_id,
        gpus,
        machine,
        team,
        headline,
    }
}

/// The report as CSV: `date,gpu,uuid,busy_percent,lent_percent,hours_sampled`, one row
/// per GPU and day, then one `all` row per day for the whole machine, then one `team`
/// row per day for the team.
pub fn utilization_csv(report: &UtilizationReport) -> String {
    let mut out = String::from("date,gpu,uuid,busy_percent,lent_percent,hours_sampled\n");
    let mut row = |d: &DayShare, gpu: &str, uuid: &str| {
        out.push_str(&format!(
            "{},{},{},{},{},{:.2}\n",
            d.date,
            csv_field(gpu),
            csv_field(uuid),
            d.busy_percent,
            d.lent_percent,
            d.hours_sampled
        ));
    };
    for g in &report.gpus {
        for d in &g.days {
            row(d, &g.name, &g.uuid);
        }
    }
    for d in &report.machine {
        row(d, "all", "");
    }
    for d in &report.team {
        row(d, "team", "");
    }
    out
}

/// A CSV field, quoted when it holds a comma, quote or line break; a leading `=`, `+`,
/// `-` or `@` is prefixed with `'` so a spreadsheet does not run it as a formula.
fn csv_field(text: &str) -> String {
    let text = if text.starts_with(['=', '+', '-', '@']) {
        format!("'{text}")
    } else {
        text.to_string()
    };
    if text.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text
    }
}

/// `GET /v1/ledger/history`: the balance after each entry, thinned to at most
/// `points` rows of `[end_ms, balance]` (the last entry always included).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BalanceHistory {
    /// Entries in the ledger.
    pub entries: u64,
    /// `[when the entry was recorded (unix ms), balance after it (credits)]`.
    pub points: Vec<(u64, f64)>,
}

/// The balance after each ledger entry, kept as entries are read so that a history is
/// never read from the chain twice (an open dashboard asks at every new receipt).
/// Holds every `stride`-th entry's row, at most [`BalanceSeries::MAX_ROWS`]: past that,
/// every other row goes and the stride doubles. The last entry's row is always kept.
#[derive(Debug, Clone)]
pub struct BalanceSeries {
    /// The last entry taken in (0: none).
    seq: u64,
    balance: f64,
    stride: u64,
    rows: Vec<(u64, f64)>,
    last: Option<(u64, f64)>,
}

impl Default for BalanceSeries {
    fn default() -> Self {
        BalanceSeries {
            seq: 0,
            balance: 0.0,
            stride: 1,
            rows: Vec::new(),
            last: None,
        }
    }
}

impl BalanceSeries {
    /// Most rows kept (twice the most points a history returns, so thinning to any
    /// allowed size still picks among rows).
    pub const MAX_ROWS: usize = 2 * MAX_BALANCE_POINTS;

    /// The last entry taken in (0: none).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Takes in entry `seq` (the one after [`BalanceSeries::seq`]), recorded at
    /// `at_ms`, which moved the balance by `change` credits.
    pub fn push(&mut self, seq: u64, at_ms: u64, change: f64) {
        self.balance += change;
        let row = (at_ms, (self.balance * 1000.0).round() / 1000.0);
        if (seq.saturating_sub(1)).is_multiple_of(self.stride) {
            self.rows.push(row);
            if self.rows.len() > Self::MAX_ROWS {
                let mut i = 0;
                self.rows.retain(|_| {
                    i += 1;
                    i % 2 == 1
                });
                self.stride *= 2;
            }
        }
        self.last = Some(row);
        self.seq = seq;
    }

    /// The history thinned to about `points` rows, the last entry included.
    pub fn history(&self, points: usize) -> BalanceHistory {
        let mut rows = self.rows.clone();
        if let Some(last) = self.last.filter(|l| rows.last() != Some(l)) {
            rows.push(last);
        }
        BalanceHistory {
            entries: self.seq,
            points: thin(rows, points),
        }
    }
}

/// Most points a balance history returns.
pub const MAX_BALANCE_POINTS: usize = 2000;

/// Thins `(t, balance)` rows to at most `points`, keeping the last.
pub fn thin(rows: Vec<(u64, f64)>, points: usize) -> Vec<(u64, f64)> {
    let points = points.clamp(2, MAX_BALANCE_POINTS);
    if rows.len() <= points {
        return rows;
    }
    let stride = rows.len().div_ceil(points);
    let last = rows.len() - 1;
    rows.into_iter()
        .enumerate()
        .filter(|(i, _)| i % stride == 0 || *i == last)
        .map(|(_, r)| r)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::GpuHistory;
    use crate::inventory::InventorySnapshot;
    use gpunode_protocol::gpu::{GpuInfo, GpuState};
    use std::collections::HashSet;

    fn snap(util: u32) -> InventorySnapshot {
        InventorySnapshot {
            gpus: vec![GpuInfo {
                index: 0,
                uuid: "GPU-1".into(),
                name: "=HYPERLINK(\"x\"),A100".into(),
                memory_total_bytes: 80 << 30,
                memory_used_bytes: 0,
                utilization_percent: util,
                mig_enabled: None,
                compute_capability: None,
                temperature_c: None,
                power_w: None,
                ecc_uncorrected: None,
                processes: Vec::new(),
                state: GpuState::Idle,
                simulated: true,
            }],
            driver_version: None,
            source: "simulated".into(),
        }
    }

    #[test]
    fn the_report_gives_daily_shares_a_headline_and_safe_csv() {
        let mut h = GpuHistory::in_memory(60_000);
        let none = HashSet::new();
        let day = 86_400_000u64;
        let t0 = 20_000 * day;
        // Day 1: busy 30% of samples; day 2: 70%.
        for (d, busy_of_ten) in [(0u64, 3u64), (1, 7)] {
            for i in 0..10 {
                let util = if i < busy_of_ten { 50 } else { 0 };
                h.record(&snap(util), &none, t0 + d * day + i * 60_000);
            }
        }
        let r = utilization(&h, "me".into());
        assert!(r.team.is_empty());
        assert_eq!(r.machine.len(), 2);
        assert_eq!(r.machine[0].busy_percent, 30.0);
        assert_eq!(r.machine[1].busy_percent, 70.0);
        let head = r.headline.clone().expect("two days");
        assert_eq!((head.from_percent, head.to_percent), (30.0, 70.0));
        let csv = utilization_csv(&r);
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines.len(), 1 + 2 + 2);
        // A GPU name that looks like a formula is neither split nor run.
        assert!(
            lines[1].contains("\"'=HYPERLINK(\"\"x\"\"),A100\""),
            "{}",
            lines[1]
        );
        assert!(lines[3].starts_with("2024-10-04,all,,30,"), "{}", lines[3]);

        // In a team, the headline is the team's: 10 GPUs seen, 2 then 5 busy.
        h.record_team(10, 2, 1, t0 + 10 * 60_000);
        h.record_team(10, 5, 5, t0 + day + 10 * 60_000);
        let r = utilization(&h, "me".into());
        assert_eq!(r.team.len(), 2);
        let head = r.headline.clone().expect("two team days");
        assert_eq!((head.from_percent, head.to_percent), (20.0, 50.0));
        assert!(utilization_csv(&r).contains("2024-10-05,team,,50,50,"));
    }

    #[test]
    fn a_balance_series_stays_bounded_and_matches_the_chain_read_at_once() {
        let change = |seq: u64| if seq.is_multiple_of(3) { -1.5 } else { 1.0 };
        let mut series = BalanceSeries::default();
        let (mut balance, mut all) = (0.0, Vec::new());
        for seq in 1..=50_000u64 {
            series.push(seq, seq * 10, change(seq));
            balance += change(seq);
            all.push((seq * 10, balance));
            assert!(series.rows.len() <= BalanceSeries::MAX_ROWS);
            // Read in pieces or at once, the history starts at the first entry and ends
            // at the last with the balance of the whole chain.
            if [1, 2, 4_001, 4_002, 33_333, 50_000].contains(&seq) {
                let h = series.history(400);
                assert_eq!(h.entries, seq);
                assert!(h.points.len() <= 401, "{seq}: {}", h.points.len());
                assert_eq!(h.points.first(), Some(&(10, 1.0)), "{seq}");
                assert_eq!(h.points.last(), all.last(), "{seq}");
                // Every point is a real row of the chain.
                assert!(h.points.iter().all(|p| all[(p.0 / 10 - 1) as usize] == *p));
            }
        }
        assert!(
            series.rows.len() > MAX_BALANCE_POINTS,
            "{}",
            series.rows.len()
        );
        let h = series.history(usize::MAX);
        assert!(h.points.len() <= MAX_BALANCE_POINTS + 1);
        assert_eq!(BalanceSeries::default().history(10).points, Vec::new());
    }

    #[test]
    fn a_balance_history_is_thinned_to_its_bound_and_keeps_the_last_point() {
        let rows: Vec<(u64, f64)> = (0..10_000).map(|i| (i, i as f64)).collect();
        let thinned = thin(rows, 500);
        assert!(thinned.len() <= 501, "{}", thinned.len());
        assert_eq!(thinned.last(), Some(&(9999, 9999.0)));
        assert_eq!(thin(vec![(1, 1.0)], 0), vec![(1, 1.0)]);
        assert!(
            thin((0..100_000).map(|i| (i, 0.0)).collect(), usize::MAX).len()
                <= MAX_BALANCE_POINTS + 1
        );
    }
}
