//! The owner comes first: which GPU processes are the owner's rather than gpunode jobs',
//! what happens to jobs on a GPU its owner starts using ([`OwnerPolicy`]), the hours the
//! GPUs are lent ([`LendingHours`]) and how much of each GPU's memory may be lent.
//!
//! Everything here takes the inventory snapshot and the clock as inputs, so the same
//! rules run on real GPUs (NVML) and on scripted simulated ones, with a scripted clock.

use std::collections::HashSet;

use gpunode_protocol::gpu::GpuState;
use gpunode_protocol::team::window_covers;
use gpunode_protocol::time::UnixMillis;

use crate::inventory::InventorySnapshot;
use crate::team::policy::{days, minute, offset};

const DAY_MS: i64 = 86_400_000;
const WEEK_MIN: u32 = 7 * 1440;
const DAY_NAMES: [&str; 7] = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"];

/// What happens to the jobs on a GPU when its owner starts using it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OwnerPolicy {
    /// Stop them after the grace period and end their leases as preempted; the
    /// requester pays for the time used and retries elsewhere.
    #[default]
    Yield,
    /// Keep them running beside the owner.
    Share,
    /// Pause them while the owner is there; resume when the owner leaves, if the
    /// lease is still valid.
    Suspend,
}

/// One lending window: days it starts on and minutes of the day (end exclusive; an
/// end before the start runs past midnight; 0-1440 is the whole day).
#[derive(Debug, Clone, PartialEq, Eq)]
struct LendWindow {
    days: Vec<u8>,
    start_min: u16,
    end_min: u16,
}

impl LendWindow {
    fn contains(&self, weekday: u8, minute: u16) -> bool {
        window_covers(&self.days, self.start_min, self.end_min, weekday, minute)
    }

    fn describe(&self) -> String {
        let days: Vec<&str> = self.days.iter().map(|d| DAY_NAMES[*d as usize]).collect();
        let (s, e) = (self.start_min, self.end_min);
        format!(
            "{} {:02}:{:02}-{:02}:{:02}",
            days.join(","),
            s / 60,
            s % 60,
            e / 60,
            e % 60
        )
    }
}

/// When GPUs are lent: `["mon-fri 19:00-08:00", "sat-sun"]` in local time given by a
/// UTC offset. No windows means always.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LendingHours {
    windows: Vec<LendWindow>,
    utc_offset_min: i32,
}

impl LendingHours {
    /// Parses the `lend` list and `lend_utc_offset` ("+01:00"); errors name the bad entry.
    pub fn parse(specs: &[String], utc_offset: &str) -> Result<LendingHours, String> {
        let mut windows = Vec::new();
        for spec in specs {
            let fail = |why: String| {
                format!(
                    "lend entry '{spec}': {why}; write e.g. \"mon-fri 19:00-08:00\" or \"sat-sun\""
                )
            };
            let mut parts = spec.split_whitespace();
            let day_part = parts.next().ok_or_else(|| fail("it is empty".into()))?;
            let days = days(day_part).map_err(fail)?;
            let (start_min, end_min) = match parts.next() {
                None => (0, 1440),
                Some(hours) => {
                    let (a, b) = hours.split_once('-').ok_or_else(|| {
                        fail(format!("'{hours}' is not a range like 19:00-08:00"))
                    })?;
                    (minute(a).map_err(fail)?, minute(b).map_err(fail)?)
                }
            };
            if parts.next().is_some() {
                return Err(fail("it has more than days and hours".into()));
            }
            if start_min == end_min {
                return Err(fail("the window is empty".into()));
            }
            windows.push(LendWindow {
                days,
                start_min,
                end_min,
            });
        }
        Ok(LendingHours {
            windows,
            utc_offset_min: offset(utc_offset)?,
        })
    }

    /// Whether there are any limits at all.
    pub fn is_always(&self) -> bool {
        self.windows.is_empty()
    }

    /// Weekday (0 = Monday) and minute of the day at `now`, local time.
    fn local(&self, now: UnixMillis) -> (u8, u16) {
        let local = now as i64 + self.utc_offset_min as i64 * 60_000;
        let weekday = (local.div_euclid(DAY_MS) + 3).rem_euclid(7) as u8;
        let minute = (local.rem_euclid(DAY_MS) / 60_000) as u16;
        (weekday, minute)
    }

    fn open_at(&self, weekday: u8, minute: u16) -> bool {
        self.windows.iter().any(|w| w.contains(weekday, minute))
    }

    /// `None` when GPUs are not lent at `now`; otherwise until when they are lent
    /// without a break (`u64::MAX` for always, or a week and more of windows).
    pub fn open_until(&self, now: UnixMillis) -> Option<UnixMillis> {
        if self.is_always() {
            return Some(UnixMillis::MAX);
        }
        let (weekday, minute) = self.local(now);
        if !self.open_at(weekday, minute) {
            return None;
        }
        let into_minute = now % 60_000;
        for step in 1..=WEEK_MIN {
            let m = minute as u32 + step;
            let (d, mm) = ((weekday as u32 + m / 1440) % 7, (m % 1440) as u16);
            if !self.open_at(d as u8, mm) {
                return Some(now - into_minute + step as u64 * 60_000);
            }
        }
        Some(UnixMillis::MAX)
    }

