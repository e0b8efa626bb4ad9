//! Job benchmarks: `dispatch` (a whole `gpunode run` of a trivial task, CLI process
//! included, on a warm 3-node loopback network), `transfer` (a 1 GiB input between two
//! nodes over QUIC and over TCP, next to iperf3 in the same run) and `sandbox-overhead`
//! (one compute kernel natively and as a wasm task; start time of a cached module).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use gpunode_node::jobs::JobEvent;
use gpunode_sandbox::wasm::{CancelToken, Isolation, Limits, RunSpec, WasmExecutor};
use serde::Serialize;

use crate::bench::percentile;
use crate::jobs::{request, task, until_end};
use crate::process::{ServeProcess, SIGINT};
use crate::{TestNet, TestNetConfig, Transport};

/// Result of `dispatch`.
#[derive(Debug, Clone, Serialize)]
pub struct DispatchReport {
    /// The `gpunode` binary timed (and run by the daemons).
    pub binary: String,
    /// Runs timed.
    pub runs: usize,
    /// Pause between runs, ms.
    pub pause_ms: u64,
    /// `--peer` given (no provider lookup) or not.
    pub named_peer: bool,
    /// `--quiet` given: the run returns once the outputs are in. Without it, it prints
    /// the summary line, whose cost waits for the settled receipt.
    pub quiet: bool,
    /// Median wall time of the `gpunode run` process, ms.
    pub median_ms: f64,
    /// 95th percentile, ms.
    pub p95_ms: f64,
    /// With `--against`: the median of this binary's time minus the first binary's, run
    /// for run (each pair timed one right after the other); `None` for the first.
    pub paired_median_diff_ms: Option<f64>,
    /// With `--against`: in how many of the pairs this binary was the faster.
    pub faster_in: Option<usize>,
    /// Median of `srun true` timed the same way in the same run, when a Slurm cluster
    /// answers on this machine (`scripts/slurm-baseline.sh` starts a one-node one), ms.
    pub srun_true_median_ms: Option<f64>,
    /// Our median over `srun true`'s.
    pub ratio_to_srun: Option<f64>,
}

/// A warm network of three `gpunode serve` processes of one binary, for `dispatch`.
struct DispatchNet {
    binary: PathBuf,
    procs: Vec<ServeProcess>,
    out: PathBuf,
    _tmp: tempfile::TempDir,
}

