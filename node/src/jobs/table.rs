//! The jobs a node runs for its own user: each job's view (state, provider, result) and
//! its events in order, so `gpunode jobs`, `gpunode logs [--follow]` and a re-attached
//! `gpunode run` read the same history. Events are kept in memory up to a bound per job
//! (the oldest events are dropped first, and the view counts the output lost). The table lives in
//! memory: a daemon restart forgets it (the leases themselves are in the store).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpunode_protocol::time::{now_ms, UnixMillis};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::requester::{JobEvent, JobRequest, JobSummary};

/// Output bytes kept per job for `logs`.
const MAX_LOG_BYTES: usize = 8 << 20;
/// Finished jobs remembered in memory.
const MAX_FINISHED: usize = 1000;

/// Where a job stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum JobState {
    /// Looking for a provider and leasing.
    Leasing,
    /// No provider can take it now; it waits and asks again (`--wait`).
    Waiting,
    /// Sending the module and inputs.
    Uploading,
    /// Running on the provider.
    Running,
    /// Ended with a result (whatever the exit code).
    Finished,
    /// Could not be run.
    Failed,
    /// Stopped by the user.
    Cancelled,
}

impl JobState {
    /// Whether the job is over.
    pub fn is_final(self) -> bool {
        matches!(
            self,
            JobState::Finished | JobState::Failed | JobState::Cancelled
        )
    }

    /// A word for tables.
    pub fn label(self) -> &'static str {
        match self {
            JobState::Leasing => "leasing",
            JobState::Waiting => "waiting",
            JobState::Uploading => "uploading",
            JobState::Running => "running",
            JobState::Finished => "finished",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }
}

/// A job as `gpunode jobs` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobView {
    /// Job id (16 hex digits).
    pub job_id: String,
    /// The task file.
    pub module: PathBuf,
    /// Arguments.
    pub args: Vec<String>,
    /// Where it stands.
    pub state: JobState,
    /// Current or last provider.
    pub provider: Option<String>,
    /// Current or last lease.
    pub lease_id: Option<String>,
    /// When it was submitted.
    pub submitted_ms: UnixMillis,
    /// When it ended.
    pub ended_ms: Option<UnixMillis>,
    /// The result, once finished.
    pub summary: Option<JobSummary>,
    /// Why it failed.
    pub error: Option<String>,
    /// Output bytes dropped from the log because of its bound.
    pub log_bytes_dropped: u64,
    /// While waiting: since when, and why each provider asked could not take it.
    #[serde(default)]
    pub waiting: Option<super::requester::Waiting>,
}

struct Entry {
    view: JobView,
    events: Vec<JobEvent>,
    /// Events dropped from the front.
    offset: usize,
    log_bytes: usize,
    changed: watch::Sender<usize>,
    cancel: watch::Sender<bool>,
}

/// Events from a position on, and whether the job is over.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventPage {
    /// The events.
    pub events: Vec<JobEvent>,
    /// Position to ask from next.
    pub next: usize,
    /// The job is over and `events` reached its last event.
    pub done: bool,
}

/// All jobs of this node's user.
#[derive(Clone, Default)]
pub struct JobTable {
    inner: Arc<Mutex<HashMap<String, Entry>>>,
}

impl std::fmt::Debug for JobTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobTable").finish_non_exhaustive()
    }
}

impl JobTable {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a new job; returns its id and the receiver its runner watches for a cancel.
    pub fn insert(&self, req: &JobRequest) -> (String, watch::Receiver<bool>) {
        let job_id = format!("{:016x}", rand::random::<u64>());
        let (cancel, cancel_rx) = watch::channel(false);
        let view = JobView {
            job_id: job_id.clone(),
            module: req.module.clone(),
            args: req.args.clone(),
            state: JobState::Leasing,
            provider: None,
            lease_id: None,
            submitted_ms: now_ms(),
            ended_ms: None,
            summary: None,
            error: None,
            log_bytes_dropped: 0,
            waiting: None,
        };
        let mut map = self.lock();
        forget_oldest_finished(&mut map);
        map.insert(
            job_id.clone(),
            Entry {
                view,
                events: Vec::new(),
                offset: 0,
                log_bytes: 0,
                changed: watch::channel(0).0,
                cancel,
            },
        );
        (job_id, cancel_rx)
    }

