//! The command line of one job: the shell that joins its cgroups and opens the
//! seccomp filter, rlimits, the uid drop, bubblewrap's namespaces and mounts (root,
//! `/tmp`, `/input`, `/output`, GPU device nodes and driver files) and the environment.

use std::path::Path;
use std::process::Command;

use super::{ContainerExecutor, ContainerLimits, ContainerSpec, Root};
use crate::container::cgroup::JobCgroup;
use crate::SandboxError;

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

impl ContainerExecutor {
    /// The whole command: cgroup join, rlimits, uid drop, bubblewrap, the task.
    pub(super) fn command_line(
        &self,
        spec: &ContainerSpec,
        command: &[String],
        uid: Option<u32>,
        cgroup: Option<&JobCgroup>,
        seccomp: Option<&Path>,
    ) -> Command {
        let mut cmd = join_cgroups_shell(cgroup, seccomp);
        rlimits(&mut cmd, spec, uid, cgroup);
        if let Some(uid) = uid {
            cmd.args([
                "setpriv",
                &format!("--reuid={uid}"),
                &format!("--regid={uid}"),
                "--clear-groups",
                "--",
            ]);
        }
        self.bubblewrap(&mut cmd, seccomp.is_some());
        let workdir = root_mounts(&mut cmd, &spec.root);
        job_mounts(&mut cmd, spec);
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

    /// Bubblewrap with every namespace of its own, dying with its parent, in a new
    /// session, with no user namespaces of the job's own where it can, and the seccomp
    /// filter from fd 3 when there is one.
    fn bubblewrap(&self, cmd: &mut Command, seccomp: bool) {
        cmd.arg(&self.config.bwrap).args([
            "--unshare-all",
            "--unshare-user",
            "--die-with-parent",
            "--new-session",
        ]);
        if self.config.disable_userns {
            cmd.arg("--disable-userns");
        }
        if seccomp {
            cmd.args(["--seccomp", "3"]);
        }
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

/// The first shell: joins the job's cgroups (writing its pid to each `cgroup.procs`),
/// opens the seccomp filter as fd 3, then runs the rest of the command line.
fn join_cgroups_shell(cgroup: Option<&JobCgroup>, seccomp: Option<&Path>) -> Command {
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
    cmd
}

/// `prlimit` with the job's rlimits.
fn rlimits(cmd: &mut Command, spec: &ContainerSpec, uid: Option<u32>, cgroup: Option<&JobCgroup>) {
    let limits: &ContainerLimits = &spec.limits;
    // rlimits: per process, so they are the fallback for memory and, without a
    // per-job uid, for processes; CPU time and file size apply always.
    let nproc = match uid {
        Some(_) => limits.max_processes as usize + 4,
        None => super::host::processes_of_this_user() + limits.max_processes as usize + 4,
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
}

/// The root: the image's, or a tmpfs with the host's software directories (made
/// read-only later). Returns the image's working directory, if it names one.
fn root_mounts(cmd: &mut Command, root: &Root) -> Option<String> {
    match root {
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
    }
}

/// `/dev`, `/proc`, the bounded tmpfs mounts, `/input` and `/output`.
fn job_mounts(cmd: &mut Command, spec: &ContainerSpec) {
    // Every writable tmpfs is bounded by the job's memory: /tmp, /dev/shm.
    let tmpfs_size = spec.limits.memory_bytes.max(16 << 20).to_string();
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
}

/// The seccomp program in a new private file (0600, random name), removed on drop.
pub(super) fn seccomp_file(program: &[u8]) -> Result<tempfile::NamedTempFile, SandboxError> {
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
pub(super) fn effective_command(spec: &ContainerSpec) -> Result<Vec<String>, SandboxError> {
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

fn is_library(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.contains(".so"))
}
