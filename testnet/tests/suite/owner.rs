//! The owner comes first, on real nodes with scripted simulated GPUs: an owner process
//! on a leased GPU preempts the lease after the grace (`yield`), the requester is
//! retried elsewhere and charged only the time used; `share` keeps the job running;
//! `suspend` pauses it until the owner leaves; lending hours refuse leases outside them
//! or past their end; the memory cap limits what is lent.

use std::time::Duration;

use gpunode_node::jobs::{ContainerRequest, JobEvent};
use gpunode_node::owner::OwnerPolicy;
use gpunode_node::{LeaseSpec, NodeConfig};
use gpunode_protocol::gpu::GpuState;
use gpunode_protocol::job::JobOutcome;
use gpunode_sandbox::container::procs::processes_with_env;
use testnet::jobs::{events_until, outcome, request, stdout_of, until_end, until_started};
use testnet::{TestNet, TestNode};

const LONG: Duration = Duration::from_secs(60);
/// A pid no gpunode job has: the owner's program.
const OWNER_PID: u32 = 4_000_001;

fn host_env_job(dir: &std::path::Path, script: &str) -> gpunode_node::jobs::JobRequest {
    request("sh".into(), dir)
        .container(ContainerRequest {
            image: None,
            command: vec!["sh".into(), "-c".into(), script.into()],
        })
        .gpus(1)
}

/// Two providers with one A100 each, configured by `tweak`, and a client that sees both.
async fn network(tweak: fn(usize, &mut NodeConfig)) -> TestNet {
    TestNet::gpu_providers(&["1xA100-80GB"; 2])
        .tweak(tweak)
        .with_clients(1)
        .clients_see_offers(LONG)
        .start()
        .await
        .expect("start")
}

fn containers(c: &mut NodeConfig) {
    c.backends = vec!["wasm".into(), "container".into()];
    c.allow_host_env = true;
}