    /// Records an event and moves the job's state along.
    pub fn push(&self, job_id: &str, event: JobEvent) {
        let mut map = self.lock();
        let Some(e) = map.get_mut(job_id) else {
            return;
        };
        match &event {
            JobEvent::Leased {
                provider, lease_id, ..
            } => {
                e.view.state = JobState::Uploading;
                e.view.waiting = None;
                e.view.provider = Some(provider.clone());
                e.view.lease_id = Some(lease_id.clone());
            }
            JobEvent::Waiting { reasons, queue } => {
                e.view.state = JobState::Waiting;
                let since = e.view.waiting.as_ref().map_or(now_ms(), |w| w.since_ms);
                e.view.waiting = Some(super::requester::Waiting {
                    since_ms: since,
                    reasons: reasons.clone(),
                    queue: queue.clone(),
                });
            }
            JobEvent::Started { .. } => e.view.state = JobState::Running,
            JobEvent::Retrying { .. } => e.view.state = JobState::Leasing,
            JobEvent::Finished { summary } => {
                e.view.state = if summary.outcome == gpunode_protocol::job::JobOutcome::Cancelled {
                    JobState::Cancelled
                } else {
                    JobState::Finished
                };
                e.view.summary = Some((**summary).clone());
                e.view.ended_ms = Some(now_ms());
            }
            JobEvent::Failed { error } => {
                e.view.state = if *e.cancel.borrow() {
                    JobState::Cancelled
                } else {
                    JobState::Failed
                };
                e.view.error = Some(error.clone());
                e.view.ended_ms = Some(now_ms());
            }
            JobEvent::Stdout { data } | JobEvent::Stderr { data } => {
                e.log_bytes += data.len();
            }
            JobEvent::Progress { .. } | JobEvent::Done { .. } => {}
        }
        e.events.push(event);
        // Over the bound, the oldest events go (positions stay valid: `offset` counts
        // what was dropped from the front).
        while e.log_bytes > MAX_LOG_BYTES && !e.events.is_empty() {
            let removed = e.events.remove(0);
            e.offset += 1;
            if let JobEvent::Stdout { data } | JobEvent::Stderr { data } = removed {
                e.log_bytes -= data.len();
                e.view.log_bytes_dropped += data.len() as u64;
            }
        }
        let total = e.offset + e.events.len();
        e.changed.send_replace(total);
    }

    /// One job's view, by id or unique prefix.
    pub fn get(&self, prefix: &str) -> Result<JobView, JobLookupError> {
        let map = self.lock();
        let id = resolve(&map, prefix)?;
        Ok(map[&id].view.clone())
    }

    /// Every job, newest first.
    pub fn list(&self) -> Vec<JobView> {
        let mut v: Vec<JobView> = self.lock().values().map(|e| e.view.clone()).collect();
        v.sort_by_key(|j| std::cmp::Reverse(j.submitted_ms));
        v
    }

    /// Asks a job to stop. Returns its id.
    pub fn cancel(&self, prefix: &str) -> Result<String, JobLookupError> {
        let map = self.lock();
        let id = resolve(&map, prefix)?;
        let e = &map[&id];
        if e.view.state.is_final() {
            let state = e.view.state.label();
            return Err(JobLookupError::AlreadyEnded { id, state });
        }
        e.cancel.send_replace(true);
        Ok(id)
    }

    /// Events from position `from`, waiting up to `wait` for new ones when there are none.
    pub async fn events(
        &self,
        prefix: &str,
        from: usize,
        wait: Duration,
    ) -> Result<EventPage, JobLookupError> {
        self.events_skipping(prefix, from, wait, &Skip::none())
            .await
    }

