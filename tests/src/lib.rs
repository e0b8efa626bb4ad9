//! Helpers for process-level tests: find (or build) the real `gpunode` binary and run
//! it with temporary data dirs.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::OnceLock;

/// Path of the `gpunode` binary of this workspace's target dir, built if out of date.
pub fn gpunode_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let exe = std::env::current_exe().expect("test exe path");
        // target/<profile>/deps/<test> -> target/<profile>/gpunode
        let profile_dir = exe
            .parent()
            .and_then(|p| p.parent())
            .expect("target profile dir")
            .to_path_buf();
        // `cargo test` builds only the binaries of packages that have tests, so build
        // (or confirm up to date) the real binary once per test process.
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut build = Command::new(cargo);
        build.args(["build", "-p", "gpunode"]);
        if profile_dir.ends_with("release") {
            build.arg("--release");
        }
        let status = build.status().expect("run cargo build");
        assert!(status.success(), "cargo build -p gpunode failed");
        profile_dir.join("gpunode")
    })
    .clone()
}

/// Path of the example task `examples/checksum` built for wasm32-wasip1 (release),
/// built if out of date. Needs the target (`scripts/install-deps.sh` adds it).
pub fn example_checksum_wasm() -> PathBuf {
    static WASM: OnceLock<PathBuf> = OnceLock::new();
    WASM.get_or_init(|| {
        let exe = std::env::current_exe().expect("test exe path");
        let target_dir = exe
            .parent()
            .and_then(|p| p.parent())
            .and_then(|p| p.parent())
            .expect("target dir")
            .to_path_buf();
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = Command::new(cargo)
            .args([
                "build",
                "-p",
                "gpunode-example-checksum",
                "--release",
                "--target",
                "wasm32-wasip1",
            ])
            .status()
            .expect("run cargo build");
        assert!(
            status.success(),
            "building the example task failed (is the wasm32-wasip1 target installed? run scripts/install-deps.sh)"
        );
        target_dir.join("wasm32-wasip1/release/checksum.wasm")
    })
    .clone()
}

/// Path of a file in the workspace, from its root.
pub fn workspace_file(rel: &str) -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .join(rel)
}

/// A UDP port on 127.0.0.1 that was free a moment ago (for `--listen .../quic-v1`).
pub fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// Runs `gpunode --data-dir DIR ARGS...` to completion.
pub fn gpunode(data_dir: &std::path::Path, args: &[&str]) -> Output {
    Command::new(gpunode_bin())
        .arg("--data-dir")
        .arg(data_dir)
        .args(args)
        .env_remove("GPUNODE_CONFIG")
        .env("XDG_CONFIG_HOME", data_dir.join("xdg-config"))
        .output()
        .expect("run gpunode")
}

/// Text of a process's stderr.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Text of a process's stdout.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A child process killed (and reaped) on drop, so a failed assertion leaves none behind.
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
