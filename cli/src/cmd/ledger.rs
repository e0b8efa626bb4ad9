//! `gpunode ledger` (balances, recent entries, `verify`, `export`) and `gpunode peers`:
//! through the daemon's API when one runs, or straight from the store otherwise.

use std::io::Write;
use std::process::ExitCode;

use anyhow::Result;
use gpunode_node::ledger::chain::VerifyReport;
use gpunode_node::ledger::views::{ExportFormat, LedgerView, PeerView};
use gpunode_node::views::{ConnectionView, NodeStatus};
use gpunode_node::{DataDir, NodeConfig};

use crate::args::{LedgerAction, LedgerArgs};
use crate::output::short_peer;
use crate::target::Target;

/// `gpunode ledger [verify | export]`.
pub async fn ledger(data_dir: DataDir, config: NodeConfig, args: LedgerArgs) -> Result<ExitCode> {
    match args.action {
        None => summary(data_dir, config, args.recent, args.json).await,
        Some(LedgerAction::Verify { json }) => verify(data_dir, config, json || args.json).await,
        Some(LedgerAction::Export { format }) => export(data_dir, config, &format).await,
    }
}

/// `gpunode ledger`: balances and the `recent` last entries.
async fn summary(
    data_dir: DataDir,
    config: NodeConfig,
    recent: usize,
    json: bool,
) -> Result<ExitCode> {
    let view: LedgerView = match Target::daemon_or_store(data_dir, config).await? {
        Target::Daemon(api) => api.get_json(&format!("/v1/ledger?recent={recent}")).await?,
        Target::Local(node) => node.once(async |h| h.ledger_view(recent)).await?,
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&view)?);
    } else {
        print_ledger(&mut std::io::stdout().lock(), &view)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `gpunode ledger verify`: exits 1 when the chain is broken.
async fn verify(data_dir: DataDir, config: NodeConfig, json: bool) -> Result<ExitCode> {
    let report: VerifyReport = match Target::daemon_or_store(data_dir, config).await? {
        Target::Daemon(api) => api.get_json("/v1/ledger/verify").await?,
        Target::Local(node) => node.once(async |h| h.verify_ledger(false).await).await?,
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        match &report.first_bad {
            None => println!(
                "ledger OK: {} entries, {} signatures checked in {:.2}s; balance {:+.3} credits",
                report.entries,
                report.signatures,
                report.took_ms as f64 / 1000.0,
                report.balance_millicredits as f64 / 1000.0
            ),
            Some(bad) => println!("ledger BROKEN at entry {}: {}", bad.seq, bad.reason),
        }
    }
    Ok(if report.first_bad.is_none() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `gpunode ledger export`: every entry, as csv or json, on stdout.
async fn export(data_dir: DataDir, config: NodeConfig, format: &str) -> Result<ExitCode> {
    let format: ExportFormat = format
        .parse()
        .map_err(|m: String| anyhow::anyhow!("invalid --format: {m}"))?;
    let text = match Target::daemon_or_store(data_dir, config).await? {
        Target::Daemon(api) => {
            let f = match format {
                ExportFormat::Csv => "csv",
                ExportFormat::Json => "json",
            };
            api.get_text(&format!("/v1/ledger/export?format={f}"))
                .await?
        }
        Target::Local(node) => node.once(async |h| h.export_ledger(format).await).await?,
    };
    std::io::stdout().lock().write_all(text.as_bytes())?;
    Ok(ExitCode::SUCCESS)
}

/// `gpunode peers`.
pub async fn peers(data_dir: DataDir, config: NodeConfig, json: bool) -> Result<ExitCode> {
    let (peers, links): (Vec<PeerView>, Vec<ConnectionView>) =
        match Target::daemon_or_store(data_dir, config).await? {
            Target::Daemon(api) => {
                let status: NodeStatus = api.get_json("/v1/status").await?;
                (api.get_json("/v1/peers").await?, status.connections)
            }
            Target::Local(node) => (node.once(async |h| h.peers_view()).await, Vec::new()),
        };
    if json {
        println!("{}", serde_json::to_string_pretty(&peers)?);
        return Ok(ExitCode::SUCCESS);
    }
    let mut out = std::io::stdout().lock();
    print_links(&mut out, &links)?;
    if peers.is_empty() {
        writeln!(out, "No known peers yet: reputation builds up as jobs run.")?;
        return Ok(ExitCode::SUCCESS);
    }
    writeln!(
        out,
        "{:<14} {:>10} {:>9} {:>8} {:>8} {:>10} {:>12} {:>12}",
        "PEER",
        "REPUTATION",
        "JOBS DONE",
        "FAILURES",
        "DISPUTES",
        "MISMATCHES",
        "BALANCE",
        "STANDING"
    )?;
    for p in &peers {
        writeln!(
            out,
            "{:<14} {:>10.2} {:>9} {:>8} {:>8} {:>10} {:>+12.3} {:>12.3}",
            short_peer(&p.peer_id),
            p.reputation,
            p.jobs_done,
            p.failures,
            p.disputes,
            p.mismatches,
            p.balance,
            p.standing
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The daemon's connections now: each peer, direct or relayed, its RTT and address.
fn print_links(out: &mut impl Write, links: &[ConnectionView]) -> std::io::Result<()> {
    if links.is_empty() {
        return Ok(());
    }
    let relayed = links.iter().filter(|l| l.path == "relayed").count();
    writeln!(
        out,
        "Connected to {} peer(s): {} direct, {relayed} relayed",
        links.len(),
        links.len() - relayed
    )?;
    writeln!(out, "{:<14} {:<8} {:>9}  ADDRESS", "PEER", "PATH", "RTT")?;
    for l in links {
        let rtt = l
            .rtt_ms
            .map(|ms| format!("{ms:.1} ms"))
            .unwrap_or_else(|| "-".into());
        writeln!(
            out,
            "{:<14} {:<8} {:>9}  {}",
            short_peer(&l.peer_id),
            l.path,
            rtt,
            l.address
        )?;
    }
    writeln!(out)
}

fn print_ledger(out: &mut impl Write, v: &LedgerView) -> std::io::Result<()> {
    writeln!(
        out,
        "Balance: {:+.3} credits (earned {:.3}, spent {:.3}) in {} entries",
        v.balance, v.earned, v.spent, v.entries
    )?;
    writeln!(
        out,
        "New peers may use {:.3} credits here, and {:.3} more past that before they are refused.",
        v.allowance, v.debt_limit
    )?;
    if !v.peers.is_empty() {
        writeln!(out, "\nWith each peer:")?;
        writeln!(
            out,
            "  {:<14} {:>12} {:>12} {:>12}",
            "PEER", "EARNED", "SPENT", "BALANCE"
        )?;
        for p in &v.peers {
            writeln!(
                out,
                "  {:<14} {:>12.3} {:>12.3} {:>+12.3}",
                short_peer(&p.peer_id),
                p.earned,
                p.spent,
                p.balance
            )?;
        }
    }
    if !v.recent.is_empty() {
        writeln!(out, "\nRecent entries:")?;
        writeln!(
            out,
            "  {:>6} {:<10} {:<7} {:<14} {:>10} {:>9} {:>4}  LAST EXIT",
            "SEQ", "LEASE", "", "PEER", "CREDITS", "BILLED", "JOBS"
        )?;
        for e in &v.recent {
            writeln!(
                out,
                "  {:>6} {:<10} {:<7} {:<14} {:>+10.3} {:>8.1}s {:>4}  {}",
                e.seq,
                &e.lease_id[..e.lease_id.len().min(8)],
                e.direction,
                short_peer(&e.peer),
                if e.direction == "earned" {
                    e.amount
                } else {
                    -e.amount
                },
                e.billed_seconds,
                e.jobs,
                e.exit_status
            )?;
        }
    }
    if !v.unsettled.is_empty() {
        writeln!(out, "\nUnsettled claims (receipts not countersigned):")?;
        for u in &v.unsettled {
            writeln!(
                out,
                "  lease {} peer {} {:.3} credits: {}",
                &u.lease_id[..u.lease_id.len().min(8)],
                short_peer(&u.peer),
                u.amount,
                u.disputed.as_deref().unwrap_or("waiting for the peer")
            )?;
        }
    }
    Ok(())
}
