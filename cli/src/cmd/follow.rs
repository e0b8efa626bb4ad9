//! Following a job: the job calls (submit, events, cancel) on a [`Target`], and the loop
//! that prints a job's events as they arrive (output, transfer progress bars, provider
//! changes) until it ends. Used by `gpunode run` and `gpunode logs --follow`.

use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::time::Duration;

use anyhow::Result;
use gpunode_node::jobs::table::{EventPage, Skip};
use gpunode_node::jobs::{JobEvent, JobRequest, JobSummary, JobView};
use gpunode_protocol::job::JobOutcome;
use indicatif::{ProgressBar, ProgressStyle};

use crate::helpers::url_segment;
use crate::output;
use crate::target::Target;

/// How long one events request waits for something new.
const POLL_WAIT_MS: u64 = 1000;

/// Job calls, to the daemon's API or the in-process node.
impl Target {
    /// Submits a job.
    pub async fn submit(&self, req: JobRequest) -> Result<JobView> {
        Ok(match self {
            Target::Daemon(c) => c.post_json("/v1/jobs", &req).await?,
            Target::Local(node) => node.handle.submit_job(req),
        })
    }

    /// A job's events from `from` on, waiting up to `wait_ms` for a new one of a kind
    /// not in `skip` (comma-separated kinds, `""` for none; a daemon too old to know
    /// `skip` wakes for every event), with the kinds `with` asks for (`done`; a daemon
    /// too old to know one never sends it).
    pub async fn events(
        &self,
        id: &str,
        from: usize,
        wait_ms: u64,
        (skip, with): (&str, &str),
    ) -> Result<EventPage> {
        Ok(match self {
            Target::Daemon(c) => {
                c.get_json(&format!(
                    "/v1/jobs/{}/events?from={from}&wait_ms={wait_ms}&skip={skip}&with={with}",
                    url_segment(id)
                ))
                .await?
            }
            Target::Local(node) => {
                let skip = Skip::parse(skip).with(with);
                node.handle
                    .job_events_skipping(id, from, Duration::from_millis(wait_ms), &skip)
                    .await
                    .map_err(anyhow::Error::msg)?
            }
        })
    }

    /// Stops a job.
    pub async fn cancel_job(&self, id: &str) -> Result<()> {
        match self {
            Target::Daemon(c) => {
                let _: serde_json::Value = c
                    .post_json(
                        &format!("/v1/jobs/{}/cancel", url_segment(id)),
                        &serde_json::json!({}),
                    )
                    .await?;
            }
            Target::Local(node) => {
                node.handle.cancel_job(id).map_err(anyhow::Error::msg)?;
            }
        }
        Ok(())
    }
}

/// Where following a job stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Until {
    /// Its receipt is settled (or the wait for it is over): the summary's cost is final.
    Settled,
    /// Its result and output files are in (`done`), and the daemon settles the receipt
    /// on its own: for a run that prints no summary. With an in-process node, which
    /// stops when the command returns, this follows to [`Until::Settled`].
    Outputs,
}

/// How a followed job ended.
pub enum End {
    /// It ran to the end (whatever its exit code).
    Finished(Box<JobSummary>),
    /// It could not run, or the events ended without a result.
    Failed(String),
}

/// Progress bars for large transfers, one per file, only on a terminal.
struct Bars {
    enabled: bool,
    bars: HashMap<(String, String), ProgressBar>,
}

impl Bars {
    fn update(&mut self, direction: &str, name: &str, done: u64, total: u64) {
        if !self.enabled {
            return;
        }
        let bar = self
            .bars
            .entry((direction.to_string(), name.to_string()))
            .or_insert_with(|| {
                let bar = ProgressBar::new(total);
                if let Ok(style) = ProgressStyle::with_template(
                    "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
                ) {
                    bar.set_style(style.progress_chars("=> "));
                }
                bar.set_message(format!("{direction} {name}"));
                bar
            });
        bar.set_position(done);
        if done >= total {
            bar.finish_and_clear();
        }
    }

    fn clear(&mut self) {
        for bar in self.bars.values() {
            bar.finish_and_clear();
        }
    }
}

