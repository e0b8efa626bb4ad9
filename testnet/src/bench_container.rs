//! What the container sandbox costs to start: `true` run plainly, under bubblewrap on
//! the host's system directories (`--host-env`), and under bubblewrap on an unpacked
//! image, each to its exit. The difference is the price of the namespaces, mounts,
//! cgroups and uid switch every container job pays once.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use gpunode_sandbox::container::image::ImageCache;
use gpunode_sandbox::container::{
    ContainerConfig, ContainerExecutor, ContainerLimits, ContainerSpec, PauseToken, Root,
};
use gpunode_sandbox::{CancelToken, Outcome};
use serde::Serialize;

/// One way of starting `true`, over `runs` runs.
#[derive(Debug, Serialize)]
pub struct StartReport {
    /// `plain`, `host-env` or `image`.
    pub how: String,
    /// Median wall time from spawn to exit, ms.
    pub median_ms: f64,
    /// 95th percentile, ms.
    pub p95_ms: f64,
    /// Runs.
    pub runs: usize,
}

fn report(how: &str, mut times: Vec<Duration>) -> StartReport {
    times.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    StartReport {
        how: how.into(),
        median_ms: ms(times[times.len() / 2]),
        p95_ms: ms(times[(times.len() * 95 / 100).min(times.len() - 1)]),
        runs: times.len(),
    }
}

/// Runs the three ways `runs` times each.
pub fn container_start(runs: usize) -> Result<Vec<StartReport>> {
    let runs = runs.max(1);
    let dir = tempfile::tempdir()?;
    let exec = ContainerExecutor::new(ContainerConfig::detect().context("bubblewrap")?);
    let archive = dir.path().join("shell.tar");
    crate::images::shell_image(&archive, &["/bin/sh", "-c", "true"])?;
    let cache = ImageCache::new(&dir.path().join("images"), 1 << 30)?;
    let (rootfs, config) = cache
        .rootfs(&archive, "bench")
        .context("unpacking the image")?;
    let mut out = Vec::new();

    let mut plain = Vec::new();
    for _ in 0..runs {
        let t = Instant::now();
        let status = std::process::Command::new("/bin/sh")
            .args(["-c", "true"])
            .status()?;
        anyhow::ensure!(status.success(), "sh -c true failed");
        plain.push(t.elapsed());
    }
    out.push(report("plain", plain));

    for (how, root, command) in [
        ("host-env", Root::HostEnv, vec!["true".to_string()]),
        ("image", Root::Image { rootfs, config }, Vec::new()),
    ] {
        let mut times = Vec::new();
        for _ in 0..runs {
            let job = tempfile::tempdir()?;
            let output = job.path().join("out");
            std::fs::create_dir(&output)?;
            let spec = ContainerSpec {
                root: root.clone(),
                command: command.clone(),
                env: Vec::new(),
                input_dir: None,
                output_dir: output,
                gpus: Vec::new(),
                limits: ContainerLimits::default(),
                stdout: Box::new(|_| {}),
                stderr: Box::new(|_| {}),
                cancel: CancelToken::new(),
                pause: PauseToken::new(),
                on_start: None,
            };
            let t = Instant::now();
            let outcome = exec.run(spec)?;
            anyhow::ensure!(outcome == Outcome::Exited(0), "{how}: {outcome:?}");
            times.push(t.elapsed());
        }
        out.push(report(how, times));
    }
    Ok(out)
}
