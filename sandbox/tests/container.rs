//! The container backend under real bubblewrap: no network, no host files outside the
//! allowed mounts, a fork bomb and a memory bomb contained, a process that ignores
//! SIGTERM still killed, output caps, only the leased GPU's device node visible (with
//! stand-in device nodes), an image root, pause and resume.
//!
//! `scripts/install-deps.sh` installs bubblewrap; without it these tests fail and say so.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpunode_sandbox::container::image::ImageConfig;
use gpunode_sandbox::container::procs::{descendants, processes_with_env};
use gpunode_sandbox::container::{
    ContainerConfig, ContainerExecutor, ContainerLimits, ContainerSpec, GpuDevice, PauseToken, Root,
};
use gpunode_sandbox::{CancelToken, Outcome};

fn executor(dev_dir: Option<&Path>) -> ContainerExecutor {
    let mut config = ContainerConfig::detect()
        .expect("bubblewrap must be installed for these tests: run scripts/install-deps.sh");
    if let Some(dir) = dev_dir {
        config.dev_dir = dir.to_path_buf();
    }
    ContainerExecutor::new(config)
}

struct Job {
    dir: tempfile::TempDir,
    stdout: Arc<Mutex<Vec<u8>>>,
    stderr: Arc<Mutex<Vec<u8>>>,
}

impl Job {
    fn new() -> Job {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(dir.path().join("input")).expect("input");
        std::fs::create_dir(dir.path().join("output")).expect("output");
        Job {
            dir,
            stdout: Arc::default(),
            stderr: Arc::default(),
        }
    }

    fn output(&self) -> PathBuf {
        self.dir.path().join("output")
    }

    fn spec(&self, command: &[&str]) -> ContainerSpec {
        let (out, err) = (self.stdout.clone(), self.stderr.clone());
        ContainerSpec {
            root: Root::HostEnv,
            command: command.iter().map(|s| s.to_string()).collect(),
            env: Vec::new(),
            input_dir: Some(self.dir.path().join("input")),
            output_dir: self.output(),
            gpus: Vec::new(),
            limits: ContainerLimits {
                wall_time: Duration::from_secs(30),
                memory_bytes: 256 << 20,
                ..ContainerLimits::default()
            },
            stdout: Box::new(move |b| out.lock().expect("lock").extend_from_slice(b)),
            stderr: Box::new(move |b| err.lock().expect("lock").extend_from_slice(b)),
            cancel: CancelToken::new(),
            pause: PauseToken::new(),
            on_start: None,
        }
    }

    fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.stdout.lock().expect("lock")).into_owned()
    }

    fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.stderr.lock().expect("lock")).into_owned()
    }
}

fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn marker(name: &str) -> String {
    format!("GPUNODE_TEST_MARK={name}-{}", std::process::id())
}

#[test]
fn a_host_env_job_runs_reads_input_and_writes_output() {
    let job = Job::new();
    std::fs::write(job.dir.path().join("input/in.txt"), "from the requester").expect("write");
    let mut spec = job.spec(&[
        "sh",
        "-c",
        "cat /input/in.txt; echo; echo err >&2; echo done > /output/result.txt; \
         touch /input/x 2>/dev/null && echo input-writable; exit 3",
    ]);
    spec.env.push(("GREETING".into(), "hi".into()));
    let outcome = executor(None).run(spec).expect("run");
    assert_eq!(outcome, Outcome::Exited(3), "stderr: {}", job.stderr());
    assert_eq!(job.stdout(), "from the requester\n");
    assert_eq!(job.stderr(), "err\n");
    assert_eq!(
        std::fs::read_to_string(job.output().join("result.txt")).expect("result"),
        "done\n"
    );
}

#[test]
fn the_network_is_unreachable_from_inside() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let port = listener.local_addr().expect("addr").port();
    let job = Job::new();
    let script = format!(
        "echo hello > /dev/tcp/127.0.0.1/{port} && echo connected; ls /sys/class/net 2>/dev/null; \
         cat /proc/net/dev | tail -n +3 | cut -d: -f1"
    );
    let outcome = executor(None)
        .run(job.spec(&["bash", "-c", &script]))
        .expect("run");
    assert_eq!(outcome, Outcome::Exited(0), "stderr: {}", job.stderr());
    assert!(!job.stdout().contains("connected"), "{}", job.stdout());
    assert!(
        job.stderr().contains("Connection refused") || job.stderr().contains("unreachable"),
        "the connect must fail inside: {}",
        job.stderr()
    );
    let interfaces: Vec<String> = job
        .stdout()
        .lines()
        .map(|l| l.trim().to_string())
        .filter(|l| !l.is_empty())
        .collect();
    assert_eq!(interfaces, vec!["lo"], "only a loopback of its own");
    assert!(
        listener.accept().is_err(),
        "nothing reached the host's listener"
    );
}

