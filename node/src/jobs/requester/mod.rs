//! The requester's side of a job: check the task locally (an invalid module never costs
//! a lease), hash the module and inputs, lease a provider, upload only what it lacks,
//! relay stdout and stderr as they arrive, download and verify the output files, and
//! retry on another provider when one vanishes or fails before the task ends.

mod ahead;
mod prepare;
mod transfer;
mod types;

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpunode_protocol::job::JobReport;
use gpunode_protocol::lease::LeaseId;
use gpunode_protocol::time::now_ms;
use libp2p::PeerId;
use tokio::sync::watch;

use super::{outputs, wire};
use super::{JOB_ENDS_LEASE_PROTOCOL, JOB_PROTOCOL};
use crate::lease::turns::{TurnWait, Turns, MIN_ASK_GAP};
use crate::ledger::claims::ReceiptStatus;
use crate::ledger::reputation::Outcome;
use crate::{LeaseError, LeaseSpec, LeaseView};

pub(crate) use prepare::Prepared;
use transfer::Attempt;
pub use types::*;

/// How long after the task's timeout the lease runs, for transfers on both ends.
const LEASE_MARGIN_MS: u64 = 120_000;
/// How long a provider reached only through a relay gets for a hole punch.
const PUNCH_WAIT: Duration = Duration::from_secs(10);
/// How long opening the job stream may take.
const OPEN_TIMEOUT: Duration = Duration::from_secs(10);
/// How long past its lease's end an attempt may still take before it is given up.
const ATTEMPT_GRACE: Duration = Duration::from_secs(30);
/// How long a finished job waits for its provider's receipt before reporting the cost
/// as an estimate.
const RECEIPT_WAIT: Duration = Duration::from_secs(10);
/// How long a failed attempt waits for its lease's cancellation to be answered.
const RELEASE_WAIT: Duration = Duration::from_secs(3);
/// Why an attempt ended when the provider went silent.
const STOPPED_ANSWERING: &str = "the provider stopped answering";
/// Why an attempt ended when the provider stopped the job unasked.
const STOPPED_UNASKED: &str = "the provider stopped the job before it ended";
/// Why an attempt ended when the provider's owner took the GPU back.
const PREEMPTED: &str =
    "the provider's owner took the GPU back (preempted; only the time used is charged)";
/// A waiting job asks again after this, then twice as long each time, up to
/// [`MAX_WAIT_POLL`].
const FIRST_WAIT_POLL: Duration = Duration::from_secs(1);
/// The longest a waiting job goes without asking again.
const MAX_WAIT_POLL: Duration = Duration::from_secs(10);
/// How often a job waiting in providers' queues asks again (well inside the time a
/// provider keeps a place that nobody asks for: `QUEUE_STALE_MS`).
const QUEUED_POLL: Duration = Duration::from_millis(200);
/// How long after a reservation's start its job is sent (the provider activates it at
/// its next tick).
const RESERVATION_START_MARGIN_MS: u64 = 300;
/// How long a cancelled job may take to report back.
const CANCEL_GRACE: Duration = Duration::from_secs(5);

/// The requester's side of jobs: prepares a task, leases a provider, ships the task,
/// follows it, retries elsewhere, and pays.
#[derive(Clone)]
pub struct Requester {
    negotiator: crate::lease::negotiate::Negotiator,
    pub(super) accounts: Arc<crate::Accounts>,
    control: libp2p_stream::Control,
    metrics: Arc<crate::metrics::Metrics>,
    executor: Arc<gpunode_sandbox::WasmExecutor>,
    in_team: bool,
    /// Jobs waiting in providers' queues, woken when a provider says their turn came.
    turns: Arc<Turns>,
    /// Job data may go through a team relay (config `allow_relayed_data`; a job's own
    /// `allow_relayed_data` also allows it).
    relayed_data: bool,
}

impl std::fmt::Debug for Requester {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Requester").finish_non_exhaustive()
    }
}

