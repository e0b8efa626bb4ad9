//! `gpunode jobs`, `logs`, `cancel` and `why`: jobs live in the daemon, so these need
//! it running.

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use gpunode_node::jobs::{JobEvent, JobState, JobView, Waiting};
use gpunode_node::DataDir;
use gpunode_protocol::units::format_age;

use crate::args::{JobArgs, LogsArgs, WhyArgs};
use crate::cmd::follow::{follow, outcome_words, who, End, Until};
use crate::helpers::print_json;
use crate::output;
use crate::target::{Target, JOBS_NEED_DAEMON};

/// `gpunode jobs`.
pub async fn jobs(data_dir: DataDir, json: bool) -> Result<ExitCode> {
    let api = Target::require_daemon(&data_dir, JOBS_NEED_DAEMON).await?;
    let views: Vec<JobView> = api.get_json("/v1/jobs").await?;
    if json {
        print_json(&views)?;
    } else {
        output::print_jobs(&mut std::io::stdout().lock(), &views)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `gpunode logs`.
pub async fn logs(data_dir: DataDir, args: LogsArgs) -> Result<ExitCode> {
    let target = Target::Daemon(Target::require_daemon(&data_dir, JOBS_NEED_DAEMON).await?);
    if args.follow {
        return match follow(&target, &args.job, (true, Until::Settled), false).await? {
            End::Finished(s) => Ok(ExitCode::from(s.exit_code.clamp(0, 255) as u8)),
            End::Failed(e) => anyhow::bail!("job {} failed: {e}", args.job),
        };
    }
    let mut from = 0;
    loop {
        let page = target.events(&args.job, from, 0, ("", "")).await?;
        let mut out = std::io::stdout().lock();
        let mut err = std::io::stderr().lock();
        for event in &page.events {
            match event {
                JobEvent::Stdout { data } => out.write_all(data)?,
                JobEvent::Stderr { data } => err.write_all(data)?,
                _ => {}
            }
        }
        if page.next == from || page.done {
            return Ok(ExitCode::SUCCESS);
        }
        from = page.next;
    }
}

/// `gpunode cancel`.
pub async fn cancel(data_dir: DataDir, args: JobArgs) -> Result<ExitCode> {
    let target = Target::Daemon(Target::require_daemon(&data_dir, JOBS_NEED_DAEMON).await?);
    target.cancel_job(&args.job).await?;
    println!("Job {} is being cancelled.", args.job);
    Ok(ExitCode::SUCCESS)
}

/// `gpunode why JOB`.
pub async fn why(data_dir: DataDir, args: WhyArgs) -> Result<ExitCode> {
    let api = Target::require_daemon(&data_dir, JOBS_NEED_DAEMON).await?;
    let views: Vec<JobView> = api.get_json("/v1/jobs").await?;
    let found: Vec<&JobView> = views
        .iter()
        .filter(|j| j.job_id.starts_with(&args.job))
        .collect();
    let job = match found.as_slice() {
        [one] => *one,
        [] => anyhow::bail!("no job {} here; `gpunode jobs` lists them", args.job),
        _ => anyhow::bail!(
            "'{}' starts more than one job id; give more of it",
            args.job
        ),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(job)?);
    } else {
        print!("{}", explain(job, gpunode_protocol::time::now_ms()));
    }
    Ok(ExitCode::SUCCESS)
}

/// A job's state in sentences: for a waiting job, what each provider said and what
/// would make it run sooner.
pub fn explain(j: &JobView, now: u64) -> String {
    let id = &j.job_id;
    let on = |p: &Option<String>| p.as_deref().map(output::short_peer).unwrap_or_default();
    match j.state {
        JobState::Waiting => match &j.waiting {
            Some(w) => explain_waiting(id, w, now),
            None => format!("Job {id} is waiting for a provider.\n"),
        },
        JobState::Leasing => format!("Job {id} is asking providers for a lease right now.\n"),
        JobState::Uploading => format!(
            "Job {id} has a lease on {} and is sending its files.\n",
            on(&j.provider)
        ),
        JobState::Running => format!("Job {id} is running on {}.\n", on(&j.provider)),
        JobState::Finished => format!(
            "Job {id} ran on {} and {}.\n",
            on(&j.provider),
            j.summary
                .as_ref()
                .map_or("ended".to_string(), |s| outcome_words(&s.outcome))
        ),
        JobState::Failed => format!(
            "Job {id} could not run: {}\n",
            j.error.as_deref().unwrap_or("no reason recorded")
        ),
        JobState::Cancelled => format!("Job {id} was cancelled.\n"),
    }
}

/// A waiting job: for how long, its best place in a queue, each provider's reason, and
/// what would help.
fn explain_waiting(id: &str, w: &Waiting, now: u64) -> String {
    let mut s = format!(
        "Job {id} has been waiting for a provider for {}: none can take it now.\n",
        format_age(Duration::from_millis(now.saturating_sub(w.since_ms)))
    );
    if let Some((provider, q)) = &w.queue {
        let when = match q.estimated_start_ms {
            Some(t) if t > now => format!(
                "is estimated to start in {} (at {})",
                format_age(Duration::from_millis(t - now)),
                output::format_utc(t)
            ),
            Some(_) => "should start any moment".to_string(),
            None => "has no estimated start yet".to_string(),
        };
        s.push_str(&format!(
            "Its best place is at {}: position {} of {} in its queue; it {when}.\n",
            output::short_peer(provider),
            q.position,
            q.of
        ));
    }
    for (provider, reason) in &w.reasons {
        s.push_str(&format!("  {}: {reason}\n", who(provider)));
    }
    s.push_str(&format!(
        "It starts as soon as one can: it asks again every few seconds. To start sooner, ask for less (fewer GPUs, another model: see `gpunode offers`), or cancel it with `gpunode cancel {id}`.\n"
    ));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(state: JobState) -> JobView {
        serde_json::from_value(serde_json::json!({
            "job_id": "a1b2c3d4e5f60708",
            "module": "t.wasm",
            "args": [],
            "state": state,
            "provider": null,
            "lease_id": null,
            "submitted_ms": 0,
            "ended_ms": null,
            "summary": null,
            "error": null,
            "log_bytes_dropped": 0
        }))
        .expect("view")
    }

    #[test]
    fn why_names_each_providers_reason_and_what_would_help() {
        let mut j = view(JobState::Waiting);
        j.waiting = Some(Waiting {
            since_ms: 1_000,
            reasons: vec![
                (
                    "12D3KooWAbCdEfGhIjKlMnOpQrStUvWxYz1234567890abcdef".into(),
                    "no GPU free; 0 of 1 GPUs free".into(),
                ),
                (
                    "-".into(),
                    "no provider offers 2 GPU(s) of model H100".into(),
                ),
            ],
            queue: None,
        });
        let text = explain(&j, 181_000);
        assert!(text.contains("waiting for a provider for 3m"), "{text}");
        assert!(text.contains(": no GPU free; 0 of 1 GPUs free"), "{text}");
        assert!(
            text.contains("no provider: no provider offers 2 GPU(s)"),
            "{text}"
        );
        assert!(text.contains("gpunode cancel a1b2c3d4e5f60708"), "{text}");
        assert!(!text.contains("best place"), "{text}");

        // Queued: its best place and estimated start come first.
        j.waiting.as_mut().expect("waiting").queue = Some((
            "12D3KooWAbCdEfGhIjKlMnOpQrStUvWxYz1234567890abcdef".into(),
            gpunode_protocol::lease::QueuePlace {
                position: 2,
                of: 3,
                estimated_start_ms: Some(481_000),
                reason: "GPU 0 is leased until 00:08:01 UTC".into(),
            },
        ));
        let text = explain(&j, 181_000);
        assert!(
            text.contains("position 2 of 3 in its queue; it is estimated to start in 5m"),
            "{text}"
        );
        assert!(text.contains("1970-01-01 00:08:01 UTC"), "{text}");
        let mut failed = view(JobState::Failed);
        failed.error = Some("the module is not a WASI command".into());
        assert_eq!(
            explain(&failed, 0),
            "Job a1b2c3d4e5f60708 could not run: the module is not a WASI command\n"
        );
    }
}
