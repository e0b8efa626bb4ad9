//! GPU alerts: thresholds checked against every inventory reading (temperature, memory
//! use, a leased GPU whose use stays at 0%, new uncorrected ECC errors). An alert is
//! logged as a warning, counted on `/metrics` and, when a hook is configured, handed to
//! it (`sh -c HOOK` with `GPUNODE_ALERT_KIND`, `GPUNODE_ALERT_GPU` and
//! `GPUNODE_ALERT_MESSAGE` set). Each alert fires once, and again only after it cleared.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use gpunode_protocol::gpu::{mig_profile, GpuInfo};
use gpunode_protocol::time::UnixMillis;

use crate::inventory::InventorySnapshot;

/// How long a hook may run before it is killed.
const HOOK_TIMEOUT: Duration = Duration::from_secs(30);

/// The thresholds; `None` (or zero) turns one off.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AlertRules {
    /// Core temperature, °C.
    pub temperature_c: Option<u32>,
    /// Memory in use, percent of the GPU's.
    pub memory_percent: Option<u32>,
    /// A leased GPU at 0% use for this long.
    pub idle_leased_after: Option<Duration>,
    /// Any new uncorrected ECC error.
    pub ecc: bool,
    /// Command run for each alert.
    pub hook: Option<String>,
}

/// One alert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Alert {
    /// `temperature`, `memory`, `idle_leased` or `ecc`.
    pub kind: &'static str,
    /// The GPU's uuid.
    pub gpu: String,
    /// For people.
    pub message: String,
}

/// What the rules have seen so far.
#[derive(Debug, Default)]
pub struct AlertWatch {
    rules: AlertRules,
    active: HashSet<(&'static str, String)>,
    idle_since: HashMap<String, UnixMillis>,
    ecc_seen: HashMap<String, u64>,
}

impl AlertWatch {
    /// A watch with these rules.
    pub fn new(rules: AlertRules) -> AlertWatch {
        AlertWatch {
            rules,
            ..AlertWatch::default()
        }
    }

    /// The hook command, if any.
    pub fn hook(&self) -> Option<&str> {
        self.rules.hook.as_deref()
    }

