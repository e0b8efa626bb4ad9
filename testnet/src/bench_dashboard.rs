//! The dashboard's figures (issue 18): first paint and time until every view shows its
//! data on a node that knows `providers` providers and holds a ledger of `entries`
//! entries; how long a change takes to reach an open page (Server-Sent Events); and the
//! node's memory with the page open against without.
//!
//! The measured node is a real `gpunode serve` process with its dashboard, as users run
//! it; its ledger is built before it starts (`entries` receipts signed by both sides).
//! Its providers are real nodes on 127.0.0.1 in this process, each with one or two
//! simulated GPUs of 12 models (`BENCH_MODELS`: no family with more providers than a
//! DHT response carries), bootstrapped to it; it learns their adverts by searching
//! for each model through its API (`/v1/offers`), as `gpunode offers` does. The
//! providers are then stopped, so the daemon only serves; their adverts stay known until
//! they expire. Memory is the daemon's resident size. The browser is Debian's chromium,
//! driven by `tests/dashboard/paint.mjs`; the live updates are jobs submitted through
//! the daemon's Unix socket. The same number of jobs is submitted the same way before
//! the page opens, and "without" is read then, so the two sizes differ by the page
//! alone (a daemon's first job sets up its job machinery, about 7 MiB, page or not).

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use gpunode_node::jobs::JobRequest;
use gpunode_node::DataDir;
use serde::Serialize;

use crate::bench::{percentile, rss_of, BENCH_MODELS as MODELS};
use crate::{start_node, TestNetConfig, TestNode};

/// What `bench dashboard` reports.
#[derive(Debug, Clone, Serialize)]
pub struct DashboardReport {
    /// Providers whose adverts the node holds.
    pub providers_known: usize,
    /// Entries in its ledger.
    pub ledger_entries: u64,
    /// Page loads timed.
    pub runs: usize,
    /// First contentful paint of a fresh page, ms: median.
    pub first_paint_ms_median: f64,
    /// Slowest first paint, ms.
    pub first_paint_ms_max: f64,
    /// From navigation until every view shows its data (all providers listed), ms: median.
    pub data_shown_ms_median: f64,
    /// Slowest of those, ms.
    pub data_shown_ms_max: f64,
    /// From a job's submission until the open page lists it, ms: median.
    pub sse_update_ms_median: f64,
    /// Slowest of those, ms.
    pub sse_update_ms_max: f64,
    /// Resident memory of the daemon with no page open, MiB.
    pub rss_without_mib: f64,
    /// The same with the page open and following live updates, MiB.
    pub rss_with_page_mib: f64,
    /// The difference, MiB.
    pub rss_delta_mib: f64,
}

/// The driver's next line (an error once it stopped or after three minutes).
async fn next_line(rx: &mut tokio::sync::mpsc::Receiver<String>) -> Result<String> {
    tokio::time::timeout(Duration::from_secs(180), rx.recv())
        .await
        .ok()
        .flatten()
        .context("the browser driver stopped")
}

fn mib(bytes: u64) -> f64 {
    (bytes as f64 / (1 << 20) as f64 * 10.0).round() / 10.0
}

fn median_max(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (percentile(&v, 0.5), v.last().copied().unwrap_or(f64::NAN))
}

/// Submits a job no provider can take (none is connected then): it appears, waits and
/// fails.
async fn submit_unservable(
    api: &gpunode_node::api::ApiClient,
    module: &std::path::Path,
    output: &std::path::Path,
) -> Result<String> {
    let req = JobRequest::new(module, output).wait(false);
    let job: serde_json::Value = api.post_json("/v1/jobs", &req).await?;
    job["job_id"]
        .as_str()
        .map(str::to_string)
        .context("the daemon answered a job without its id")
}

/// A job's id as the page may quote it in a selector (hex digits only).
fn selector_safe(id: &str) -> Result<&str> {
    if id.is_empty() || !id.chars().all(|c| c.is_ascii_alphanumeric()) {
        bail!("unexpected job id {id:?}");
    }
    Ok(id)
}

