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

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::cgroup::JobCgroup;
use super::image::ImageConfig;
use super::procs::{descendants, effective_uid, send, Signal};
use crate::wasm::{over_output_limits, CancelToken, OutputSink};
use crate::{Outcome, SandboxError};

/// How often the watcher looks at the job.
const POLL: Duration = Duration::from_millis(20);
/// How often (in polls) `/output` is measured.
const OUTPUT_CHECK_POLLS: u32 = 10;
/// First uid of the per-job uids used when running as root.
const JOB_UID_BASE: u32 = 200_000;
/// How many per-job uids there are before they are reused.
const JOB_UIDS: u32 = 50_000;
/// Host directories a `--host-env` job sees read-only: software, not data.
const HOST_ENV_DIRS: &[&str] = &[
    "usr", "etc", "opt", "bin", "sbin", "lib", "lib32", "lib64", "libx32",
];
/// NVIDIA device nodes every GPU job needs besides its own `nvidiaN`.
const NVIDIA_CONTROL_NODES: &[&str] = &[
    "nvidiactl",
    "nvidia-uvm",
    "nvidia-uvm-tools",
    "nvidia-modeset",
    "nvidia-caps",
];
/// Where an image job finds the host's NVIDIA user-space driver.
const DRIVER_DIR: &str = "/run/gpunode-driver";
/// PATH when neither the image nor the requester sets one.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

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
        let stdout_over = Arc::new(AtomicBool::new(false));
        let stderr_over = Arc::new(AtomicBool::new(false));
        let readers = [
            child.stdout.take().map(|s| {
                forward(
                    s,
                    spec.limits.stdout_bytes,
                    std::mem::replace(&mut spec.stdout, Box::new(|_| {})),
                    stdout_over.clone(),
                )
            }),
            child.stderr.take().map(|s| {
                forward(
                    s,
                    spec.limits.stderr_bytes,
                    std::mem::replace(&mut spec.stderr, Box::new(|_| {})),
                    stderr_over.clone(),
                )
            }),
        ];
        let outcome = watch(&mut child, &spec, &stdout_over, &stderr_over, &cgroup);
        for reader in readers.into_iter().flatten() {
            let _ = reader.join();
        }
        let over_output = || {
            let l = &spec.limits;
            over_output_limits(&spec.output_dir, l.output_bytes, l.output_files)
        };
        // A job that failed after the kernel refused it memory ran out of memory (a
        // successful one only had its page cache trimmed).
        let oom = !matches!(outcome, Outcome::Exited(0))
            && cgroup.as_ref().is_some_and(JobCgroup::oom_killed);
        let outcome = match outcome {
            Outcome::Exited(_) | Outcome::Trapped(_) if over_output().is_some() => {
                Outcome::OutputTooLarge(over_output().unwrap_or_default())
            }
            Outcome::Exited(_) | Outcome::Trapped(_) if oom => Outcome::OutOfMemory,
            Outcome::Exited(_) if stdout_over.load(Ordering::SeqCst) => {
                Outcome::OutputTooLarge("stdout".into())
            }
            Outcome::Exited(_) if stderr_over.load(Ordering::SeqCst) => {
                Outcome::OutputTooLarge("stderr".into())
            }
            other => other,
        };
        drop(cgroup);
        Ok(outcome)
    }

    /// The whole command: cgroup join, rlimits, uid drop, bubblewrap, the task.
    fn command_line(
        &self,
        spec: &ContainerSpec,
        command: &[String],
        uid: Option<u32>,
        cgroup: Option<&JobCgroup>,
        seccomp: Option<&Path>,
    ) -> Command {
        let limits = &spec.limits;
        let procs = cgroup.map(JobCgroup::procs_files).unwrap_or_default();
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(
                "f=$1; shift; n=$1; shift; while [ \"$n\" -gt 0 ]; do echo $$ > \"$1\" || exit 125; \
                 shift; n=$((n-1)); done; if [ -n \"$f\" ]; then exec 3<\"$f\" || exit 125; fi; \
                 exec \"$@\"",
            )
            .arg("gpunode-job")
            .arg(seccomp.map(Path::as_os_str).unwrap_or_default())
            .arg(procs.len().to_string())
            .args(&procs);
        // rlimits: per process, so they are the fallback for memory and, without a
        // per-job uid, for processes; CPU time and file size apply always.
        let nproc = match uid {
            Some(_) => limits.max_processes as usize + 4,
            None => processes_of_this_user() + limits.max_processes as usize + 4,
        };
        cmd.arg("prlimit")
            .arg(format!("--nproc={nproc}"))
            .arg(format!("--cpu={}", limits.cpu_seconds.max(1)))
            // One byte past the cap, so that a file stopped by it shows as over the cap.
            .arg(format!("--fsize={}", limits.output_bytes.saturating_add(1)))
            .arg("--core=0");
        // Address-space limits break CUDA (it maps far more than it uses), so without
        // a memory cgroup only CPU jobs get one.
        if cgroup.is_none() && spec.gpus.is_empty() {
            cmd.arg(format!("--as={}", limits.memory_bytes.max(16 << 20)));
        }
        cmd.arg("--");
        if let Some(uid) = uid {
            cmd.args([
                "setpriv",
                &format!("--reuid={uid}"),
                &format!("--regid={uid}"),
                "--clear-groups",
                "--",
            ]);
        }
        cmd.arg(&self.config.bwrap).args([
            "--unshare-all",
            "--unshare-user",
            "--die-with-parent",
            "--new-session",
        ]);
        if self.config.disable_userns {
            cmd.arg("--disable-userns");
        }
        if seccomp.is_some() {
            cmd.args(["--seccomp", "3"]);
        }
        let workdir = match &spec.root {
            Root::Image { rootfs, config } => {
                cmd.arg("--ro-bind").arg(rootfs).arg("/");
                Some(config.working_dir.clone()).filter(|w| w.starts_with('/'))
            }
            Root::HostEnv => {
                // Only mount points live here; it is made read-only below.
                cmd.args(["--size", "1048576", "--tmpfs", "/"]);
                for dir in HOST_ENV_DIRS {
                    let host = Path::new("/").join(dir);
                    match std::fs::symlink_metadata(&host) {
                        Ok(m) if m.file_type().is_symlink() => {
                            if let Ok(target) = std::fs::read_link(&host) {
                                cmd.arg("--symlink").arg(target).arg(&host);
                            }
                        }
                        Ok(m) if m.is_dir() => {
                            cmd.arg("--ro-bind").arg(&host).arg(&host);
                        }
                        _ => {}
                    }
                }
                None
            }
        };
        // Every writable tmpfs is bounded by the job's memory: /tmp, /dev/shm.
        let tmpfs_size = limits.memory_bytes.max(16 << 20).to_string();
        cmd.args(["--dev", "/dev", "--proc", "/proc"]);
        cmd.arg("--size").arg(&tmpfs_size).args(["--tmpfs", "/tmp"]);
        cmd.arg("--size")
            .arg(&tmpfs_size)
            .args(["--tmpfs", "/dev/shm"]);
        match &spec.input_dir {
            Some(dir) => {
                cmd.arg("--ro-bind").arg(dir).arg("/input");
            }
            None if matches!(spec.root, Root::HostEnv) => {
                cmd.args(["--dir", "/input"]);
            }
            None => {}
        }
        cmd.arg("--bind").arg(&spec.output_dir).arg("/output");
        self.gpu_mounts(&mut cmd, spec);
        if matches!(spec.root, Root::HostEnv) {
            cmd.args(["--remount-ro", "/"]);
        }
        cmd.args(["--chdir", workdir.as_deref().unwrap_or("/output")]);
        cmd.arg("--clearenv");
        for (k, v) in job_env(spec) {
            cmd.arg("--setenv").arg(k).arg(v);
        }
        cmd.arg("--").args(command);
        cmd
    }

    /// The leased GPUs' device nodes, the control nodes and, for image roots, the
    /// driver's user-space files. Nothing else of `/dev` is there (`--dev`).
    fn gpu_mounts(&self, cmd: &mut Command, spec: &ContainerSpec) {
        if spec.gpus.is_empty() {
            return;
        }
        let dev = &self.config.dev_dir;
        let own = spec.gpus.iter().map(|g| format!("nvidia{}", g.index));
        for name in own.chain(NVIDIA_CONTROL_NODES.iter().map(|s| s.to_string())) {
            let host = dev.join(&name);
            if host.exists() {
                cmd.arg("--dev-bind")
                    .arg(host)
                    .arg(Path::new("/dev").join(&name));
            }
        }
        if matches!(spec.root, Root::Image { .. }) && !self.config.driver_files.is_empty() {
            cmd.args(["--size", "1048576", "--tmpfs", "/run"]);
            for file in &self.config.driver_files {
                let Some(name) = file.file_name() else {
                    continue;
                };
                let sub = if is_library(file) { "lib" } else { "bin" };
                cmd.arg("--ro-bind")
                    .arg(file)
                    .arg(Path::new(DRIVER_DIR).join(sub).join(name));
            }
        }
    }
}

