//! Control groups for one container job, where the host lets us make them: the memory
//! and process-count limits the kernel enforces for the whole process tree, the count of
//! OOM kills, and a sweep that kills whatever is left in the group. Cgroup v2 (a child of
//! this process's own group, see [`delegated_v2_group`]) and v1 (`pids` and `memory`
//! hierarchies) are tried; when neither is writable the caller falls back to rlimits.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

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
        static PARENT: OnceLock<Option<PathBuf>> = OnceLock::new();
        let parent = PARENT.get_or_init(|| {
            let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
            delegated_v2_group(Path::new(ROOT), &own, std::process::id())
        });
        let dir = parent.as_ref()?.join(name);
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
        // Every group is swept, even after one that had processes.
        let mut empty = true;
        for dir in &self.dirs {
            empty &= kill_members(dir);
        }
        empty
    }
}

/// Kills every process in the group at `dir`; true when it had none.
fn kill_members(dir: &Path) -> bool {
    let pids = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
    let mut empty = true;
    for pid in pids.lines().filter_map(|l| l.trim().parse::<u32>().ok()) {
        empty = false;
        send(pid, Signal::Kill);
    }
    empty
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
        let busy: Vec<PathBuf> = self
            .dirs
            .iter()
            .filter(|dir| std::fs::remove_dir(dir).is_err())
            .cloned()
            .collect();
        if !busy.is_empty() {
            // A killed GPU process can take seconds to give its device back, and its group
            // cannot be removed before: that is left to a thread, so the job's end is not
            // held up.
            let _ = std::thread::Builder::new()
                .name("cgroup-removal".into())
                .spawn(move || remove_when_empty(busy));
        }
    }
}

/// How long a group whose processes are still exiting is waited for before it is left.
const REMOVAL_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Removes `dirs` once their last processes have gone (killing any that are left), or
/// says which could not be removed within [`REMOVAL_WAIT`].
fn remove_when_empty(mut dirs: Vec<PathBuf>) {
    let until = std::time::Instant::now() + REMOVAL_WAIT;
    while !dirs.is_empty() && std::time::Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(100));
        dirs.retain(|dir| {
            kill_members(dir);
            std::fs::remove_dir(dir).is_err()
        });
    }
    for dir in dirs {
        tracing::warn!(
            "cannot remove cgroup {}: its processes did not exit within {}s",
            dir.display(),
            REMOVAL_WAIT.as_secs()
        );
    }
}

/// The leaf this process moves into when its own cgroup v2 group must give controllers
/// to job groups.
pub const DAEMON_LEAF: &str = "gpunode-daemon";
/// The group made under the v2 root for job groups when this process's own group cannot
/// hold them (root only, as container engines do with theirs).
pub const TOP_GROUP: &str = "gpunode";
/// The controllers a job group needs (cpu is enabled too where the host has it).
const NEEDED: [&str; 2] = ["memory", "pids"];

/// The cgroup v2 group under which job groups are made, with the memory and pids
/// controllers enabled for its children; `None` where there is no v2 hierarchy at `root`
/// (its mount) or no group can give both controllers. `proc_self_cgroup` is the text of
/// `/proc/self/cgroup`, `pid` this process.
///
/// Cgroup v2 lets no group that holds processes, except the root, give controllers to its
/// children. So, in order:
/// 1. this process's own group, where it gives them already or they can be enabled in
///    place (the root group, as for root on a v2 host);
/// 2. the same, after this process moves into a leaf of its group ([`DAEMON_LEAF`]),
///    which is what systemd expects of a unit with `Delegate=yes`; if other processes
///    share the group, this process moves back and the group is left as it was;
/// 3. a group of our own under the root ([`TOP_GROUP`]), where the root gives the
///    controllers and this process may make groups there (root).
///
/// A process already in its leaf uses the group above it. Call it before the process
/// starts children of its own, which would share its group.
pub fn delegated_v2_group(root: &Path, proc_self_cgroup: &str, pid: u32) -> Option<PathBuf> {
    let rel = proc_self_cgroup
        .lines()
        .find_map(|l| l.strip_prefix("0::"))?
        .trim();
    let mut own = root.join(rel.trim_start_matches('/'));
    if own.file_name().is_some_and(|n| n == DAEMON_LEAF) {
        own = own.parent()?.to_path_buf();
    }
    if gives_or_enables(&own) {
        return Some(own);
    }
    if own != root && offers(&own) && move_into_leaf(&own, pid) {
        if gives_or_enables(&own) {
            tracing::info!(
                "moved into cgroup {} so that job groups under {} get memory and process limits",
                own.join(DAEMON_LEAF).display(),
                own.display()
            );
            return Some(own);
        }
        let _ = std::fs::write(own.join("cgroup.procs"), pid.to_string());
        let _ = std::fs::remove_dir(own.join(DAEMON_LEAF));
    }
    let top = root.join(TOP_GROUP);
    if own != top && gives_or_enables(root) {
        let _ = std::fs::create_dir(&top);
        if gives_or_enables(&top) {
            return Some(top);
        }
    }
    None
}