    /// Like [`JobTable::events`], but events of the kinds in `skip` do not end the wait
    /// by themselves: they come with the page that a later event, the job's end or the
    /// deadline returns.
    pub async fn events_skipping(
        &self,
        prefix: &str,
        from: usize,
        wait: Duration,
        skip: &Skip,
    ) -> Result<EventPage, JobLookupError> {
        let mut changed = {
            let map = self.lock();
            let id = resolve(&map, prefix)?;
            map[&id].changed.subscribe()
        };
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            {
                let map = self.lock();
                let id = resolve(&map, prefix)?;
                let e = &map[&id];
                let total = e.offset + e.events.len();
                let final_state = e.view.state.is_final();
                let start = from.saturating_sub(e.offset).min(e.events.len());
                let page = |e: &Entry| EventPage {
                    events: e.events[start..]
                        .iter()
                        .filter(|ev| skip.shows(ev))
                        .cloned()
                        .collect(),
                    next: total,
                    done: final_state,
                };
                let fresh = &e.events[start..];
                // (`from < total` with nothing left: the log dropped them; say so now.)
                if final_state
                    || (from < total && fresh.is_empty())
                    || fresh.iter().any(|ev| skip.wakes(ev))
                {
                    return Ok(page(e));
                }
                if tokio::time::Instant::now() >= deadline {
                    // What was skipped comes now (an empty page when nothing came).
                    return Ok(if from < total {
                        page(e)
                    } else {
                        EventPage {
                            events: Vec::new(),
                            next: from,
                            done: false,
                        }
                    });
                }
            }
            tokio::select! {
                r = changed.changed() => if r.is_err() { return Err(JobLookupError::Closed) },
                _ = tokio::time::sleep_until(deadline) => {}
            }
        }
    }
}

/// What a follower asks of a job's events: kinds that do not wake it by themselves
/// (`leased`, `started`, ...: one that prints nothing for them is not woken, and does not
/// ask again, for each; they still come with the next page), and the kinds of
/// [`JobEvent::ASKED_FOR`] it wants to see at all (`with`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Skip {
    skip: Vec<&'static str>,
    with: Vec<&'static str>,
}

impl Skip {
    /// Every event wakes; no kind is asked for.
    pub fn none() -> Skip {
        Skip::default()
    }

    /// From a comma-separated list of kinds (`leased,started`); empty for none. Names
    /// this node does not know are left out: skipping is a hint, and a newer client may
    /// name kinds of a newer node (each of them then wakes it, as without `skip`).
    pub fn parse(list: &str) -> Skip {
        Skip {
            skip: kinds_named(list, &JobEvent::KINDS),
            with: Vec::new(),
        }
    }

    /// These kinds of [`JobEvent::ASKED_FOR`] too (comma-separated; others are left out).
    pub fn with(mut self, list: &str) -> Skip {
        self.with = kinds_named(list, &JobEvent::ASKED_FOR);
        self
    }

    /// Whether `event` is on this follower's pages at all.
    fn shows(&self, event: &JobEvent) -> bool {
        let kind = event.kind();
        !JobEvent::ASKED_FOR.contains(&kind) || self.with.contains(&kind)
    }

    /// Whether `event` ends a wait.
    fn wakes(&self, event: &JobEvent) -> bool {
        self.shows(event) && !self.skip.contains(&event.kind())
    }
}

