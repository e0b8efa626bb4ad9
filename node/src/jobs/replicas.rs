//! Replicated runs (`gpunode run --replicas N`): the same deterministic task on N
//! different providers, outputs compared by digest. When they disagree, one more run on
//! yet another provider breaks the tie; the providers outside the majority lose
//! reputation (replica mismatch) and the majority's outputs are kept.
//!
//! Every replica downloads into its own hidden directory under the output directory;
//! the winner's files are then moved into place and the rest removed.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use libp2p::PeerId;
use tokio::sync::watch;

use super::requester::Requester;
use super::requester::{JobError, JobEvent, JobRequest, JobSummary, Prepared, ReplicaView};
use crate::ledger::reputation::Outcome;

impl Requester {
    /// Runs `req` on `req.replicas` providers (plus a tie-breaker when they disagree).
    pub(super) async fn run_replicated(
        &self,
        req: &JobRequest,
        prepared: &Prepared,
        events: &mut (dyn FnMut(JobEvent) + Send),
        cancel: &mut watch::Receiver<bool>,
    ) -> Result<JobSummary, JobError> {
        if req.peer.is_some() {
            return Err(JobError::Invalid(
                "--replicas runs on different providers; it cannot be combined with --peer".into(),
            ));
        }
        let wanted = req.replicas as usize;
        let mut runs: Vec<JobSummary> = Vec::new();
        let mut used: Vec<String> = Vec::new();
        let result = loop {
            let n = runs.len() + 1;
            let mut one = req.clone();
            one.output_dir = replica_dir(&req.output_dir, n);
            one.replicas = 1;
            // Only the first replica's output streams to the user, and no replica's
            // result is the job's (that waits for the majority).
            let mut quiet = |e: JobEvent| {
                let output = matches!(e, JobEvent::Stdout { .. } | JobEvent::Stderr { .. });
                if (n == 1 || !output) && !matches!(e, JobEvent::Done { .. }) {
                    events(e)
                }
            };
            let summary = match self
                .run_once(&one, prepared, &mut quiet, cancel, used.clone())
                .await
            {
                Ok(s) => s,
                Err(e) => break Err(e),
            };
            used.push(summary.provider.clone());
            runs.push(summary);
            if runs.len() < wanted {
                continue;
            }
            match majority(&runs) {
                Some(digest) if runs.len() == wanted || agree_count(&runs, &digest) >= 2 => {
                    break Ok(digest)
                }
                _ if runs.len() > wanted => {
                    break Err(JobError::Failed(format!(
                        "the {} replicas all disagree; no result can be trusted (providers {})",
                        runs.len(),
                        used.join(", ")
                    )))
                }
                // Disagreement: one more run breaks the tie.
                _ => continue,
            }
        };
        match result {
            Ok(digest) => self.keep_majority(req, runs, &digest),
            Err(e) => {
                for n in 1..=runs.len() + 1 {
                    let _ = std::fs::remove_dir_all(replica_dir(&req.output_dir, n));
                }
                Err(e)
            }
        }
    }

    /// Moves the majority's outputs into place, blames the others, builds the summary.
    fn keep_majority(
        &self,
        req: &JobRequest,
        runs: Vec<JobSummary>,
        digest: &str,
    ) -> Result<JobSummary, JobError> {
        let winner = runs
            .iter()
            .position(|r| r.output_digest == digest)
            .ok_or_else(|| JobError::Failed("no replica has the majority's digest".into()))?;
        let from = replica_dir(&req.output_dir, winner + 1);
        if !runs[winner].outputs.is_empty() {
            // The winner's directory was made fresh by its download: moved whole, with
            // the same no-replace rule as a single run's outputs.
            std::fs::rename(&from, &req.output_dir).map_err(|e| {
                JobError::Failed(format!(
                    "cannot move the outputs to {}: {e}",
                    req.output_dir.display()
                ))
            })?;
        }
        for n in 1..=runs.len() {
            let _ = std::fs::remove_dir_all(replica_dir(&req.output_dir, n));
        }
        let replicas: Vec<ReplicaView> = runs
            .iter()
            .map(|r| ReplicaView {
                provider: r.provider.clone(),
                output_digest: r.output_digest.clone(),
                agrees: r.output_digest == digest,
            })
            .collect();
        for r in replicas.iter().filter(|r| !r.agrees) {
            tracing::warn!(provider = %r.provider, "replica outputs disagree with the majority");
            if let Ok(peer) = r.provider.parse::<PeerId>() {
                self.accounts
                    .reputation
                    .record(peer, Outcome::ReplicaMismatch);
            }
        }
        let total_cost: f64 = runs.iter().map(|r| r.cost).sum();
        let attempts: u32 = runs.iter().map(|r| r.attempts).sum();
        let wall_ms: u64 = runs.iter().map(|r| r.wall_ms).sum();
        let mut summary = runs[winner].clone();
        summary.cost = total_cost;
        summary.attempts = attempts;
        summary.wall_ms = wall_ms;
        summary.output_dir = req.output_dir.clone();
        summary.replicas = replicas;
        Ok(summary)
    }
}

/// Where replica `n` downloads: beside the output directory, which stays absent until
/// the majority's outputs move there.
fn replica_dir(output_dir: &Path, n: usize) -> PathBuf {
    let name = output_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into());
    output_dir.with_file_name(format!(".{name}.replica-{n}"))
}

fn agree_count(runs: &[JobSummary], digest: &str) -> usize {
    runs.iter().filter(|r| r.output_digest == digest).count()
}

/// The digest more than half of the runs share, if any.
fn majority(runs: &[JobSummary]) -> Option<String> {
    let mut votes: HashMap<&str, usize> = HashMap::new();
    for r in runs {
        *votes.entry(r.output_digest.as_str()).or_default() += 1;
    }
    votes
        .into_iter()
        .find(|(_, n)| *n * 2 > runs.len())
        .map(|(d, _)| d.to_string())
}