impl Requester {
    /// A requester negotiating with `negotiator`, paying from `accounts`, opening job
    /// streams with `control` (counting in `metrics`) and compiling tasks with
    /// `executor`; `in_team` makes jobs wait in queues by default.
    pub fn new(
        negotiator: crate::lease::negotiate::Negotiator,
        accounts: Arc<crate::Accounts>,
        (control, metrics): (libp2p_stream::Control, Arc<crate::metrics::Metrics>),
        executor: Arc<gpunode_sandbox::WasmExecutor>,
        in_team: bool,
    ) -> Requester {
        Requester {
            negotiator,
            accounts,
            control,
            metrics,
            executor,
            in_team,
            turns: Arc::default(),
            relayed_data: false,
        }
    }

    /// Lets job data go through a team relay when hole punching fails.
    pub fn allow_relayed_data(mut self, allowed: bool) -> Requester {
        self.relayed_data = allowed;
        self
    }

    /// The jobs waiting in providers' queues (the queue-turn handler wakes them).
    pub fn turns(&self) -> &Arc<Turns> {
        &self.turns
    }

    /// Runs a job to its end, reporting each step to `events`. `cancel` turning true
    /// stops it (the provider is told, the lease is cancelled).
    pub async fn run_job(
        &self,
        req: JobRequest,
        events: &mut (dyn FnMut(JobEvent) + Send),
        mut cancel: watch::Receiver<bool>,
    ) -> Result<JobSummary, JobError> {
        let mut req = req;
        // Outputs never mix with files already there: an existing directory gets a new
        // one for this job inside it (`submit_job` names it by the job id).
        req.output_dir = outputs::final_dir(
            &req.output_dir,
            &format!("job-{:08x}", rand::random::<u32>()),
        );
        let prepared = self.prepare(&req).await?;
        if req.replicas <= 1 {
            return self
                .run_once(&req, &prepared, events, &mut cancel, Vec::new())
                .await;
        }
        self.run_replicated(&req, &prepared, events, &mut cancel)
            .await
    }

    /// One run on one provider (retrying on others after failures), avoiding `exclude`.
    pub(super) async fn run_once(
        &self,
        req: &JobRequest,
        prepared: &Prepared,
        events: &mut (dyn FnMut(JobEvent) + Send),
        cancel: &mut watch::Receiver<bool>,
        mut exclude: Vec<String>,
    ) -> Result<JobSummary, JobError> {
        let mut attempt = 0;
        let mut last_failure = String::new();
        let wait = req.wait.unwrap_or(self.in_team);
        // One ticket for the whole job, so providers keep its place in their queues.
        let ticket: u128 = rand::random();
        let mut waiting = WaitingRoom::new(self.turns.register(ticket));
        // The job's stream opens while the lease's acceptance travels.
        let ahead = ahead::StreamAhead::default();
        let relayed_ok = self.relayed_data || req.allow_relayed_data;
        let open_ahead = |provider: PeerId| {
            let client = self.negotiator.loop_client();
            ahead.open(&self.control, client, provider, relayed_ok);
        };
        loop {
            attempt += 1;
            if *cancel.borrow() {
                return Err(JobError::Cancelled);
            }
            let asked = match &req.reservation {
                Some(prefix) => self
                    .reserved_lease(prefix, req, events, cancel)
                    .await?
                    .map_err(LeaseError::Invalid),
                None => {
                    let spec = lease_spec(req, &exclude, wait.then_some(ticket));
                    self.negotiator.request_lease_and(spec, &open_ahead).await
                }
            };
            if asked.is_err() {
                // Accepted offers that did not become a lease: no job comes on their
                // streams (before any wait in queues).
                ahead.clear();
            }
            let lease = match asked {
                Ok(l) => {
                    waiting.withdraw_elsewhere(&l.provider, &self.control);
                    l
                }
                Err(e) if attempt == 1 && wait && waitable(&e) => {
                    waiting.wait(&e, events, cancel).await;
                    attempt = 0;
                    continue;
                }
                Err(e) if attempt == 1 => return Err(e.into()),
                Err(e) => {
                    return Err(JobError::Failed(format!(
                        "{} provider(s) failed and no other is available: {e}; the last failed because {last_failure}",
                        attempt - 1
                    )))
                }
            };
            let started = Instant::now();
            let outcome = self
                .run_on_lease(req, prepared, &lease, (events, cancel), &ahead)
                .await;
            match outcome {
                Attempt::Done(report) => {
                    // The result and outputs are in and the lease is over here: a
                    // follower that does not wait for the receipt has all it needs (a
                    // next run finds the provider free; a daemon stopped now loses
                    // nothing of this job but the receipt, which its provider sends again).
                    let summary = self.summary(req, &lease, &report, started, attempt);
                    events(JobEvent::Done {
                        summary: Box::new(summary.clone()),
                    });
                    return Ok(self.settled(req, &lease, summary).await);
                }
                Attempt::Fatal(why) => return Err(JobError::Failed(why)),
                Attempt::Retry(why) | Attempt::OnlyRelayed(why)
                    if attempt <= req.retries
                        && req.peer.is_none()
                        && req.reservation.is_none() =>
                {
                    last_failure.clone_from(&why);
                    events(JobEvent::Retrying {
                        provider: lease.provider.clone(),
                        reason: why,
                        attempt: attempt + 1,
                    });
                    exclude.push(lease.provider.clone());
                }
                Attempt::Retry(why) | Attempt::OnlyRelayed(why) => {
                    return Err(JobError::Failed(format!(
                        "provider {} failed: {why}",
                        lease.provider
                    )))
                }
            }
        }
    }

