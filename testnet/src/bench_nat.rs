//! NAT benchmark (`testnet bench nat`, root only), in a team of `gpunode serve`
//! processes in a [`crate::netlab`] lab: a public member, a provider `a` and a requester
//! `b` behind endpoint-independent NATs, a requester `c` behind a symmetric NAT.
//!
//! - Time from starting `a` and `b` to the first successful `gpunode run` from `b` on
//!   `a` (reservations on the relay, the relayed meeting, the punch, the job).
//! - Hole-punch success over `attempts` per NAT type: the requester restarts on a new
//!   port each time (new NAT mappings), runs a job on `a` through the relay, and its log
//!   says whether the punch that followed succeeded.
//! - A job input's transfer rate from `b` (direct after the punch) and from `c`
//!   (through the team relay), fresh random bytes each run so nothing is cached.
//!
//! With `GPUNODE_LAB_KEEP` set, the lab's directory (every member's `serve.log`, and
//! `b/first.log` from before `b` restarts) is kept and its path printed; with
//! `GPUNODE_LAB_LOG` the members log at that `RUST_LOG` level.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use crate::netlab::{Nat, TeamLab, LAB_PORT};

/// Result of `nat`.
#[derive(Debug, Clone, Serialize)]
pub struct NatReport {
    /// From starting the two members to the first job done between them, ms.
    pub first_run_ms: f64,
    /// Punches per NAT type.
    pub punches: Vec<PunchReport>,
    /// Bytes of each transfer.
    pub transfer_bytes: u64,
    /// Median job-input rate over the direct (punched) connection, MB/s.
    pub direct_mb_s: f64,
    /// Median job-input rate through the team relay, MB/s.
    pub relayed_mb_s: f64,
}

/// Hole punches from behind one kind of NAT.
#[derive(Debug, Clone, Serialize)]
pub struct PunchReport {
    /// The requester's NAT.
    pub nat: String,
    /// Attempts made.
    pub attempts: usize,
    /// Punches that gave a direct connection.
    pub succeeded: usize,
    /// `succeeded / attempts`.
    pub success_rate: f64,
}

/// Runs the benchmark with `gpunode` at `binary`.
pub fn nat(binary: &Path, attempts: usize, transfer_bytes: u64, runs: usize) -> Result<NatReport> {
    let mut tmp = tempfile::Builder::new().prefix("bench-nat").tempdir()?;
    if std::env::var_os("GPUNODE_LAB_KEEP").is_some() {
        // To read the members' logs afterwards.
        tmp.disable_cleanup(true);
        eprintln!("keeping the lab's files in {}", tmp.path().display());
    }
    let hosts = [
        ("a", Nat::EndpointIndependent),
        ("b", Nat::EndpointIndependent),
        ("c", Nat::Symmetric),
    ];
    let mut team = TeamLab::start(binary, tmp.path(), &hosts)?;
    let hello = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/wat/hello.wat");
    let hello = hello.to_str().context("path")?.to_string();
    let out = tmp.path().join("out").display().to_string();

    let started = Instant::now();
    team.start_member("a", LAB_PORT, &[])?;
    team.start_member("b", LAB_PORT, &[])?;
    let a = team.member("a").context("a")?.peer_id.clone();
    run_until_done(
        &team,
        "b",
        &["run", "--quiet", "--peer", &a, &hello, "--output", &out],
        Duration::from_secs(120),
    )?;
    let first_run_ms = started.elapsed().as_secs_f64() * 1000.0;
    if std::env::var_os("GPUNODE_LAB_KEEP").is_some() {
        // `b` restarts below, which starts its log afresh.
        std::fs::copy(
            tmp.path().join("b/serve.log"),
            tmp.path().join("b/first.log"),
        )?;
    }

    let mut punches = Vec::new();
    for (name, nat) in [("b", "endpoint-independent"), ("c", "symmetric")] {
        let mut succeeded = 0;
        for _ in 0..attempts {
            if punch(&mut team, name, &a, &hello, &out)? {
                succeeded += 1;
            }
        }
        punches.push(PunchReport {
            nat: nat.to_string(),
            attempts,
            succeeded,
            success_rate: succeeded as f64 / attempts.max(1) as f64,
        });
    }

    team.start_member("b", LAB_PORT, &[])?;
    team.start_member("c", LAB_PORT, &[])?;
    let mut rates = Vec::new();
    for (name, extra) in [("b", None), ("c", Some("--allow-relayed-data"))] {
        let mut each = Vec::new();
        for i in 0..runs.max(1) + 1 {
            let input = tmp.path().join(format!("input-{name}-{i}"));
            random_file(&input, transfer_bytes)?;
            let input = input.display().to_string();
            let mut args = vec!["run", "--quiet", "--peer", &a, "--input", &input];
            args.extend(extra);
            args.extend([hello.as_str(), "--output", &out]);
            let t = Instant::now();
            let o = team.cli(name, &args)?;
            let secs = t.elapsed().as_secs_f64();
            if !o.status.success() {
                bail!(
                    "transfer from {name} failed: {}",
                    String::from_utf8_lossy(&o.stderr)
                );
            }
            // The first run also makes the connection and punches: not timed.
            if i > 0 {
                each.push(transfer_bytes as f64 / secs / 1e6);
            }
        }
        each.sort_by(f64::total_cmp);
        rates.push(crate::bench::percentile(&each, 0.5));
    }
    team.stop();
    Ok(NatReport {
        first_run_ms,
        punches,
        transfer_bytes,
        direct_mb_s: rates[0],
        relayed_mb_s: rates[1],
    })
}

