//! Members behind NAT, in a lab of network namespaces this test builds and removes
//! ([`gpunode_procs::netlab`]): a team member with a public address, two members behind
//! endpoint-independent NATs and one behind a symmetric NAT.
//!
//! Members behind the endpoint-independent NATs reserve a slot on the public member's
//! relay, meet through it, punch a hole (DCUtR) and run a job over the direct
//! connection. From behind the symmetric NAT the punch fails: the job is refused with
//! the fix named, and runs over the relay once relayed data is allowed.

use std::process::Output;
use std::time::{Duration, Instant};

use gpunode_e2e::{gpunode_bin, stderr, stdout, workspace_file};
use gpunode_procs::netlab::{Nat, TeamLab, LAB_PORT, WAN};
use gpunode_procs::process::ServeProcess;
use serde_json::Value;

fn ok(out: &Output) -> String {
    assert!(out.status.success(), "{}", stderr(out));
    stdout(out).trim().to_string()
}

fn wait_for(what: &str, bound: Duration, logs: &[&ServeProcess], mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + bound;
    while !check() {
        if Instant::now() > deadline {
            let logs: Vec<String> = logs.iter().map(|p| p.log()).collect();
            panic!("not within {bound:?}: {what}\n{}", logs.join("\n-----\n"));
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}

#[test]
fn members_behind_nat_punch_through_and_relay_only_when_allowed() {
    let tmp = tempfile::tempdir().expect("tmp");
    let hosts = [
        ("a", Nat::EndpointIndependent),
        ("b", Nat::EndpointIndependent),
        ("c", Nat::Symmetric),
    ];
    let mut team = TeamLab::start(&gpunode_bin(), tmp.path(), &hosts).expect("lab");
    // c also asks for a UPnP mapping: the lab has no such router, and says so.
    let upnp = tmp.path().join("upnp.toml");
    std::fs::write(&upnp, "upnp = true\nmax_connections_per_ip = 0\n").expect("config");
    for (name, _) in hosts {
        let extra = match name {
            "c" => vec!["--config".to_string(), upnp.display().to_string()],
            _ => Vec::new(),
        };
        team.start_member(name, LAB_PORT, &extra)
            .expect("member serves");
    }
    let status = |name: &str| -> Value {
        serde_json::from_str(&ok(&team.cli(name, &["status", "--json"]).expect("status")))
            .expect("status json")
    };
    let link_to = |name: &str, peer: &str| -> Option<Value> {
        status(name)["connections"]
            .as_array()?
            .iter()
            .find(|c| c["peer_id"] == peer)
            .cloned()
    };
    let public_id = team.public.peer_id.clone();
    // Behind NAT, each reserves a slot on the public member's relay.
    for (name, _) in hosts {
        let m = team.member(name).expect("serving");
        wait_for(
            "a member behind NAT is relayed by the public member",
            Duration::from_secs(40),
            &[m, &team.public],
            || {
                status(name)["reachability"]
                    .as_str()
                    .is_some_and(|r| r.contains("relayed via") && r.contains(&public_id))
            },
        );
    }
    let public = status("pub");
    assert!(
        public["reachability"]
            .as_str()
            .is_some_and(|r| r.starts_with("public")),
        "{public}"
    );
    let a = team.member("a").expect("a").peer_id.clone();
    let hello = workspace_file("examples/wat/hello.wat");
    let hello = hello.to_str().expect("utf8");
    let out = tmp.path().join("out");
    let out = out.to_str().expect("utf8");

    // b -> a: both NATs keep ports, the punch succeeds, the job's data goes direct.
    let ran = team
        .cli("b", &["run", "--peer", &a, hello, "--output", out])
        .expect("run");
    assert_eq!(ok(&ran), "hello from a gpunode sandbox", "{}", stderr(&ran));
    let link = link_to("b", &a).expect("b is connected to a");
    assert_eq!(link["path"], "direct", "{link}");
    let addr = link["address"].as_str().unwrap_or_default();
    assert!(
        addr.starts_with(&format!("/ip4/{WAN}.11/")) && !addr.contains("p2p-circuit"),
        "the direct connection goes to a's NAT: {link}"
    );

    // c -> a: the symmetric NAT defeats the punch; relayed data is refused with the fix.
    let refused = team
        .cli("c", &["run", "--peer", &a, hello, "--output", out])
        .expect("run");
    assert!(!refused.status.success(), "{}", stdout(&refused));
    let why = stderr(&refused);
    if !(why.contains("only through a team relay") && why.contains("--allow-relayed-data")) {
        let logs: Vec<String> = ["c", "a"]
            .iter()
            .map(|m| team.member(m).map(|p| p.log()).unwrap_or_default())
            .collect();
        panic!("{why}\n{}", logs.join("\n-----\n"));
    }
    let link = link_to("c", &a).expect("c is connected to a");
    assert_eq!(link["path"], "relayed", "{link}");
    // `gpunode why` on the refused job gives the same reason.
    let jobs: Value = serde_json::from_str(&ok(&team.cli("c", &["jobs", "--json"]).expect("jobs")))
        .expect("jobs json");
    let failed = jobs
        .as_array()
        .and_then(|js| js.iter().find(|j| j["state"] == "failed"))
        .and_then(|j| j["job_id"].as_str())
        .unwrap_or_else(|| panic!("c has no failed job: {jobs}"))
        .to_string();
    let explained = ok(&team.cli("c", &["why", &failed]).expect("why"));
    assert!(
        explained.contains("could not run") && explained.contains("--allow-relayed-data"),
        "{explained}"
    );
    // Allowed, the same job runs through the relay.
    let ran = team
        .cli(
            "c",
            &[
                "run",
                "--allow-relayed-data",
                "--peer",
                &a,
                hello,
                "--output",
                out,
            ],
        )
        .expect("run");
    assert_eq!(ok(&ran), "hello from a gpunode sandbox", "{}", stderr(&ran));
    // Refusing relayed data costs the provider nothing in c's eyes.
    let peers: Value =
        serde_json::from_str(&ok(&team.cli("c", &["peers", "--json"]).expect("peers")))
            .expect("json");
    let failures: u64 = peers
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["peer_id"] == a.as_str())
        .map(|r| r["failures"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(failures, 0, "{peers}");
    let c_log = team.member("c").expect("c").log();
    assert!(c_log.contains("UPnP: no router offers it here"), "{c_log}");
    team.stop();
}
