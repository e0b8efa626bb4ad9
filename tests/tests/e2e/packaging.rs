//! What a package installs besides the binary: shell completions and man pages, both
//! generated from the flags' own definitions.

use std::process::Command;

use gpunode_e2e::{gpunode_bin, stderr, stdout};

fn run(args: &[&str]) -> std::process::Output {
    Command::new(gpunode_bin())
        .args(args)
        .output()
        .expect("run gpunode")
}

#[test]
fn completions_for_each_shell_name_every_command() {
    for shell in ["bash", "zsh", "fish"] {
        let out = run(&["completions", shell]);
        assert!(out.status.success(), "{shell}: {}", stderr(&out));
        let script = stdout(&out);
        for word in ["serve", "doctor", "reservations", "gpu-model"] {
            assert!(script.contains(word), "{shell} completion lacks {word}");
        }
    }
    // The bash script parses.
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("gpunode.bash");
    std::fs::write(&path, run(&["completions", "bash"]).stdout).expect("write");
    let check = Command::new("bash")
        .arg("-n")
        .arg(&path)
        .output()
        .expect("bash");
    assert!(check.status.success(), "{}", stderr(&check));
    // An unknown shell is refused with the list of known ones.
    let out = run(&["completions", "tcsh"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("possible values"), "{}", stderr(&out));
}

#[test]
fn man_pages_cover_every_subcommand() {
    let out = run(&["man"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains(".TH gpunode 1"), "{}", stdout(&out));
    let dir = tempfile::tempdir().expect("tmp");
    let pages = dir.path().join("man1");
    let out = run(&["man", "--dir", pages.to_str().expect("utf-8")]);
    assert!(out.status.success(), "{}", stderr(&out));
    for page in [
        "gpunode.1",
        "gpunode-serve.1",
        "gpunode-doctor.1",
        "gpunode-team-join.1",
        "gpunode-reservations-cancel.1",
    ] {
        let text =
            std::fs::read_to_string(pages.join(page)).unwrap_or_else(|e| panic!("{page}: {e}"));
        assert!(text.contains(".TH"), "{page}");
    }
    let serve = std::fs::read_to_string(pages.join("gpunode-serve.1")).expect("serve page");
    assert!(serve.contains("simulate"), "the serve page lists its flags");
}

#[test]
fn serve_tells_systemd_when_ready_and_when_stopping_and_leaves_time_stamps_to_the_journal() {
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::net::UnixDatagram;
    use std::time::Duration;

    let tmp = tempfile::tempdir().expect("tmp");
    let socket = tmp.path().join("notify");
    let manager = UnixDatagram::bind(&socket).expect("bind the notify socket");
    manager
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    // stderr is "the journal's stream": JOURNAL_STREAM names its device and inode.
    let log_path = tmp.path().join("journal.log");
    let log = std::fs::File::create(&log_path).expect("log");
    let meta = log.metadata().expect("meta");
    let node = tmp.path().join("node");
    let mut child = gpunode_e2e::KillOnDrop(
        Command::new(gpunode_bin())
            .arg("--data-dir")
            .arg(&node)
            .args([
                "serve",
                "--no-mdns",
                "--listen",
                "/ip4/127.0.0.1/udp/0/quic-v1",
            ])
            .env("NOTIFY_SOCKET", &socket)
            .env("JOURNAL_STREAM", format!("{}:{}", meta.dev(), meta.ino()))
            .env_remove("GPUNODE_CONFIG")
            .env("XDG_CONFIG_HOME", tmp.path().join("xdg"))
            .stderr(log)
            .spawn()
            .expect("serve"),
    );
    let mut buf = [0u8; 512];
    let n = manager.recv(&mut buf).expect("READY within 30 s");
    let ready = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(
        ready.starts_with("READY=1\nSTATUS=serving as 12D3"),
        "{ready}"
    );
    // Ready means ready: the local API answers.
    let status = gpunode_e2e::gpunode(&node, &["status", "--json"]);
    assert!(status.status.success(), "{}", stderr(&status));

    let term = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .expect("kill");
    assert!(term.success());
    let n = manager.recv(&mut buf).expect("STOPPING within 30 s");
    assert_eq!(&buf[..n], b"STOPPING=1");
    let exit = child.0.wait().expect("exit");
    assert!(exit.success(), "{exit}");

    let journal = std::fs::read_to_string(&log_path).expect("log");
    let first = journal.lines().next().expect("a log line");
    assert!(
        !first.trim_start().starts_with("20"),
        "the journal adds the time; gpunode should not: {first}"
    );
    assert!(first.contains("INFO"), "{first}");
}

#[test]
fn the_systemd_unit_is_valid_and_runs_serve_as_a_notify_service_with_delegated_cgroups() {
    let unit = std::fs::read_to_string(gpunode_e2e::workspace_file("packaging/gpunode.service"))
        .expect("packaging/gpunode.service");
    for line in [
        "Type=notify",
        "Delegate=yes",
        "ExecStart=/usr/bin/gpunode serve",
        "User=gpunode",
        "StateDirectory=gpunode",
        "StateDirectoryMode=0700",
        "Environment=GPUNODE_DATA_DIR=/var/lib/gpunode",
    ] {
        assert!(unit.lines().any(|l| l == line), "the unit lacks {line}");
    }
    // What would break bubblewrap or GPU jobs is absent.
    for key in [
        "PrivateDevices=",
        "RestrictNamespaces=",
        "PrivateUsers=",
        "ProtectControlGroups=",
    ] {
        assert!(
            !unit.lines().any(|l| l.starts_with(key)),
            "{key} breaks jobs"
        );
    }
    // systemd's own check, with the binary built here in place of /usr/bin/gpunode.
    let Ok(analyze) = which("systemd-analyze") else {
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    let local = unit
        .replace("/usr/bin/gpunode", &gpunode_bin().display().to_string())
        .lines()
        .filter(|l| !l.starts_with("Documentation="))
        .collect::<Vec<_>>()
        .join("\n");
    let path = dir.path().join("gpunode.service");
    std::fs::write(&path, local).expect("write");
    let out = Command::new(analyze)
        .arg("verify")
        .arg(&path)
        .current_dir(dir.path())
        .output()
        .expect("systemd-analyze");
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "{}",
        stderr(&out)
    );
}

fn which(name: &str) -> Result<std::path::PathBuf, ()> {
    std::env::var_os("PATH")
        .and_then(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join(name))
                .find(|f| f.is_file())
        })
        .ok_or(())
}