/// Whether `group`'s `file` lists both needed controllers.
fn lists_needed(group: &Path, file: &str) -> bool {
    std::fs::read_to_string(group.join(file)).is_ok_and(|text| {
        // The kernel lists names; a `+name` as written is read the same.
        let names: Vec<&str> = text
            .split_whitespace()
            .map(|n| n.trim_start_matches('+'))
            .collect();
        NEEDED.iter().all(|c| names.contains(c))
    })
}

/// Whether `group` offers both needed controllers to be enabled for its children.
fn offers(group: &Path) -> bool {
    lists_needed(group, "cgroup.controllers")
}

/// Whether `group` gives its children both needed controllers, enabling them (and cpu,
/// where offered) if it can.
fn gives_or_enables(group: &Path) -> bool {
    if lists_needed(group, "cgroup.subtree_control") {
        return true;
    }
    if !offers(group) {
        return false;
    }
    let control = group.join("cgroup.subtree_control");
    let enabled = std::fs::write(&control, "+memory +pids").is_ok()
        && lists_needed(group, "cgroup.subtree_control");
    if enabled {
        // Optional: caps a job's CPU time where the host has the controller.
        let _ = std::fs::write(&control, "+cpu");
    }
    enabled
}

/// Moves process `pid` into the leaf [`DAEMON_LEAF`] of `group`.
fn move_into_leaf(group: &Path, pid: u32) -> bool {
    let leaf = group.join(DAEMON_LEAF);
    let _ = std::fs::create_dir(&leaf);
    let moved = std::fs::write(leaf.join("cgroup.procs"), pid.to_string()).is_ok();
    if !moved {
        let _ = std::fs::remove_dir(&leaf);
    }
    moved
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in for a v2 mount: `own` with the given files. Plain files take every
    /// write, so this checks which group is chosen and what is written, not the kernel's
    /// refusals (those are checked on real hosts by `scripts/gpu-check.sh`).
    fn fake_group(root: &Path, own: &str, controllers: &str, subtree: &str) -> PathBuf {
        let group = root.join(own);
        std::fs::create_dir_all(&group).expect("group");
        std::fs::write(group.join("cgroup.controllers"), controllers).expect("controllers");
        std::fs::write(group.join("cgroup.subtree_control"), subtree).expect("subtree");
        group
    }

    #[test]
    fn a_group_that_already_gives_memory_and_pids_is_used_as_it_is() {
        let root = tempfile::tempdir().expect("tmp");
        let group = fake_group(
            root.path(),
            "system.slice/gpunode.service",
            "cpu memory pids",
            "memory pids",
        );
        let found = delegated_v2_group(root.path(), "0::/system.slice/gpunode.service\n", 42);
        assert_eq!(found, Some(group.clone()));
        assert!(!group.join(DAEMON_LEAF).exists(), "nothing moved");
    }

    #[test]
    fn controllers_offered_but_not_enabled_are_enabled_for_job_groups() {
        let root = tempfile::tempdir().expect("tmp");
        let group = fake_group(root.path(), "", "cpuset cpu io memory pids", "");
        let found = delegated_v2_group(root.path(), "0::/\n", 42);
        assert_eq!(found, Some(group.clone()));
        let written = std::fs::read_to_string(group.join("cgroup.subtree_control")).expect("read");
        assert_eq!(written, "+cpu", "memory and pids first, then cpu");
    }

    #[test]
    fn no_group_where_the_host_does_not_offer_both_controllers_or_has_no_v2() {
        let root = tempfile::tempdir().expect("tmp");
        fake_group(root.path(), "user.slice", "cpu memory", "");
        assert_eq!(
            delegated_v2_group(root.path(), "0::/user.slice\n", 42),
            None
        );
        // cgroup v1 only: no "0::" line.
        let v1 = "12:pids:/user.slice\n4:memory:/user.slice\n";
        assert_eq!(delegated_v2_group(root.path(), v1, 42), None);
    }

    #[test]
    fn a_group_of_our_own_under_the_root_where_our_group_offers_nothing() {
        let root = tempfile::tempdir().expect("tmp");
        fake_group(root.path(), "", "cpu memory pids", "memory pids");
        fake_group(root.path(), "session-3.scope", "", "");
        // The kernel gives a new group its controller files; the stand-in has them ahead.
        let top = fake_group(root.path(), TOP_GROUP, "cpu memory pids", "");
        let found = delegated_v2_group(root.path(), "0::/session-3.scope\n", 42);
        assert_eq!(found, Some(top.clone()));
        let written = std::fs::read_to_string(top.join("cgroup.subtree_control")).expect("read");
        assert_eq!(written, "+cpu", "memory and pids enabled, then cpu");
        assert!(!root
            .path()
            .join("session-3.scope")
            .join(DAEMON_LEAF)
            .exists());
    }

    #[test]
    fn a_process_already_in_its_leaf_uses_the_group_above() {
        let root = tempfile::tempdir().expect("tmp");
        let group = fake_group(
            root.path(),
            "system.slice/gpunode.service",
            "memory pids",
            "memory pids",
        );
        let found = delegated_v2_group(
            root.path(),
            "0::/system.slice/gpunode.service/gpunode-daemon\n",
            42,
        );
        assert_eq!(found, Some(group));
    }
}