    /// One attempt on `lease`, bounded by the lease (a provider that stops answering
    /// without dropping the connection cannot hold the job past it); the lease is then
    /// released ([`Requester::release`]), unless it is a reservation kept for the next
    /// job.
    async fn run_on_lease(
        &self,
        req: &JobRequest,
        prepared: &Prepared,
        lease: &LeaseView,
        (events, cancel): (
            &mut (dyn FnMut(JobEvent) + Send),
            &mut watch::Receiver<bool>,
        ),
        ahead: &ahead::StreamAhead,
    ) -> Attempt {
        events(JobEvent::Leased {
            provider: lease.provider.clone(),
            lease_id: lease.lease_id.clone(),
            price_per_gpu_hour: lease.price_per_gpu_hour,
        });
        let started = Instant::now();
        let watchdog = Duration::from_millis(lease.end_ms.saturating_sub(now_ms())) + ATTEMPT_GRACE;
        let lease_key = lease.lease_id.parse::<LeaseId>().ok();
        // The lease's receipt is checked against what this attempt observes: a claim
        // that comes sooner (its provider ends the lease as it sends the outputs) waits.
        let observing = lease_key.map(|id| Observing::start(&self.accounts, id));
        let mut provider_ends_lease = false;
        let attempt = self.attempt(
            req,
            prepared,
            lease,
            events,
            cancel,
            (ahead, &mut provider_ends_lease),
        );
        let outcome = tokio::time::timeout(watchdog, attempt)
            .await
            .unwrap_or_else(|_| Attempt::Retry(STOPPED_ANSWERING.into()));
        self.observe(lease_key, &lease.provider, &outcome, started.elapsed());
        drop(observing);
        if req.reservation.is_none() {
            self.release(lease, lease_key, &outcome, provider_ends_lease)
                .await;
        }
        outcome
    }

    /// Ends `lease` after an attempt. When its provider ended it with the job, the end is
    /// put on record here, so a provider that bills past it is refused; otherwise (an
    /// older provider, a failed attempt, or the record could not be written) it is
    /// cancelled, waiting at most [`RELEASE_WAIT`]: a requester that exits next, as
    /// `gpunode run` without a daemon does, would otherwise leave the provider's GPUs
    /// held until the lease's end.
    async fn release(
        &self,
        lease: &LeaseView,
        lease_key: Option<LeaseId>,
        outcome: &Attempt,
        provider_ends_lease: bool,
    ) {
        let negotiator = self.negotiator.clone();
        if let (true, Attempt::Done(_), Some(id)) = (provider_ends_lease, outcome, lease_key) {
            match negotiator.end_here(&id).await {
                Ok(()) => return,
                Err(e) => tracing::warn!(lease = %id, "cannot mark the lease ended: {e}"),
            }
        }
        let lease_id = lease.lease_id.clone();
        let release = async move {
            let _ = negotiator.cancel_lease(&lease_id).await;
        };
        let _ = tokio::time::timeout(RELEASE_WAIT, release).await;
    }

