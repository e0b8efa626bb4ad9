//! Small pieces every command uses: the config file, logging, flag parsing with the
//! flag's name in the error, JSON on stdout, and ids made safe for an API path.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use gpunode_node::{DataDir, NodeConfig};
use gpunode_protocol::team::JobKind;
use gpunode_protocol::units::{parse_bytes, parse_duration};

/// The config file given with `--config` (which must exist), else the default one if
/// it exists, else the defaults.
pub fn load_config(path: Option<&Path>) -> Result<NodeConfig> {
    Ok(match path {
        Some(path) => NodeConfig::load(path, true)?,
        None => match DataDir::default_config_file() {
            Some(path) => NodeConfig::load(&path, false)?,
            None => NodeConfig::default(),
        },
    })
}

/// Logs to stderr at `filter` unless `RUST_LOG` says otherwise.
pub fn init_logging(filter: &str) {
    // Kademlia warns about bootstrapping while a node has no peers yet; that is normal.
    let filter = std::env::var("RUST_LOG")
        .unwrap_or_else(|_| format!("{filter},libp2p_kad=error,libp2p_mdns=warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&filter)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    // The journal stamps each line itself.
    let _ = if crate::systemd::logging_to_journal() {
        builder.without_time().try_init()
    } else {
        builder.try_init()
    };
}

/// This binary, which doubles as the sandbox worker; `None` (guests on threads) if
/// its path cannot be found.
pub fn wasm_worker() -> Option<PathBuf> {
    std::env::current_exe().ok()
}

/// Pretty JSON and a newline on stdout.
pub fn print_json<T: serde::Serialize>(value: &T) -> Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, value)?;
    writeln!(out)?;
    Ok(())
}

/// A size flag such as `--mem 2G`, in bytes.
pub fn parse_size(flag: &str, v: &str) -> Result<u64> {
    parse_bytes(v).map_err(|e| anyhow::anyhow!("invalid --{flag}: {e}"))
}

/// An optional size flag such as `--min-gpu-mem 24G`, in bytes.
pub fn parse_size_opt(flag: &str, v: Option<&str>) -> Result<Option<u64>> {
    v.map(|v| parse_size(flag, v)).transpose()
}

/// A duration flag such as `--timeout 10m`.
pub fn parse_time(flag: &str, v: &str) -> Result<Duration> {
    parse_duration(v).map_err(|e| anyhow::anyhow!("invalid --{flag}: {e}"))
}

/// `--batch` as a job kind.
pub fn job_kind(batch: bool) -> JobKind {
    if batch {
        JobKind::Batch
    } else {
        JobKind::Interactive
    }
}

/// An id (or prefix) with everything but letters and digits removed, for an API path.
pub fn url_segment(id: &str) -> String {
    id.chars().filter(|c| c.is_ascii_alphanumeric()).collect()
}

/// `p` as an absolute path, against the current directory.
pub fn absolute(p: &Path) -> Result<PathBuf> {
    if p.is_absolute() {
        return Ok(p.to_path_buf());
    }
    Ok(std::env::current_dir()
        .context("cannot read the current directory")?
        .join(p))
}
