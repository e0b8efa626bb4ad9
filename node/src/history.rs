//! GPU history: what the dashboard plots and the utilization report sums. Each of this
//! machine's GPUs keeps the last hour of samples (one per `step`), the last day (one a
//! minute) and 30 days of daily busy and lent shares, all in bounded rings, plus the
//! latest alerts. Saved to `gpu-history.bin` in the data dir at most once a minute, so a
//! restart keeps the day; a file that does not decode is set aside, never trusted.

use std::collections::{HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use gpunode_protocol::encoding;
use gpunode_protocol::gpu::GpuState;
use gpunode_protocol::time::UnixMillis;
use serde::{Deserialize, Serialize};

use crate::inventory::InventorySnapshot;

/// The history's file in the data dir.
pub const HISTORY_FILE: &str = "gpu-history.bin";
/// Most GPUs (or MIG instances) whose history is kept.
pub const MAX_GPUS: usize = 64;
/// Points of the day plot: one a minute.
const DAY_POINTS: usize = 24 * 60;
const DAY_STEP_MS: u64 = 60_000;
/// Days of busy shares kept for the utilization report.
pub const REPORT_DAYS: usize = 30;
/// Latest alerts kept.
const MAX_ALERTS: usize = 50;
/// How often the history is written to disk.
const SAVE_EVERY_MS: u64 = 60_000;
/// The history file's largest accepted size.
const MAX_FILE_BYTES: usize = 16 * 1024 * 1024;
const FILE_VERSION: u16 = 1;
const MS_PER_DAY: u64 = 86_400_000;

/// One reading of one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// When, unix ms.
    pub t_ms: UnixMillis,
    /// Compute utilization, percent.
    pub util: u8,
    /// Memory in use, MiB.
    pub mem_used_mib: u32,
    /// Core temperature, °C, when the driver reports it.
    pub temp_c: Option<u16>,
    /// Power draw, watts, when the driver reports it.
    pub power_w: Option<u16>,
    /// Held by a lease.
    pub lent: bool,
    /// In use at all: lent, the owner's process, or utilization above zero.
    pub busy: bool,
}

/// The samples of one UTC day, summed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DayTotals {
    /// Days since the unix epoch (UTC).
    pub day: u32,
    /// Samples taken.
    pub samples: u32,
    /// Of which the GPU was busy.
    pub busy: u32,
    /// Of which a lease held it.
    pub lent: u32,
    /// Milliseconds sampled (samples times the step).
    pub sampled_ms: u64,
}

/// One GPU's history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuSeries {
    /// Stable identifier.
    pub uuid: String,
    /// Product name.
    pub name: String,
    /// Total memory, bytes.
    pub memory_total_bytes: u64,
    /// Simulated (test network).
    pub simulated: bool,
    /// The last hour, oldest first.
    pub hour: VecDeque<Sample>,
    /// The last day, one a minute, oldest first.
    pub day: VecDeque<Sample>,
    /// The last [`REPORT_DAYS`] days, oldest first.
    pub days: VecDeque<DayTotals>,
}

/// An alert as the dashboard lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AlertRecord {
    /// When it was raised, unix ms.
    pub at_ms: UnixMillis,
    /// `temperature`, `memory`, `idle_leased` or `ecc`.
    pub kind: String,
    /// The GPU's uuid.
    pub gpu: String,
    /// For people.
    pub message: String,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Saved {
    version: u16,
    gpus: Vec<GpuSeries>,
    alerts: VecDeque<AlertRecord>,
    team_days: VecDeque<DayTotals>,
}

/// The history of this machine's GPUs (see the module doc).
#[derive(Debug)]
pub struct GpuHistory {
    step_ms: u64,
    gpus: Vec<GpuSeries>,
    alerts: VecDeque<AlertRecord>,
    /// The team's GPUs as this node sees them (members' adverts and its own), by day:
    /// `samples` counts GPU-samples, `busy` and `lent` those leased or owner-busy.
    team_days: VecDeque<DayTotals>,
    last_sample_ms: UnixMillis,
    last_save_ms: UnixMillis,
    dirty: bool,
    path: Option<PathBuf>,
}