    /// The job's summary before its receipt settles: priced like the lease's maximum (a
    /// lease without GPUs as one GPU) over the wall time, receipt `pending`.
    fn summary(
        &self,
        req: &JobRequest,
        lease: &LeaseView,
        report: &JobReport,
        started: Instant,
        attempts: u32,
    ) -> JobSummary {
        let wall_ms = started.elapsed().as_millis() as u64;
        let gpus = lease.gpus.len().max(1) as f64;
        JobSummary {
            provider: lease.provider.clone(),
            lease_id: lease.lease_id.clone(),
            exit_code: exit_code(&report.outcome),
            output_digest: replica_digest(report),
            outcome: report.outcome.clone(),
            wall_ms,
            run_ms: report.run_ms,
            cost: lease.price_per_gpu_hour * gpus * wall_ms as f64 / 3_600_000.0,
            receipt: "pending".to_string(),
            replicas: Vec::new(),
            output_dir: req.output_dir.clone(),
            outputs: report.outputs.iter().map(|f| f.path.clone()).collect(),
            attempts,
            module_cached: report.module_cached,
            gpu: report.gpu,
        }
    }

    /// `summary` once its receipt is settled (its cost then the receipt's amount), refused,
    /// or still pending after [`RECEIPT_WAIT`].
    async fn settled(
        &self,
        req: &JobRequest,
        lease: &LeaseView,
        mut summary: JobSummary,
    ) -> JobSummary {
        summary.receipt = match lease.lease_id.parse::<LeaseId>().ok() {
            // Settled once, for the whole reservation, when it ends.
            Some(_) if req.reservation.is_some() => "at the reservation's end".to_string(),
            Some(id) => match self.accounts.wait_receipt(&id, RECEIPT_WAIT).await {
                ReceiptStatus::Settled(r) => {
                    summary.cost = crate::ledger::credits(r.receipt.amount_millicredits);
                    "settled".to_string()
                }
                ReceiptStatus::Refused(why) => format!("refused: {why}"),
                ReceiptStatus::Pending => "pending".to_string(),
            },
            None => "pending".to_string(),
        };
        summary
    }

    /// The reservation `prefix` names, once it has started (waiting for its start, and
    /// saying so); the inner error says why it cannot be used.
    async fn reserved_lease(
        &self,
        prefix: &str,
        req: &JobRequest,
        events: &mut (dyn FnMut(JobEvent) + Send),
        cancel: &mut watch::Receiver<bool>,
    ) -> Result<Result<crate::views::LeaseView, String>, JobError> {
        use crate::lease::{LeaseRole, LeaseState};
        let leases = self
            .negotiator
            .list_leases()
            .await
            .map_err(|e| JobError::Failed(e.to_string()))?;
        let found: Vec<_> = leases
            .into_iter()
            .filter(|l| l.role == LeaseRole::Requester && l.lease_id.starts_with(prefix.trim()))
            .collect();
        let lease = match found.as_slice() {
            [one] => one.clone(),
            [] => {
                return Ok(Err(format!(
                    "no reservation {prefix} of yours here; `gpunode reservations` lists them"
                )))
            }
            _ => {
                return Ok(Err(format!(
                    "'{prefix}' starts more than one lease id; give more of it"
                )))
            }
        };
        if !matches!(lease.state, LeaseState::Reserved | LeaseState::Active) {
            return Ok(Err(format!(
                "reservation {} is {}; book another with `gpunode reserve`",
                lease.lease_id,
                lease.state.label()
            )));
        }
        let start = lease.start_ms.max(now_ms());
        if start + req.timeout_ms > lease.end_ms {
            return Ok(Err(format!(
                "reservation {} ends at {}, before a job started then could use its --timeout of {} s; renew it (`gpunode reservations renew`) or give a shorter --timeout",
                lease.lease_id,
                gpunode_protocol::time::format_utc(lease.end_ms),
                req.timeout_ms / 1000
            )));
        }
        let wait_ms = lease.start_ms.saturating_sub(now_ms());
        if wait_ms > 0 {
            events(JobEvent::Waiting {
                reasons: vec![(
                    lease.provider.clone(),
                    format!(
                        "it runs in reservation {}, which starts at {}",
                        lease.lease_id,
                        gpunode_protocol::time::format_utc(lease.start_ms)
                    ),
                )],
                queue: None,
            });
            // A little past the start, so the provider has activated it.
            let until = Duration::from_millis(wait_ms + RESERVATION_START_MARGIN_MS);
            tokio::select! {
                _ = tokio::time::sleep(until) => {}
                _ = cancel.wait_for(|c| *c) => return Err(JobError::Cancelled),
            }
        }
        Ok(Ok(lease))
    }

