//! Bad input: each case gets a clear error, a non-zero exit code, and nothing is
//! overwritten or left behind.

use std::fs;

use gpunode_e2e::{gpunode, gpunode_bin, stderr, stdout};
use gpunode_procs::process::ServeProcess;

#[test]
fn malformed_bootstrap_address_is_refused_before_anything_is_created() {
    let tmp = tempfile::tempdir().expect("tmp");
    let d = tmp.path().join("d");
    let out = gpunode(&d, &["serve", "--no-mdns", "--bootstrap", "not-an-address"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("invalid bootstrap address 'not-an-address'"),
        "{err}"
    );
    assert!(err.contains("multiaddr"), "{err}");
    assert!(!d.join("identity.key").exists());
}

#[test]
fn port_in_use_is_a_clear_error() {
    let tmp = tempfile::tempdir().expect("tmp");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port();
    let d = tmp.path().join("d");
    let out = gpunode(
        &d,
        &[
            "serve",
            "--no-mdns",
            "--listen",
            &format!("/ip4/127.0.0.1/tcp/{port}"),
        ],
    );
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("cannot listen on") && err.contains("in use"),
        "{err}"
    );
    assert!(!d.join("api.sock").exists());
    // The identity made on this first start is kept for the next.
    assert!(d.join("identity.key").exists());
}

#[test]
fn corrupt_or_unreadable_key_is_named_and_kept() {
    let tmp = tempfile::tempdir().expect("tmp");
    let d = tmp.path().join("d");
    fs::create_dir_all(&d).expect("mkdir");
    fs::write(d.join("identity.key"), b"garbage").expect("write");
    for args in [&["id"][..], &["serve", "--no-mdns"][..]] {
        let out = gpunode(&d, args);
        assert_eq!(out.status.code(), Some(2));
        let err = stderr(&out);
        assert!(
            err.contains("identity.key") && err.contains("corrupt"),
            "{err}"
        );
    }
    assert_eq!(fs::read(d.join("identity.key")).expect("read"), b"garbage");

    // A key path that cannot be read at all (a directory here, since root reads anything).
    let d2 = tmp.path().join("d2");
    fs::create_dir_all(d2.join("identity.key")).expect("mkdir");
    let out = gpunode(&d2, &["id"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("cannot read identity key") && err.contains("identity.key"),
        "{err}"
    );
    assert!(d2.join("identity.key").is_dir());
}

#[test]
fn invalid_config_names_key_and_line() {
    let tmp = tempfile::tempdir().expect("tmp");
    let d = tmp.path().join("d");
    let cfg = tmp.path().join("config.toml");
    fs::write(&cfg, "mdns = false\nadvert_tll = \"5m\"\n").expect("write");
    let out = gpunode(&d, &["--config", cfg.to_str().expect("utf8"), "serve"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("advert_tll") && err.contains("line 2"),
        "{err}"
    );
    assert!(err.contains("config.toml"), "{err}");

    fs::write(&cfg, "mdns = false\nprice_per_gpu_hour = \"cheap\"\n").expect("write");
    let out = gpunode(&d, &["--config", cfg.to_str().expect("utf8"), "serve"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("line 2"), "{}", stderr(&out));

    fs::write(&cfg, "mdns = false\ndebt_limit = -3.0\n").expect("write");
    let out = gpunode(&d, &["--config", cfg.to_str().expect("utf8"), "serve"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("debt_limit"), "{}", stderr(&out));

    let out = gpunode(&d, &["--config", "/nonexistent/gpunode.toml", "serve"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("/nonexistent/gpunode.toml"));
    assert!(!d.join("identity.key").exists());
}

#[test]
fn bad_flags_and_second_daemon_are_refused() {
    let tmp = tempfile::tempdir().expect("tmp");
    let d = tmp.path().join("d");
    let out = gpunode(&d, &["serve", "--simulate-gpus", "3xA100"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("memory size"), "{}", stderr(&out));
    let out = gpunode(&d, &["offers", "--min-gpu-mem", "lots"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--min-gpu-mem"), "{}", stderr(&out));
    // Reservation times: unreadable, or in the past, are refused before any network.
    let out = gpunode(&d, &["reserve", "--at", "tomorrow", "--for", "1h"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("invalid --at") && stderr(&out).contains("YYYY-MM-DD HH:MM"),
        "{}",
        stderr(&out)
    );
    let out = gpunode(&d, &["reserve", "--at", "2020-01-01 10:00", "--for", "1h"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("not in the future"),
        "{}",
        stderr(&out)
    );

    let first = ServeProcess::start(&gpunode_bin(), &d, &[]).expect("first daemon");
    let out = gpunode(
        &d,
        &[
            "serve",
            "--no-mdns",
            "--listen",
            "/ip4/127.0.0.1/udp/0/quic-v1",
        ],
    );
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("in use") || err.contains("already running"),
        "{err}"
    );
    // The first one is unharmed.
    let st = gpunode(&d, &["status", "--json"]);
    assert!(st.status.success(), "{}", stderr(&st));
    assert!(stdout(&st).contains(&first.peer_id));
    // Dropping it stops the daemon and waits for it to exit.
    drop(first);
    // Without a daemon, status says so and exits non-zero.
    let st = gpunode(&d, &["status"]);
    assert_eq!(st.status.code(), Some(1));
    assert!(stdout(&st).contains("not running"));
}

#[test]
fn bad_run_flags_and_task_files_are_refused_before_any_lease() {
    let tmp = tempfile::tempdir().expect("tmp");
    let d = tmp.path().join("d");
    let task = tmp.path().join("t.wat");
    fs::write(&task, "(module (func (export \"_start\")))").expect("write");
    let task = task.to_str().expect("utf8");
    let cases: [(&[&str], &str); 15] = [
        (&["run", task, "--env", "NOEQUALS"], "expected NAME=VALUE"),
        (&["run", task, "--env", "=v"], "the name is empty"),
        (&["run", task, "--timeout", "0s"], "--timeout"),
        (&["run", task, "--timeout", "soon"], "invalid --timeout"),
        (&["run", task, "--mem", "lots"], "invalid --mem"),
        (&["run", "/nonexistent/task.wasm"], "does not exist"),
        (&["run", task, "--replicas", "0"], "--replicas"),
        (&["run", task, "--replicas", "two"], "--replicas"),
        (
            &["run", "--detach", task],
            "--detach needs a running daemon",
        ),
        (&["run"], "give a TASK file"),
        (
            &["run", task, "--host-env", "--", "sh"],
            "a container job takes no TASK",
        ),
        (
            &["run", "--backend", "container", "--", "sh"],
            "needs --image ARCHIVE",
        ),
        (&["run", "--host-env"], "--host-env needs a command"),
        (
            &["run", "--image", "/nonexistent/img.tar", "--", "sh"],
            "image archive /nonexistent/img.tar does not exist",
        ),
        (
            &["run", "--backend", "wasm", task, "--host-env"],
            "are for --backend container",
        ),
    ];
    for (args, expect) in cases {
        let out = gpunode(&d, args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        let err = stderr(&out);
        assert!(err.contains(expect), "{args:?}: {err}");
    }
    // Nothing was started: no identity, no store.
    assert!(!d.join("store").exists());
    let out = gpunode(&d, &["jobs"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("no gpunode daemon is running"));
}
