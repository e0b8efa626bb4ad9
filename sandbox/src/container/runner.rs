//! One container task under bubblewrap: the command line that builds its namespaces and
//! mounts, the limits around it, and the loop that watches it until one [`Outcome`].
//!
//! ```text
//! sh (joins the job's cgroups) ─exec▶ prlimit ─exec▶ setpriv (job uid, when root)
//!   ─exec▶ bwrap --unshare-all --die-with-parent ... ─fork▶ pid 1 of the job ─▶ task
//! ```
//!
//! Killing the outer `bwrap` kills the job's pid 1 (`--die-with-parent`), and the kernel
//! then kills everything else in the job's pid namespace, whatever it does with SIGTERM.
//! When this process runs as root, each job runs as a uid of its own (no passwd entry,
//! no capabilities), so `RLIMIT_NPROC` counts exactly the job's processes and jobs cannot
//! signal or read each other.

mod command;
mod host;
mod watch;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::cgroup::JobCgroup;
use super::image::ImageConfig;
use super::procs::effective_uid;
use crate::wasm::{over_output_limits, CancelToken, OutputSink};
use crate::{Outcome, SandboxError};
use command::{effective_command, seccomp_file};
use host::{find_in_path, free_job_uid, UidHold};
use watch::{watch, OutputPipes};

pub use host::nvidia_driver_files;

static NEXT_JOB: AtomicU32 = AtomicU32::new(0);

/// What the host provides to container jobs.
#[derive(Debug, Clone)]
pub struct ContainerConfig {
    /// The bubblewrap binary.
    pub bwrap: PathBuf,
    /// Where GPU device nodes are (`/dev`; tests use a directory of stand-ins).
    pub dev_dir: PathBuf,
    /// The NVIDIA user-space driver (libraries, `nvidia-smi`) shown read-only to image
    /// jobs that hold GPUs.
    pub driver_files: Vec<PathBuf>,
    /// Whether to put jobs in cgroups where the host allows (rlimits otherwise).
    pub use_cgroups: bool,
    /// Whether this bubblewrap can stop the job making user namespaces of its own
    /// (`--disable-userns`, bubblewrap 0.8 and later); the seccomp filter refuses
    /// `clone` with a new user namespace either way.
    pub disable_userns: bool,
}

impl ContainerConfig {
    /// The host's setup: `bwrap` from PATH, `/dev`, the NVIDIA driver files found on
    /// the library path. Errors say what to install.
    pub fn detect() -> Result<ContainerConfig, SandboxError> {
        let bwrap = find_in_path("bwrap").ok_or_else(|| {
            SandboxError::Setup(
                "bubblewrap (bwrap) is not installed; install it (Debian: apt-get install bubblewrap) \
                 or remove \"container\" from backends"
                    .to_string(),
            )
        })?;
        let disable_userns = Command::new(&bwrap)
            .arg("--help")
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout).contains("--disable-userns")
                    || String::from_utf8_lossy(&o.stderr).contains("--disable-userns")
            })
            .unwrap_or(false);
        Ok(ContainerConfig {
            bwrap,
            dev_dir: PathBuf::from("/dev"),
            driver_files: nvidia_driver_files(),
            use_cgroups: true,
            disable_userns,
        })
    }
}

/// A GPU a job holds: the device minor number and its UUID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuDevice {
    /// `N` of `/dev/nvidiaN`.
    pub index: u32,
    /// `GPU-…` (or `MIG-…` for a MIG instance).
    pub uuid: String,
}

/// The job's root filesystem.
#[derive(Debug, Clone)]
pub enum Root {
    /// An unpacked image, read-only, with what its config says about running it.
    Image {
        /// The unpacked root.
        rootfs: PathBuf,
        /// Env, entrypoint, cmd, working dir.
        config: ImageConfig,
    },
    /// The host's own software directories, read-only.
    HostEnv,
}