/// `testnet bench dashboard`.
pub async fn dashboard(
    binary: &std::path::Path,
    providers: usize,
    entries: u64,
    runs: usize,
    updates: usize,
) -> Result<DashboardReport> {
    let driver =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/dashboard/paint.mjs");
    if !driver.with_file_name("node_modules").exists() {
        bail!("tests/dashboard has no node_modules: run scripts/install-deps.sh");
    }
    let dir = tempfile::Builder::new().prefix("gpunode-dash").tempdir()?;
    let data_dir = DataDir::new(dir.path());
    data_dir.ensure()?;
    let key = data_dir.load_or_create_identity()?;
    {
        let store = gpunode_node::store::Store::open(&data_dir.store_dir())?;
        let (ledger, writer) = gpunode_node::ledger::Ledger::open(store, key.clone())?;
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let writer = tokio::spawn(writer.run(stop_rx));
        crate::ledger::fill_ledger(&ledger, &key, entries).await?;
        let _ = stop.send(true);
        drop(ledger);
        writer.await?;
    }

    let config_file = dir.path().join("bench.toml");
    std::fs::write(
        &config_file,
        "listen = [\"/ip4/127.0.0.1/udp/0/quic-v1\"]\nmdns = false\nmax_connections_per_ip = 0\n\
         simulate_gpus = \"2xA100-80GB\"\nhistory_step = \"1s\"\ninventory_poll = \"500ms\"\n\
         dashboard_addr = \"127.0.0.1:0\"\n",
    )?;
    let daemon = gpunode_procs::process::ServeProcess::start(
        binary,
        dir.path(),
        &["--config".into(), config_file.display().to_string()],
    )?;
    let pid = daemon.pid().to_string();
    let api = gpunode_node::api::ApiClient::new(&data_dir.api_socket());

    // The providers dial the daemon (one bootstrapped to 200 peers keeps only the 20
    // per k-bucket that fit its routing table).
    let cfg = TestNetConfig {
        ephemeral_store: true,
        advert_ttl: Duration::from_secs(3600),
        inventory_poll: Duration::from_secs(2),
        ..TestNetConfig::new(Vec::new())
    };
    let started = Instant::now();
    let mut nodes: Vec<TestNode> = Vec::with_capacity(providers);
    for i in 0..providers {
        let count = 1 + i % 2;
        let spec = format!("{count}x{}", MODELS[i % MODELS.len()]);
        nodes.push(start_node(&cfg, i, Some(&spec), std::slice::from_ref(&daemon.addr)).await?);
    }
    eprintln!(
        "{providers} providers started in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    // A provider answers once its own advert is signed and published, which takes a
    // while when hundreds start at once on a few cores.
    let deadline = Instant::now() + Duration::from_secs(900);
    let known = |api: &gpunode_node::api::ApiClient| {
        let api = api.clone();
        async move {
            api.get_json::<serde_json::Value>("/v1/network?limit=0")
                .await
                .ok()
                .and_then(|v| v["total"].as_u64())
                .unwrap_or(0) as usize
        }
    };
    let (mut best, mut still) = (0, 0);
    loop {
        for model in MODELS {
            let family = model.split('-').next().unwrap_or(model);
            let _ = api
                .get_text(&format!("/v1/offers?gpu_model={family}"))
                .await;
        }
        let n = known(&api).await;
        eprintln!("adverts known: {n} of {providers}");
        if n >= providers {
            break;
        }
        // A few providers may never answer while hundreds start on two cores (issue
        // 16's formation problem); the page is measured with what the daemon knows, and
        // the report says how many that is.
        (best, still) = if n > best { (n, 0) } else { (best, still + 1) };
        let late = Instant::now() > deadline;
        if late && n == 0 {
            bail!("no advert known within 900s");
        }
        if late || (still >= 5 && n * 100 >= providers * 95) {
            eprintln!("going on with {n} of {providers} adverts");
            break;
        }
    }
    for n in &mut nodes {
        n.crash();
    }
    drop(nodes);
    let providers_known = known(&api).await;
    eprintln!("the daemon knows {providers_known} providers; settling");
    tokio::time::sleep(Duration::from_secs(10)).await;
    let out = tempfile::tempdir()?;
    let module = crate::jobs::task("sleep.wat");
    for n in 1..=updates {
        tokio::time::sleep(Duration::from_millis(700)).await;
        submit_unservable(&api, &module, &out.path().join(format!("before-{n}"))).await?;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_without = rss_of(&pid);
    let status: serde_json::Value = api.get_json("/v1/status").await?;
    let url = status["dashboard_url"]
        .as_str()
        .context("the daemon serves no dashboard")?
        .to_string();

    let mut browser = Command::new("node")
        .arg(&driver)
        .arg(&url)
        .arg(providers_known.to_string())
        .arg(runs.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("cannot run node (scripts/install-deps.sh installs it)")?;
    let mut stdin = browser.stdin.take().context("stdin")?;
    let stdout = browser.stdout.take().context("stdout")?;
    let (line_tx, mut line_rx) = tokio::sync::mpsc::channel(64);
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line_tx.blocking_send(line).is_err() {
                break;
            }
        }
    });
    loop {
        if next_line(&mut line_rx).await? == "OPEN" {
            break;
        }
    }
    for n in 1..=updates {
        tokio::time::sleep(Duration::from_millis(700)).await;
        let at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis();
        let job = submit_unservable(&api, &module, &out.path().join(n.to_string())).await?;
        writeln!(stdin, "JOB {n} {at} {}", selector_safe(&job)?)?;
        loop {
            if next_line(&mut line_rx).await?.starts_with("SEEN") {
                break;
            }
        }
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_with = rss_of(&pid);
    drop(stdin);
    let mut result = String::new();
    while let Ok(line) = next_line(&mut line_rx).await {
        if line.starts_with('{') {
            result = line;
            break;
        }
    }
    let _ = browser.wait();
    drop(daemon);

    #[derive(serde::Deserialize)]
    struct Driver {
        first_paint_ms: Vec<Option<f64>>,
        data_shown_ms: Vec<f64>,
        sse_update_ms: Vec<f64>,
    }
    let d: Driver = serde_json::from_str(&result).context("the driver's JSON line")?;
    let (first_paint_ms_median, first_paint_ms_max) =
        median_max(d.first_paint_ms.into_iter().flatten().collect());
    let (data_shown_ms_median, data_shown_ms_max) = median_max(d.data_shown_ms);
    let (sse_update_ms_median, sse_update_ms_max) = median_max(d.sse_update_ms);
    Ok(DashboardReport {
        providers_known,
        ledger_entries: entries,
        runs,
        first_paint_ms_median,
        first_paint_ms_max,
        data_shown_ms_median,
        data_shown_ms_max,
        sse_update_ms_median,
        sse_update_ms_max,
        rss_without_mib: mib(rss_without),
        rss_with_page_mib: mib(rss_with),
        rss_delta_mib: mib(rss_with.saturating_sub(rss_without)),
    })
}