impl DispatchNet {
    fn start(binary: &Path) -> Result<DispatchNet> {
        let tmp = tempfile::Builder::new()
            .prefix("bench-dispatch")
            .tempdir()?;
        let mut procs: Vec<ServeProcess> = Vec::new();
        for i in 0..3 {
            // The requester (node 0) asks more than the others, so it never picks itself
            // even if it could.
            let mut extra = vec!["--price".to_string(), if i == 0 { "9" } else { "1" }.into()];
            if let Some(first) = procs.first() {
                extra.push("--bootstrap".into());
                extra.push(first.addr.clone());
            }
            procs.push(ServeProcess::start(
                binary,
                &tmp.path().join(format!("n{i}")),
                &extra,
            )?);
        }
        let net = DispatchNet {
            binary: binary.to_path_buf(),
            procs,
            out: tmp.path().join("out"),
            _tmp: tmp,
        };
        // Until both providers are visible and every path is warm.
        let deadline = Instant::now() + Duration::from_secs(30);
        while net.run(None, true).is_err() {
            if Instant::now() > deadline {
                bail!("no provider took the task within 30s");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        for _ in 0..10 {
            net.run(None, true)?;
        }
        Ok(net)
    }

    /// The provider that `--peer` runs name.
    fn named_provider(&self) -> String {
        self.procs[1].peer_id.clone()
    }

    /// One `gpunode run` through the requester's daemon, timed.
    fn run(&self, peer: Option<&str>, quiet: bool) -> Result<f64> {
        let hello = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/wat/hello.wat");
        let mut cmd = Command::new(&self.binary);
        cmd.arg("--data-dir")
            .arg(&self.procs[0].data_dir)
            .arg("run")
            .arg(&hello)
            .args(quiet.then_some("--quiet"))
            .arg("--output")
            .arg(&self.out);
        if let Some(p) = peer {
            cmd.args(["--peer", p]);
        }
        timed(&mut cmd)
    }
}

impl Drop for DispatchNet {
    fn drop(&mut self) {
        for p in &mut self.procs {
            let _ = p.stop(SIGINT, Duration::from_secs(10));
        }
    }
}

/// Runs `gpunode run hello.wat` through a daemon on a warm network of three
/// `gpunode serve` processes, timing the whole CLI process each time, with `pause`
/// between runs. With more than one binary (`--against`), each gets a network of its
/// own, all running side by side, and each timed run is followed by the same run on the
/// others (the order turning each time), so that the machine's drift falls on all of
/// them alike.
pub fn dispatch(binaries: &[PathBuf], runs: usize, pause: Duration) -> Result<Vec<DispatchReport>> {
    let nets = binaries
        .iter()
        .map(|b| DispatchNet::start(b))
        .collect::<Result<Vec<_>>>()?;
    let mut reports = Vec::new();
    let modes = [(false, true), (true, true), (true, false)];
    for (named, quiet) in modes {
        let mut times = vec![Vec::with_capacity(runs); nets.len()];
        for i in 0..runs {
            for k in 0..nets.len() {
                let n = (i + k) % nets.len();
                let peer = named.then(|| nets[n].named_provider());
                std::thread::sleep(pause);
                times[n].push(nets[n].run(peer.as_deref(), quiet)?);
            }
        }
        for (n, t) in times.iter().enumerate() {
            let (paired, faster) = if n == 0 {
                (None, None)
            } else {
                let mut diffs: Vec<f64> = t.iter().zip(&times[0]).map(|(a, b)| a - b).collect();
                let faster = diffs.iter().filter(|d| **d < 0.0).count();
                diffs.sort_by(f64::total_cmp);
                (Some(percentile(&diffs, 0.5)), Some(faster))
            };
            let mut sorted = t.clone();
            sorted.sort_by(f64::total_cmp);
            reports.push(DispatchReport {
                binary: nets[n].binary.display().to_string(),
                runs,
                pause_ms: pause.as_millis() as u64,
                named_peer: named,
                quiet,
                median_ms: percentile(&sorted, 0.5),
                p95_ms: percentile(&sorted, 0.95),
                paired_median_diff_ms: paired,
                faster_in: faster,
                srun_true_median_ms: None,
                ratio_to_srun: None,
            });
        }
    }
    drop(nets);
    if let Some(srun) = srun_true(runs) {
        let median = percentile(&srun, 0.5);
        for r in &mut reports {
            r.srun_true_median_ms = Some(median);
            r.ratio_to_srun = Some(r.median_ms / median);
        }
    }
    Ok(reports)
}

/// Runs `cmd` to its exit: its wall time from spawn to exit in ms, or its stderr when
/// it fails.
fn timed(cmd: &mut Command) -> Result<f64> {
    let t = Instant::now();
    let o = cmd.output()?;
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    if !o.status.success() {
        bail!(
            "{} failed: {}",
            cmd.get_program().to_string_lossy(),
            String::from_utf8_lossy(&o.stderr)
        );
    }
    Ok(ms)
}

/// `srun true` timed `runs` times from spawn to exit, as `gpunode run` is (after three
/// untimed, so both are warm); `None`, saying why, when there is no Slurm cluster with
/// a free node here or `srun` fails. Each `srun` gives up after 10 s without a node.
fn srun_true(runs: usize) -> Option<Vec<f64>> {
    if runs == 0 {
        return None;
    }
    let free = Command::new("sinfo")
        .args(["-h", "-r", "-t", "idle,mixed", "-o", "%N"])
        .output()
        .ok()
        .filter(|o| o.status.success() && !o.stdout.trim_ascii().is_empty());
    if free.is_none() {
        eprintln!(
            "no Slurm cluster with a free node answers here (`sinfo`), so no `srun true` baseline; scripts/slurm-baseline.sh runs this bench next to a one-node Slurm"
        );
        return None;
    }
    let mut times = Vec::with_capacity(runs);
    for i in 0..runs + 3 {
        match timed(Command::new("srun").args(["--immediate=10", "true"])) {
            Ok(ms) if i >= 3 => times.push(ms),
            Ok(_) => {}
            Err(e) => {
                eprintln!("no `srun true` baseline: {e}");
                return None;
            }
        }
    }
    times.sort_by(f64::total_cmp);
    Some(times)
}

/// Result of `transfer`.
#[derive(Debug, Clone, Serialize)]
pub struct TransferReport {
    /// `quic` or `tcp`.
    pub transport: String,
    /// Bytes per run.
    pub bytes: u64,
    /// Median upload throughput of a job input (stream, chunks, blake3 check, disk), MB/s.
    pub median_mb_s: f64,
    /// Each run, MB/s.
    pub runs_mb_s: Vec<f64>,
    /// iperf3 on the same loopback in the same run (UDP for QUIC, TCP for TCP), MB/s.
    pub iperf3_mb_s: Option<f64>,
    /// Our median over iperf3's figure.
    pub ratio: Option<f64>,
    /// QUIC only: a plain quinn stream with the same cipher in the same run, MB/s (the
    /// stack's ceiling: `bench_quinn`).
    pub plain_quinn_mb_s: Option<f64>,
    /// Our median over the plain quinn stream's figure.
    pub ratio_to_quinn: Option<f64>,
}

/// Sends a fresh `bytes` input to a provider `runs` times per transport, timing from
/// the lease to the task's start (upload, hash check and staging of the input).
pub async fn transfer(bytes: u64, runs: usize) -> Result<Vec<TransferReport>> {
    let mut reports = Vec::new();
    for transport in [Transport::Quic, Transport::Tcp] {
        fn roomy(_: usize, c: &mut gpunode_node::NodeConfig) {
            c.max_job_bytes = 8 << 30;
            c.blob_cache = 16 << 30;
        }
        let mut config = TestNetConfig::new(vec![None]);
        config.transport = transport;
        config.tweak = Some(roomy);
        let net = TestNet::start(config).await?;
        let client = net.new_client().await?;
        let dir = tempfile::Builder::new()
            .prefix("bench-transfer")
            .tempdir()?;
        let input = dir.path().join("input.bin");
        write_pattern(&input, bytes)?;
        let mut speeds = Vec::new();
        for run in 0..runs {
            // A new first block each run: a new hash, so nothing comes from the cache.
            stamp(&input, run as u64)?;
            let mut req = request(task("spin.wat"), &dir.path().join("out"));
            req.peer = Some(net.nodes[0].handle.peer_id().to_string());
            req.inputs = vec![input.clone()];
            req.timeout_ms = 600_000;
            req.args = vec!["forever".into()];
            let view = client.handle.submit_job(req);
            let mut from = 0;
            let (mut leased, mut started) = (None, None);
            let deadline = Instant::now() + Duration::from_secs(600);
            while started.is_none() && Instant::now() < deadline {
                let page = client
                    .handle
                    .job_events(&view.job_id, from, Duration::from_millis(50))
                    .await
                    .map_err(anyhow::Error::msg)?;
                from = page.next;
                for e in page.events {
                    match e {
                        JobEvent::Leased { .. } => leased = Some(Instant::now()),
                        JobEvent::Started { .. } => started = Some(Instant::now()),
                        JobEvent::Failed { error } => bail!("transfer job failed: {error}"),
                        _ => {}
                    }
                }
            }
            let (Some(l), Some(s)) = (leased, started) else {
                bail!("the transfer job did not start");
            };
            speeds.push(bytes as f64 / (s - l).as_secs_f64() / 1e6);
            client
                .handle
                .cancel_job(&view.job_id)
                .map_err(anyhow::Error::msg)?;
            until_end(&client.handle, &view.job_id, &mut from).await?;
        }
        let mut sorted = speeds.clone();
        sorted.sort_by(f64::total_cmp);
        let median = percentile(&sorted, 0.5);
        let iperf = iperf3(transport, bytes).ok();
        let quinn = match transport {
            Transport::Quic => Some(crate::bench_quinn::plain_quinn_mb_s(bytes).await?),
            Transport::Tcp => None,
        };
        reports.push(TransferReport {
            transport: match transport {
                Transport::Quic => "quic".into(),
                Transport::Tcp => "tcp".into(),
            },
            bytes,
            median_mb_s: median,
            runs_mb_s: speeds,
            iperf3_mb_s: iperf,
            ratio: iperf.map(|i| median / i),
            plain_quinn_mb_s: quinn,
            ratio_to_quinn: quinn.map(|q| median / q),
        });
        net.shutdown().await;
    }
    Ok(reports)
}

fn write_pattern(path: &Path, bytes: u64) -> Result<()> {
    use std::io::Write;
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    let block: Vec<u8> = (0..1 << 20)
        .map(|i: u32| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let mut left = bytes;
    while left > 0 {
        let n = left.min(block.len() as u64) as usize;
        f.write_all(&block[..n])?;
        left -= n as u64;
    }
    f.flush()?;
    Ok(())
}

fn stamp(path: &Path, n: u64) -> Result<()> {
    use std::io::{Seek, Write};
    let mut f = std::fs::OpenOptions::new().write(true).open(path)?;
    f.seek(std::io::SeekFrom::Start(0))?;
    f.write_all(&n.to_le_bytes())?;
    Ok(())
}

/// iperf3's received throughput on loopback, MB/s: TCP, or UDP with 1400-byte writes
/// at unlimited rate (what the QUIC path is compared with).
fn iperf3(transport: Transport, bytes: u64) -> Result<f64> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let mut server = Command::new("iperf3")
        .args(["-s", "-1", "-B", "127.0.0.1", "-p", &port.to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .context("iperf3 not installed (scripts/install-deps.sh installs it)")?;
    std::thread::sleep(Duration::from_millis(300));
    let mut client = Command::new("iperf3");
    client.args([
        "-c",
        "127.0.0.1",
        "-p",
        &port.to_string(),
        "-J",
        "-n",
        &bytes.to_string(),
    ]);
    if transport == Transport::Quic {
        client.args(["-u", "-b", "0", "-l", "1400"]);
    }
    let out = client.output();
    let _ = server.kill();
    let _ = server.wait();
    let json: serde_json::Value = serde_json::from_slice(&out?.stdout)?;
    let end = &json["end"];
    let mb_s = if transport == Transport::Quic {
        let sum = &end["sum"];
        let lost = sum["lost_percent"].as_f64().unwrap_or(0.0);
        sum["bits_per_second"].as_f64().context("no UDP figure")? / 8e6 * (1.0 - lost / 100.0)
    } else {
        end["sum_received"]["bits_per_second"]
            .as_f64()
            .context("no TCP figure")?
            / 8e6
    };
    Ok(mb_s)
}

/// Result of `sandbox-overhead`.
#[derive(Debug, Clone, Serialize)]
pub struct SandboxReport {
    /// Matrix size of the kernel.
    pub n: usize,
    /// Median native time (process start included), ms.
    pub native_ms: f64,
    /// Isolation measured: a worker process kept ready (as `gpunode serve` runs tasks),
    /// one started per task, or `thread` (epoch interruption, as in-process test networks
    /// run them).
    pub isolation: String,
    /// Median time as a wasm task, ms.
    pub wasm_ms: f64,
    /// wasm over native.
    pub ratio: f64,
    /// Median time from a cached module to the end of a trivial task, ms (module in
    /// this process's memory; a worker process loads it from disk).
    pub cached_start_ms: f64,
    /// The same with a fresh executor loading the module from disk (a restarted node), ms.
    pub disk_cached_start_ms: f64,
    /// First compilation of the kernel's module, ms.
    pub compile_ms: f64,
}

/// Times `checksum matmul N` natively and in the sandbox with each isolation, and the
/// start of a cached task. `worker` is the binary that serves as the sandbox worker.
pub fn sandbox_overhead(
    native: &Path,
    wasm: &Path,
    worker: &Path,
    n: usize,
    runs: usize,
) -> Result<Vec<SandboxReport>> {
    let arg = n.to_string();
    let mut native_times = Vec::new();
    let mut expected = String::new();
    for _ in 0..runs {
        let t = Instant::now();
        let out = Command::new(native).args(["matmul", &arg]).output()?;
        native_times.push(t.elapsed().as_secs_f64() * 1000.0);
        expected = String::from_utf8_lossy(&out.stdout).into_owned();
    }
    native_times.sort_by(f64::total_cmp);
    let native_ms = percentile(&native_times, 0.5);
    let work = tempfile::tempdir()?;
    let kernel = SandboxRuns {
        kernel: std::fs::read(wasm).with_context(|| format!("read {}", wasm.display()))?,
        hello: std::fs::read(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/wat/hello.wat"),
        )?,
        args: vec!["matmul".into(), arg],
        expected,
        runs,
        output_dir: work.path().join("out"),
        input_dir: work.path().join("in"),
    };
    std::fs::create_dir_all(&kernel.input_dir)?;
    let mut reports = Vec::new();
    let process = Isolation::Process(worker.to_path_buf());
    for (label, isolation, ready) in [
        (
            "process, worker ready (as serve runs tasks)",
            process.clone(),
            1,
        ),
        ("process, worker started per task", process, 0),
        ("thread", Isolation::Thread, 0),
    ] {
        let times = kernel.measure(isolation, ready)?;
        reports.push(SandboxReport {
            n,
            native_ms,
            isolation: label.into(),
            wasm_ms: times.wasm_ms,
            ratio: times.wasm_ms / native_ms,
            cached_start_ms: times.cached_start_ms,
            disk_cached_start_ms: times.disk_cached_start_ms,
            compile_ms: times.compile_ms,
        });
    }
    Ok(reports)
}

/// Stdout of a sandboxed task, as it arrives.
type Captured = std::sync::Arc<std::sync::Mutex<Vec<u8>>>;

/// What `sandbox-overhead` runs in the sandbox: the kernel (whose stdout must be the
/// native run's) and a trivial task.
struct SandboxRuns {
    kernel: Vec<u8>,
    hello: Vec<u8>,
    args: Vec<String>,
    expected: String,
    runs: usize,
    output_dir: PathBuf,
    /// An empty `/input` for the trivial task.
    input_dir: PathBuf,
}

/// Medians of one isolation's runs, ms.
struct IsolationTimes {
    compile_ms: f64,
    wasm_ms: f64,
    cached_start_ms: f64,
    disk_cached_start_ms: f64,
}

impl SandboxRuns {
    fn spec(&self, args: Vec<String>, out: Captured) -> RunSpec {
        RunSpec {
            args,
            env: Vec::new(),
            input_dir: None,
            output_dir: self.output_dir.clone(),
            limits: Limits::default(),
            stdout: Box::new(move |b: &[u8]| {
                if let Ok(mut o) = out.lock() {
                    o.extend_from_slice(b)
                }
            }),
            stderr: Box::new(|_| {}),
            cancel: CancelToken::new(),
        }
    }

    /// The kernel's compilation and runs, then the trivial task's starts from a cached
    /// module, in memory and from disk, under `isolation`, with `ready` worker processes
    /// kept started (each timed run waits until they are, as on an idle node).
    fn measure(&self, isolation: Isolation, ready: usize) -> Result<IsolationTimes> {
        let cache = tempfile::tempdir()?;
        let exec = WasmExecutor::with_isolation(cache.path(), isolation.clone())?;
        exec.keep_workers_ready(ready);
        let t = Instant::now();
        let task = exec.compile(&self.kernel, false)?;
        let compile_ms = t.elapsed().as_secs_f64() * 1000.0;
        let mut wasm_times = Vec::new();
        for _ in 0..self.runs {
            let out: Captured = Default::default();
            wait_ready(&exec, ready)?;
            let t = Instant::now();
            exec.run(&task, self.spec(self.args.clone(), out.clone()))?;
            wasm_times.push(t.elapsed().as_secs_f64() * 1000.0);
            let got = out.lock().map(|o| o.clone()).unwrap_or_default();
            if String::from_utf8_lossy(&got) != self.expected {
                bail!("wasm and native disagree: {got:?} vs {:?}", self.expected);
            }
        }
        // Start of a trivial task whose module is cached: compile() hit plus the run.
        exec.compile(&self.hello, false)?;
        let mut start_times = Vec::new();
        for _ in 0..self.runs.max(20) {
            wait_ready(&exec, ready)?;
            start_times.push(self.time_hello(&exec)?);
        }
        let mut disk_times = Vec::new();
        for _ in 0..5 {
            let fresh = WasmExecutor::with_isolation(cache.path(), isolation.clone())?;
            fresh.keep_workers_ready(ready);
            wait_ready(&fresh, ready)?;
            disk_times.push(self.time_hello(&fresh)?);
        }
        for v in [&mut wasm_times, &mut start_times, &mut disk_times] {
            v.sort_by(f64::total_cmp);
        }
        Ok(IsolationTimes {
            compile_ms,
            wasm_ms: percentile(&wasm_times, 0.5),
            cached_start_ms: percentile(&start_times, 0.5),
            disk_cached_start_ms: percentile(&disk_times, 0.5),
        })
    }

    /// Time of one compile (a cache hit) and run of the trivial task, ms.
    /// With `/input` and `/output` preopened as a job has them (`hello.wat` writes
    /// `/output/hello.txt`, fd 4), `/output` a new directory as each job's is; the run
    /// must succeed.
    fn time_hello(&self, exec: &WasmExecutor) -> Result<f64> {
        let mut spec = self.spec(Vec::new(), Default::default());
        spec.input_dir = Some(self.input_dir.clone());
        static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        spec.output_dir = self.output_dir.with_file_name(format!("hello-{run}"));
        let t = Instant::now();
        let task = exec.compile(&self.hello, false)?;
        let outcome = exec.run(&task, spec)?;
        let took = t.elapsed().as_secs_f64() * 1000.0;
        if outcome != gpunode_sandbox::Outcome::Exited(0) {
            bail!("hello.wat ended {outcome:?}");
        }
        Ok(took)
    }
}

/// Waits until `exec` has `n` worker processes started, then 20 ms for them to build
/// their engines, as on a node idle between tasks (a minute at most).
fn wait_ready(exec: &WasmExecutor, n: usize) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let deadline = Instant::now() + std::time::Duration::from_secs(60);
    while exec.workers_ready() < n {
        if Instant::now() > deadline {
            bail!("{n} sandbox worker(s) not ready after a minute");
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    std::thread::sleep(std::time::Duration::from_millis(20));
    Ok(())
}

/// The example kernel built natively and for wasm32-wasip1 (release), building both.
pub fn build_kernel() -> Result<(PathBuf, PathBuf)> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    for target in [None, Some("wasm32-wasip1")] {
        let mut cmd = Command::new(&cargo);
        cmd.args(["build", "--release", "-p", "gpunode-example-checksum"]);
        if let Some(t) = target {
            cmd.args(["--target", t]);
        }
        if !cmd.status()?.success() {
            bail!("building examples/checksum failed (wasm32-wasip1 target installed?)");
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target");
    Ok((
        root.join("release/checksum"),
        root.join("wasm32-wasip1/release/checksum.wasm"),
    ))
}