#[test]
fn host_files_outside_the_allowed_mounts_are_unreadable() {
    let secret_dir = tempfile::tempdir().expect("tempdir");
    let secret = secret_dir.path().join("secret.key");
    std::fs::write(&secret, "provider's key").expect("write");
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let job = Job::new();
    let script = format!(
        "cat {} 2>&1; cat {manifest} 2>&1; ls /root 2>&1; ls /home 2>&1; cat /etc/shadow 2>&1; \
         (echo probe > /usr/probe) 2>&1; (echo probe > /etc/probe) 2>&1; \
         (echo probe > /probe) 2>&1; echo shm > /dev/shm/ok && cat /dev/shm/ok; id -u",
        secret.display()
    );
    let outcome = executor(None)
        .run(job.spec(&["sh", "-c", &script]))
        .expect("run");
    assert_eq!(outcome, Outcome::Exited(0), "stderr: {}", job.stderr());
    let out = job.stdout();
    assert!(!out.contains("provider's key"), "{out}");
    assert!(!out.contains("[package]"), "{out}");
    assert!(
        out.matches("No such file or directory").count() >= 4,
        "tmp, the workspace, /root and /home are not there: {out}"
    );
    assert!(out.contains("Permission denied"), "/etc/shadow: {out}");
    assert!(out.contains("Read-only file system"), "{out}");
    assert!(!Path::new("/usr/probe").exists() && !Path::new("/etc/probe").exists());
    assert_eq!(
        out.matches("Read-only file system").count(),
        3,
        "/usr, /etc and the root itself are read-only: {out}"
    );
    assert!(out.contains("shm\n"), "a private /dev/shm: {out}");
}

