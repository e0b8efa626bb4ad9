//! Networks of real `gpunode serve` processes, for demos and process-level checks.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// SIGINT, as Ctrl-C sends.
pub const SIGINT: i32 = 2;
/// SIGTERM, as service managers send.
pub const SIGTERM: i32 = 15;
/// SIGKILL: a crash, as far as the node can tell.
pub const SIGKILL: i32 = 9;

/// A running `gpunode serve` process; stopped with SIGINT when dropped.
pub struct ServeProcess {
    child: Child,
    /// Its data directory.
    pub data_dir: PathBuf,
    /// Its peer id.
    pub peer_id: String,
    /// The first address it listens on (QUIC or TCP), with `/p2p/PEER_ID`.
    pub addr: String,
    log: PathBuf,
}

impl ServeProcess {
    /// Starts `gpunode serve` on a free loopback port with the given extra arguments and
    /// waits until it listens.
    pub fn start(binary: &Path, data_dir: &Path, extra: &[String]) -> Result<ServeProcess> {
        ServeProcess::start_opts(binary, data_dir, extra, false)
    }

    /// Like [`ServeProcess::start`], with LAN discovery by mDNS left on when `mdns` is set.
    pub fn start_opts(
        binary: &Path,
        data_dir: &Path,
        extra: &[String],
        mdns: bool,
    ) -> Result<ServeProcess> {
        std::fs::create_dir_all(data_dir)?;
        let id = Command::new(binary)
            .arg("--data-dir")
            .arg(data_dir)
            .arg("id")
            .output()
            .context("cannot run gpunode id")?;
        let peer_id = String::from_utf8(id.stdout)?.trim().to_string();
        let log = data_dir.join("serve.log");
        // Every process of a test network dials from 127.0.0.1: no per-address limit;
        // each dashboard on a port of its own (a `--config` in `extra` takes precedence
        // over this).
        let config = data_dir.join("testnet.toml");
        std::fs::write(
            &config,
            "max_connections_per_ip = 0\ndashboard_addr = \"127.0.0.1:0\"\n",
        )?;
        let child = Command::new(binary)
            .env("GPUNODE_CONFIG", &config)
            .arg("--data-dir")
            .arg(data_dir)
            .arg("serve")
            .args(if mdns { &[][..] } else { &["--no-mdns"][..] })
            .args(if extra.iter().any(|a| a == "--listen") {
                &[][..]
            } else {
                &["--listen", "/ip4/127.0.0.1/udp/0/quic-v1"][..]
            })
            .args(extra)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .context("cannot start gpunode serve")?;
        let mut p = ServeProcess {
            child,
            data_dir: data_dir.to_path_buf(),
            peer_id,
            addr: String::new(),
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let text = std::fs::read_to_string(&p.log).unwrap_or_default();
            if let Some(addr) = text.split_whitespace().find(|w| {
                (w.starts_with("/ip4/127.0.0.1/udp/") && w.ends_with("/quic-v1"))
                    || w.starts_with("/ip4/127.0.0.1/tcp/")
            }) {
                p.addr = format!("{addr}/p2p/{}", p.peer_id);
                return Ok(p);
            }
            if let Some(status) = p.child.try_wait()? {
                bail!("gpunode serve exited with {status}: {text}");
            }
            if Instant::now() > deadline {
                bail!("gpunode serve did not listen within 20s: {text}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What the process logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends `signal` and waits up to `timeout` for the exit status.
    pub fn stop(
        &mut self,
        signal: i32,
        timeout: Duration,
    ) -> Result<Option<std::process::ExitStatus>> {
        if let Some(status) = self.child.try_wait()? {
            return Ok(Some(status));
        }
        let _ = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.child.id().to_string())
            .status();
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                return Ok(Some(status));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(None)
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.stop(SIGINT, Duration::from_secs(5));
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
