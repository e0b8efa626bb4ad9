//! A lease between two real `gpunode serve` processes survives a provider crash
//! (kill -9) and restart: both sides still agree, and cancel reaches the provider.

use std::time::Duration;

use gpunode_e2e::{free_udp_port, gpunode, gpunode_bin, stderr, stdout};
use gpunode_procs::process::{ServeProcess, SIGINT, SIGKILL};
use serde_json::Value;

fn leases(dir: &std::path::Path) -> Vec<Value> {
    let out = gpunode(dir, &["leases", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    serde_json::from_str(&stdout(&out)).expect("leases json")
}

#[test]
fn lease_survives_provider_crash_and_restart() {
    let tmp = tempfile::tempdir().expect("tmp");
    let bin = gpunode_bin();
    let port = free_udp_port();
    let listen = format!("/ip4/127.0.0.1/udp/{port}/quic-v1");
    let provider_args = vec![
        "--listen".to_string(),
        listen.clone(),
        "--simulate-gpus".into(),
        "2xA100-80GB".into(),
        "--price".into(),
        "1.5".into(),
    ];
    let mut provider =
        ServeProcess::start(&bin, &tmp.path().join("p"), &provider_args).expect("provider");
    let requester = ServeProcess::start(
        &bin,
        &tmp.path().join("r"),
        &["--bootstrap".into(), provider.addr.clone()],
    )
    .expect("requester");

    // Ask the provider by peer id, through the requester's daemon.
    let out = gpunode(
        &requester.data_dir,
        &[
            "lease",
            "request",
            "--peer",
            &provider.peer_id,
            "--gpus",
            "1",
            "--gpu-model",
            "A100",
            "--cpus",
            "2",
            "--mem",
            "4G",
            "--duration",
            "30m",
            "--json",
        ],
    );
    assert!(
        out.status.success(),
        "lease request failed: {}",
        stderr(&out)
    );
    let lease: Value = serde_json::from_str(&stdout(&out)).expect("lease json");
    let id = lease["lease_id"].as_str().expect("id").to_string();
    assert_eq!(lease["state"], "active");
    assert_eq!(lease["provider_signature"], "valid");
    assert_eq!(lease["requester_signature"], "valid");
    assert_eq!(lease["gpus"].as_array().expect("gpus").len(), 1);
    assert_eq!(lease["price_per_gpu_hour"], 1.5);
    // The text form names the GPU and both signatures.
    let text = stdout(&gpunode(&requester.data_dir, &["leases"]));
    assert!(
        text.contains(&id[..12]) && text.contains("active"),
        "{text}"
    );

    // Crash the provider and start it again on the same data dir and port.
    provider
        .stop(SIGKILL, Duration::from_secs(5))
        .expect("kill")
        .expect("died");
    drop(provider);
    let provider =
        ServeProcess::start(&bin, &tmp.path().join("p"), &provider_args).expect("restart");
    let on_provider = leases(&provider.data_dir);
    let on_requester = leases(&requester.data_dir);
    assert_eq!(on_provider.len(), 1);
    assert_eq!(on_requester.len(), 1);
    for field in [
        "lease_id",
        "state",
        "end_ms",
        "start_ms",
        "gpus",
        "provider",
        "requester",
    ] {
        assert_eq!(
            on_provider[0][field], on_requester[0][field],
            "{field} differs"
        );
    }
    assert_eq!(on_provider[0]["role"], "provider");
    assert_eq!(on_requester[0]["role"], "requester");

    // Cancel from the requester: the restarted provider hears it and releases the GPU.
    let out = gpunode(
        &requester.data_dir,
        &["lease", "cancel", &id[..8], "--json"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let outcome: Value = serde_json::from_str(&stdout(&out)).expect("cancel json");
    assert_eq!(outcome["peer_notified"], true, "{outcome}");
    assert_eq!(leases(&provider.data_dir)[0]["state"], "cancelled");
    assert_eq!(leases(&requester.data_dir)[0]["state"], "cancelled");

    // Bad input: an unknown id and a malformed duration change nothing.
    let out = gpunode(&requester.data_dir, &["lease", "cancel", "ffffffff"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("no lease"), "{}", stderr(&out));
    let out = gpunode(
        &requester.data_dir,
        &["lease", "request", "--duration", "soon"],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--duration"), "{}", stderr(&out));
    assert_eq!(leases(&requester.data_dir).len(), 1);

    let mut requester = requester;
    let mut provider = provider;
    for p in [&mut requester, &mut provider] {
        let status = p
            .stop(SIGINT, Duration::from_secs(8))
            .expect("stop")
            .expect("exited");
        assert!(status.success(), "{}", p.log());
    }
}
