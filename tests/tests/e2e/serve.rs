//! Real `gpunode serve` processes on loopback: offers, status, metrics, clean exit; a
//! node started before its bootstrap peer joins it once it is up.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use gpunode_e2e::{gpunode, gpunode_bin, stderr, stdout};
use gpunode_procs::process::{ServeProcess, SIGINT, SIGTERM};
use serde_json::Value;

fn offers_json(data_dir: &std::path::Path, extra: &[&str]) -> Vec<Value> {
    let mut args = vec!["offers", "--json"];
    args.extend_from_slice(extra);
    let out = gpunode(data_dir, &args);
    assert!(out.status.success(), "offers failed: {}", stderr(&out));
    serde_json::from_str::<Vec<Value>>(&stdout(&out)).expect("offers --json is a JSON list")
}

fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn three_processes_find_each_other_and_exit_cleanly() {
    let tmp = tempfile::tempdir().expect("tmp");
    let bin = gpunode_bin();
    let metrics_port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let mut a = ServeProcess::start(
        &bin,
        &tmp.path().join("a"),
        &[
            "--simulate-gpus".into(),
            "2xA100-80GB".into(),
            "--metrics-addr".into(),
            format!("127.0.0.1:{metrics_port}"),
        ],
    )
    .expect("start a");
    let mut b = ServeProcess::start(
        &bin,
        &tmp.path().join("b"),
        &[
            "--simulate-gpus".into(),
            "1xT4-16GB".into(),
            "--bootstrap".into(),
            a.addr.clone(),
        ],
    )
    .expect("start b");
    let mut c = ServeProcess::start(
        &bin,
        &tmp.path().join("c"),
        &[
            "--simulate-gpus".into(),
            "4xH100-80GB".into(),
            "--price".into(),
            "2.5".into(),
            "--bootstrap".into(),
            a.addr.clone(),
        ],
    )
    .expect("start c");

    // Through a's daemon: the other two, with the right GPUs.
    let offers = wait_for("a to list b and c", Duration::from_secs(30), || {
        let o = offers_json(&a.data_dir, &[]);
        (o.len() == 2).then_some(o)
    });
    let by_peer = |id: &str| {
        offers
            .iter()
            .find(|o| o["peer_id"] == id)
            .unwrap_or_else(|| panic!("{id} missing from {offers:?}"))
    };
    let ob = by_peer(&b.peer_id);
    assert_eq!(ob["gpus"].as_array().expect("gpus").len(), 1);
    assert_eq!(ob["gpus"][0]["model"], "T4-16GB");
    assert_eq!(ob["simulated"], true);
    let oc = by_peer(&c.peer_id);
    assert_eq!(oc["gpus"].as_array().expect("gpus").len(), 4);
    assert_eq!(oc["gpus"][0]["model"], "H100-80GB");
    assert_eq!(oc["price_per_gpu_hour"], 2.5);
    assert!(!offers.iter().any(|o| o["peer_id"] == a.peer_id.as_str()));

    // Filters pass through the API.
    let h100 = offers_json(
        &a.data_dir,
        &["--gpu-model", "H100", "--min-gpu-mem", "40G"],
    );
    assert_eq!(h100.len(), 1);
    assert_eq!(h100[0]["peer_id"], c.peer_id.as_str());

    // The table form names the GPUs and says they are simulated.
    let table = stdout(&gpunode(&a.data_dir, &["offers"]));
    assert!(
        table.contains("4x H100-80GB 80G (4 idle)") && table.contains("simulated"),
        "{table}"
    );

    // Without a daemon: a short-lived client node joins through a bootstrap address.
    let lone = tmp.path().join("lone");
    let seen = offers_json(&lone, &["--no-mdns", "--bootstrap", &a.addr]);
    assert_eq!(seen.len(), 3, "{seen:?}");

    // Status of a running node.
    let out = gpunode(&b.data_dir, &["status", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let status: Value = serde_json::from_str(&stdout(&out)).expect("status json");
    assert_eq!(status["peer_id"], b.peer_id.as_str());
    assert!(status["advert"]["seq"].as_u64().expect("seq") >= 1);
    assert_eq!(status["inventory"]["gpus"][0]["name"], "T4-16GB");
    let text = stdout(&gpunode(&b.data_dir, &["status"]));
    assert!(
        text.contains("GPUs (simulated)") && text.contains("T4-16GB"),
        "{text}"
    );

    // Metrics on the localhost port.
    let mut s = std::net::TcpStream::connect(("127.0.0.1", metrics_port)).expect("metrics port");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .expect("write");
    let mut body = String::new();
    s.read_to_string(&mut body).expect("read");
    assert!(body.contains("gpunode_peers_connected"), "{body}");
    assert!(body.contains("gpunode_adverts_published_total"), "{body}");

    // Ctrl-C and SIGTERM: clean exit within a few seconds, socket removed.
    for (p, sig) in [(&mut c, SIGINT), (&mut b, SIGTERM), (&mut a, SIGINT)] {
        let status = p
            .stop(sig, Duration::from_secs(8))
            .expect("stop")
            .expect("exited in time");
        assert!(status.success(), "exit status {status}: {}", p.log());
        assert!(!p.data_dir.join("api.sock").exists());
    }
    // A daemon allocates through jemalloc (`node/src/allocator.rs`).
    assert!(a.log().contains(", allocator jemalloc)"), "{}", a.log());
    // The identity survives a restart.
    let id = stdout(&gpunode(&b.data_dir, &["id"]));
    assert_eq!(id.trim(), b.peer_id);
}

/// A node started while its bootstrap peer is not up yet (a restart, a machine booting
/// later, a team inviter that has not let it in yet) dials it again while it has no
/// connection, and joins once the peer is there.
#[test]
fn a_node_started_before_its_bootstrap_peer_joins_once_that_peer_is_up() {
    let tmp = tempfile::tempdir().expect("tmp");
    let bin = gpunode_bin();
    let port = {
        let s = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        s.local_addr().expect("addr").port()
    };
    let addr = format!("/ip4/127.0.0.1/udp/{port}/quic-v1");
    let mut late = ServeProcess::start(
        &bin,
        &tmp.path().join("b"),
        &["--bootstrap".into(), addr.clone()],
    )
    .expect("start b");
    // Its first dial found nothing; once it says it dials again, only that can connect it.
    wait_for(
        "the late node to dial its bootstrap peer again",
        Duration::from_secs(60),
        || {
            late.log()
                .contains("dialling the bootstrap peers again")
                .then_some(())
        },
    );
    let connected = |dir: &std::path::Path| -> usize {
        let out = gpunode(dir, &["status", "--json"]);
        let status: Value = serde_json::from_str(&stdout(&out)).unwrap_or_default();
        status["connected_peers"].as_array().map_or(0, |p| p.len())
    };
    assert_eq!(
        connected(&late.data_dir),
        0,
        "nothing listened at {addr} yet"
    );
    let mut first = ServeProcess::start(&bin, &tmp.path().join("a"), &["--listen".into(), addr])
        .expect("start a");
    wait_for("the late node to connect", Duration::from_secs(60), || {
        (connected(&late.data_dir) > 0).then_some(())
    });
    for p in [&mut late, &mut first] {
        p.stop(SIGINT, Duration::from_secs(10)).expect("stops");
    }
}