/// Restarts `name` on a new port, runs a job on `provider` through the relay, and
/// waits for the punch that follows to end, as either side logs it: whether it gave a
/// direct connection.
fn punch(team: &mut TeamLab, name: &str, provider: &str, hello: &str, out: &str) -> Result<bool> {
    let punches_with = |log: &str, peer: &str| -> Vec<bool> {
        log.lines()
            .filter(|l| l.contains("hole punch") && l.contains(peer))
            .map(|l| l.contains("succeeded"))
            .collect()
    };
    let provider_log = |team: &TeamLab| {
        team.members
            .iter()
            .find(|(_, m)| m.peer_id == provider)
            .map(|(_, m)| m.log())
            .unwrap_or_default()
    };
    team.start_member(name, 0, &[])?;
    // Counted right after the start: a punch needs the relayed connection the run makes.
    let me = team.member(name).context("serving")?.peer_id.clone();
    let before = punches_with(&provider_log(team), &me).len();
    let args = [
        "run",
        "--quiet",
        "--allow-relayed-data",
        "--peer",
        provider,
        hello,
        "--output",
        out,
    ];
    run_until_done(team, name, &args, Duration::from_secs(60))?;
    let deadline = Instant::now() + PUNCH_BOUND;
    loop {
        let mine = team.member(name).context("serving")?.log();
        if let Some(&ok) = punches_with(&mine, provider).first() {
            return Ok(ok);
        }
        if let Some(&ok) = punches_with(&provider_log(team), &me).get(before) {
            return Ok(ok);
        }
        if Instant::now() > deadline {
            let tail: Vec<&str> = mine.lines().rev().take(40).collect();
            bail!(
                "no punch with {provider} ended within {PUNCH_BOUND:?}; {name}'s log ends:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            )
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// How long one punch may take to end either way (libp2p tries three times).
const PUNCH_BOUND: Duration = Duration::from_secs(180);

/// Repeats `gpunode <args>` on member `name` until it succeeds, for at most `bound`.
fn run_until_done(team: &TeamLab, name: &str, args: &[&str], bound: Duration) -> Result<()> {
    let started = Instant::now();
    let deadline = started + bound;
    let mut last = String::new();
    loop {
        let o = team.cli(name, args)?;
        if o.status.success() {
            return Ok(());
        }
        // Each new reason a run fails for, on stderr: where the time to a first run goes.
        let why = String::from_utf8_lossy(&o.stderr).trim().to_string();
        if why != last {
            eprintln!("{name} +{:.1}s: {why}", started.elapsed().as_secs_f64());
            last = why;
        }
        if Instant::now() > deadline {
            bail!(
                "{name} ran no job within {bound:?}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn random_file(path: &Path, bytes: u64) -> Result<()> {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut left = bytes;
    let mut buf = vec![0u8; 1 << 20];
    while left > 0 {
        rand_fill(&mut buf);
        let n = left.min(buf.len() as u64) as usize;
        f.write_all(&buf[..n])?;
        left -= n as u64;
    }
    f.flush()?;
    Ok(())
}

/// Fills `buf` with pseudo-random bytes (xorshift; only has to defeat caching).
fn rand_fill(buf: &mut [u8]) {
    let mut x: u64 = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1)
        | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}