/// The seccomp program in a new private file (0600, random name), removed on drop.
fn seccomp_file(program: &[u8]) -> Result<tempfile::NamedTempFile, SandboxError> {
    use std::io::Write;
    let mut file = tempfile::Builder::new()
        .prefix("gpunode-seccomp-")
        .tempfile()
        .map_err(|e| SandboxError::Setup(format!("cannot write the seccomp filter: {e}")))?;
    file.write_all(program)
        .and_then(|()| file.flush())
        .map_err(|e| SandboxError::Setup(format!("cannot write the seccomp filter: {e}")))?;
    Ok(file)
}

/// The command to run: the requester's, or the image's entrypoint and cmd.
fn effective_command(spec: &ContainerSpec) -> Result<Vec<String>, SandboxError> {
    let command = match (&spec.root, spec.command.is_empty()) {
        (Root::Image { config, .. }, true) => {
            let mut c = config.entrypoint.clone();
            c.extend(config.cmd.iter().cloned());
            c
        }
        (Root::Image { config, .. }, false) if !config.entrypoint.is_empty() => {
            let mut c = config.entrypoint.clone();
            c.extend(spec.command.iter().cloned());
            c
        }
        _ => spec.command.clone(),
    };
    if command.is_empty() {
        return Err(SandboxError::InvalidModule(
            "no command: give one after `--`, or use an image with an entrypoint or cmd"
                .to_string(),
        ));
    }
    Ok(command)
}