/// What a container job may use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerLimits {
    /// Wall-clock time.
    pub wall_time: Duration,
    /// Memory of the whole job (cgroup) or of each process (rlimit fallback).
    pub memory_bytes: u64,
    /// Processes and threads at once.
    pub max_processes: u32,
    /// CPU seconds per process.
    pub cpu_seconds: u64,
    /// Bytes of stdout forwarded.
    pub stdout_bytes: u64,
    /// Bytes of stderr forwarded.
    pub stderr_bytes: u64,
    /// Bytes left in `/output` (also the largest file anywhere).
    pub output_bytes: u64,
    /// Files in `/output`.
    pub output_files: u64,
    /// CPU cores the job's processes may keep busy together (cgroup CPU quota, where
    /// the host has the cpu controller); 0: no cap.
    pub cpus: u32,
}

impl Default for ContainerLimits {
    fn default() -> Self {
        ContainerLimits {
            wall_time: Duration::from_secs(600),
            memory_bytes: 2 << 30,
            max_processes: 256,
            cpu_seconds: 3600,
            stdout_bytes: 16 << 20,
            stderr_bytes: 16 << 20,
            output_bytes: 1 << 30,
            output_files: 1000,
            cpus: 0,
        }
    }
}

/// Pauses and resumes a running job (the owner's `suspend` policy), and counts how long
/// it was held paused (not billed, and added to its deadline).
#[derive(Debug, Clone, Default)]
pub struct PauseToken(Arc<AtomicBool>, Arc<AtomicU64>);

impl PauseToken {
    /// Milliseconds the job has spent paused so far.
    pub fn paused_ms(&self) -> u64 {
        self.1.load(Ordering::SeqCst)
    }

    /// A token that does not pause.
    pub fn new() -> PauseToken {
        PauseToken::default()
    }

    /// Pause (`true`) or resume (`false`) within one poll.
    pub fn set(&self, paused: bool) {
        self.0.store(paused, Ordering::SeqCst);
    }

