//! What `gpunode ledger` and `gpunode peers` show: balances, recent entries, unsettled
//! claims, the chain check, exports, and each known peer's standing and reputation.

use std::collections::BTreeSet;

use gpunode_protocol::time::now_ms;
use libp2p::PeerId;
use serde::{Deserialize, Serialize};

use super::chain::VerifyReport;
use super::claims::UnsettledView;
use super::{credits, EntryView, LedgerError};

/// The ledger at a glance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LedgerView {
    /// This node.
    pub peer_id: String,
    /// Earned minus spent, credits.
    pub balance: f64,
    /// Earned providing, credits.
    pub earned: f64,
    /// Spent using others' resources, credits.
    pub spent: f64,
    /// Entries in the chain.
    pub entries: u64,
    /// Credits a new peer may use here.
    pub allowance: f64,
    /// Debt past the allowance tolerated here.
    pub debt_limit: f64,
    /// Balance with each peer.
    pub peers: Vec<PeerBalance>,
    /// Newest entries first.
    pub recent: Vec<EntryView>,
    /// Receipts we claimed that are not settled (pending or disputed).
    pub unsettled: Vec<UnsettledView>,
}

/// Balance with one peer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerBalance {
    /// The peer.
    pub peer_id: String,
    /// What we earned from it, credits.
    pub earned: f64,
    /// What we spent with it, credits.
    pub spent: f64,
    /// Earned minus spent, credits.
    pub balance: f64,
}

/// A known peer, for `gpunode peers`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerView {
    /// The peer.
    pub peer_id: String,
    /// Reputation score (0 to 1; 0.5 when unknown).
    pub reputation: f64,
    /// Jobs it ran for us to the end.
    pub jobs_done: u64,
    /// Failed jobs, timeouts and jobs it stopped unasked.
    pub failures: u64,
    /// Disputed receipts, either way.
    pub disputes: u64,
    /// Replica mismatches.
    pub mismatches: u64,
    /// Our balance with it (earned minus spent), credits.
    pub balance: f64,
    /// Its give-to-get standing here (allowance + given − taken), credits.
    pub standing: f64,
}

/// Export formats of `gpunode ledger export`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExportFormat {
    /// One row per entry with a header.
    Csv,
    /// A JSON array of entries.
    Json,
}

impl std::str::FromStr for ExportFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "csv" => Ok(ExportFormat::Csv),
            "json" => Ok(ExportFormat::Json),
            other => Err(format!("unknown export format '{other}': use csv or json")),
        }
    }
}

const CSV_HEADER: &str = "seq,recorded_ms,lease_id,direction,peer,amount,billed_seconds,gpu_seconds,peak_gpu_memory_bytes,cpu_seconds,jobs,exit_status,start_ms,end_ms,price_per_gpu_hour,output_digest,hash,prev";

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// The report of a whole-chain check and the head it checked.
#[derive(Debug, Clone)]
pub struct CheckedChain {
    seq: u64,
    hash: gpunode_protocol::receipt::Digest,
    report: VerifyReport,
}

impl CheckedChain {
    fn is_of(&self, head: &super::chain::ChainHead) -> bool {
        self.seq == head.seq && self.hash == head.hash
    }
}

impl super::accounts::Accounts {
    /// Balances, the `recent` newest entries and unsettled claims.
    pub fn ledger_view(&self, recent: usize) -> Result<LedgerView, LedgerError> {
        let a = self;
        let accounts = a.ledger.accounts();
        let mut peers: Vec<PeerBalance> = accounts
            .iter()
            .map(|(p, acc)| PeerBalance {
                peer_id: p.to_string(),
                earned: credits(acc.earned),
                spent: credits(acc.spent),
                balance: credits(acc.balance()),
            })
            .collect();
        peers.sort_by(|x, y| y.balance.total_cmp(&x.balance));
        let earned: u64 = accounts.values().map(|x| x.earned).sum();
        let spent: u64 = accounts.values().map(|x| x.spent).sum();
        Ok(LedgerView {
            peer_id: self.ledger.local().to_string(),
            balance: credits(a.ledger.balance()),
            earned: credits(earned),
            spent: credits(spent),
            entries: a.ledger.head().seq,
            allowance: credits(a.allowance_millicredits),
            debt_limit: credits(a.debt_limit_millicredits),
            peers,
            recent: a.ledger.recent(recent)?,
            unsettled: a.unsettled(),
        })
    }