#[test]
fn a_fork_bomb_is_contained_and_killed_at_the_deadline() {
    let job = Job::new();
    let mark = marker("forkbomb");
    // Forks until it cannot, and keeps every process it made.
    let mut spec = job.spec(&[
        "bash",
        "-c",
        "exec 2>/dev/null; while true; do sleep 100 & done",
    ]);
    let (key, value) = mark.split_once('=').expect("marker");
    spec.env.push((key.into(), value.into()));
    spec.limits.max_processes = 32;
    // Long enough to reach the cap on a loaded machine.
    spec.limits.wall_time = Duration::from_secs(10);
    let root = Arc::new(Mutex::new(None));
    let seen_root = root.clone();
    spec.on_start = Some(Box::new(move |pid| {
        *seen_root.lock().expect("lock") = Some(pid);
    }));
    let peak = Arc::new(Mutex::new(0usize));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (root, peak, stop) = (root.clone(), peak.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                if let Some(pid) = *root.lock().expect("lock") {
                    let n = descendants(pid).len();
                    let mut p = peak.lock().expect("lock");
                    *p = (*p).max(n);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };
    let outcome = executor(None).run(spec).expect("run");
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    sampler.join().expect("sampler");
    assert_eq!(outcome, Outcome::TimedOut);
    let peak = *peak.lock().expect("lock");
    assert!(
        peak >= 24,
        "the bomb forked up to the limit ({peak} processes)"
    );
    // The job's processes plus bwrap's two of its own.
    assert!(peak <= 32 + 4, "at most the limit at once, saw {peak}");
    wait_until("the bomb to be gone", Duration::from_secs(5), || {
        processes_with_env(&mark).is_empty()
    });
}

#[test]
fn a_memory_bomb_is_contained() {
    let job = Job::new();
    let mut spec = job.spec(&[
        "sh",
        "-c",
        "head -c 1000000000 /dev/zero | tail -n 1 > /dev/null",
    ]);
    spec.limits.memory_bytes = 64 << 20;
    let started = Instant::now();
    let outcome = executor(None).run(spec).expect("run");
    assert!(
        matches!(outcome, Outcome::OutOfMemory | Outcome::Exited(1..)),
        "the allocation must fail: {outcome:?}, stderr {}",
        job.stderr()
    );
    assert!(
        started.elapsed() < Duration::from_secs(25),
        "it ended by itself"
    );
}

#[test]
fn a_process_that_ignores_sigterm_is_killed_on_cancel() {
    let job = Job::new();
    let mark = marker("stubborn");
    let mut spec = job.spec(&[
        "sh",
        "-c",
        "trap '' TERM INT HUP; (trap '' TERM; while true; do sleep 1; done) & \
         while true; do sleep 1; done",
    ]);
    let (key, value) = mark.split_once('=').expect("marker");
    spec.env.push((key.into(), value.into()));
    let cancel = spec.cancel.clone();
    let exec = executor(None);
    let runner = std::thread::spawn(move || exec.run(spec));
    wait_until("the job to start", Duration::from_secs(10), || {
        processes_with_env(&mark).len() >= 2
    });
    cancel.cancel();
    let outcome = runner.join().expect("join").expect("run");
    assert_eq!(outcome, Outcome::Cancelled);
    wait_until(
        "every process of the job to die",
        Duration::from_secs(5),
        || processes_with_env(&mark).is_empty(),
    );
}

#[test]
fn output_caps_are_enforced() {
    let job = Job::new();
    let mut spec = job.spec(&[
        "sh",
        "-c",
        "head -c 3000000 /dev/zero > /output/big; sleep 5",
    ]);
    spec.limits.output_bytes = 1_000_000;
    let outcome = executor(None).run(spec).expect("run");
    assert!(matches!(outcome, Outcome::OutputTooLarge(_)), "{outcome:?}");
    let size = std::fs::metadata(job.output().join("big")).map_or(0, |m| m.len());
    assert!(size <= 1_000_001, "the file stopped at the cap: {size}");

    let job = Job::new();
    let mut spec = job.spec(&["sh", "-c", "head -c 100000 /dev/zero; sleep 5"]);
    spec.limits.stdout_bytes = 1000;
    let outcome = executor(None).run(spec).expect("run");
    assert_eq!(outcome, Outcome::OutputTooLarge("stdout".into()));
    assert_eq!(job.stdout.lock().expect("lock").len(), 1000);
}

#[test]
fn only_the_leased_gpu_is_visible() {
    let dev = tempfile::tempdir().expect("tempdir");
    for name in ["nvidia0", "nvidia1", "nvidia2", "nvidiactl", "nvidia-uvm"] {
        std::fs::write(dev.path().join(name), format!("stand-in {name}")).expect("node");
    }
    let job = Job::new();
    let mut spec = job.spec(&[
        "sh",
        "-c",
        "ls /dev | grep nvidia; cat /dev/nvidia1; echo; echo \"$CUDA_VISIBLE_DEVICES $NVIDIA_VISIBLE_DEVICES\"; \
         cat /dev/nvidia0 2>&1; true",
    ]);
    spec.gpus = vec![GpuDevice {
        index: 1,
        uuid: "GPU-sim-1".into(),
    }];
    let outcome = executor(Some(dev.path())).run(spec).expect("run");
    assert_eq!(outcome, Outcome::Exited(0), "stderr: {}", job.stderr());
    let out = job.stdout();
    let nodes: Vec<&str> = out
        .lines()
        .take_while(|l| l.starts_with("nvidia"))
        .collect();
    assert_eq!(nodes, vec!["nvidia-uvm", "nvidia1", "nvidiactl"], "{out}");
    assert!(out.contains("stand-in nvidia1"), "{out}");
    assert!(out.contains("GPU-sim-1 GPU-sim-1"), "{out}");
    assert!(out.contains("No such file or directory"), "nvidia0: {out}");

    // Without GPUs, no device node at all and CUDA sees none.
    let job = Job::new();
    let spec = job.spec(&[
        "sh",
        "-c",
        "ls /dev | grep -c nvidia; echo \"[$NVIDIA_VISIBLE_DEVICES]\"",
    ]);
    executor(Some(dev.path())).run(spec).expect("run");
    assert_eq!(job.stdout(), "0\n[none]\n");
}

/// A root with the host's `sh` and the libraries it links, like a tiny image.
fn tiny_rootfs(dir: &Path) -> PathBuf {
    let root = dir.join("rootfs");
    let sh = std::fs::canonicalize("/bin/sh").expect("/bin/sh");
    let ldd = std::process::Command::new("ldd")
        .arg(&sh)
        .output()
        .expect("ldd");
    let mut files = vec![sh.clone()];
    for line in String::from_utf8_lossy(&ldd.stdout).lines() {
        if let Some(path) = line.split_whitespace().find(|w| w.starts_with('/')) {
            files.push(PathBuf::from(path));
        }
    }
    for file in files {
        let dst = root.join(file.strip_prefix("/").expect("absolute"));
        std::fs::create_dir_all(dst.parent().expect("parent")).expect("dirs");
        std::fs::copy(&file, &dst).expect("copy");
    }
    std::os::unix::fs::symlink(&sh, root.join("bin-sh")).expect("symlink");
    root
}

#[test]
fn an_image_root_runs_its_own_files_and_config() {
    let job = Job::new();
    let rootfs = tiny_rootfs(job.dir.path());
    std::fs::write(rootfs.join("image-file"), "inside the image").expect("write");
    let sh = std::fs::canonicalize("/bin/sh").expect("/bin/sh");
    let mut spec = job.spec(&[]);
    spec.root = Root::Image {
        rootfs,
        config: ImageConfig {
            env: vec!["FROM_IMAGE=yes".into()],
            entrypoint: vec![sh.display().to_string(), "-c".into()],
            cmd: vec!["read x < /image-file; echo \"$x $FROM_IMAGE\"; echo out > /output/o".into()],
            working_dir: "/".into(),
        },
    };
    let outcome = executor(None).run(spec).expect("run");
    assert_eq!(outcome, Outcome::Exited(0), "stderr: {}", job.stderr());
    assert_eq!(job.stdout(), "inside the image yes\n");
    assert_eq!(
        std::fs::read_to_string(job.output().join("o")).expect("o"),
        "out\n"
    );
}

#[test]
fn a_paused_job_stops_and_resumes() {
    let job = Job::new();
    let spec = job.spec(&[
        "sh",
        "-c",
        "i=0; while true; do i=$((i+1)); echo $i > /output/count.tmp; mv /output/count.tmp /output/count; sleep 0.02; done",
    ]);
    let (cancel, pause) = (spec.cancel.clone(), spec.pause.clone());
    let exec = executor(None);
    let runner = std::thread::spawn(move || exec.run(spec));
    let count_file = job.output().join("count");
    let count = || -> u64 {
        std::fs::read_to_string(&count_file)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    };
    wait_until("the job to count", Duration::from_secs(10), || count() > 3);
    pause.set(true);
    // The pause lands within the watcher's next look (20 ms), later on a loaded machine:
    // wait for a count that holds for 300 ms, then check it holds.
    let mut paused_at = count();
    wait_until("the count to stop", Duration::from_secs(10), || {
        std::thread::sleep(Duration::from_millis(300));
        let now = count();
        std::mem::replace(&mut paused_at, now) == now
    });
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(count(), paused_at, "no progress while paused");
    pause.set(false);
    wait_until("the job to go on", Duration::from_secs(10), || {
        count() > paused_at + 3
    });
    cancel.cancel();
    assert_eq!(
        runner.join().expect("join").expect("run"),
        Outcome::Cancelled
    );
}

#[test]
fn a_paused_job_can_still_be_cancelled_and_leaves_nothing() {
    let job = Job::new();
    let mark = marker("paused-cancel");
    let mut spec = job.spec(&["sh", "-c", "while true; do sleep 0.05; done"]);
    let (key, value) = mark.split_once('=').expect("marker");
    spec.env.push((key.into(), value.into()));
    let (cancel, pause) = (spec.cancel.clone(), spec.pause.clone());
    let exec = executor(None);
    let runner = std::thread::spawn(move || exec.run(spec));
    wait_until("the job to start", Duration::from_secs(10), || {
        !processes_with_env(&mark).is_empty()
    });
    pause.set(true);
    std::thread::sleep(Duration::from_millis(300));
    cancel.cancel();
    assert_eq!(
        runner.join().expect("join").expect("run"),
        Outcome::Cancelled
    );
    assert!(
        pause.paused_ms() >= 200,
        "the pause was counted: {}",
        pause.paused_ms()
    );
    wait_until(
        "every process of the job to die",
        Duration::from_secs(5),
        || processes_with_env(&mark).is_empty(),
    );
}

#[test]
fn escape_system_calls_and_new_user_namespaces_are_refused() {
    let job = Job::new();
    // Each probe prints the call's result and errno; EPERM (1) is the filter's answer.
    let probe = |name: &str, nr: i64| {
        format!(
            "perl -e '$r = syscall({nr}, 0, 0, 0, 0, 0); print \"{name} $r \", $!+0, \"\\n\"'\n"
        )
    };
    let script = [
        probe("keyctl", libc::SYS_keyctl),
        probe("bpf", libc::SYS_bpf),
        probe("perf_event_open", libc::SYS_perf_event_open),
        probe("userfaultfd", libc::SYS_userfaultfd),
        probe("mount", libc::SYS_mount),
        "unshare -U true 2>/dev/null && echo made-a-user-namespace\n".to_string(),
        "unshare -r -m true 2>/dev/null && echo made-a-mount-namespace\n".to_string(),
        "echo done\n".to_string(),
    ]
    .concat();
    std::fs::write(job.dir.path().join("input/probe.sh"), script).expect("write");
    let outcome = executor(None)
        .run(job.spec(&["sh", "/input/probe.sh"]))
        .expect("run");
    assert_eq!(outcome, Outcome::Exited(0), "stderr: {}", job.stderr());
    assert_eq!(
        job.stdout(),
        "keyctl -1 1\nbpf -1 1\nperf_event_open -1 1\nuserfaultfd -1 1\nmount -1 1\ndone\n",
        "stderr: {}",
        job.stderr()
    );
}

#[test]
fn a_gpu_job_without_a_memory_limit_is_refused_not_run() {
    let dev = tempfile::tempdir().expect("tempdir");
    for name in ["nvidia0", "nvidiactl"] {
        std::fs::write(dev.path().join(name), "stand-in").expect("node");
    }
    let mut config = ContainerConfig::detect().expect("bubblewrap");
    config.dev_dir = dev.path().to_path_buf();
    // A host where no cgroup can be made: GPU jobs would get no memory limit at all.
    config.use_cgroups = false;
    let job = Job::new();
    let mut spec = job.spec(&["sh", "-c", "echo ran > /output/ran"]);
    spec.gpus = vec![GpuDevice {
        index: 0,
        uuid: "GPU-sim-0".into(),
    }];
    let err = ContainerExecutor::new(config.clone())
        .run(spec)
        .expect_err("refused");
    assert!(err.to_string().contains("no memory limit"), "{err}");
    assert!(!job.output().join("ran").exists(), "nothing ran");
    // A CPU job still runs there, under a per-process memory limit.
    let job = Job::new();
    let outcome = ContainerExecutor::new(config)
        .run(job.spec(&["sh", "-c", "echo ran"]))
        .expect("run");
    assert_eq!(outcome, Outcome::Exited(0));
}

#[test]
fn the_cpu_time_of_a_job_is_capped_at_its_leased_cores() {
    let job = Job::new();
    let mut spec = job.spec(&["sh", "-c", "sleep 3"]);
    spec.limits.cpus = 2;
    let executor = executor(None);
    let run = std::thread::spawn(move || executor.run(spec));
    // The job's group, as the kernel enforces it: v1 `cpu` or v2 `cpu.max`.
    let prefix = format!("gpunode-job-{}-", std::process::id());
    let quota = || -> Option<String> {
        let v1 = std::fs::read_dir("/sys/fs/cgroup/cpu")
            .ok()
            .and_then(|dir| {
                dir.flatten()
                    .find(|e| e.file_name().to_string_lossy().starts_with(&prefix))
                    .and_then(|e| std::fs::read_to_string(e.path().join("cpu.cfs_quota_us")).ok())
            });
        v1.or_else(|| {
            let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
            let rel = own.lines().find_map(|l| l.strip_prefix("0::"))?;
            let parent = Path::new("/sys/fs/cgroup").join(rel.trim_start_matches('/'));
            std::fs::read_dir(parent).ok()?.flatten().find_map(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with(&prefix)
                    .then(|| std::fs::read_to_string(e.path().join("cpu.max")).ok())?
            })
        })
    };
    let mut seen = None;
    wait_until("the job's cpu group", Duration::from_secs(10), || {
        seen = quota();
        seen.is_some()
    });
    let seen = seen.unwrap_or_default();
    assert!(
        seen.trim() == "200000" || seen.trim() == "200000 100000",
        "quota for 2 cores: {seen}"
    );
    assert_eq!(
        run.join().expect("thread").expect("run"),
        Outcome::Exited(0)
    );
}