/// Follows a job's events to its end (or as far as `until` says), printing output;
/// Ctrl-C cancels it when `cancel_on_interrupt`.
pub async fn follow(
    target: &Target,
    job_id: &str,
    (quiet, until): (bool, Until),
    cancel_on_interrupt: bool,
) -> Result<End> {
    let mut bars = Bars {
        enabled: !quiet && std::io::stderr().is_terminal(),
        bars: HashMap::new(),
    };
    // Kinds `print_events` shows nothing for here: no wake-up, and no new request,
    // for each (they arrive with the next page).
    let skip = match (quiet, bars.enabled) {
        (true, _) => "leased,started,progress",
        (false, false) => "started,progress",
        (false, true) => "started",
    };
    let with = match (until, target) {
        (Until::Outputs, Target::Daemon(_)) => "done",
        _ => "",
    };
    let mut from = 0;
    let mut interrupted = false;
    let mut ctrl_c = Box::pin(tokio::signal::ctrl_c());
    loop {
        let page = tokio::select! {
            p = target.events(job_id, from, POLL_WAIT_MS, (skip, with)) => Some(p?),
            _ = &mut ctrl_c, if cancel_on_interrupt => None,
        };
        let Some(page) = page else {
            if interrupted {
                anyhow::bail!("interrupted; job {job_id} may still be stopping");
            }
            interrupted = true;
            eprintln!("gpunode: cancelling job {job_id} (Ctrl-C again to leave it)");
            target.cancel_job(job_id).await.ok();
            ctrl_c = Box::pin(tokio::signal::ctrl_c());
            continue;
        };
        from = page.next;
        let end = print_events(page.events, &mut bars, quiet)?;
        if let Some(end) = end {
            bars.clear();
            return Ok(end);
        }
        if page.done {
            bars.clear();
            return Ok(End::Failed("the job ended without a result".into()));
        }
    }
}

/// Prints one page of events; the job's end, if it is among them.
fn print_events(events: Vec<JobEvent>, bars: &mut Bars, quiet: bool) -> Result<Option<End>> {
    let mut out = std::io::stdout().lock();
    let mut err = std::io::stderr().lock();
    let mut end = None;
    for event in events {
        match event {
            JobEvent::Stdout { data } => {
                out.write_all(&data)?;
            }
            JobEvent::Stderr { data } => {
                err.write_all(&data)?;
            }
            JobEvent::Progress {
                direction,
                name,
                done,
                total,
            } => bars.update(&direction, &name, done, total),
            JobEvent::Leased {
                provider, lease_id, ..
            } if !quiet => {
                writeln!(
                    err,
                    "gpunode: leased from {} (lease {})",
                    output::short_peer(&provider),
                    &lease_id[..8.min(lease_id.len())]
                )?;
            }
            JobEvent::Retrying {
                provider,
                reason,
                attempt,
            } => {
                writeln!(
                    err,
                    "gpunode: provider {} failed ({reason}); retrying elsewhere (attempt {attempt})",
                    output::short_peer(&provider)
                )?;
            }
            JobEvent::Waiting { reasons, .. } => {
                writeln!(
                    err,
                    "gpunode: no provider can take the job now; waiting (Ctrl-C to give up):"
                )?;
                for (provider, reason) in &reasons {
                    writeln!(err, "  {}: {reason}", who(provider))?;
                }
            }
            // A page with both: the later, settled summary is the one kept.
            JobEvent::Done { summary } | JobEvent::Finished { summary } => {
                end = Some(End::Finished(summary))
            }
            JobEvent::Failed { error } => end = Some(End::Failed(error)),
            _ => {}
        }
    }
    out.flush()?;
    err.flush()?;
    Ok(end)
}

/// A provider named in a waiting job's reasons; `-` stands for none in particular.
pub fn who(provider: &str) -> String {
    if provider == "-" {
        "no provider".to_string()
    } else {
        output::short_peer(provider)
    }
}

/// How a task ended, in words.
pub fn outcome_words(outcome: &JobOutcome) -> String {
    match outcome {
        JobOutcome::Exited(c) => format!("exited {c}"),
        JobOutcome::Trapped(t) => format!("trapped ({t})"),
        JobOutcome::TimedOut => "timed out".into(),
        JobOutcome::OutOfFuel => "ran out of fuel".into(),
        JobOutcome::OutOfMemory => "ran out of memory".into(),
        JobOutcome::OutputTooLarge(w) => format!("output too large ({w})"),
        JobOutcome::Cancelled => "cancelled".into(),
        JobOutcome::Preempted => "preempted by the GPU's owner".into(),
    }
}