async fn gpu_state(node: &TestNode) -> GpuState {
    node.handle.status().await.expect("status").inventory.gpus[0].state
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_coming_back_preempts_and_the_job_runs_elsewhere() {
    let net = network(|i, c| {
        containers(c);
        c.owner_policy = OwnerPolicy::Yield;
        c.owner_grace = Duration::from_millis(500);
        c.price_per_gpu_hour = if i == 0 { 0.5 } else { 2.0 };
    })
    .await;
    let client = net.client(0);
    let dir = tempfile::tempdir().expect("tempdir");
    // Long enough that the owner's return (a 0.5 s grace, then the next 1 s tick) lands
    // mid-run on a loaded machine.
    let view = client
        .handle
        .submit_job(host_env_job(dir.path(), "sleep 6; echo finished"));
    let mut from = 0;
    let started = until_started(&client.handle, &view.job_id, &mut from)
        .await
        .expect("started");
    let first = net.provider_id(0);
    assert!(
        started
            .iter()
            .any(|e| matches!(e, JobEvent::Started { provider } if *provider == first)),
        "the cheaper provider runs it first"
    );
    net.provider(0)
        .gpus
        .as_ref()
        .expect("simulated")
        .set_owner_process(0, Some(OWNER_PID), 10 << 30);
    let events = until_end(&client.handle, &view.job_id, &mut from)
        .await
        .expect("end");
    let summary = outcome(&events)
        .expect("ended")
        .expect("the job succeeds elsewhere");
    assert_eq!(summary.outcome, JobOutcome::Exited(0));
    assert_eq!(summary.provider, net.provider_id(1));
    assert!(
        events.iter().any(|e| matches!(e, JobEvent::Retrying { reason, .. } if reason.contains("owner took the GPU back"))),
        "{events:?}"
    );
    assert_eq!(stdout_of(&events), b"finished\n");
    assert_eq!(gpu_state(net.provider(0)).await, GpuState::OwnerBusy);

    // The preempted lease is settled for the time used only.
    let ledger = &net.provider(0).handle.accounts().ledger;
    let mut entry = None;
    for _ in 0..300 {
        entry = ledger
            .recent(10)
            .expect("ledger")
            .into_iter()
            .find(|e| e.exit_status == "preempted");
        if entry.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let entry = entry.unwrap_or_else(|| {
        panic!(
            "a receipt for the preempted lease; ledger: {:?}, unsettled: {:?}",
            ledger.recent(10),
            net.provider(0).handle.accounts().unsettled()
        )
    });
    assert!(
        entry.billed_seconds > 0.0 && entry.billed_seconds < 5.9,
        "billed the time used before the owner came back, not the whole task: {entry:?}"
    );
    net.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn share_keeps_running_and_suspend_pauses_until_the_owner_leaves() {
    let net = network(|i, c| {
        containers(c);
        c.owner_policy = if i == 0 {
            OwnerPolicy::Share
        } else {
            OwnerPolicy::Suspend
        };
        c.owner_grace = Duration::from_millis(100);
    })
    .await;
    let client = net.client(0);
    let dir = tempfile::tempdir().expect("tempdir");

    // share: the owner's process runs beside the job, which finishes.
    let req =
        host_env_job(&dir.path().join("a"), "sleep 1.5; echo shared").peer(net.provider_id(0));
    let view = client.handle.submit_job(req);
    let mut from = 0;
    until_started(&client.handle, &view.job_id, &mut from)
        .await
        .expect("started");
    let sim0 = net.provider(0).gpus.clone().expect("simulated");
    sim0.set_owner_process(0, Some(OWNER_PID), 1 << 30);
    let events = until_end(&client.handle, &view.job_id, &mut from)
        .await
        .expect("end");
    let summary = outcome(&events)
        .expect("ended")
        .expect("shared job finishes");
    assert_eq!(summary.outcome, JobOutcome::Exited(0));
    assert_eq!(stdout_of(&events), b"shared\n");

    // suspend: the job stops printing while the owner is there and goes on after.
    let req = host_env_job(
        &dir.path().join("b"),
        "i=0; while [ $i -lt 40 ]; do i=$((i+1)); echo $i; sleep 0.05; done",
    )
    .peer(net.provider_id(1));
    let view = client.handle.submit_job(req);
    let mut from = 0;
    let mut seen = events_until(
        &client.handle,
        &view.job_id,
        &mut from,
        LONG,
        |e| matches!(e, JobEvent::Stdout { data } if data.ends_with(b"3\n")),
    )
    .await
    .expect("counting");
    let sim1 = net.provider(1).gpus.clone().expect("simulated");
    sim1.set_owner_process(0, Some(OWNER_PID), 1 << 30);
    // Wait until the provider has paused the job, then watch for a second.
    status_until(net.provider(1), "the job to be paused", |s| {
        s.running_jobs.iter().any(|j| j.paused)
    })
    .await;
    seen.extend(events_for(client, &view.job_id, &mut from, Duration::from_millis(300)).await);
    let paused_at = stdout_of(&seen).len();
    let during = events_for(client, &view.job_id, &mut from, Duration::from_secs(1)).await;
    assert!(
        stdout_of(&during).is_empty(),
        "no output while the owner is there (had {paused_at} bytes)"
    );
    sim1.set_owner_process(0, None, 0);
    seen.extend(during);
    let rest = until_end(&client.handle, &view.job_id, &mut from)
        .await
        .expect("end");
    let summary = outcome(&rest)
        .expect("ended")
        .expect("the job resumes and ends");
    assert_eq!(summary.outcome, JobOutcome::Exited(0));
    seen.extend(rest);
    let lines: Vec<String> = String::from_utf8(stdout_of(&seen))
        .expect("utf-8")
        .lines()
        .map(String::from)
        .collect();
    assert_eq!(lines.len(), 40, "every line, none lost: {lines:?}");
    // The time the owner held it paused is not billed: 40 x 50 ms of work plus start-up,
    // not the 1.6 s or more it stood still.
    let ledger = &net.provider(1).handle.accounts().ledger;
    let entry = first_entry(ledger).await;
    assert!(
        entry.billed_seconds > 1.5 && entry.billed_seconds < summary.wall_ms as f64 / 1000.0 - 1.0,
        "paused time is not billed: {entry:?}, wall {} ms",
        summary.wall_ms
    );
    net.shutdown().await;
}

/// The node's status once `ok` holds for it (within 10 s).
async fn status_until(
    node: &TestNode,
    what: &str,
    ok: impl Fn(&gpunode_node::views::NodeStatus) -> bool,
) -> gpunode_node::views::NodeStatus {
    for _ in 0..200 {
        let status = node.handle.status().await.expect("status");
        if ok(&status) {
            return status;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting for {what}")
}

/// The ledger's newest entry, once a receipt has settled (within 30 s).
async fn first_entry(ledger: &gpunode_node::ledger::Ledger) -> gpunode_node::ledger::EntryView {
    for _ in 0..300 {
        if let Some(e) = ledger.recent(1).expect("ledger").into_iter().next() {
            return e;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no receipt settled within 30 s")
}

/// Every event of a job for `time`.
async fn events_for(
    client: &TestNode,
    job_id: &str,
    from: &mut usize,
    time: Duration,
) -> Vec<JobEvent> {
    let deadline = tokio::time::Instant::now() + time;
    let mut out = Vec::new();
    while tokio::time::Instant::now() < deadline {
        let page = client
            .handle
            .job_events(job_id, *from, Duration::from_millis(100))
            .await
            .expect("events");
        *from = page.next;
        out.extend(page.events);
    }
    out
}

/// `mon-sun HH:MM-HH:MM` from `from_min` to `to_min` minutes from now (UTC).
fn window(from_min: i64, to_min: i64) -> String {
    let now_min = (gpunode_protocol::time::now_ms() / 60_000) as i64;
    let at = |m: i64| {
        let day_min = (now_min + m).rem_euclid(1440);
        format!("{:02}:{:02}", day_min / 60, day_min % 60)
    };
    format!("mon-sun {}-{}", at(from_min), at(to_min))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lending_hours_and_the_memory_cap_limit_what_is_lent() {
    let net = network(|i, c| {
        if i == 0 {
            // Lent from an hour ago until 30 minutes from now.
            c.lend = vec![window(-60, 30)];
        } else {
            // Lent only from an hour from now.
            c.lend = vec![window(60, 120)];
            c.lend_gpu_memory = Some("50%".into());
        }
    })
    .await;
    let client = net.client(0);
    let (p0, p1) = (net.provider_id(0), net.provider_id(1));
    assert_eq!(gpu_state(net.provider(0)).await, GpuState::Idle);
    assert_eq!(gpu_state(net.provider(1)).await, GpuState::OffHours);
    let inventory = net
        .provider(1)
        .handle
        .status()
        .await
        .expect("status")
        .inventory;
    assert_eq!(
        inventory.gpus[0].memory_total_bytes,
        40 << 30,
        "half of 80 GB is lent"
    );

    let mut spec = LeaseSpec::new(1, 10 * 60_000).peer(&p0);
    client
        .handle
        .request_lease(spec.clone())
        .await
        .expect("10 minutes fit");
    spec.duration_ms = 3_600_000;
    let err = client
        .handle
        .request_lease(spec)
        .await
        .expect_err("an hour does not");
    assert!(err.to_string().contains("lending hours end at"), "{err}");
    let err = client
        .handle
        .request_lease(LeaseSpec::new(1, 60_000).peer(&p1))
        .await
        .expect_err("closed now");
    assert!(
        err.to_string()
            .contains("outside this provider's lending hours"),
        "{err}"
    );
    net.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_use_is_metered_into_the_receipt_and_alerts_run_the_hook() {
    let net = network(|_, c| {
        containers(c);
        c.alert_temperature_c = 80;
        c.alert_hook = Some(
            "echo \"$GPUNODE_ALERT_KIND $GPUNODE_ALERT_GPU\" >> /tmp/gpunode-alerts-$PPID".into(),
        );
    })
    .await;
    let client = net.client(0);
    let alerts_file = format!("/tmp/gpunode-alerts-{}", std::process::id());
    let _ = std::fs::remove_file(&alerts_file);
    let dir = tempfile::tempdir().expect("tempdir");
    let marker = format!("GPUNODE_METER_MARK={}", std::process::id());
    let (key, value) = marker.split_once('=').expect("marker");
    let req = host_env_job(dir.path(), "sleep 6")
        .env(key, value)
        .peer(net.provider_id(0));
    let view = client.handle.submit_job(req);
    let mut from = 0;
    until_started(&client.handle, &view.job_id, &mut from)
        .await
        .expect("started");
    // The driver would list the job's process on its GPU: script that.
    let sim = net.provider(0).gpus.clone().expect("simulated");
    let mut pids = Vec::new();
    for _ in 0..100 {
        pids = processes_with_env(&marker);
        if !pids.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let pid = *pids.first().expect("the job's process");
    sim.set_job_process(0, pid, Some((3 << 30, 70)));
    sim.set_readings(0, 91, 0, 70);
    let status = status_until(
        net.provider(0),
        "300 ms of the job's GPU use to be sampled",
        |s| {
            s.running_jobs
                .iter()
                .any(|j| j.gpu.is_some_and(|g| g.gpu_ms >= 300))
        },
    )
    .await;
    assert_eq!(
        status.inventory.gpus[0].state,
        GpuState::Idle,
        "a job's process is not the owner"
    );
    let running = &status.running_jobs;
    assert_eq!(running.len(), 1, "{running:?}");
    let gpu = running[0].gpu.expect("metered");
    assert!(
        gpu.gpu_ms > 0 && gpu.peak_memory_bytes == 3 << 30,
        "{gpu:?}"
    );
    let metrics = net.provider(0).handle.metrics().encode();
    assert!(
        metrics.contains("gpunode_job_gpu_memory_peak_bytes{"),
        "{metrics}"
    );
    assert!(
        metrics.contains("gpunode_gpu_temperature_celsius{"),
        "{metrics}"
    );
    // The job leaves the GPU for the rest of its run.
    sim.set_job_process(0, pid, None);

    let events = until_end(&client.handle, &view.job_id, &mut from)
        .await
        .expect("end");
    let summary = outcome(&events).expect("ended").expect("ran");
    let gpu = summary.gpu.expect("the report carries GPU use");
    assert!(
        gpu.gpu_ms >= 300 && gpu.gpu_ms + 500 < summary.run_ms,
        "GPU time while its process was on the GPU only: {gpu:?} {summary:?}"
    );
    assert_eq!(gpu.peak_memory_bytes, 3 << 30);

    // The receipt carries the measured GPU time, not the leased time.
    let ledger = &net.provider(0).handle.accounts().ledger;
    let entry = first_entry(ledger).await;
    assert!(
        entry.gpu_seconds > 0.0 && entry.gpu_seconds < entry.billed_seconds,
        "measured GPU time is below the leased GPU time: {entry:?}"
    );
    assert_eq!(
        entry.peak_gpu_memory_bytes,
        3 << 30,
        "the signed receipt has the peak"
    );

    // The temperature alert ran the hook once.
    let uuid = status.inventory.gpus[0].uuid.clone();
    let mut text = String::new();
    for _ in 0..100 {
        text = std::fs::read_to_string(&alerts_file).unwrap_or_default();
        if !text.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = std::fs::remove_file(&alerts_file);
    assert_eq!(text, format!("temperature {uuid}\n"));
    assert!(net
        .provider(0)
        .handle
        .metrics()
        .encode()
        .contains("gpunode_alerts_total{kind=\"temperature\"} 1"));
    net.shutdown().await;
}