/// The job's environment: defaults, the image's, the requester's, then the GPU
/// variables, which the requester cannot override.
fn job_env(spec: &ContainerSpec) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = vec![
        ("PATH".into(), DEFAULT_PATH.into()),
        ("HOME".into(), "/tmp".into()),
    ];
    let mut set = |k: &str, v: &str| match env.iter_mut().find(|(key, _)| key == k) {
        Some(slot) => slot.1 = v.to_string(),
        None => env.push((k.to_string(), v.to_string())),
    };
    if let Root::Image { config, .. } = &spec.root {
        for kv in &config.env {
            if let Some((k, v)) = kv.split_once('=') {
                set(k, v);
            }
        }
    }
    for (k, v) in &spec.env {
        set(k, v);
    }
    let uuids: Vec<&str> = spec.gpus.iter().map(|g| g.uuid.as_str()).collect();
    let visible = if uuids.is_empty() {
        "none".to_string()
    } else {
        uuids.join(",")
    };
    set("NVIDIA_VISIBLE_DEVICES", &visible);
    set(
        "CUDA_VISIBLE_DEVICES",
        if uuids.is_empty() { "" } else { &visible },
    );
    if !spec.gpus.is_empty() && matches!(spec.root, Root::Image { .. }) {
        let lib = format!("{DRIVER_DIR}/lib");
        let ld = env
            .iter()
            .find(|(k, _)| k == "LD_LIBRARY_PATH")
            .map(|(_, v)| format!("{lib}:{v}"))
            .unwrap_or(lib);
        let path = env
            .iter()
            .find(|(k, _)| k == "PATH")
            .map(|(_, v)| format!("{v}:{DRIVER_DIR}/bin"))
            .unwrap_or_default();
        env.retain(|(k, _)| k != "LD_LIBRARY_PATH" && k != "PATH");
        env.push(("LD_LIBRARY_PATH".into(), ld));
        env.push(("PATH".into(), path));
    }
    env
}

