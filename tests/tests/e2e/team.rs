//! Private teams across real `gpunode` processes: create, invite and join on three
//! machines' worth of data dirs (and six more invited and joined back to back), run a
//! task inside the team, list members; bad tokens get clear errors and change nothing.

use std::time::Duration;

use gpunode_e2e::{gpunode, gpunode_bin, stderr, stdout, workspace_file};
use gpunode_procs::process::{ServeProcess, SIGINT};
use serde_json::Value;

fn ok(out: &std::process::Output) -> String {
    assert!(out.status.success(), "{}", stderr(out));
    stdout(out).trim().to_string()
}

fn refused(out: &std::process::Output, expect: &str) {
    assert_eq!(out.status.code(), Some(2), "{}", stderr(out));
    assert!(
        stderr(out).contains(expect),
        "expected '{expect}' in: {}",
        stderr(out)
    );
}

#[test]
fn create_invite_join_and_run_inside_a_team() {
    let tmp = tempfile::tempdir().expect("tmp");
    let bin = gpunode_bin();
    let (a, b, c, d) = (
        tmp.path().join("a"),
        tmp.path().join("b"),
        tmp.path().join("c"),
        tmp.path().join("d"),
    );
    let team_id = ok(&gpunode(&a, &["team", "create", "lab"]));
    assert_eq!(team_id.len(), 64);
    refused(
        &gpunode(&a, &["team", "create", "again"]),
        "already in team",
    );
    refused(
        &gpunode(&a, &["team", "invite"]),
        "needs the running daemon",
    );
    let mut pa = ServeProcess::start(&bin, &a, &[]).expect("a serves");

    let invite = |uses: &str| ok(&gpunode(&a, &["team", "invite", "--uses", uses]));
    let token_b = invite("1");
    assert!(token_b.starts_with("gpunode-invite-1:"));

    // Bad tokens: clear errors, nothing written.
    refused(
        &gpunode(&d, &["team", "join", "hello"]),
        "should start with",
    );
    refused(
        &gpunode(&d, &["team", "join", &token_b[..token_b.len() - 9]]),
        "copy it again",
    );
    let expired = ok(&gpunode(&a, &["team", "invite", "--expires", "1s"]));
    std::thread::sleep(Duration::from_millis(1500));
    refused(&gpunode(&d, &["team", "join", &expired]), "expired");
    assert!(!d.join("team").exists(), "failed joins change nothing");

    ok(&gpunode(&b, &["team", "join", &token_b]));
    refused(&gpunode(&d, &["team", "join", &token_b]), "used up");
    assert!(!d.join("team").exists());
    // Already in another team.
    ok(&gpunode(&d, &["team", "create", "other"]));
    let token_c = invite("1");
    refused(&gpunode(&d, &["team", "join", &token_c]), "already in team");

    ok(&gpunode(&c, &["team", "join", &token_c]));
    let mut pb = ServeProcess::start(&bin, &b, &[]).expect("b serves");
    let mut pc = ServeProcess::start(&bin, &c, &[]).expect("c serves");

    // A task from c runs on a team provider found through the team's DHT. Inside a team
    // a run waits for a provider by default; `--no-wait` fails at once instead, so the
    // loop's deadline bounds the whole wait (a member that never joined the network
    // fails the test instead of hanging it).
    let hello = workspace_file("examples/wat/hello.wat");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let out = loop {
        let out = gpunode(
            &c,
            &[
                "run",
                hello.to_str().expect("utf8"),
                "--no-wait",
                "--output",
                tmp.path().join("out").to_str().expect("utf8"),
            ],
        );
        if out.status.success() || std::time::Instant::now() > deadline {
            break out;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    assert_eq!(ok(&out), "hello from a gpunode sandbox");
    let err = stderr(&out);
    assert!(
        err.contains(&pa.peer_id[pa.peer_id.len() - 4..])
            || err.contains(&pb.peer_id[pb.peer_id.len() - 4..]),
        "ran on a team member: {err}"
    );

    let members: Value =
        serde_json::from_str(&ok(&gpunode(&a, &["team", "members", "--json"]))).expect("json");
    assert_eq!(members["team_id"], team_id.as_str());
    let list = members["members"].as_array().expect("members");
    assert_eq!(list.len(), 3, "{members}");
    for p in [&pa.peer_id, &pb.peer_id, &pc.peer_id] {
        assert!(
            list.iter().any(|m| m["peer_id"] == p.as_str()),
            "{p} listed"
        );
    }
    let status: Value =
        serde_json::from_str(&ok(&gpunode(&b, &["status", "--json"]))).expect("json");
    assert_eq!(status["team"], team_id.as_str());

    // Machines invited and joined back to back, as a script does: each join is answered
    // while the next invite is made, and that invite must not be undone by the set of
    // allowed peers worked out for the join before it.
    for i in 0..6 {
        let token = invite("1");
        ok(&gpunode(
            &tmp.path().join(format!("m{i}")),
            &["team", "join", &token],
        ));
    }

    for p in [&mut pa, &mut pb, &mut pc] {
        p.stop(SIGINT, Duration::from_secs(10)).expect("stops");
    }
    // With the daemons stopped, an admin still adds and revokes, straight in its files.
    let e = ok(&gpunode(&tmp.path().join("e"), &["id"]));
    ok(&gpunode(&a, &["team", "add", &e]));
    ok(&gpunode(&a, &["team", "revoke", &pc.peer_id]));
    refused(&gpunode(&a, &["team", "revoke", "bob"]), "is not a peer id");
    refused(&gpunode(&b, &["team", "add", &e]), "only a team admin");
    let members: Value =
        serde_json::from_str(&ok(&gpunode(&a, &["team", "members", "--json"]))).expect("json");
    let list = members["members"].as_array().expect("members");
    assert!(list.iter().any(|m| m["peer_id"] == e.as_str()));
    assert!(list
        .iter()
        .any(|m| m["peer_id"] == pc.peer_id.as_str() && m["revoked"] == true));

    ok(&gpunode(&c, &["team", "leave"]));
    refused(&gpunode(&c, &["team", "members"]), "in no team");
}