    /// Whether the job should be paused.
    pub fn is_paused(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// One container run.
pub struct ContainerSpec {
    /// Root filesystem.
    pub root: Root,
    /// Program and arguments; empty means the image's entrypoint and cmd.
    pub command: Vec<String>,
    /// Environment on top of the image's.
    pub env: Vec<(String, String)>,
    /// Host directory shown read-only at `/input`.
    pub input_dir: Option<PathBuf>,
    /// Host directory shown writable at `/output`.
    pub output_dir: PathBuf,
    /// GPUs the job holds; no other GPU device is visible.
    pub gpus: Vec<GpuDevice>,
    /// Limits.
    pub limits: ContainerLimits,
    /// Receives stdout.
    pub stdout: OutputSink,
    /// Receives stderr.
    pub stderr: OutputSink,
    /// Stops the job.
    pub cancel: CancelToken,
    /// Pauses the job.
    pub pause: PauseToken,
    /// Told the host pid of the job's outer process once it runs (for GPU metering:
    /// the job's processes are its descendants, see [`descendants`]).
    pub on_start: Option<Box<dyn FnOnce(u32) + Send>>,
}

/// Runs container jobs.
#[derive(Debug, Clone)]
pub struct ContainerExecutor {
    config: ContainerConfig,
}

impl ContainerExecutor {
    /// An executor for this host setup.
    pub fn new(config: ContainerConfig) -> ContainerExecutor {
        ContainerExecutor { config }
    }

    /// The host setup.
    pub fn config(&self) -> &ContainerConfig {
        &self.config
    }

    /// Runs one job to its end. Blocks; call from a thread of its own.
    pub fn run(&self, mut spec: ContainerSpec) -> Result<Outcome, SandboxError> {
        let command = effective_command(&spec)?;
        let job = NEXT_JOB.fetch_add(1, Ordering::Relaxed);
        let uid = (effective_uid() == 0).then(free_job_uid);
        let _uid_held = uid.map(UidHold);
        prepare_dirs(&spec, uid)?;
        let cgroup = self.job_cgroup(&spec, job)?;
        // The filter goes to bubblewrap as an open file (`--seccomp 3`, opened by the
        // first shell of the command line); the file is removed when the job ends.
        let filter = match super::seccomp::program() {
            Some(bytes) => Some(seccomp_file(&bytes)?),
            None => None,
        };
        let mut cmd = self.command_line(
            &spec,
            &command,
            uid,
            cgroup.as_ref(),
            filter.as_ref().map(|f| f.path()),
        );
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .map_err(|e| SandboxError::Setup(format!("cannot start bubblewrap: {e}")))?;
        if let Some(f) = spec.on_start.take() {
            f(child.id());
        }
        let mut pipes = OutputPipes::start(&mut child, &mut spec);
        let outcome = watch(
            &mut child,
            &spec,
            &pipes.stdout_over,
            &pipes.stderr_over,
            &cgroup,
        );
        pipes.join();
        let outcome = final_outcome(outcome, &spec, &pipes, cgroup.as_ref());
        drop(cgroup);
        Ok(outcome)
    }

    /// The job's cgroup, where the host allows one (its limits otherwise fall back to
    /// rlimits). A GPU job without one is refused: it would run with no memory limit.
    fn job_cgroup(
        &self,
        spec: &ContainerSpec,
        job: u32,
    ) -> Result<Option<JobCgroup>, SandboxError> {
        let cgroup = if self.config.use_cgroups {
            JobCgroup::create(
                &format!("gpunode-job-{}-{job}", std::process::id()),
                spec.limits.memory_bytes,
                spec.limits.max_processes,
                spec.limits.cpus,
            )
        } else {
            None
        };
        // Without a memory cgroup, only CPU jobs get a memory limit (per process, see
        // `command_line`): a GPU job would run with none, so it does not run at all.
        if cgroup.is_none() && !spec.gpus.is_empty() {
            return Err(SandboxError::Setup(
                "no memory limit can be applied to a GPU job on this host: it needs the \
                 memory and pids cgroup controllers (run gpunode under systemd with \
                 Delegate=yes, or as root on a host with cgroups), so the job was refused"
                    .to_string(),
            ));
        }
        if spec.limits.cpus > 0 && !cgroup.as_ref().is_some_and(JobCgroup::cpu_capped) {
            tracing::warn!(
                "this host gives no cpu cgroup controller: the job's CPU use is not capped at its {} leased cores",
                spec.limits.cpus
            );
        }
        Ok(cgroup)
    }
}

/// Makes the image root's mount points where they are missing, and hands `/output` to
/// the job's own uid when it has one.
fn prepare_dirs(spec: &ContainerSpec, uid: Option<u32>) -> Result<(), SandboxError> {
    if let Root::Image { rootfs, .. } = &spec.root {
        // The image cache makes these; a root from elsewhere may lack them.
        for dir in super::image::MOUNT_POINTS {
            let path = rootfs.join(dir);
            match std::fs::create_dir(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => {
                    return Err(SandboxError::Setup(format!(
                        "cannot prepare {}: {e}",
                        path.display()
                    )))
                }
            }
        }
    }
    if let Some(uid) = uid {
        std::os::unix::fs::chown(&spec.output_dir, Some(uid), Some(uid)).map_err(|e| {
            SandboxError::Setup(format!("cannot hand /output to the job's uid: {e}"))
        })?;
    }
    Ok(())
}

/// What the job's end means once its output is counted: over an output limit, out of
/// memory, or as it ended.
fn final_outcome(
    outcome: Outcome,
    spec: &ContainerSpec,
    pipes: &OutputPipes,
    cgroup: Option<&JobCgroup>,
) -> Outcome {
    let over_output = || {
        let l = &spec.limits;
        over_output_limits(&spec.output_dir, l.output_bytes, l.output_files)
    };
    // A job that failed after the kernel refused it memory ran out of memory (a
    // successful one only had its page cache trimmed).
    let oom = !matches!(outcome, Outcome::Exited(0)) && cgroup.is_some_and(JobCgroup::oom_killed);
    match outcome {
        Outcome::Exited(_) | Outcome::Trapped(_) if over_output().is_some() => {
            Outcome::OutputTooLarge(over_output().unwrap_or_default())
        }
        Outcome::Exited(_) | Outcome::Trapped(_) if oom => Outcome::OutOfMemory,
        Outcome::Exited(_) if pipes.stdout_over.load(Ordering::SeqCst) => {
            Outcome::OutputTooLarge("stdout".into())
        }
        Outcome::Exited(_) if pipes.stderr_over.load(Ordering::SeqCst) => {
            Outcome::OutputTooLarge("stderr".into())
        }
        other => other,
    }
}