/// Watches the job until it ends or must be stopped.
fn watch(
    child: &mut Child,
    spec: &ContainerSpec,
    stdout_over: &AtomicBool,
    stderr_over: &AtomicBool,
    cgroup: &Option<JobCgroup>,
) -> Outcome {
    let started = Instant::now();
    let mut deadline = started + spec.limits.wall_time;
    let (mut polls, mut paused) = (0u32, false);
    let mut paused_since = started;
    let stop = |child: &mut Child, why: Outcome| {
        // A frozen (v1) process cannot die until it is thawed.
        if let Some(group) = cgroup {
            group.freeze(false);
        }
        let _ = child.kill();
        let _ = child.wait();
        if let Some(group) = cgroup {
            group.kill_all();
        }
        why
    };
    let outcome = loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                use std::os::unix::process::ExitStatusExt;
                break match (status.code(), status.signal()) {
                    (Some(code), _) => Outcome::Exited(code),
                    (None, Some(sig)) => Outcome::Trapped(format!("killed by signal {sig}")),
                    (None, None) => Outcome::Trapped("ended without a status".into()),
                };
            }
            Ok(None) => {}
            Err(e) => break stop(child, Outcome::Trapped(format!("lost the job: {e}"))),
        }
        if spec.cancel.is_cancelled() {
            break stop(child, Outcome::Cancelled);
        }
        // A paused job's deadline moves on when it resumes; the lease's end still cancels it.
        if !paused && Instant::now() >= deadline {
            break stop(child, Outcome::TimedOut);
        }
        if stdout_over.load(Ordering::SeqCst) {
            break stop(child, Outcome::OutputTooLarge("stdout".into()));
        }
        if stderr_over.load(Ordering::SeqCst) {
            break stop(child, Outcome::OutputTooLarge("stderr".into()));
        }
        polls += 1;
        if polls.is_multiple_of(OUTPUT_CHECK_POLLS) {
            let limits = &spec.limits;
            if let Some(why) =
                over_output_limits(&spec.output_dir, limits.output_bytes, limits.output_files)
            {
                break stop(child, Outcome::OutputTooLarge(why));
            }
        }
        let want_pause = spec.pause.is_paused();
        if want_pause != paused {
            let signal = if want_pause {
                Signal::Stop
            } else {
                Signal::Continue
            };
            // The freezer stops the whole group at once; without one, signal the tree,
            // children first when stopping, so none runs on while its parent stops.
            if !cgroup.as_ref().is_some_and(|g| g.freeze(want_pause)) {
                let mut tree = descendants(child.id());
                if want_pause {
                    tree.reverse();
                }
                for pid in tree {
                    send(pid, signal);
                }
            }
            paused = want_pause;
            if paused {
                paused_since = Instant::now();
            } else {
                // Paused time does not count against the job.
                let held = paused_since.elapsed();
                deadline += held;
                spec.pause
                    .1
                    .fetch_add(held.as_millis() as u64, Ordering::SeqCst);
            }
        }
        // Short jobs end within milliseconds: look often at first, then every POLL.
        std::thread::sleep(POLL.min(Duration::from_millis(1) + started.elapsed() / 8));
    };
    if paused {
        let held = paused_since.elapsed().as_millis() as u64;
        spec.pause.1.fetch_add(held, Ordering::SeqCst);
    }
    outcome
}