/// The kinds of `known` that the comma-separated `list` names, each once.
fn kinds_named(list: &str, known: &[&'static str]) -> Vec<&'static str> {
    let mut kinds = Vec::new();
    for name in list.split(',').map(str::trim) {
        if let Some(kind) = known.iter().find(|k| **k == name) {
            if !kinds.contains(kind) {
                kinds.push(*kind);
            }
        }
    }
    kinds
}

/// Why a job could not be found or acted on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JobLookupError {
    /// No id was given.
    #[error("give a job id (see `gpunode jobs`)")]
    NoId,
    /// The prefix fits several jobs.
    #[error("job id prefix '{0}' is ambiguous; give more digits")]
    Ambiguous(String),
    /// No job has this id or prefix.
    #[error("no job '{0}' (see `gpunode jobs`)")]
    Unknown(String),
    /// The job is over already.
    #[error("job {id} already {state}")]
    AlreadyEnded {
        /// The job.
        id: String,
        /// How it ended.
        state: &'static str,
    },
    /// The node is stopping.
    #[error("job table closed")]
    Closed,
}

fn resolve(map: &HashMap<String, Entry>, prefix: &str) -> Result<String, JobLookupError> {
    let prefix = prefix.trim();
    if prefix.is_empty() {
        return Err(JobLookupError::NoId);
    }
    let mut found = map.keys().filter(|k| k.starts_with(prefix));
    match (found.next(), found.next()) {
        (Some(id), None) => Ok(id.clone()),
        (Some(_), Some(_)) => Err(JobLookupError::Ambiguous(prefix.to_string())),
        (None, _) => Err(JobLookupError::Unknown(prefix.to_string())),
    }
}

fn forget_oldest_finished(map: &mut HashMap<String, Entry>) {
    let finished = map.values().filter(|e| e.view.state.is_final()).count();
    if finished < MAX_FINISHED {
        return;
    }
    if let Some(id) = map
        .iter()
        .filter(|(_, e)| e.view.state.is_final())
        .min_by_key(|(_, e)| e.view.submitted_ms)
        .map(|(id, _)| id.clone())
    {
        map.remove(&id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> JobRequest {
        JobRequest {
            module: "t.wasm".into(),
            container: None,
            inputs: vec![],
            output_dir: "/tmp/out".into(),
            output_per_job: false,
            args: vec![],
            env: vec![],
            gpus: 0,
            gpu_model: None,
            gpu_slice: None,
            wait: None,
            reservation: None,
            max_output_bytes: None,
            max_output_files: None,
            allow_relayed_data: false,
            cpus: 1,
            mem_bytes: 0,
            timeout_ms: 1000,
            max_price: None,
            peer: None,
            retries: 0,
            fuel: None,
            replicas: 0,
            kind: Default::default(),
        }
    }

    /// In paused time: a follower's long poll ends at its deadline with nothing new.
    #[tokio::test(start_paused = true)]
    async fn a_follower_with_nothing_new_gets_an_empty_page_at_its_deadline() {
        let table = JobTable::default();
        let (id, _cancel) = table.insert(&request());
        let (waited, page) =
            timed_poll(&table, &id, 0, Duration::from_secs(30), &Skip::none()).await;
        assert_eq!(waited, Duration::from_secs(30));
        assert_eq!((page.events.len(), page.next, page.done), (0, 0, false));
        assert_eq!(
            table.events("nope", 0, Duration::from_secs(1)).await.err(),
            Some(JobLookupError::Unknown("nope".into()))
        );
    }

    fn started() -> JobEvent {
        JobEvent::Started {
            provider: "p".into(),
        }
    }

    /// A follower's long poll from `from`, and how long it waited (in paused time).
    async fn timed_poll(
        table: &JobTable,
        id: &str,
        from: usize,
        wait: Duration,
        skip: &Skip,
    ) -> (Duration, EventPage) {
        let asked = tokio::time::Instant::now();
        let page = table
            .events_skipping(id, from, wait, skip)
            .await
            .expect("events");
        (asked.elapsed(), page)
    }

    /// In paused time: events of skipped kinds do not end a follower's wait; they come
    /// with the next event that does, or at the deadline.
    #[tokio::test(start_paused = true)]
    async fn skipped_kinds_come_with_the_next_page_and_do_not_wake_a_follower() {
        let table = JobTable::default();
        let (id, _cancel) = table.insert(&request());
        let skip = Skip::parse("leased, started");
        table.push(&id, started());
        // Only a skipped event so far: the wait runs to its deadline, then brings it.
        let (waited, page) = timed_poll(&table, &id, 0, Duration::from_secs(5), &skip).await;
        assert_eq!(waited, Duration::from_secs(5));
        assert_eq!(page.events.len(), 1);
        assert_eq!(page.next, 1);
        // A skipped event then one that wakes: one page with both, at once.
        let t = table.clone();
        let idc = id.clone();
        let pusher = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            t.push(&idc, started());
            tokio::time::sleep(Duration::from_secs(1)).await;
            t.push(
                &idc,
                JobEvent::Stdout {
                    data: b"x".to_vec(),
                },
            );
        });
        let (waited, page) = timed_poll(&table, &id, 1, Duration::from_secs(30), &skip).await;
        pusher.await.expect("pusher");
        assert_eq!(waited, Duration::from_secs(2));
        let kinds: Vec<&str> = page.events.iter().map(JobEvent::kind).collect();
        assert_eq!(kinds, ["started", "stdout"]);
        assert_eq!(page.next, 3);
        // Without a skip, the same follower is woken by the first.
        table.push(
            &id,
            JobEvent::Leased {
                provider: "p".into(),
                lease_id: "l".into(),
                price_per_gpu_hour: 1.0,
            },
        );
        let (waited, page) =
            timed_poll(&table, &id, 3, Duration::from_secs(30), &Skip::none()).await;
        assert_eq!(waited, Duration::ZERO);
        assert_eq!(page.events.len(), 1);
    }

    /// In paused time: a follower whose events were all dropped from the log (one chunk
    /// larger than the log) is answered at once with the new position, not at the deadline.
    #[tokio::test(start_paused = true)]
    async fn a_follower_behind_a_dropped_chunk_is_answered_at_once() {
        let table = JobTable::default();
        let (id, _cancel) = table.insert(&request());
        table.push(
            &id,
            JobEvent::Stdout {
                data: vec![0; MAX_LOG_BYTES + 1],
            },
        );
        let (waited, page) =
            timed_poll(&table, &id, 0, Duration::from_secs(30), &Skip::none()).await;
        assert_eq!(waited, Duration::ZERO);
        assert_eq!((page.events.len(), page.next), (0, 1));
    }

    /// The summary of a job that exited 0 on provider `p`, its receipt `receipt`.
    fn summary(receipt: &str) -> Box<JobSummary> {
        Box::new(JobSummary {
            provider: "p".into(),
            lease_id: "l".into(),
            outcome: gpunode_protocol::job::JobOutcome::Exited(0),
            exit_code: 0,
            wall_ms: 3,
            run_ms: 1,
            cost: 0.5,
            receipt: receipt.into(),
            output_digest: String::new(),
            replicas: Vec::new(),
            output_dir: PathBuf::from("/out"),
            outputs: vec!["a.txt".into()],
            attempts: 1,
            module_cached: true,
            gpu: None,
        })
    }

    /// In paused time: `done` is only on the pages of a follower that asks for it (an
    /// older client never meets a kind it cannot read), and wakes only that follower.
    #[tokio::test(start_paused = true)]
    async fn done_reaches_only_the_followers_that_ask_for_it() {
        let table = JobTable::default();
        let (id, _cancel) = table.insert(&request());
        table.push(&id, started());
        table.push(
            &id,
            JobEvent::Done {
                summary: summary("pending"),
            },
        );
        let asks = Skip::parse("started").with("done,finished,unknown");
        assert_eq!(asks.with, ["done"], "only kinds that must be asked for");
        let (waited, page) = timed_poll(&table, &id, 0, Duration::from_secs(30), &asks).await;
        assert_eq!(
            waited,
            Duration::ZERO,
            "done wakes a follower that asks for it"
        );
        let kinds: Vec<&str> = page.events.iter().map(JobEvent::kind).collect();
        assert_eq!(
            (kinds, page.next, page.done),
            (vec!["started", "done"], 2, false)
        );
        // A follower that does not ask: not woken, and `done` is not on its page.
        let older = Skip::parse("started");
        let (waited, page) = timed_poll(&table, &id, 0, Duration::from_secs(30), &older).await;
        assert_eq!(waited, Duration::from_secs(30));
        let kinds: Vec<&str> = page.events.iter().map(JobEvent::kind).collect();
        assert_eq!((kinds, page.next), (vec!["started"], 2));
        let json = serde_json::to_string(&page).expect("json");
        assert!(!json.contains(r#""type":"done""#), "{json}");
        // From past `done`, with nothing new: it is not there to wake anyone either.
        let (waited, page) = timed_poll(&table, &id, 2, Duration::from_secs(5), &asks).await;
        assert_eq!((waited, page.events.len()), (Duration::from_secs(5), 0));
        // The settled summary ends the job for every follower.
        table.push(
            &id,
            JobEvent::Finished {
                summary: summary("settled"),
            },
        );
        for skip in [&asks, &older] {
            let (waited, page) = timed_poll(&table, &id, 2, Duration::from_secs(30), skip).await;
            assert_eq!(waited, Duration::ZERO);
            let kinds: Vec<&str> = page.events.iter().map(JobEvent::kind).collect();
            assert_eq!((kinds, page.done), (vec!["finished"], true));
        }
        assert_eq!(
            table.get(&id).expect("job").summary.map(|s| s.receipt),
            Some("settled".to_string())
        );
    }

    #[test]
    fn a_skip_list_keeps_known_kinds_only_and_each_kind_is_its_wire_type() {
        assert_eq!(Skip::parse(""), Skip::none());
        assert_eq!(
            Skip::parse("started,,started , leased").skip,
            ["started", "leased"]
        );
        // A kind this node does not know is left out (a newer client's), not an error.
        assert_eq!(
            Skip::parse("started,newer_kind,x".repeat(3).as_str()).skip,
            ["started"]
        );
        let samples = [
            JobEvent::Leased {
                provider: "p".into(),
                lease_id: "l".into(),
                price_per_gpu_hour: 1.0,
            },
            JobEvent::Progress {
                direction: "up".into(),
                name: "n".into(),
                done: 1,
                total: 2,
            },
            JobEvent::Started {
                provider: "p".into(),
            },
            JobEvent::Stdout { data: vec![1] },
            JobEvent::Stderr { data: vec![2] },
            JobEvent::Waiting {
                reasons: vec![],
                queue: None,
            },
            JobEvent::Retrying {
                provider: "p".into(),
                reason: "r".into(),
                attempt: 2,
            },
            JobEvent::Done {
                summary: summary("pending"),
            },
            JobEvent::Finished {
                summary: summary("settled"),
            },
            JobEvent::Failed { error: "e".into() },
        ];
        for event in &samples {
            let wire = serde_json::to_value(event).expect("json");
            assert_eq!(wire["type"], event.kind());
            assert!(JobEvent::KINDS.contains(&event.kind()));
        }
        // Every kind is sampled.
        let sampled: Vec<&str> = samples.iter().map(JobEvent::kind).collect();
        let missing: Vec<&&str> = JobEvent::KINDS
            .iter()
            .filter(|k| !sampled.contains(k))
            .collect();
        assert!(missing.is_empty(), "{missing:?}");
    }

    #[tokio::test]
    async fn followers_see_events_in_order_and_the_end() {
        let table = JobTable::default();
        let (id, cancel) = table.insert(&request());
        let t = table.clone();
        let idc = id.clone();
        let follower = tokio::spawn(async move {
            let mut from = 0;
            let mut seen = Vec::new();
            loop {
                let page = t
                    .events(&idc[..6], from, Duration::from_secs(5))
                    .await
                    .unwrap();
                seen.extend(page.events);
                from = page.next;
                if page.done {
                    return seen;
                }
            }
        });
        table.push(
            &id,
            JobEvent::Stdout {
                data: b"a".to_vec(),
            },
        );
        table.push(
            &id,
            JobEvent::Stdout {
                data: b"b".to_vec(),
            },
        );
        assert_eq!(table.cancel(&id), Ok(id.clone()));
        assert!(*cancel.borrow());
        table.push(
            &id,
            JobEvent::Failed {
                error: "cancelled".into(),
            },
        );
        let seen = follower.await.unwrap();
        assert_eq!(seen.len(), 3);
        assert_eq!(table.get(&id).unwrap().state, JobState::Cancelled);
        assert!(
            table.cancel(&id).is_err(),
            "a finished job cannot be cancelled"
        );
        assert!(table.get("zz").is_err());
    }

    #[test]
    fn log_is_bounded_from_the_front_and_positions_stay_valid() {
        let table = JobTable::default();
        let (id, _) = table.insert(&request());
        for i in 0..20u8 {
            table.push(
                &id,
                JobEvent::Stdout {
                    data: vec![i; 1 << 20],
                },
            );
        }
        {
            let map = table.lock();
            let e = &map[&id];
            assert!(e.log_bytes <= MAX_LOG_BYTES);
            assert_eq!(e.view.log_bytes_dropped, 12 << 20);
            assert_eq!(e.offset + e.events.len(), 20);
        }
        // A follower at position 15 gets events 15.. exactly; one behind the front gets
        // what is left.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let page = rt.block_on(table.events(&id, 15, Duration::ZERO)).unwrap();
        assert_eq!(page.next, 20);
        assert_eq!(page.events.len(), 5);
        assert!(matches!(&page.events[0], JobEvent::Stdout { data } if data[0] == 15));
        let page = rt.block_on(table.events(&id, 0, Duration::ZERO)).unwrap();
        assert!(matches!(&page.events[0], JobEvent::Stdout { data } if data[0] == 12));
    }
}