    /// Whether a lease of `duration_ms` from `now` fits; the error says why not.
    pub fn check(&self, duration_ms: u64, now: UnixMillis) -> Result<(), String> {
        match self.open_until(now) {
            None => Err(format!(
                "outside this provider's lending hours ({}, UTC{}); try again then or ask another provider",
                self.describe(),
                self.offset_text()
            )),
            Some(until) if now.saturating_add(duration_ms) > until => {
                let (d, m) = self.local(until);
                Err(format!(
                    "this provider's lending hours end at {} {:02}:{:02} (UTC{}), {} min from now; ask for a shorter lease or another provider",
                    DAY_NAMES[d as usize],
                    m / 60,
                    m % 60,
                    self.offset_text(),
                    (until - now) / 60_000
                ))
            }
            Some(_) => Ok(()),
        }
    }

    /// Like "mon-fri 19:00-08:00, sat,sun 00:00-24:00".
    pub fn describe(&self) -> String {
        if self.is_always() {
            return "always".into();
        }
        let w: Vec<String> = self.windows.iter().map(LendWindow::describe).collect();
        w.join(", ")
    }

    fn offset_text(&self) -> String {
        let o = self.utc_offset_min;
        format!(
            "{}{:02}:{:02}",
            if o < 0 { '-' } else { '+' },
            o.unsigned_abs() / 60,
            o.unsigned_abs() % 60
        )
    }
}

/// How much of each GPU's memory may be lent.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MemoryCap {
    /// A share of each GPU's memory (0 < f ≤ 1).
    Fraction(f64),
    /// At most this many bytes of each GPU.
    Bytes(u64),
}

impl MemoryCap {
    /// "50%" or "40G".
    pub fn parse(text: &str) -> Result<MemoryCap, String> {
        let t = text.trim();
        if let Some(p) = t.strip_suffix('%') {
            let pct: f64 = p.trim().parse().map_err(|_| {
                format!("lend_gpu_memory '{t}': write a percentage like 50% or a size like 40G")
            })?;
            if !(pct > 0.0 && pct <= 100.0) {
                return Err(format!(
                    "lend_gpu_memory '{t}' must be above 0% and at most 100%"
                ));
            }
            return Ok(MemoryCap::Fraction(pct / 100.0));
        }
        gpunode_protocol::units::parse_bytes(t)
            .map(MemoryCap::Bytes)
            .map_err(|e| {
                format!(
                    "lend_gpu_memory '{t}': {e}; write a percentage like 50% or a size like 40G"
                )
            })
    }

    /// Lendable bytes of a GPU with `total` bytes.
    pub fn apply(self, total: u64) -> u64 {
        match self {
            MemoryCap::Fraction(f) => (total as f64 * f) as u64,
            MemoryCap::Bytes(b) => b.min(total),
        }
    }
}

/// The owner's rules applied to each inventory snapshot.
#[derive(Debug, Clone, Default)]
pub struct OwnerRules {
    /// When GPUs are lent.
    pub hours: LendingHours,
    /// How much memory of each GPU is lent.
    pub memory_cap: Option<MemoryCap>,
}

