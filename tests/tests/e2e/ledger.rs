//! `gpunode ledger` and `gpunode peers` end to end: two real `gpunode serve` processes
//! run tasks; both ledgers hold the receipts; `ledger`, `ledger verify`, `ledger export`
//! and `peers` show them through the daemon and, with the daemon stopped, from the store.

use std::time::Duration;

use gpunode_e2e::{gpunode, stderr, stdout, workspace_file};
use gpunode_procs::process::SIGINT;
use serde_json::Value;

use crate::common;
use common::provider_and_requester;

fn json(out: &std::process::Output) -> Value {
    assert!(out.status.success(), "{}", stderr(out));
    serde_json::from_str(&stdout(out)).expect("JSON output")
}

#[test]
fn ledgers_peers_verify_and_export_after_real_jobs() {
    let tmp = tempfile::tempdir().expect("tmp");
    let (mut provider, mut requester) = provider_and_requester(tmp.path());
    let hello = workspace_file("examples/wat/hello.wat");
    for _ in 0..2 {
        let out = gpunode(
            &requester.data_dir,
            &[
                "run",
                hello.to_str().expect("utf8"),
                "--peer",
                &provider.peer_id,
                "--output",
                tmp.path().join("out").to_str().expect("utf8"),
            ],
        );
        assert!(out.status.success(), "{}", stderr(&out));
        let err = stderr(&out);
        assert!(
            err.contains("cost") && !err.contains("estimate"),
            "the receipt settled before the summary: {err}"
        );
    }

    // The requester's side, through its daemon.
    let view = json(&gpunode(&requester.data_dir, &["ledger", "--json"]));
    assert_eq!(view["entries"], 2);
    assert_eq!(view["recent"][0]["direction"], "spent");
    assert_eq!(view["recent"][0]["peer"], provider.peer_id.as_str());
    assert_eq!(view["recent"][0]["exit_status"], "exited 0");
    let text = stdout(&gpunode(&requester.data_dir, &["ledger"]));
    assert!(
        text.contains("Balance:") && text.contains("Recent entries"),
        "{text}"
    );
    let out = gpunode(&requester.data_dir, &["ledger", "verify"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("ledger OK: 2 entries, 4 signatures"),
        "{}",
        stdout(&out)
    );
    let csv = stdout(&gpunode(
        &requester.data_dir,
        &["ledger", "export", "--format", "csv"],
    ));
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines.len(), 3, "{csv}");
    assert!(lines[0].starts_with("seq,recorded_ms,lease_id"));
    assert!(lines[1].starts_with("1,") && lines[2].starts_with("2,"));
    let exported: Value = serde_json::from_str(&stdout(&gpunode(
        &requester.data_dir,
        &["ledger", "export", "--format", "json"],
    )))
    .expect("json export");
    assert_eq!(exported.as_array().map(Vec::len), Some(2));
    let out = gpunode(
        &requester.data_dir,
        &["ledger", "export", "--format", "xml"],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("csv or json"), "{}", stderr(&out));
    let peers = json(&gpunode(&requester.data_dir, &["peers", "--json"]));
    let p = peers
        .as_array()
        .and_then(|a| a.iter().find(|p| p["peer_id"] == provider.peer_id.as_str()))
        .expect("the provider is listed");
    assert_eq!(p["jobs_done"], 2);
    assert!(p["reputation"].as_f64().expect("score") > 0.5);
    // The daemon's link to the provider: direct, on loopback, listed by `peers`.
    let status = json(&gpunode(&requester.data_dir, &["status", "--json"]));
    let link = status["connections"]
        .as_array()
        .and_then(|a| a.iter().find(|c| c["peer_id"] == provider.peer_id.as_str()))
        .expect("connected to the provider");
    assert_eq!(link["path"], "direct", "{link}");
    assert!(
        link["address"]
            .as_str()
            .expect("address")
            .starts_with("/ip4/127.0.0.1/"),
        "{link}"
    );
    let text = stdout(&gpunode(&requester.data_dir, &["peers"]));
    assert!(text.contains("REPUTATION"), "{text}");
    assert!(
        text.contains("Connected to") && text.contains(" direct "),
        "{text}"
    );

    // The provider holds the same receipts (it appends after the countersignature).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let provider_view = loop {
        let v = json(&gpunode(&provider.data_dir, &["ledger", "--json"]));
        if v["entries"] == 2 || std::time::Instant::now() > deadline {
            break v;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(provider_view["entries"], 2);
    assert_eq!(provider_view["recent"][0]["direction"], "earned");
    assert_eq!(
        provider_view["recent"][0]["lease_id"],
        view["recent"][0]["lease_id"]
    );
    assert_eq!(
        provider_view["recent"][0]["amount"],
        view["recent"][0]["amount"]
    );

    // With the daemon stopped, the commands read the store.
    requester
        .stop(SIGINT, Duration::from_secs(10))
        .expect("requester stops");
    let out = gpunode(&requester.data_dir, &["ledger", "verify", "--json"]);
    let report = json(&out);
    assert_eq!(report["entries"], 2);
    assert!(report["first_bad"].is_null());
    let view = json(&gpunode(&requester.data_dir, &["ledger", "--json"]));
    assert_eq!(view["entries"], 2);
    provider
        .stop(SIGINT, Duration::from_secs(10))
        .expect("provider stops");
}