    /// Checks the whole chain (off the async workers). Checks run one at a time; with
    /// `reuse`, a check of the same head as the last one returns that report instead of
    /// reading the chain again (entries only ever append, so a head unchanged since is
    /// the same chain).
    pub async fn verify_ledger(&self, reuse: bool) -> Result<VerifyReport, LedgerError> {
        let mut last = self.last_verify.lock().await;
        let head = self.ledger.head();
        if let Some(done) = last.as_ref().filter(|c| reuse && c.is_of(&head)) {
            return Ok(done.report.clone());
        }
        let ledger = self.ledger.clone();
        let report = tokio::task::spawn_blocking(move || {
            let report = ledger.verify();
            // A pass over the whole chain leaves the allocator holding what it read.
            crate::heap::trim();
            report
        })
        .await
        .map_err(|e| LedgerError::Task(e.to_string()))??;
        *last = Some(CheckedChain {
            seq: head.seq,
            hash: head.hash,
            report: report.clone(),
        });
        Ok(report)
    }

    /// The balance after each entry, oldest first, thinned to about `points` rows.
    /// Only entries recorded since the last call are read from the chain.
    pub async fn balance_history(
        &self,
        points: usize,
    ) -> Result<crate::overview::BalanceHistory, LedgerError> {
        let (ledger, series) = (self.ledger.clone(), self.balance_series.clone());
        tokio::task::spawn_blocking(move || {
            let mut series = series.lock().unwrap_or_else(|p| p.into_inner());
            let after = series.seq();
            ledger.for_each_entry_after(after, |e| {
                let change = if e.direction == "earned" {
                    e.amount
                } else {
                    -e.amount
                };
                series.push(e.seq, e.recorded_ms, change);
                Ok(())
            })?;
            Ok(series.history(points))
        })
        .await
        .map_err(|e| LedgerError::Task(e.to_string()))?
    }

    /// Every ledger entry in `format`.
    pub async fn export_ledger(&self, format: ExportFormat) -> Result<String, LedgerError> {
        let ledger = self.ledger.clone();
        tokio::task::spawn_blocking(move || {
            let mut out = Vec::new();
            match format {
                ExportFormat::Csv => {
                    out.extend_from_slice(CSV_HEADER.as_bytes());
                    out.push(b'\n');
                    ledger.for_each_entry(|e| {
                        use std::io::Write;
                        writeln!(
                            out,
                            "{},{},{},{},{},{:.3},{:.3},{:.3},{},{:.3},{},{},{},{},{:.3},{},{},{}",
                            e.seq,
                            e.recorded_ms,
                            e.lease_id,
                            e.direction,
                            e.peer,
                            e.amount,
                            e.billed_seconds,
                            e.gpu_seconds,
                            e.peak_gpu_memory_bytes,
                            e.cpu_seconds,
                            e.jobs,
                            csv_field(&e.exit_status),
                            e.start_ms,
                            e.end_ms,
                            e.price_per_gpu_hour,
                            e.output_digest,
                            e.hash,
                            e.prev
                        )
                    })?;
                }
                ExportFormat::Json => {
                    let mut all = Vec::new();
                    ledger.for_each_entry(|e| {
                        all.push(e);
                        Ok(())
                    })?;
                    out = serde_json::to_vec_pretty(&all)
                        .map_err(|e| LedgerError::Store(e.to_string()))?;
                    out.push(b'\n');
                }
            }
            Ok::<_, LedgerError>(String::from_utf8_lossy(&out).into_owned())
        })
        .await
        .map_err(|e| LedgerError::Task(e.to_string()))?
    }

    /// Every peer we have a reputation record or a balance with.
    pub fn peers_view(&self) -> Vec<PeerView> {
        let a = self;
        let records = a.reputation.all();
        let accounts = a.ledger.accounts();
        let peers: BTreeSet<PeerId> = records.keys().chain(accounts.keys()).copied().collect();
        let now = now_ms();
        let mut out: Vec<PeerView> = peers
            .into_iter()
            .map(|p| {
                let r = records.get(&p).cloned().unwrap_or_default();
                let acc = accounts.get(&p).copied().unwrap_or_default();
                PeerView {
                    peer_id: p.to_string(),
                    reputation: r.score(now),
                    jobs_done: r.jobs_done,
                    failures: r.failures + r.timeouts + r.cancelled_by_provider,
                    disputes: r.disputes,
                    mismatches: r.mismatches,
                    balance: credits(acc.balance()),
                    standing: credits(a.standing(&p)),
                }
            })
            .collect();
        out.sort_by(|x, y| y.reputation.total_cmp(&x.reputation));
        out
    }
}
