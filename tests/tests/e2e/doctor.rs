//! `gpunode doctor` as users meet it: each problem is named with its fix and the exit
//! code says whether any check failed; the network checks ask the running daemon; in a
//! network namespace with no route it names the missing reachability.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use gpunode_e2e::{free_udp_port, gpunode, gpunode_bin, stdout};
use gpunode_procs::process::ServeProcess;
use serde_json::Value;

fn checks(out: &std::process::Output) -> Vec<Value> {
    serde_json::from_str(&stdout(out)).unwrap_or_else(|e| panic!("{e}: {}", stdout(out)))
}

fn find<'a>(checks: &'a [Value], name: &str) -> &'a Value {
    checks
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no {name} check in {checks:?}"))
}

#[test]
fn doctor_names_each_problem_with_its_fix() {
    let tmp = tempfile::tempdir().expect("tmp");
    // A data dir others can read, and a config that does not load.
    let dd = tmp.path().join("open");
    std::fs::create_dir(&dd).expect("mkdir");
    std::fs::set_permissions(&dd, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let bad = tmp.path().join("bad.toml");
    std::fs::write(&bad, "listen = 5\n").expect("write");
    let cfg = bad.to_str().expect("utf-8");
    let out = gpunode(&dd, &["--config", cfg, "doctor"]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    let text = stdout(&out);
    assert!(
        text.contains(&format!("fix: chmod 700 {}", dd.display())),
        "{text}"
    );
    assert!(
        text.contains("FAIL  config") && text.contains("listen"),
        "{text}"
    );
    assert!(text.contains("skip  daemon: not running"), "{text}");
    assert!(text.contains("gpunode serve"), "{text}");
    // Nothing was changed by looking.
    let mode = std::fs::metadata(&dd).expect("meta").permissions().mode();
    assert_eq!(mode & 0o777, 0o755);

    // Fixed as told; a daemon on loopback whose bootstrap peer is not there.
    std::fs::set_permissions(&dd, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let absent = tmp.path().join("absent");
    let absent_id = stdout(&gpunode(&absent, &["id"])).trim().to_string();
    let port = free_udp_port();
    let config = tmp.path().join("config.toml");
    std::fs::write(
        &config,
        format!(
            "max_connections_per_ip = 0\nbootstrap = [\"/ip4/127.0.0.1/udp/{port}/quic-v1/p2p/{absent_id}\"]\n"
        ),
    )
    .expect("write");
    let cfg = config.to_str().expect("utf-8");
    let daemon =
        ServeProcess::start(&gpunode_bin(), &dd, &["--config".into(), cfg.into()]).expect("serve");
    let out = gpunode(&dd, &["--config", cfg, "doctor", "--json"]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    let list = checks(&out);
    assert_eq!(find(&list, "data dir")["verdict"], "ok");
    assert_eq!(find(&list, "config")["verdict"], "ok");
    assert_eq!(find(&list, "daemon")["verdict"], "ok");
    let listen = find(&list, "listen addresses");
    assert_eq!(listen["verdict"], "warn", "{listen}");
    assert!(listen["detail"].as_str().unwrap().contains("loopback only"));
    assert!(listen["fix"].as_str().unwrap().contains("listen = ["));
    let boot = find(&list, "bootstrap");
    assert_eq!(boot["verdict"], "fail", "{boot}");
    assert!(
        boot["detail"].as_str().unwrap().contains(&absent_id),
        "{boot}"
    );
    assert!(
        boot["fix"]
            .as_str()
            .unwrap()
            .contains(&format!("UDP port {port}")),
        "{boot}"
    );

    // A peer connects: it tells the daemon how it sees it (its own loopback address).
    let peer = ServeProcess::start(
        &gpunode_bin(),
        &tmp.path().join("peer"),
        &["--bootstrap".into(), daemon.addr.clone()],
    )
    .expect("peer");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let reach = loop {
        let list = checks(&gpunode(&dd, &["--config", cfg, "doctor", "--json"]));
        let reach = find(&list, "reachability").clone();
        // Until the peer's identify arrives the check says none has reported yet.
        let reported = reach["detail"]
            .as_str()
            .unwrap()
            .contains("peers see this node");
        if reported || std::time::Instant::now() > deadline {
            break reach;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    assert_eq!(reach["verdict"], "ok", "{reach}\n{}", daemon.log());
    assert!(
        reach["detail"]
            .as_str()
            .unwrap()
            .contains("/ip4/127.0.0.1/"),
        "{reach}"
    );
    let status = stdout(&gpunode(&dd, &["status"]));
    assert!(
        status.contains("Seen by peers:  /ip4/127.0.0.1/"),
        "{status}"
    );
    drop(peer);
    drop(daemon);
}

/// A network namespace with nothing but loopback (down), removed on drop.
struct Isolated(String);

impl Drop for Isolated {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

#[test]
fn doctor_without_a_route_names_the_missing_reachability_and_the_fix() {
    let ns = Isolated(format!("gpn-doctor-{}", std::process::id() % 100_000));
    let made = Command::new("ip")
        .args(["netns", "add", &ns.0])
        .output()
        .expect("run ip (iproute2)");
    assert!(
        made.status.success(),
        "ip netns add failed (this test needs root and iproute2): {}",
        String::from_utf8_lossy(&made.stderr)
    );
    let tmp = tempfile::tempdir().expect("tmp");
    let dd = tmp.path().join("node");
    let out = Command::new("ip")
        .args(["netns", "exec", &ns.0])
        .arg(gpunode_bin())
        .arg("--data-dir")
        .arg(&dd)
        .arg("doctor")
        .env_remove("GPUNODE_CONFIG")
        .env("XDG_CONFIG_HOME", tmp.path().join("xdg"))
        .output()
        .expect("run doctor in the namespace");
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("FAIL  network route: no network route besides loopback"),
        "{text}"
    );
    assert!(text.contains("fix: connect a network interface"), "{text}");
}
