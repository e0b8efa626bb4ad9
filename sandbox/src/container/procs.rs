//! Host processes of a sandbox: the tree under a pid (read from `/proc`), signals to
//! them, and the effective uid. The only unsafe code of the container backend lives here.

use std::collections::{HashMap, HashSet};

/// Every process whose parent chain leads to `root` (not `root` itself), read from `/proc`.
pub fn descendants(root: u32) -> Vec<u32> {
    ProcessTree::read().descendants(root)
}

/// Parent-to-children links of every process, read from `/proc` once, so that the trees
/// of many roots cost one scan.
#[derive(Debug, Default)]
pub struct ProcessTree {
    children: HashMap<u32, Vec<u32>>,
}

impl ProcessTree {
    /// Reads `/proc` now.
    pub fn read() -> ProcessTree {
        let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
        for pid in all_pids() {
            if let Some(ppid) = parent_of(pid) {
                children.entry(ppid).or_default().push(pid);
            }
        }
        ProcessTree { children }
    }

    /// Every process below `root` (not `root` itself).
    pub fn descendants(&self, root: u32) -> Vec<u32> {
        let (mut out, mut seen, mut stack) = (Vec::new(), HashSet::new(), vec![root]);
        while let Some(p) = stack.pop() {
            for &c in self.children.get(&p).map(Vec::as_slice).unwrap_or(&[]) {
                if seen.insert(c) {
                    out.push(c);
                    stack.push(c);
                }
            }
        }
        out
    }
}

/// Every process on the host whose environment holds `needle` (e.g. `NAME=value`):
/// how tests and operators find a job's processes by a variable it was given.
pub fn processes_with_env(needle: &str) -> Vec<u32> {
    all_pids()
        .into_iter()
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|var| var == needle.as_bytes()))
        })
        .collect()
}

/// The pids in `/proc`.
fn all_pids() -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()))
        .collect()
}

/// The parent pid of `pid`, from `/proc/PID/stat` (the field after the command name,
/// which may itself hold spaces and parentheses).
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(1)?.parse().ok()
}

/// Signals the sandbox may send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// Stop for good.
    Kill,
    /// Pause.
    Stop,
    /// Resume after [`Signal::Stop`].
    Continue,
}

/// Sends `signal` to `pid`; false when it is gone or not ours.
#[allow(unsafe_code)]
pub fn send(pid: u32, signal: Signal) -> bool {
    let sig = match signal {
        Signal::Kill => libc::SIGKILL,
        Signal::Stop => libc::SIGSTOP,
        Signal::Continue => libc::SIGCONT,
    };
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: kill(2) takes plain integers and touches no memory of ours; a positive pid
    // names one process, never a group.
    unsafe { libc::kill(pid, sig) == 0 }
}

/// The effective uid of this process.
#[allow(unsafe_code)]
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid(2) has no arguments and cannot fail.
    unsafe { libc::geteuid() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_and_grandchild_are_found_and_stopped() {
        let mut child = std::process::Command::new("sh")
            .args(["-c", "sleep 30 & wait"])
            .spawn()
            .expect("spawn sh");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let mut found = Vec::new();
        while found.is_empty() && std::time::Instant::now() < deadline {
            found = descendants(child.id());
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(found.len(), 1, "the sleep under sh: {found:?}");
        assert!(send(found[0], Signal::Kill));
        let status = child.wait().expect("wait");
        assert!(status.success(), "sh's wait returns once sleep is gone");
        assert!(
            !send(found[0], Signal::Kill),
            "gone processes are not signalled"
        );
    }
}