/// Why a history file was not loaded (it is then set aside and a new one started).
#[derive(Debug, thiserror::Error)]
#[error(
    "GPU history {path} could not be read ({why}); it was moved to {moved} and a new one started"
)]
pub struct LoadError {
    path: String,
    why: String,
    moved: String,
}

impl GpuHistory {
    /// An empty history sampled every `step_ms` (at least a second), kept in memory.
    pub fn in_memory(step_ms: u64) -> GpuHistory {
        GpuHistory {
            step_ms: step_ms.clamp(1000, 60_000),
            gpus: Vec::new(),
            alerts: VecDeque::new(),
            team_days: VecDeque::new(),
            last_sample_ms: 0,
            last_save_ms: 0,
            dirty: false,
            path: None,
        }
    }

    /// The history saved at `path`, or an empty one when there is none. A file that is
    /// too large or does not decode is renamed to `*.corrupt` and reported.
    pub fn open(path: &Path, step_ms: u64) -> (GpuHistory, Option<LoadError>) {
        let mut h = GpuHistory::in_memory(step_ms);
        h.path = Some(path.to_path_buf());
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(_) => return (h, None),
        };
        let decoded = if bytes.len() > MAX_FILE_BYTES {
            Err(format!("{} bytes, more than {MAX_FILE_BYTES}", bytes.len()))
        } else {
            encoding::decode::<Saved>(&bytes, MAX_FILE_BYTES)
                .map_err(|e| e.to_string())
                .and_then(|s| {
                    if s.version == FILE_VERSION {
                        Ok(s)
                    } else {
                        Err(format!(
                            "version {} (this gpunode writes {FILE_VERSION})",
                            s.version
                        ))
                    }
                })
        };
        match decoded {
            Ok(saved) => {
                h.gpus = saved.gpus;
                h.alerts = saved.alerts;
                h.team_days = saved.team_days;
                h.bound();
                (h, None)
            }
            Err(why) => {
                let moved = path.with_extension("bin.corrupt");
                let _ = std::fs::rename(path, &moved);
                let err = LoadError {
                    path: path.display().to_string(),
                    why,
                    moved: moved.display().to_string(),
                };
                (h, Some(err))
            }
        }
    }

    /// Trims whatever a loaded file holds to the rings' bounds.
    fn bound(&mut self) {
        self.gpus.truncate(MAX_GPUS);
        let hour_points = self.hour_points();
        for g in &mut self.gpus {
            trim_front(&mut g.hour, hour_points);
            trim_front(&mut g.day, DAY_POINTS);
            trim_front(&mut g.days, REPORT_DAYS);
        }
        trim_front(&mut self.alerts, MAX_ALERTS);
        trim_front(&mut self.team_days, REPORT_DAYS);
    }

    fn hour_points(&self) -> usize {
        (3_600_000 / self.step_ms) as usize
    }

    /// The sampling step, ms.
    pub fn step_ms(&self) -> u64 {
        self.step_ms
    }

    /// Takes a sample of every GPU in `snap` when a step has passed since the last;
    /// `leased` names the GPUs (uuids) a lease holds. Returns whether it sampled.
    pub fn record(
        &mut self,
        snap: &InventorySnapshot,
        leased: &HashSet<String>,
        now: UnixMillis,
    ) -> bool {
        if self.last_sample_ms != 0 && now < self.last_sample_ms + self.step_ms {
            return false;
        }
        let day_due = self
            .gpus
            .first()
            .and_then(|g| g.day.back())
            .is_none_or(|s| now >= s.t_ms + DAY_STEP_MS);
        let hour_points = self.hour_points();
        let day = (now / MS_PER_DAY) as u32;
        for gpu in &snap.gpus {
            let at = match self.gpus.iter().position(|g| g.uuid == gpu.uuid) {
                Some(at) => at,
                None if self.gpus.len() < MAX_GPUS => {
                    self.gpus.push(GpuSeries {
                        uuid: gpu.uuid.clone(),
                        name: gpu.name.clone(),
                        memory_total_bytes: gpu.memory_total_bytes,
                        simulated: gpu.simulated,
                        hour: VecDeque::new(),
                        day: VecDeque::new(),
                        days: VecDeque::new(),
                    });
                    self.gpus.len() - 1
                }
                None => continue,
            };
            let lent = leased.contains(&gpu.uuid) || gpu.state == GpuState::Leased;
            let busy = lent
                || gpu.state == GpuState::OwnerBusy
                || gpu.utilization_percent > 0
                || !gpu.processes.is_empty();
            let sample = Sample {
                t_ms: now,
                util: gpu.utilization_percent.min(100) as u8,
                mem_used_mib: (gpu.memory_used_bytes >> 20).min(u32::MAX as u64) as u32,
                temp_c: gpu.temperature_c.map(|t| t.min(u16::MAX as u32) as u16),
                power_w: gpu.power_w.map(|p| p.min(u16::MAX as u32) as u16),
                lent,
                busy,
            };
            let series = &mut self.gpus[at];
            series.name.clone_from(&gpu.name);
            series.memory_total_bytes = gpu.memory_total_bytes;
            push_bounded(&mut series.hour, sample, hour_points);
            if day_due || series.day.is_empty() {
                push_bounded(&mut series.day, sample, DAY_POINTS);
            }
            count_day(
                &mut series.days,
                day,
                (1, busy.into(), lent.into()),
                self.step_ms,
            );
        }
        self.last_sample_ms = now;
        self.dirty = true;
        true
    }

    /// Counts one look at the team's GPUs at `now`: `total` GPUs, of which `busy` were
    /// in use and `lent` leased (call it when [`GpuHistory::record`] sampled).
    pub fn record_team(&mut self, total: u32, busy: u32, lent: u32, now: UnixMillis) {
        let day = (now / MS_PER_DAY) as u32;
        let counts = (total, busy.min(total), lent.min(total));
        count_day(&mut self.team_days, day, counts, self.step_ms);
        self.dirty = true;
    }

    /// The team's days, oldest first (empty outside a team).
    pub fn team_days(&self) -> &VecDeque<DayTotals> {
        &self.team_days
    }

    /// Remembers an alert (the latest [`MAX_ALERTS`]).
    pub fn record_alert(&mut self, alert: &crate::alerts::Alert, now: UnixMillis) {
        push_bounded(
            &mut self.alerts,
            AlertRecord {
                at_ms: now,
                kind: alert.kind.to_string(),
                gpu: alert.gpu.clone(),
                message: alert.message.clone(),
            },
            MAX_ALERTS,
        );
        self.dirty = true;
    }

    /// The encoded history and where to write it, when it changed and the last save is
    /// a minute old (or `force`).
    pub fn take_save(&mut self, now: UnixMillis, force: bool) -> Option<(PathBuf, Vec<u8>)> {
        let path = self.path.clone()?;
        if !self.dirty || (!force && now < self.last_save_ms + SAVE_EVERY_MS) {
            return None;
        }
        self.dirty = false;
        self.last_save_ms = now;
        let saved = Saved {
            version: FILE_VERSION,
            gpus: self.gpus.clone(),
            alerts: self.alerts.clone(),
            team_days: self.team_days.clone(),
        };
        Some((path, encoding::encode(&saved)))
    }

    /// Every GPU's series.
    pub fn gpus(&self) -> &[GpuSeries] {
        &self.gpus
    }

    /// The latest alerts, oldest first.
    pub fn alerts(&self) -> &VecDeque<AlertRecord> {
        &self.alerts
    }
}

