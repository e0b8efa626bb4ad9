//! Container jobs through real `gpunode` processes: a provider that offers the container
//! backend (and lends its own system with `allow_host_env`), a requester daemon, and
//! `gpunode run --host-env` and `gpunode run --image` from the command line: live output,
//! output files, the task's exit code; a damaged image is refused with a reason.

use gpunode_e2e::{free_udp_port, gpunode, gpunode_bin, stderr, stdout};
use std::time::Duration;

use gpunode_procs::process::{ServeProcess, SIGINT};

#[test]
fn run_a_host_env_command_and_an_image_on_a_peer() {
    let tmp = tempfile::tempdir().expect("tmp");
    let bin = gpunode_bin();
    let config = tmp.path().join("provider.toml");
    std::fs::write(
        &config,
        "backends = [\"wasm\", \"container\"]\nallow_host_env = true\n",
    )
    .expect("config");
    // The default data dir of a root provider: ~/.local/share/gpunode under a 0700
    // home, made 0700 as `gpunode` makes it on first start. Container jobs, which run as
    // uids of their own, must still reach their directories, without the home or the
    // data dir being opened for them.
    let home = tmp.path().join("root-home");
    let provider_dir = home.join(".local/share/gpunode");
    std::fs::create_dir_all(&provider_dir).expect("mkdir");
    for dir in [&home, &provider_dir] {
        std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .expect("chmod");
    }
    let job_root = gpunode_node::data_dir::DataDir::new(&provider_dir).job_root();
    let _remove_job_root = RemoveOnDrop(job_root.clone());
    let listen = format!("/ip4/127.0.0.1/udp/{}/quic-v1", free_udp_port());
    let mut provider = ServeProcess::start(
        &bin,
        &provider_dir,
        &[
            "--listen".into(),
            listen,
            "--config".into(),
            config.display().to_string(),
        ],
    )
    .expect("provider");
    let mut requester = ServeProcess::start(
        &bin,
        &tmp.path().join("r"),
        &["--bootstrap".into(), provider.addr.clone()],
    )
    .expect("requester");

    let out_dir = tmp.path().join("out");
    let out = gpunode(
        &requester.data_dir,
        &[
            "run",
            "--host-env",
            "--peer",
            &provider.peer_id,
            "--output",
            out_dir.to_str().expect("utf8"),
            "--timeout",
            "1m",
            "--",
            "sh",
            "-c",
            "echo hello from the sandbox; echo result > /output/o.txt; exit 3",
        ],
    );
    assert_eq!(
        out.status.code(),
        Some(3),
        "the task's exit code: {}",
        stderr(&out)
    );
    assert_eq!(stdout(&out), "hello from the sandbox\n");
    assert!(stderr(&out).contains("exited 3"), "{}", stderr(&out));
    assert_eq!(
        std::fs::read_to_string(out_dir.join("o.txt")).expect("output file"),
        "result\n"
    );

    let image = tmp.path().join("shell.tar");
    gpunode_procs::images::shell_image(&image, &["/bin/sh", "-c", "echo the image says hi"])
        .expect("image");
    let out = gpunode(
        &requester.data_dir,
        &[
            "run",
            "--image",
            image.to_str().expect("utf8"),
            "--peer",
            &provider.peer_id,
            "--timeout",
            "1m",
            "--quiet",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), "the image says hi\n");

    let damaged = tmp.path().join("damaged.tar");
    std::fs::write(&damaged, b"this is not a tar archive at all").expect("write");
    let out = gpunode(
        &requester.data_dir,
        &[
            "run",
            "--image",
            damaged.to_str().expect("utf8"),
            "--peer",
            &provider.peer_id,
            "--timeout",
            "1m",
            "--",
            "true",
        ],
    );
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("the image cannot be used"),
        "{}",
        stderr(&out)
    );
    for node in [&mut requester, &mut provider] {
        let status = node.stop(SIGINT, Duration::from_secs(15)).expect("stop");
        assert!(
            status.is_some_and(|s| s.success()),
            "clean exit: {}",
            node.log()
        );
    }
    // Nothing of the operator's was opened to the job uids.
    for dir in [&home, &provider_dir] {
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(dir).expect("dir").permissions(),
        );
        assert_eq!(mode & 0o777, 0o700, "{}", dir.display());
    }
}

/// Removes a directory the test made outside its temporary one (a root provider's job
/// root under /var/lib/gpunode).
struct RemoveOnDrop(std::path::PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if self.0.starts_with(gpunode_node::data_dir::SYSTEM_JOB_ROOT) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}