    /// Notes what this attempt used (for checking the provider's receipt) and what it
    /// says about the provider (reputation).
    fn observe(&self, lease: Option<LeaseId>, provider: &str, outcome: &Attempt, took: Duration) {
        let accounts = &self.accounts;
        let ms = took.as_millis() as u64;
        let peer = provider.parse::<PeerId>().ok();
        let (status, digest, verdict) = match outcome {
            Attempt::Done(report) => (
                super::provider::outcome_status(&report.outcome),
                Some(gpunode_protocol::receipt::job_output_digest(
                    &report.outputs,
                )),
                Some(Outcome::JobDone),
            ),
            Attempt::Retry(why) if why == STOPPED_ANSWERING => {
                ("failed".into(), None, Some(Outcome::TimedOut))
            }
            Attempt::Retry(why) if why == STOPPED_UNASKED => {
                ("failed".into(), None, Some(Outcome::CancelledByProvider))
            }
            // The owner's right, announced in the provider's policy: no fault.
            Attempt::Retry(why) if why == PREEMPTED => ("preempted".into(), None, None),
            Attempt::Retry(_) => ("failed".into(), None, Some(Outcome::Failed)),
            Attempt::Fatal(_) => ("failed".into(), None, None),
            // Our NAT or our rule: no fault of the provider.
            Attempt::OnlyRelayed(_) => ("not_direct".into(), None, None),
        };
        if let Some(id) = lease {
            accounts.observed.add_job(id, ms, status, digest);
        }
        if let (Some(peer), Some(verdict)) = (peer, verdict) {
            accounts.reputation.record(peer, verdict);
        }
    }
}

/// A job of a lease we hold is under way here: until this drops (after its usage is
/// noted), claims for the lease wait for it (see `Accounts::answer_claims`).
struct Observing {
    accounts: Arc<crate::Accounts>,
    lease: LeaseId,
}

impl Observing {
    fn start(accounts: &Arc<crate::Accounts>, lease: LeaseId) -> Observing {
        accounts.observed.job_started(lease);
        Observing {
            accounts: accounts.clone(),
            lease,
        }
    }
}

impl Drop for Observing {
    fn drop(&mut self) {
        self.accounts.observed.job_ended(self.lease);
    }
}