impl OwnerRules {
    /// Rewrites `snap` as peers should see it at `now`: a GPU with a process that is not
    /// one of `job_pids` is the owner's (busy); outside lending hours the others are
    /// off-hours; memory is capped to what may be lent.
    pub fn apply(&self, snap: &mut InventorySnapshot, job_pids: &HashSet<u32>, now: UnixMillis) {
        let closed = self.hours.open_until(now).is_none();
        for gpu in &mut snap.gpus {
            let owner = gpu.processes.iter().any(|p| !job_pids.contains(&p.pid));
            gpu.state = if owner {
                GpuState::OwnerBusy
            } else if closed {
                GpuState::OffHours
            } else {
                GpuState::Idle
            };
            if let Some(cap) = self.memory_cap {
                gpu.memory_total_bytes = cap.apply(gpu.memory_total_bytes);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpunode_protocol::gpu::{GpuInfo, GpuProcess};

    /// 2026-11-30 is a Monday; this is 00:00 UTC that day.
    const MONDAY: UnixMillis = 1_795_996_800_000;
    const H: u64 = 3_600_000;

    fn hours(specs: &[&str]) -> LendingHours {
        let specs: Vec<String> = specs.iter().map(|s| s.to_string()).collect();
        LendingHours::parse(&specs, "+00:00").expect("parse")
    }

    #[test]
    fn the_clock_constant_is_a_monday() {
        assert_eq!(hours(&["mon"]).local(MONDAY + 5 * H), (0, 300));
    }

    #[test]
    fn nights_and_weekends() {
        let h = hours(&["mon-fri 19:00-08:00", "sat-sun"]);
        assert!(
            h.open_until(MONDAY + 10 * H).is_none(),
            "monday 10:00 is working time"
        );
        // Monday 20:00: lent until Tuesday 08:00.
        assert_eq!(h.open_until(MONDAY + 20 * H), Some(MONDAY + 32 * H));
        // Friday 20:00: the night runs into the weekend, which ends at Monday 00:00
        // (Sunday starts no night window).
        let friday = MONDAY + 4 * 24 * H;
        assert_eq!(h.open_until(friday + 20 * H), Some(MONDAY + 7 * 24 * H));
        // Tuesday 07:30: half an hour left.
        let tue = MONDAY + 24 * H + 7 * H + 30 * 60_000;
        assert!(h.check(20 * 60_000, tue).is_ok());
        let err = h.check(H, tue).expect_err("past the end");
        assert!(
            err.contains("end at tue 08:00") && err.contains("30 min"),
            "{err}"
        );
        let err = h.check(60_000, MONDAY + 12 * H).expect_err("closed");
        assert!(
            err.contains("outside this provider's lending hours"),
            "{err}"
        );
        assert!(
            hours(&[]).check(1000 * H, MONDAY).is_ok(),
            "no windows: always"
        );
    }

    #[test]
    fn offsets_shift_the_windows() {
        let specs = vec!["mon 09:00-17:00".to_string()];
        let h = LendingHours::parse(&specs, "+02:00").expect("parse");
        assert!(h.open_until(MONDAY + 6 * H).is_none(), "08:00 local");
        assert_eq!(h.open_until(MONDAY + 7 * H), Some(MONDAY + 15 * H));
    }

    #[test]
    fn bad_entries_are_named() {
        for (bad, says) in [
            ("someday", "unknown day"),
            ("mon 9-17", "not a time of day"),
            ("mon 19:00", "not a range"),
            ("mon 10:00-10:00", "empty"),
            ("mon 10:00-11:00 extra", "more than days and hours"),
        ] {
            let err = LendingHours::parse(&[bad.to_string()], "+00:00").expect_err(bad);
            assert!(err.contains(bad) && err.contains(says), "{bad}: {err}");
        }
        assert!(LendingHours::parse(&[], "1 hour").is_err());
        for bad in ["0%", "150%", "lots", "-5%"] {
            assert!(MemoryCap::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(MemoryCap::parse("50%").expect("pct").apply(80), 40);
        assert_eq!(
            MemoryCap::parse("40G").expect("bytes").apply(80 << 30),
            40 << 30
        );
        assert_eq!(
            MemoryCap::parse("400G").expect("bytes").apply(80 << 30),
            80 << 30
        );
    }

    fn gpu(pids: &[u32]) -> GpuInfo {
        GpuInfo {
            index: 0,
            uuid: "GPU-0".into(),
            name: "A100".into(),
            memory_total_bytes: 80 << 30,
            memory_used_bytes: 0,
            utilization_percent: 0,
            mig_enabled: None,
            compute_capability: None,
            temperature_c: None,
            power_w: None,
            ecc_uncorrected: None,
            processes: pids
                .iter()
                .map(|&pid| GpuProcess {
                    pid,
                    used_memory_bytes: None,
                    sm_util_percent: None,
                })
                .collect(),
            state: GpuState::Idle,
            simulated: true,
        }
    }

    #[test]
    fn job_processes_are_not_the_owner_and_hours_and_caps_apply() {
        let rules = OwnerRules {
            hours: hours(&["mon 19:00-08:00"]),
            memory_cap: Some(MemoryCap::Fraction(0.5)),
        };
        let mut snap = InventorySnapshot {
            gpus: vec![gpu(&[]), gpu(&[100]), gpu(&[100, 7])],
            driver_version: None,
            source: "simulated".into(),
        };
        let jobs: HashSet<u32> = [100].into_iter().collect();
        let mut evening = snap.clone();
        rules.apply(&mut evening, &jobs, MONDAY + 20 * H);
        let states: Vec<GpuState> = evening.gpus.iter().map(|g| g.state).collect();
        assert_eq!(
            states,
            vec![GpuState::Idle, GpuState::Idle, GpuState::OwnerBusy],
            "a job's own process is not the owner; pid 7 is"
        );
        assert!(evening
            .gpus
            .iter()
            .all(|g| g.memory_total_bytes == 40 << 30));
        rules.apply(&mut snap, &jobs, MONDAY + 12 * H);
        let states: Vec<GpuState> = snap.gpus.iter().map(|g| g.state).collect();
        assert_eq!(
            states,
            vec![GpuState::OffHours, GpuState::OffHours, GpuState::OwnerBusy]
        );
    }
}
