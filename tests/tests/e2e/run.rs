//! `gpunode run` end to end: two real `gpunode serve` processes, the example tasks from
//! examples/ (the Rust guest built for wasm32-wasip1, and the .wat one), live output,
//! output files, the task's exit code, and detached jobs with `jobs`, `logs`, `cancel`.

use std::time::Duration;

use gpunode_e2e::{example_checksum_wasm, gpunode, gpunode_bin, stderr, stdout, workspace_file};
use gpunode_procs::process::{ServeProcess, SIGINT, SIGKILL};
use serde_json::Value;

use crate::common;
use common::provider_and_requester;

fn sha256_hex(data: &[u8]) -> String {
    // The expected digests come from the system's sha256sum, not from our own code.
    let tmp = tempfile::NamedTempFile::new().expect("tmp");
    std::fs::write(tmp.path(), data).expect("write");
    let out = std::process::Command::new("sha256sum")
        .arg(tmp.path())
        .output()
        .expect("sha256sum");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .expect("digest")
        .to_string()
}

#[test]
fn run_ships_a_task_to_a_peer_and_brings_back_its_output() {
    let wasm = example_checksum_wasm();
    let tmp = tempfile::tempdir().expect("tmp");
    let bin = gpunode_bin();
    let (mut provider, mut requester) = provider_and_requester(tmp.path());

    let inputs = tmp.path().join("photos");
    std::fs::create_dir_all(inputs.join("2026")).expect("mkdir");
    let a = b"first file\n".to_vec();
    let b: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(inputs.join("a.txt"), &a).expect("write");
    std::fs::write(inputs.join("2026/b.bin"), &b).expect("write");
    let out_dir = tmp.path().join("out");
    let out = gpunode(
        &requester.data_dir,
        &[
            "run",
            wasm.to_str().expect("utf8"),
            "--peer",
            &provider.peer_id,
            "--input",
            inputs.to_str().expect("utf8"),
            "--output",
            out_dir.to_str().expect("utf8"),
            "--timeout",
            "1m",
        ],
    );
    assert!(out.status.success(), "run failed: {}", stderr(&out));
    let expected = format!(
        "{}  photos/2026/b.bin\n{}  photos/a.txt\n",
        sha256_hex(&b),
        sha256_hex(&a)
    );
    assert_eq!(stdout(&out), expected);
    assert_eq!(
        std::fs::read_to_string(out_dir.join("SHA256SUMS")).expect("sums"),
        expected
    );
    assert_eq!(
        std::fs::read_to_string(out_dir.join("summary.txt")).expect("summary"),
        "2 files, 200011 bytes\n"
    );
    let err = stderr(&out);
    assert!(
        err.contains("checksum: 2 files"),
        "task stderr relayed: {err}"
    );
    assert!(
        err.contains("exited 0") && err.contains("cost"),
        "summary line: {err}"
    );

    // The .wat example, output to the default ./gpunode-out/JOB_ID.
    let work = tmp.path().join("work");
    std::fs::create_dir_all(&work).expect("mkdir");
    let hello = workspace_file("examples/wat/hello.wat");
    let out = std::process::Command::new(&bin)
        .current_dir(&work)
        .arg("--data-dir")
        .arg(&requester.data_dir)
        .args(["run", hello.to_str().expect("utf8"), "--quiet"])
        .output()
        .expect("run");
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), "hello from a gpunode sandbox\n");
    assert!(stderr(&out).is_empty(), "--quiet prints nothing else");
    let job_dirs: Vec<_> = std::fs::read_dir(work.join("gpunode-out"))
        .expect("default output dir")
        .flatten()
        .collect();
    assert_eq!(job_dirs.len(), 1);
    assert_eq!(
        std::fs::read_to_string(job_dirs[0].path().join("hello.txt")).expect("hello.txt"),
        "hello from a gpunode sandbox\n"
    );
    // --quiet returns once the result and outputs are in; the daemon settles the
    // receipt on its own.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let out = gpunode(&requester.data_dir, &["jobs", "--json"]);
        let jobs: Value = serde_json::from_slice(&out.stdout).expect("jobs --json");
        let newest = &jobs[0];
        if newest["summary"]["receipt"] == "settled" {
            assert_eq!(newest["state"], "finished", "{newest}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the quiet run's receipt never settled: {newest}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // The task's exit code is the command's.
    let spin = workspace_file("testnet/tasks/spin.wat");
    let out = gpunode(
        &requester.data_dir,
        &[
            "run",
            spin.to_str().expect("utf8"),
            "--output",
            out_dir.to_str().expect("utf8"),
        ],
    );
    assert_eq!(out.status.code(), Some(7), "{}", stderr(&out));
    assert_eq!(stdout(&out), "started\ndone\n");

    // A module that is not valid fails before any lease, with a clear message.
    let bad = tmp.path().join("bad.wasm");
    std::fs::write(&bad, b"not wasm").expect("write");
    let out = gpunode(&requester.data_dir, &["run", bad.to_str().expect("utf8")]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("not a runnable task"),
        "{}",
        stderr(&out)
    );

    // Detached: the daemon keeps the job; jobs, logs and cancel reach it.
    let out = gpunode(
        &requester.data_dir,
        &[
            "run",
            "--detach",
            spin.to_str().expect("utf8"),
            "--",
            "forever",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let job_id = stdout(&out).trim().to_string();
    assert_eq!(job_id.len(), 16);
    let mut running = false;
    for _ in 0..100 {
        let out = gpunode(&requester.data_dir, &["jobs", "--json"]);
        let jobs: Vec<Value> = serde_json::from_str(&stdout(&out)).expect("jobs json");
        let job = jobs
            .iter()
            .find(|j| j["job_id"] == job_id.as_str())
            .expect("listed");
        if job["state"] == "running" {
            running = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(running, "the detached job started");
    // "running" comes with the provider's start; the task's first line follows it.
    let mut logged = String::new();
    for _ in 0..100 {
        logged = stdout(&gpunode(&requester.data_dir, &["logs", &job_id[..8]]));
        if !logged.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(logged, "started\n");
    let out = gpunode(&requester.data_dir, &["cancel", &job_id]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = gpunode(&requester.data_dir, &["logs", "--follow", &job_id]);
    assert_eq!(out.status.code(), Some(130), "{}", stderr(&out));
    let out = gpunode(&requester.data_dir, &["jobs"]);
    assert!(stdout(&out).contains("cancelled"), "{}", stdout(&out));
    let out = gpunode(&requester.data_dir, &["logs", "nosuchjob"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("no job"), "{}", stderr(&out));

    requester
        .stop(SIGINT, Duration::from_secs(15))
        .expect("stop");
    provider
        .stop(SIGINT, Duration::from_secs(15))
        .expect("stop");
}

#[test]
fn a_provider_killed_mid_task_is_replaced() {
    let tmp = tempfile::tempdir().expect("tmp");
    let bin = gpunode_bin();
    let mut first = ServeProcess::start(&bin, &tmp.path().join("p1"), &[]).expect("provider 1");
    let mut second = ServeProcess::start(
        &bin,
        &tmp.path().join("p2"),
        &["--bootstrap".into(), first.addr.clone()],
    )
    .expect("provider 2");
    let mut requester = ServeProcess::start(
        &bin,
        &tmp.path().join("r"),
        &[
            "--bootstrap".into(),
            first.addr.clone(),
            "--price".into(),
            "99".into(),
        ],
    )
    .expect("requester");
    // Both providers visible to the requester (which never lists itself).
    let mut seen = 0;
    for _ in 0..100 {
        let out = gpunode(&requester.data_dir, &["offers", "--json"]);
        seen = serde_json::from_str::<Vec<Value>>(&stdout(&out))
            .map(|o| o.len())
            .unwrap_or(0);
        if seen >= 2 {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(seen >= 2, "both providers visible: {seen}");

    let spin = workspace_file("testnet/tasks/spin.wat");
    let out_dir = tmp.path().join("out");
    let run = std::process::Command::new(&bin)
        .arg("--data-dir")
        .arg(&requester.data_dir)
        .args([
            "run",
            spin.to_str().expect("utf8"),
            "--output",
            out_dir.to_str().expect("utf8"),
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run");
    // Wait until it runs somewhere, then kill -9 that provider.
    let mut provider = String::new();
    for _ in 0..200 {
        let out = gpunode(&requester.data_dir, &["jobs", "--json"]);
        let jobs: Vec<Value> = serde_json::from_str(&stdout(&out)).unwrap_or_default();
        if let Some(j) = jobs.first().filter(|j| j["state"] == "running") {
            provider = j["provider"].as_str().unwrap_or_default().to_string();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!provider.is_empty(), "the job started");
    let victim = if provider == first.peer_id {
        &mut first
    } else {
        &mut second
    };
    victim
        .stop(SIGKILL, Duration::from_secs(5))
        .expect("kill -9");
    let out = run.wait_with_output().expect("run ends");
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(7), "{err}");
    assert!(err.contains("retrying elsewhere"), "{err}");
    assert!(err.contains("after 2 attempts"), "{err}");
    assert!(
        stdout(&out).ends_with("started\ndone\n"),
        "{}",
        stdout(&out)
    );
    requester
        .stop(SIGINT, Duration::from_secs(15))
        .expect("stop");
    let survivor = if provider == first.peer_id {
        &mut second
    } else {
        &mut first
    };
    survivor
        .stop(SIGINT, Duration::from_secs(15))
        .expect("stop");
}

/// A requester daemon started with `--bootstrap` and asked to `run` at once finds the
/// provider, every time. Twenty fresh requesters in a row, each killed (not stopped)
/// before the next starts: the provider's routing table fills with dead peers that
/// advertised their CPUs too, which is what made a lookup wait out its timeout and
/// answer with nothing.
#[test]
fn a_run_right_after_start_finds_the_provider_every_time() {
    let tmp = tempfile::tempdir().expect("tmp");
    let bin = gpunode_bin();
    let listen = format!(
        "/ip4/127.0.0.1/udp/{}/quic-v1",
        gpunode_e2e::free_udp_port()
    );
    let mut provider =
        ServeProcess::start(&bin, &tmp.path().join("p"), &["--listen".into(), listen])
            .expect("provider");
    let hello = workspace_file("examples/wat/hello.wat");
    for i in 0..20 {
        let mut requester = ServeProcess::start(
            &bin,
            &tmp.path().join(format!("r{i}")),
            &["--bootstrap".into(), provider.addr.clone()],
        )
        .expect("requester");
        let out = gpunode(
            &requester.data_dir,
            &[
                "run",
                hello.to_str().expect("utf8"),
                "--quiet",
                "--output",
                tmp.path().join("out").to_str().expect("utf8"),
            ],
        );
        assert!(
            out.status.success(),
            "run {i} right after start failed: {}\nrequester log:\n{}",
            stderr(&out),
            requester.log()
        );
        assert_eq!(stdout(&out), "hello from a gpunode sandbox\n");
        requester
            .stop(SIGKILL, Duration::from_secs(5))
            .expect("kill -9");
    }
    provider
        .stop(SIGINT, Duration::from_secs(15))
        .expect("stop");
}