/// The history shared by the event loop (which records) and the API (which reads).
#[derive(Debug, Clone)]
pub struct SharedHistory(Arc<Mutex<GpuHistory>>);

impl SharedHistory {
    /// Shares `history`.
    pub fn new(history: GpuHistory) -> SharedHistory {
        SharedHistory(Arc::new(Mutex::new(history)))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GpuHistory> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a sample (when a step has passed) and `alerts`; `team` (the team's GPU
    /// use, `None` outside a team) is asked only when a sample was taken. Once a minute
    /// the history is written to disk on a blocking thread.
    pub fn record(
        &self,
        snap: &InventorySnapshot,
        leased: &HashSet<String>,
        alerts: &[crate::alerts::Alert],
        team: impl FnOnce() -> Option<(u32, u32, u32)>,
        now: UnixMillis,
    ) {
        let sampled = self.lock().record(snap, leased, now);
        // Looking at the team walks the advert book: only when a sample is due.
        let team = if sampled { team() } else { None };
        let save = {
            let mut h = self.lock();
            if let Some((total, busy, lent)) = team {
                h.record_team(total, busy, lent, now);
            }
            for a in alerts {
                h.record_alert(a, now);
            }
            h.take_save(now, false)
        };
        if let Some((path, bytes)) = save {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn_blocking(move || save_or_warn(&path, &bytes));
            }
        }
    }

    /// Writes what changed since the last save, now (at shutdown).
    pub fn save_now(&self) {
        let save = self
            .lock()
            .take_save(gpunode_protocol::time::now_ms(), true);
        if let Some((path, bytes)) = save {
            save_or_warn(&path, &bytes);
        }
    }

    /// Reads the history.
    pub fn read<R>(&self, f: impl FnOnce(&GpuHistory) -> R) -> R {
        f(&self.lock())
    }
}

fn save_or_warn(path: &Path, bytes: &[u8]) {
    if let Err(e) = write_atomically(path, bytes) {
        tracing::warn!("cannot save the GPU history to {}: {e}", path.display());
    }
}

/// Writes `bytes` to `path` through a temporary file and a rename, so a crash leaves
/// the old file or the new one, never half of one.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("bin.tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// Adds `(samples, busy, lent)` taken over `step_ms` to `day` in `days` (a new last
/// day when `day` is not the last; the oldest go past [`REPORT_DAYS`]).
fn count_day(days: &mut VecDeque<DayTotals>, day: u32, counts: (u32, u32, u32), step_ms: u64) {
    if days.back().is_none_or(|d| d.day != day) {
        let fresh = DayTotals {
            day,
            samples: 0,
            busy: 0,
            lent: 0,
            sampled_ms: 0,
        };
        push_bounded(days, fresh, REPORT_DAYS);
    }
    if let Some(d) = days.back_mut() {
        d.samples = d.samples.saturating_add(counts.0);
        d.busy = d.busy.saturating_add(counts.1);
        d.lent = d.lent.saturating_add(counts.2);
        d.sampled_ms += step_ms;
    }
}

fn push_bounded<T>(ring: &mut VecDeque<T>, item: T, cap: usize) {
    ring.push_back(item);
    trim_front(ring, cap);
}

fn trim_front<T>(ring: &mut VecDeque<T>, cap: usize) {
    while ring.len() > cap {
        ring.pop_front();
    }
}

/// The date of a day number, `YYYY-MM-DD` (UTC).
pub fn day_label(day: u32) -> String {
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = day as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpunode_protocol::gpu::GpuInfo;

    fn gpu(uuid: &str, util: u32) -> GpuInfo {
        GpuInfo {
            index: 0,
            uuid: uuid.into(),
            name: "NVIDIA A100-SXM4-80GB".into(),
            memory_total_bytes: 80 << 30,
            memory_used_bytes: 1 << 30,
            utilization_percent: util,
            mig_enabled: None,
            compute_capability: None,
            temperature_c: Some(40),
            power_w: Some(120),
            ecc_uncorrected: None,
            processes: Vec::new(),
            state: GpuState::Idle,
            simulated: true,
        }
    }

    fn snap(gpus: Vec<GpuInfo>) -> InventorySnapshot {
        InventorySnapshot {
            gpus,
            driver_version: None,
            source: "simulated".into(),
        }
    }

    #[test]
    fn samples_are_taken_once_a_step_and_the_rings_stay_bounded() {
        let mut h = GpuHistory::in_memory(10_000);
        let none = HashSet::new();
        let start = 20_000 * MS_PER_DAY;
        assert!(h.record(&snap(vec![gpu("a", 0)]), &none, start));
        assert!(!h.record(&snap(vec![gpu("a", 0)]), &none, start + 5_000));
        // Two days of samples, every 10 s.
        let mut t = start;
        for _ in 0..(2 * 8640) {
            t += 10_000;
            h.record(&snap(vec![gpu("a", 50)]), &none, t);
        }
        let g = &h.gpus()[0];
        assert_eq!(g.hour.len(), 360);
        assert_eq!(g.day.len(), DAY_POINTS);
        assert_eq!(g.days.len(), 3);
        assert!(g.days.iter().all(|d| d.samples <= 8640));
        // Many GPUs: only MAX_GPUS are kept.
        let many: Vec<GpuInfo> = (0..200).map(|i| gpu(&format!("g{i}"), 1)).collect();
        h.record(&snap(many), &none, t + 10_000);
        assert_eq!(h.gpus().len(), MAX_GPUS);
    }

    #[test]
    fn busy_and_lent_shares_are_counted_per_day() {
        let mut h = GpuHistory::in_memory(1000);
        let leased: HashSet<String> = ["a".to_string()].into();
        let none = HashSet::new();
        let t0 = 20_000 * MS_PER_DAY;
        for i in 0..10 {
            let lent = if i < 3 { &leased } else { &none };
            let util = if i < 5 { 30 } else { 0 };
            h.record(&snap(vec![gpu("a", util)]), lent, t0 + i * 1000);
        }
        let d = h.gpus()[0].days[0];
        assert_eq!((d.samples, d.busy, d.lent), (10, 5, 3));
        assert_eq!(day_label(d.day), "2024-10-04");
    }

    #[test]
    fn a_restart_keeps_the_day_and_a_corrupt_file_is_set_aside() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("gpu-history.bin");
        let (mut h, err) = GpuHistory::open(&path, 1000);
        assert!(err.is_none());
        let t0 = 20_000 * MS_PER_DAY;
        h.record(&snap(vec![gpu("a", 10)]), &HashSet::new(), t0);
        h.record_alert(
            &crate::alerts::Alert {
                kind: "temperature",
                gpu: "a".into(),
                message: "hot".into(),
            },
            t0,
        );
        let (p, bytes) = h.take_save(t0, true).expect("dirty");
        write_atomically(&p, &bytes).expect("write");
        assert!(h.take_save(t0 + 1, true).is_none(), "nothing new to save");
        let (again, err) = GpuHistory::open(&path, 1000);
        assert!(err.is_none());
        assert_eq!(again.gpus(), h.gpus());
        assert_eq!(again.alerts().len(), 1);

        // Garbage, and a file too large: each is moved aside and the node starts afresh.
        for bad in [vec![0xff; 100], vec![0u8; MAX_FILE_BYTES + 1]] {
            std::fs::write(&path, &bad).expect("write");
            let (fresh, err) = GpuHistory::open(&path, 1000);
            let err = err.expect("refused").to_string();
            assert!(err.contains("moved to"), "{err}");
            assert!(fresh.gpus().is_empty());
            assert!(!path.exists());
            assert_eq!(
                std::fs::read(path.with_extension("bin.corrupt")).expect("kept"),
                bad
            );
        }
    }
}
