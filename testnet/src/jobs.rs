//! Helpers for jobs in test networks: the WAT tasks under `testnet/tasks/`, job
//! requests with test defaults, and following a job's events.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Result};
use gpunode_node::jobs::{JobEvent, JobRequest, JobSummary};
use gpunode_node::NodeHandle;

/// A task file shipped with this crate (`copy.wat`, `spin.wat`).
pub fn task(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tasks")
        .join(name)
}

/// A request for `module` with one CPU, 256 MiB, a minute, two retries; chain
/// [`JobRequest`]'s setters for more.
pub fn request(module: PathBuf, output_dir: &Path) -> JobRequest {
    JobRequest::new(module, output_dir)
        .mem_bytes(256 << 20)
        .timeout_ms(60_000)
}

/// Reads a job's events from `*from` on until `stop` accepts one or the job ends.
pub async fn events_until(
    handle: &NodeHandle,
    job_id: &str,
    from: &mut usize,
    timeout: Duration,
    stop: impl Fn(&JobEvent) -> bool,
) -> Result<Vec<JobEvent>> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut seen = Vec::new();
    loop {
        let page = handle
            .job_events(job_id, *from, Duration::from_millis(200))
            .await
            .map_err(anyhow::Error::msg)?;
        // Events after a hit stay for the next call.
        let first = page.next - page.events.len();
        *from = page.next;
        for (i, e) in page.events.into_iter().enumerate() {
            let hit = stop(&e);
            seen.push(e);
            if hit {
                *from = first + i + 1;
                return Ok(seen);
            }
        }
        if page.done {
            return Ok(seen);
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("job {job_id} did not get there within {timeout:?}; events so far: {seen:?}");
        }
    }
}

/// Events up to the task's start on a provider.
pub async fn until_started(
    handle: &NodeHandle,
    job_id: &str,
    from: &mut usize,
) -> Result<Vec<JobEvent>> {
    events_until(handle, job_id, from, Duration::from_secs(60), |e| {
        matches!(e, JobEvent::Started { .. })
    })
    .await
}

/// Events up to the job's end.
pub async fn until_end(
    handle: &NodeHandle,
    job_id: &str,
    from: &mut usize,
) -> Result<Vec<JobEvent>> {
    events_until(handle, job_id, from, Duration::from_secs(60), |e| {
        matches!(e, JobEvent::Finished { .. } | JobEvent::Failed { .. })
    })
    .await
}

/// The end of a job: its summary, or the error it failed with.
pub fn outcome(events: &[JobEvent]) -> Option<Result<JobSummary, String>> {
    events.iter().rev().find_map(|e| match e {
        JobEvent::Finished { summary } => Some(Ok((**summary).clone())),
        JobEvent::Failed { error } => Some(Err(error.clone())),
        _ => None,
    })
}

/// Submits a job and follows it to its end.
pub async fn run_to_end(
    handle: &NodeHandle,
    req: JobRequest,
    timeout: Duration,
) -> Result<(Vec<JobEvent>, Result<JobSummary, String>)> {
    let view = handle.submit_job(req);
    let mut from = 0;
    let events = events_until(handle, &view.job_id, &mut from, timeout, |e| {
        matches!(e, JobEvent::Finished { .. } | JobEvent::Failed { .. })
    })
    .await?;
    let Some(end) = outcome(&events) else {
        bail!("job {} ended without a result: {events:?}", view.job_id)
    };
    Ok((events, end))
}

/// Everything the task printed to stdout.
pub fn stdout_of(events: &[JobEvent]) -> Vec<u8> {
    events
        .iter()
        .filter_map(|e| match e {
            JobEvent::Stdout { data } => Some(data.as_slice()),
            _ => None,
        })
        .flatten()
        .copied()
        .collect()
}
