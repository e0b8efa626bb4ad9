//! Control groups for one container job, where the host lets us make them: the memory
//! and process-count limits the kernel enforces for the whole process tree, the count of
//! OOM kills, and a sweep that kills whatever is left in the group. Cgroup v1 (`pids`
//! and `memory` hierarchies) and v2 (a child of this process's own group) are tried; when
//! neither is writable the caller falls back to rlimits.

use std::path::{Path, PathBuf};

use super::procs::{send, Signal};

const ROOT: &str = "/sys/fs/cgroup";

/// The groups made for one job; removed (after killing what is in them) on drop.
#[derive(Debug)]
pub struct JobCgroup {
    dirs: Vec<PathBuf>,
    memory_dir: Option<PathBuf>,
    /// Where pausing happens: the v1 `freezer` group, or the v2 group itself.
    freezer_dir: Option<PathBuf>,
    v2: bool,
    cpu_capped: bool,
}

impl JobCgroup {
    /// Makes the groups with these limits; `None` when the host gives us neither the
    /// memory nor the pids controller.
    ///
    /// `cpus` (when not 0) caps the group's CPU time at that many cores (CFS quota),
    /// where the host has the cpu controller; a host without it runs the job uncapped
    /// in CPU, which [`JobCgroup::cpu_capped`] tells.
    pub fn create(
        name: &str,
        memory_bytes: u64,
        max_processes: u32,
        cpus: u32,
    ) -> Option<JobCgroup> {
        let mut group = JobCgroup::create_v2(name, memory_bytes, max_processes)
            .or_else(|| JobCgroup::create_v1(name, memory_bytes, max_processes))?;
        if cpus > 0 {
            group.cap_cpu(name, cpus);
        }
        Some(group)
    }

    /// Adds the CPU cap: `cpu.max` in the v2 group, or a v1 `cpu` group.
    fn cap_cpu(&mut self, name: &str, cpus: u32) {
        const PERIOD_US: u64 = 100_000;
        let quota = (cpus as u64).saturating_mul(PERIOD_US);
        if self.v2 {
            if let Some(dir) = self.dirs.first() {
                let path = dir.join("cpu.max");
                self.cpu_capped = std::fs::write(path, format!("{quota} {PERIOD_US}")).is_ok();
            }
            return;
        }
        let cpu = Path::new(ROOT).join("cpu").join(name);
        if make(
            &cpu,
            &[
                ("cpu.cfs_period_us", PERIOD_US.to_string()),
                ("cpu.cfs_quota_us", quota.to_string()),
            ],
        ) {
            self.dirs.push(cpu);
            self.cpu_capped = true;
        }
    }

    /// Whether the job's CPU time is capped by the group.
    pub fn cpu_capped(&self) -> bool {
        self.cpu_capped
    }

    fn create_v1(name: &str, memory_bytes: u64, max_processes: u32) -> Option<JobCgroup> {
        let mut group = JobCgroup {
            dirs: Vec::new(),
            memory_dir: None,
            freezer_dir: None,
            v2: false,
            cpu_capped: false,
        };
        let pids = Path::new(ROOT).join("pids").join(name);
        if make(&pids, &[("pids.max", max_processes.to_string())]) {
            group.dirs.push(pids);
        }
        let memory = Path::new(ROOT).join("memory").join(name);
        if make(
            &memory,
            &[("memory.limit_in_bytes", memory_bytes.to_string())],
        ) {
            group.dirs.push(memory.clone());
            group.memory_dir = Some(memory);
        }
        // Both or nothing: half a cgroup would leave one limit to rlimits silently.
        if group.dirs.len() == 2 {
            // The freezer pauses the whole group at once, where the host has one.
            let freezer = Path::new(ROOT).join("freezer").join(name);
            if make(&freezer, &[]) {
                group.dirs.push(freezer.clone());
                group.freezer_dir = Some(freezer);
            }
            Some(group)
        } else {
            drop(group);
            None
        }
    }

    fn create_v2(name: &str, memory_bytes: u64, max_processes: u32) -> Option<JobCgroup> {
        let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
        let rel = own.lines().find_map(|l| l.strip_prefix("0::"))?;
        let parent = Path::new(ROOT).join(rel.trim_start_matches('/'));
        let controllers = std::fs::read_to_string(parent.join("cgroup.subtree_control")).ok()?;
        if !(controllers.contains("memory") && controllers.contains("pids")) {
            return None;
        }
        let dir = parent.join(name);
        let limits = [
            ("memory.max", memory_bytes.to_string()),
            ("memory.swap.max", "0".to_string()),
            ("pids.max", max_processes.to_string()),
        ];
        make(&dir, &limits).then(|| JobCgroup {
            memory_dir: Some(dir.clone()),
            freezer_dir: Some(dir.clone()),
            dirs: vec![dir],
            v2: true,
            cpu_capped: false,
        })
    }

    /// The `cgroup.procs` files a process writes its pid into to join every group.
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs.iter().map(|d| d.join("cgroup.procs")).collect()
    }

    /// Whether the kernel killed a process of the group for going over its memory.
    pub fn oom_killed(&self) -> bool {
        let Some(dir) = &self.memory_dir else {
            return false;
        };
        let (file, key) = if self.v2 {
            ("memory.events", "oom_kill")
        } else {
            ("memory.oom_control", "oom_kill")
        };
        let counted = std::fs::read_to_string(dir.join(file))
            .ok()
            .and_then(|text| {
                text.lines().find_map(|l| {
                    let (k, v) = l.split_once(' ')?;
                    (k == key).then(|| v.trim().parse::<u64>().ok())?
                })
            });
        match counted {
            Some(n) => n > 0,
            // Older v1 kernels have no oom_kill line: any refused charge counts.
            None => std::fs::read_to_string(dir.join("memory.failcnt"))
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .is_some_and(|n| n > 0),
        }
    }

    /// Pauses (`true`) or resumes every process of the group at once, forks in flight
    /// included; false when this host gives no freezer (the caller signals instead).
    pub fn freeze(&self, frozen: bool) -> bool {
        let Some(dir) = &self.freezer_dir else {
            return false;
        };
        let (file, value) = match (self.v2, frozen) {
            (true, true) => ("cgroup.freeze", "1"),
            (true, false) => ("cgroup.freeze", "0"),
            (false, true) => ("freezer.state", "FROZEN"),
            (false, false) => ("freezer.state", "THAWED"),
        };
        std::fs::write(dir.join(file), value).is_ok()
    }

    /// Kills every process in the groups; true when none is left.
    pub fn kill_all(&self) -> bool {
        let mut empty = true;
        for file in self.procs_files() {
            let pids = std::fs::read_to_string(&file).unwrap_or_default();
            for pid in pids.lines().filter_map(|l| l.trim().parse::<u32>().ok()) {
                empty = false;
                send(pid, Signal::Kill);
            }
        }
        empty
    }
}

impl Drop for JobCgroup {
    fn drop(&mut self) {
        self.freeze(false);
        for _ in 0..100 {
            if self.kill_all() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        for dir in &self.dirs {
            if let Err(e) = std::fs::remove_dir(dir) {
                tracing::warn!("cannot remove cgroup {}: {e}", dir.display());
            }
        }
    }
}

/// Creates a group and writes its limits; false (and nothing left behind) on failure.
fn make(dir: &Path, limits: &[(&str, String)]) -> bool {
    if std::fs::create_dir(dir).is_err() {
        return false;
    }
    for (file, value) in limits {
        if std::fs::write(dir.join(file), value).is_err() && !file.contains("swap") {
            let _ = std::fs::remove_dir(dir);
            return false;
        }
    }
    true
}
