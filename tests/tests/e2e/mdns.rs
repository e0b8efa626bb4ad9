//! LAN discovery: two `gpunode serve` processes on a private two-host network (two
//! network namespaces joined by a veth pair, made and removed by this test) find each
//! other by mDNS alone, with no bootstrap address.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::{Duration, Instant};

use gpunode_e2e::{gpunode, gpunode_bin, stderr, stdout};
use gpunode_procs::process::ServeProcess;
use serde_json::Value;

/// Two namespaces and the veth between them; removed on drop.
struct TwoHosts {
    names: [String; 2],
}

fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .expect("run ip (iproute2)");
    assert!(
        out.status.success(),
        "ip {} failed (this test needs root and iproute2): {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl TwoHosts {
    fn new() -> TwoHosts {
        let tag = std::process::id() % 100_000;
        let names = [format!("gpn-mdns-a-{tag}"), format!("gpn-mdns-b-{tag}")];
        let (va, vb) = (format!("gma{tag}"), format!("gmb{tag}"));
        let hosts = TwoHosts { names };
        let [a, b] = &hosts.names;
        ip(&["netns", "add", a]);
        ip(&["netns", "add", b]);
        ip(&[
            "link", "add", &va, "netns", a, "type", "veth", "peer", "name", &vb, "netns", b,
        ]);
        ip(&["-n", a, "addr", "add", "10.77.0.1/24", "dev", &va]);
        ip(&["-n", b, "addr", "add", "10.77.0.2/24", "dev", &vb]);
        for (ns, dev) in [(a, &va), (b, &vb)] {
            ip(&["-n", ns, "link", "set", "lo", "up"]);
            ip(&["-n", ns, "link", "set", dev, "up"]);
        }
        hosts
    }

    /// A script that runs the gpunode binary inside namespace `i`.
    fn launcher(&self, i: usize, dir: &std::path::Path) -> std::path::PathBuf {
        let path = dir.join(format!("gpunode-in-{i}.sh"));
        let script = format!(
            "#!/bin/sh\nexec ip netns exec {} {} \"$@\"\n",
            self.names[i],
            gpunode_bin().display()
        );
        std::fs::write(&path, script).expect("write launcher");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        path
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

#[test]
fn nodes_on_a_lan_find_each_other_by_mdns() {
    let tmp = tempfile::tempdir().expect("tmp");
    let hosts = TwoHosts::new();
    let listen = [
        "--listen".to_string(),
        "/ip4/0.0.0.0/udp/0/quic-v1".to_string(),
    ];
    let a = ServeProcess::start_opts(
        &hosts.launcher(0, tmp.path()),
        &tmp.path().join("a"),
        &[
            &listen[..],
            &["--simulate-gpus".into(), "1xA100-80GB".into()],
        ]
        .concat(),
        true,
    )
    .expect("node a");
    let b = ServeProcess::start_opts(
        &hosts.launcher(1, tmp.path()),
        &tmp.path().join("b"),
        &[&listen[..], &["--simulate-gpus".into(), "1xT4-16GB".into()]].concat(),
        true,
    )
    .expect("node b");
    // No bootstrap anywhere: each must learn of the other on the LAN.
    for (me, other, model) in [(&a, &b, "T4-16GB"), (&b, &a, "A100-80GB")] {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let out = gpunode(&me.data_dir, &["offers", "--json"]);
            assert!(out.status.success(), "{}", stderr(&out));
            let offers: Vec<Value> = serde_json::from_str(&stdout(&out)).expect("json");
            if offers
                .iter()
                .any(|o| o["peer_id"] == other.peer_id.as_str() && o["gpus"][0]["model"] == model)
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "no mDNS discovery within 30s: {offers:?}\n{}",
                me.log()
            );
            std::thread::sleep(Duration::from_millis(300));
        }
    }
}