async fn sleep_until_opt(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The lease a job asks for: its resources for its timeout plus a margin, from the
/// named peer or any not in `exclude`, queued under `ticket` when it waits.
fn lease_spec(req: &JobRequest, exclude: &[String], ticket: Option<u128>) -> LeaseSpec {
    LeaseSpec {
        peer: req.peer.clone(),
        gpus: req.gpus,
        gpu_model: req.gpu_model.clone(),
        gpu_slice: req.gpu_slice.clone(),
        min_gpu_mem_bytes: None,
        cpus: req.cpus,
        mem_bytes: req.mem_bytes,
        backend: if req.container.is_some() {
            "container"
        } else {
            "wasm"
        }
        .into(),
        duration_ms: req.timeout_ms.saturating_add(LEASE_MARGIN_MS),
        max_price: req.max_price,
        exclude: exclude.to_vec(),
        kind: req.kind,
        ticket,
        start_at_ms: None,
    }
}

/// A job waiting for room: says why when the reasons change, and asks again after a
/// backoff (soon while it holds a place in a queue, which is kept only by asking), or as
/// soon as a provider queueing it says its turn came.
struct WaitingRoom {
    backoff: Duration,
    last_reasons: Option<Vec<(String, String)>>,
    turn: TurnWait,
    /// When the job last asked (a notice never makes it ask within [`MIN_ASK_GAP`]).
    last_ask: tokio::time::Instant,
}

impl WaitingRoom {
    fn new(turn: TurnWait) -> WaitingRoom {
        WaitingRoom {
            backoff: FIRST_WAIT_POLL,
            last_reasons: None,
            turn,
            last_ask: tokio::time::Instant::now(),
        }
    }

    /// The job got a lease from `granted`: the other providers still queueing it are
    /// told to free its place now.
    fn withdraw_elsewhere(&self, granted: &str, control: &libp2p_stream::Control) {
        for peer in self.turn.queued_at_now() {
            if peer.to_string() != granted {
                let control = control.clone();
                tokio::spawn(crate::lease::turns::send_withdrawal(
                    control,
                    peer,
                    self.turn.ticket(),
                ));
            }
        }
    }

    /// Reports why the job waits (once per change) and sleeps until it asks again or
    /// is cancelled.
    async fn wait(
        &mut self,
        e: &LeaseError,
        events: &mut (dyn FnMut(JobEvent) + Send),
        cancel: &mut watch::Receiver<bool>,
    ) {
        let reasons = wait_reasons(e);
        let queue = match e {
            LeaseError::Queued { queued, .. } => queued.first().cloned(),
            _ => None,
        };
        if let LeaseError::Queued { queued, .. } = e {
            self.turn
                .queued_at(queued.iter().filter_map(|(p, _)| p.parse::<PeerId>().ok()));
        }
        if self.last_reasons.as_ref() != Some(&reasons) {
            events(JobEvent::Waiting {
                reasons: reasons.clone(),
                queue: queue.clone(),
            });
            self.last_reasons = Some(reasons);
        }
        if queue.is_some() {
            self.backoff = QUEUED_POLL;
        }
        let turn = async {
            self.turn.notified().await;
            tokio::time::sleep_until(self.last_ask + MIN_ASK_GAP).await;
        };
        tokio::select! {
            _ = tokio::time::sleep(self.backoff) => {}
            _ = turn => {}
            changed = cancel.changed() => {
                if changed.is_err() {
                    tokio::time::sleep(self.backoff).await;
                }
            }
        }
        self.backoff = (self.backoff * 2).min(MAX_WAIT_POLL);
        self.last_ask = tokio::time::Instant::now();
    }
}

/// Whether a lease failure may pass with time (busy, hours, quota, debt), so that a job
/// with `--wait` asks again rather than failing.
fn waitable(e: &LeaseError) -> bool {
    use gpunode_protocol::lease::RejectCode;
    match e {
        LeaseError::NoProviders(_) | LeaseError::AllRefused(_) | LeaseError::Queued { .. } => true,
        LeaseError::Refused(r) => matches!(
            r.code,
            RejectCode::NoCapacity
                | RejectCode::LendingHours
                | RejectCode::TeamPolicy
                | RejectCode::DebtLimit
                | RejectCode::LowReputation
        ),
        _ => false,
    }
}

/// What each provider said, in plain words, for `gpunode why`.
fn wait_reasons(e: &LeaseError) -> Vec<(String, String)> {
    match e {
        LeaseError::AllRefused(list) => list.clone(),
        LeaseError::Queued { queued, refused } => queued
            .iter()
            .map(|(p, q)| (p.clone(), crate::lease::describe_place(q)))
            .chain(refused.iter().cloned())
            .collect(),
        other => vec![("-".to_string(), other.to_string())],
    }
}
