//! A peer of another libp2p implementation (js-libp2p, TCP + noise + yamux) connects to
//! a real `gpunode serve` process and gets identify and ping answers.
//! `scripts/install-deps.sh` installs Node.js and the js packages.

use std::process::Command;
use std::time::Duration;

use gpunode_e2e::gpunode_bin;
use gpunode_procs::process::{ServeProcess, SIGINT};
use serde_json::Value;

#[test]
fn js_libp2p_peer_gets_identify_and_ping() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("interop");
    assert!(
        root.join("node_modules").is_dir(),
        "js-libp2p is not installed: run scripts/install-deps.sh first"
    );
    let tmp = tempfile::tempdir().expect("tmp");
    let mut node = ServeProcess::start(
        &gpunode_bin(),
        &tmp.path().join("n"),
        &["--listen".into(), "/ip4/127.0.0.1/tcp/0".into()],
    )
    .expect("serve");
    let log = node.log();
    let tcp = log
        .split_whitespace()
        .find(|w| w.starts_with("/ip4/127.0.0.1/tcp/"))
        .expect("tcp listen address in the log");
    let target = format!("{tcp}/p2p/{}", node.peer_id);
    let out = Command::new("node")
        .arg(root.join("interop.mjs"))
        .arg(&target)
        .current_dir(&root)
        .output()
        .expect("run node");
    assert!(
        out.status.success(),
        "js peer failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let answer: Value = serde_json::from_slice(&out.stdout).expect("json from the js peer");
    assert_eq!(answer["peer"], node.peer_id.as_str());
    assert!(answer["agent"]
        .as_str()
        .expect("agent")
        .starts_with("gpunode/"));
    let protocols: Vec<&str> = answer["protocols"]
        .as_array()
        .expect("protocols")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(protocols.contains(&"/ipfs/ping/1.0.0"), "{protocols:?}");
    assert!(protocols.contains(&"/gpunode/kad/1.0.0"), "{protocols:?}");
    assert!(answer["ping_ms"].as_f64().is_some());
    let status = node
        .stop(SIGINT, Duration::from_secs(8))
        .expect("stop")
        .expect("exited");
    assert!(status.success());
}
