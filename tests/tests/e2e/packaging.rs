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