    /// New alerts in `snap` at `now`; `leased` names the GPUs under a lease.
    pub fn check(
        &mut self,
        snap: &InventorySnapshot,
        leased: &HashSet<String>,
        now: UnixMillis,
    ) -> Vec<Alert> {
        let mut raised = Vec::new();
        for gpu in &snap.gpus {
            let id = format!("GPU {} ({})", gpu.index, gpu.uuid);
            let conditions: [(&'static str, Option<String>); 4] = [
                ("temperature", self.too_hot(gpu, &id)),
                ("memory", self.memory_full(gpu, &id)),
                ("idle_leased", self.idle_leased(gpu, &id, leased, now)),
                ("ecc", self.new_ecc_errors(gpu, &id)),
            ];
            for (kind, message) in conditions {
                let key = (kind, gpu.uuid.clone());
                match message {
                    Some(message) => {
                        if self.active.insert(key) {
                            raised.push(Alert {
                                kind,
                                gpu: gpu.uuid.clone(),
                                message,
                            });
                        }
                    }
                    None => {
                        self.active.remove(&key);
                    }
                }
            }
        }
        raised
    }

    /// The message when `gpu` is at or above the temperature limit.
    fn too_hot(&self, gpu: &GpuInfo, id: &str) -> Option<String> {
        match (self.rules.temperature_c, gpu.temperature_c) {
            (Some(limit), Some(t)) if limit > 0 && t >= limit => {
                Some(format!("{id} is at {t} °C (alert at {limit} °C)"))
            }
            _ => None,
        }
    }

    /// The message when `gpu` has at least the limit's share of its memory in use.
    fn memory_full(&self, gpu: &GpuInfo, id: &str) -> Option<String> {
        match self.rules.memory_percent {
            Some(limit) if limit > 0 && gpu.memory_total_bytes > 0 => {
                let pct = gpu.memory_used_bytes.saturating_mul(100) / gpu.memory_total_bytes;
                (pct >= limit as u64)
                    .then(|| format!("{id} has {pct}% of its memory in use (alert at {limit}%)"))
            }
            _ => None,
        }
    }

    /// The message when `gpu` is leased but has been idle for the rule's time (counted
    /// from when it was first seen idle while leased).
    fn idle_leased(
        &mut self,
        gpu: &GpuInfo,
        id: &str,
        leased: &HashSet<String>,
        now: UnixMillis,
    ) -> Option<String> {
        match self.rules.idle_leased_after {
            // MIG instances report no utilization: no idle alert for them.
            Some(after)
                if !after.is_zero()
                    && leased.contains(&gpu.uuid)
                    && gpu.utilization_percent == 0
                    && mig_profile(&gpu.name).is_none() =>
            {
                let since = *self.idle_since.entry(gpu.uuid.clone()).or_insert(now);
                (now.saturating_sub(since) >= after.as_millis() as u64).then(|| {
                    format!(
                        "{id} is leased but has been at 0% use for {} s",
                        (now - since) / 1000
                    )
                })
            }
            _ => {
                self.idle_since.remove(&gpu.uuid);
                None
            }
        }
    }

    /// The message when `gpu` reported uncorrected ECC errors since the last snapshot.
    fn new_ecc_errors(&mut self, gpu: &GpuInfo, id: &str) -> Option<String> {
        match (self.rules.ecc, gpu.ecc_uncorrected) {
            (true, Some(n)) => {
                let before = self.ecc_seen.insert(gpu.uuid.clone(), n);
                match before {
                    Some(b) if n > b => Some(format!(
                        "{id} reported {} new uncorrected ECC error(s) ({n} since the driver loaded)",
                        n - b
                    )),
                    // Errors from before the node started are not news.
                    _ => None,
                }
            }
            _ => None,
        }
    }
}

/// Logs an alert and runs the hook for it, if any, without waiting for it.
pub fn raise(alert: &Alert, hook: Option<&str>) {
    tracing::warn!(kind = alert.kind, gpu = %alert.gpu, "GPU alert: {}", alert.message);
    let Some(hook) = hook else {
        return;
    };
    let mut cmd = tokio::process::Command::new("/bin/sh");
    cmd.arg("-c")
        .arg(hook)
        .env("GPUNODE_ALERT_KIND", alert.kind)
        .env("GPUNODE_ALERT_GPU", &alert.gpu)
        .env("GPUNODE_ALERT_MESSAGE", &alert.message)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    match cmd.spawn() {
        Ok(mut child) => {
            tokio::spawn(async move {
                match tokio::time::timeout(HOOK_TIMEOUT, child.wait()).await {
                    Ok(Ok(status)) if !status.success() => {
                        tracing::warn!("alert hook exited with {status}");
                    }
                    Ok(_) => {}
                    Err(_) => tracing::warn!("alert hook ran over {HOOK_TIMEOUT:?}; killed"),
                }
            });
        }
        Err(e) => tracing::warn!("cannot run the alert hook: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::{GpuInventory, SimulatedGpus};

    #[test]
    fn thresholds_fire_once_and_again_after_clearing() {
        let sim = SimulatedGpus::from_spec("2xA100-80GB", "peer").expect("spec");
        let mut watch = AlertWatch::new(AlertRules {
            temperature_c: Some(85),
            memory_percent: Some(90),
            idle_leased_after: Some(Duration::from_secs(60)),
            ecc: true,
            hook: None,
        });
        let uuid = |i: usize| sim.snapshot().expect("snap").gpus[i].uuid.clone();
        let leased: HashSet<String> = [uuid(1)].into_iter().collect();
        let kinds =
            |alerts: Vec<Alert>| -> Vec<&'static str> { alerts.iter().map(|a| a.kind).collect() };
        let check =
            |watch: &mut AlertWatch, now| watch.check(&sim.snapshot().expect("snap"), &leased, now);

        // Cool, empty, GPU 1 leased and idle but not for long yet.
        assert!(check(&mut watch, 0).is_empty());
        sim.set_readings(0, 91, 0, 50);
        let alerts = check(&mut watch, 1000);
        assert_eq!(kinds(alerts.clone()), vec!["temperature"]);
        assert!(alerts[0].message.contains("91 °C"), "{alerts:?}");
        assert!(check(&mut watch, 2000).is_empty(), "once while it lasts");
        sim.set_readings(0, 60, 0, 50);
        assert!(check(&mut watch, 3000).is_empty());
        sim.set_readings(0, 92, 0, 50);
        assert_eq!(
            kinds(check(&mut watch, 4000)),
            vec!["temperature"],
            "again after clearing"
        );

        // GPU 1 leased at 0% since t=0: an alert after a minute.
        assert_eq!(kinds(check(&mut watch, 61_000)), vec!["idle_leased"]);
        // New ECC errors and a full memory.
        sim.set_readings(1, 40, 2, 0);
        sim.set_job_process(1, 77, Some((78 << 30, 0)));
        let alerts = check(&mut watch, 62_000);
        assert_eq!(kinds(alerts.clone()), vec!["memory", "ecc"], "{alerts:?}");
        assert!(
            alerts[1].message.contains("2 new uncorrected"),
            "{alerts:?}"
        );
        assert!(check(&mut watch, 63_000).is_empty());
    }
}