/// Forwards a pipe to a sink up to `cap` bytes; past it, sets `over` and drains.
fn forward(
    mut pipe: impl Read + Send + 'static,
    cap: u64,
    sink: OutputSink,
    over: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    let mut sink = sink;
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        let mut sent = 0u64;
        loop {
            let n = match pipe.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let room = cap.saturating_sub(sent) as usize;
            if n > room {
                over.store(true, Ordering::SeqCst);
            }
            let take = n.min(room);
            if take > 0 {
                sink(&buf[..take]);
                sent += take as u64;
            }
        }
    })
}

/// Each running process: its uid and how many threads it has.
fn processes() -> Vec<(u32, usize)> {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.parse::<u32>().is_ok())
        })
        .filter_map(|e| {
            let uid = e.metadata().ok()?.uid();
            let threads = std::fs::read_dir(e.path().join("task")).map_or(1, |t| t.count());
            Some((uid, threads))
        })
        .collect()
}

/// The uids of the processes running now.
fn process_uids() -> Vec<u32> {
    processes().into_iter().map(|(uid, _)| uid).collect()
}

/// Threads of this uid now (what `RLIMIT_NPROC` counts), for the fallback without a
/// per-job uid.
fn processes_of_this_user() -> usize {
    let uid = effective_uid();
    processes()
        .into_iter()
        .filter(|(u, _)| *u == uid)
        .map(|(_, threads)| threads)
        .sum()
}

/// Per-job uids handed out by this process and not yet released (a job between picking
/// its uid and starting its first process shows no process yet).
static HELD_UIDS: std::sync::Mutex<Vec<u32>> = std::sync::Mutex::new(Vec::new());

/// Releases a held per-job uid when the job ends.
struct UidHold(u32);

impl Drop for UidHold {
    fn drop(&mut self) {
        HELD_UIDS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|u| *u != self.0);
    }
}

/// A per-job uid no process runs as now and no other job of this process holds (so
/// `RLIMIT_NPROC` counts this job alone), starting from a point that differs between
/// jobs and between processes.
fn free_job_uid() -> u32 {
    let mut held = HELD_UIDS.lock().unwrap_or_else(|p| p.into_inner());
    let mut busy: std::collections::HashSet<u32> = process_uids().into_iter().collect();
    busy.extend(held.iter().copied());
    let start = NEXT_JOB.fetch_add(1, Ordering::Relaxed) ^ (std::process::id() << 8);
    let uid = (0..JOB_UIDS)
        .map(|i| JOB_UID_BASE + start.wrapping_add(i) % JOB_UIDS)
        .find(|uid| !busy.contains(uid))
        .unwrap_or(JOB_UID_BASE);
    held.push(uid);
    uid
}

fn find_in_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

fn is_library(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.contains(".so"))
}

/// The NVIDIA user-space driver on this host: `libcuda`, `libnvidia-*` and `nvidia-smi`,
/// as the dynamic loader's cache and the usual directories list them.
pub fn nvidia_driver_files() -> Vec<PathBuf> {
    let mut files = Vec::new();
    let dirs = [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/local/nvidia/lib64",
    ];
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let wanted = name.starts_with("libcuda.so")
                || name.starts_with("libnvidia-ml.so")
                || name.starts_with("libnvidia-ptxjitcompiler.so")
                || name.starts_with("libnvidia-nvvm.so")
                || name.starts_with("libcudadebugger.so");
            if wanted {
                files.push(entry.path());
            }
        }
    }
    if let Some(smi) = find_in_path("nvidia-smi") {
        files.push(smi);
    }
    files.sort();
    files.dedup();
    files
}
