//! One attempt on a leased provider: open the job stream, upload what the provider
//! lacks, relay the task's output as it comes, download and verify the output files.

use std::collections::HashMap;

use futures::{AsyncReadExt, AsyncWriteExt};
use gpunode_protocol::job::{
    BlobHash, JobOutcome, JobRefusal, JobReport, ProviderMsg, RequesterMsg,
};
use gpunode_protocol::lease::LeaseId;
use libp2p::PeerId;
use tokio::sync::watch;

use super::{outputs, wire};
use super::{JOB_ENDS_LEASE_PROTOCOL, JOB_PROTOCOL};
use crate::router::framing;
use crate::LeaseView;

use super::ahead::{close_unused, StreamAhead};
use super::prepare::{LocalFile, Prepared};
use super::types::*;
use super::*;

/// How one attempt ended.
pub(super) enum Attempt {
    Done(JobReport),
    /// The provider refused or failed; another may do.
    Retry(String),
    /// No provider can do this (the module or request is bad).
    Fatal(String),
    /// The provider is reachable only through a relay and job data may not go that
    /// way: another may do, and the provider is not at fault.
    OnlyRelayed(String),
}

impl Requester {
    /// Job data goes over a direct connection: a provider reached only through a relay
    /// gets [`PUNCH_WAIT`] for a hole punch to succeed, and is then refused with the fix,
    /// unless relayed data is allowed. `Ok(true)` where the provider was not connected at
    /// all: the job stream then dials whatever works, so its path is looked at once it is
    /// open ([`Requester::on_allowed_path`]).
    async fn direct_or_allowed(&self, provider: PeerId, req: &JobRequest) -> Result<bool, String> {
        if self.relayed_data_allowed(req) {
            return Ok(false);
        }
        let deadline = tokio::time::Instant::now() + PUNCH_WAIT;
        loop {
            match self.path_to(provider).await {
                Some(crate::views::LinkPath::Relayed) => {}
                // A new stream takes a direct connection (our copy of libp2p-stream
                // prefers them).
                Some(crate::views::LinkPath::Direct) => return Ok(false),
                None => return Ok(true),
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(only_relayed(provider));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn relayed_data_allowed(&self, req: &JobRequest) -> bool {
        self.relayed_data || req.allow_relayed_data
    }

    async fn path_to(&self, provider: PeerId) -> Option<crate::views::LinkPath> {
        self.negotiator
            .loop_client()
            .path_to(provider)
            .await
            .ok()
            .flatten()
    }

    /// `stream`, opened to `provider` by a dial, where job data may take its path: a
    /// stream takes a direct connection wherever one exists (our copy of libp2p-stream
    /// prefers them), so where none exists once it is open it runs through a relay. Such
    /// a stream is closed, and the provider gets the wait for a hole punch and one more
    /// stream. Not caught: a hole punch that ends between the stream's opening on a
    /// relayed connection and this look (the stream then dies with the relayed
    /// connection, and the attempt is retried).
    async fn on_allowed_path(
        &self,
        provider: PeerId,
        req: &JobRequest,
        opened: (libp2p::Stream, bool),
    ) -> Result<(libp2p::Stream, bool), Attempt> {
        if self.path_to(provider).await == Some(crate::views::LinkPath::Direct) {
            return Ok(opened);
        }
        close_unused(opened.0).await;
        self.direct_or_allowed(provider, req)
            .await
            .map_err(Attempt::OnlyRelayed)?;
        match self.path_to(provider).await {
            Some(crate::views::LinkPath::Direct) => {}
            Some(crate::views::LinkPath::Relayed) => {
                return Err(Attempt::OnlyRelayed(only_relayed(provider)))
            }
            None => {
                return Err(Attempt::Retry(
                    "the connection to the provider closed".into(),
                ))
            }
        }
        let one_job = req.reservation.is_none();
        let opening = open_job_stream(self.control.clone(), provider, one_job);
        match tokio::time::timeout(OPEN_TIMEOUT, opening).await {
            Ok(Ok(opened)) => Ok(opened),
            Ok(Err(e)) => Err(Attempt::Retry(format!("cannot open a job stream: {e}"))),
            Err(_) => Err(Attempt::Retry("opening a job stream timed out".into())),
        }
    }

    pub(super) async fn attempt(
        &self,
        req: &JobRequest,
        prepared: &Prepared,
        lease: &LeaseView,
        events: &mut (dyn FnMut(JobEvent) + Send),
        cancel: &mut watch::Receiver<bool>,
        (ahead, provider_ends_lease): (&StreamAhead, &mut bool),
    ) -> Attempt {
        let (Ok(provider), Ok(lease_id)) = (
            lease.provider.parse::<PeerId>(),
            lease.lease_id.parse::<LeaseId>(),
        ) else {
            return Attempt::Fatal("the lease names an invalid provider or id".into());
        };
        let dials = match self.direct_or_allowed(provider, req).await {
            Ok(dials) => dials,
            Err(why) => return Attempt::OnlyRelayed(why),
        };
        let one_job = req.reservation.is_none();
        // The stream opened ahead (waited for within its freshness), else a new one
        // with the whole of OPEN_TIMEOUT.
        let opened = match ahead.take(provider).await {
            Some(opened) => {
                self.metrics.job_streams_ahead_used.inc();
                Ok(Ok(opened))
            }
            None => {
                let opening = open_job_stream(self.control.clone(), provider, one_job);
                tokio::time::timeout(OPEN_TIMEOUT, opening).await
            }
        };
        let opened = match opened {
            Ok(Ok(opened)) => opened,
            Ok(Err(e)) => return Attempt::Retry(format!("cannot open a job stream: {e}")),
            Err(_) => return Attempt::Retry("opening a job stream timed out".into()),
        };
        let (stream, ends_lease) = if dials {
            match self.on_allowed_path(provider, req, opened).await {
                Ok(opened) => opened,
                Err(attempt) => return attempt,
            }
        } else {
            opened
        };
        *provider_ends_lease = ends_lease;
        let (mut r, mut w) = AsyncReadExt::split(stream);
        let submit = prepared.submit(req, lease_id);
        let lost = |e: std::io::Error| Attempt::Retry(format!("the provider went away: {e}"));
        if let Err(e) = framing::write_message(&mut w, &RequesterMsg::Submit(submit)).await {
            return lost(e);
        }
        if let Err(e) = w.flush().await {
            return lost(e);
        }
        let missing = match framing::read_message::<_, ProviderMsg>(&mut r).await {
            Ok(ProviderMsg::Accepted { missing }) => missing,
            Ok(ProviderMsg::Rejected(rej)) => return refused(rej),
            Ok(other) => return Attempt::Retry(format!("unexpected answer {other:?}")),
            Err(e) => return lost(e),
        };
        if let Err(e) = self.upload(prepared, &missing, &mut w, events).await {
            return lost(e);
        }

        let (report, cancel_sent) = match follow(&mut r, &mut w, lease, events, cancel).await {
            Ok(followed) => followed,
            Err(ended) => return ended,
        };
        if report.outcome == JobOutcome::Preempted {
            return Attempt::Retry(PREEMPTED.into());
        }
        if report.outcome == JobOutcome::Cancelled && !cancel_sent {
            // Not our doing: the provider ended the lease, shut down or was preempted.
            return Attempt::Retry(STOPPED_UNASKED.into());
        }
        match self.download(req, &report, &mut r, events).await {
            Ok(()) => Attempt::Done(report),
            Err(e) => Attempt::Retry(format!("downloading outputs failed: {e}")),
        }
    }

    async fn upload<W: futures::AsyncWrite + Unpin>(
        &self,
        prepared: &Prepared,
        missing: &[BlobHash],
        w: &mut W,
        events: &mut (dyn FnMut(JobEvent) + Send),
    ) -> std::io::Result<()> {
        let by_hash: HashMap<BlobHash, &LocalFile> = prepared
            .inputs
            .iter()
            .map(|f| (f.file.blob.hash, f))
            .collect();
        let program = prepared.program.blob();
        for hash in missing {
            match (program, &prepared.image) {
                (Some(blob), None) if blob.hash == *hash => {
                    wire::send_bytes(w, &prepared.module).await?;
                    continue;
                }
                (Some(blob), Some(path)) if blob.hash == *hash => {
                    let src = tokio::fs::File::open(path).await?.into_std().await;
                    let name = path
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_else(|| "image".into());
                    let mut report = progress_reporter("upload", &name, blob.size, events);
                    wire::send_blob(w, src, blob.size, &mut report).await?;
                    continue;
                }
                _ => {}
            }
            let Some(local) = by_hash.get(hash) else {
                return Err(std::io::Error::other(
                    "the provider asked for a blob this job does not have",
                ));
            };
            let size = local.file.blob.size;
            let src = tokio::fs::File::open(&local.path).await?.into_std().await;
            let name = local.file.path.clone();
            let mut report = progress_reporter("upload", &name, size, events);
            wire::send_blob(w, src, size, &mut report).await?;
        }
        w.flush().await
    }

    async fn download<R: futures::AsyncRead + Unpin>(
        &self,
        req: &JobRequest,
        report: &JobReport,
        r: &mut R,
        events: &mut (dyn FnMut(JobEvent) + Send),
    ) -> std::io::Result<()> {
        if report.outputs.is_empty() {
            return Ok(());
        }
        let limits = req.output_limits();
        // Refused before the staging directory exists: nothing is written at all.
        limits
            .check(&report.outputs)
            .map_err(std::io::Error::other)?;
        let staging = outputs::Staging::beside(&req.output_dir)?;
        let mut steps = (String::new(), ProgressSteps::default());
        outputs::receive_outputs(&staging, &report.outputs, &limits, r, |f, done| {
            if steps.0 != f.path {
                steps = (f.path.clone(), ProgressSteps::default());
            }
            if steps.1.due(done, f.blob.size) {
                events(JobEvent::Progress {
                    direction: "download".into(),
                    name: f.path.clone(),
                    done,
                    total: f.blob.size,
                });
            }
        })
        .await?;
        staging.commit(&req.output_dir)
    }
}

/// When to report a transfer's progress: every 8 MiB and at the end (small files: never).
#[derive(Default)]
struct ProgressSteps {
    last: u64,
}

impl ProgressSteps {
    fn due(&mut self, done: u64, total: u64) -> bool {
        const STEP: u64 = 8 << 20;
        let due = total >= STEP && (done.saturating_sub(self.last) >= STEP || done == total);
        if due {
            self.last = done;
        }
        due
    }
}

/// Progress events for one file: every 8 MiB and at the end (small files: none).
fn progress_reporter<'a>(
    direction: &'a str,
    name: &'a str,
    total: u64,
    events: &'a mut (dyn FnMut(JobEvent) + Send),
) -> impl FnMut(u64) + 'a {
    let mut steps = ProgressSteps::default();
    move |done| {
        if steps.due(done, total) {
            events(JobEvent::Progress {
                direction: direction.to_string(),
                name: name.to_string(),
                done,
                total,
            });
        }
    }
}

pub(super) fn refused(rej: gpunode_protocol::job::JobRejection) -> Attempt {
    match rej.code {
        JobRefusal::InvalidModule | JobRefusal::BadRequest => Attempt::Fatal(rej.message),
        _ => Attempt::Retry(rej.message),
    }
}

/// Follows the run until its report: the provider's events are passed on, and a cancel
/// is passed on once, after which the provider has [`CANCEL_GRACE`] to confirm. Returns
/// the report and whether this side cancelled; `Err` is how the attempt ended instead.
async fn follow<R, W>(
    r: &mut R,
    w: &mut W,
    lease: &LeaseView,
    events: &mut (dyn FnMut(JobEvent) + Send),
    cancel: &mut watch::Receiver<bool>,
) -> Result<(JobReport, bool), Attempt>
where
    R: futures::AsyncRead + Unpin,
    W: futures::AsyncWrite + Unpin,
{
    let mut cancel_sent = false;
    let mut cancel_deadline: Option<tokio::time::Instant> = None;
    loop {
        let next = framing::read_message::<_, ProviderMsg>(r);
        let msg = tokio::select! {
            m = next => m,
            _ = cancel.changed(), if !cancel_sent => {
                cancel_sent = true;
                cancel_deadline = Some(tokio::time::Instant::now() + CANCEL_GRACE);
                let _ = framing::write_message(w, &RequesterMsg::Cancel).await;
                let _ = w.flush().await;
                continue;
            }
            _ = sleep_until_opt(cancel_deadline) => {
                return Err(Attempt::Fatal("cancelled (the provider did not confirm)".into()));
            }
        };
        match msg {
            Ok(ProviderMsg::Started) => events(JobEvent::Started {
                provider: lease.provider.clone(),
            }),
            Ok(ProviderMsg::Stdout(data)) => events(JobEvent::Stdout { data }),
            Ok(ProviderMsg::Stderr(data)) => events(JobEvent::Stderr { data }),
            Ok(ProviderMsg::Finished(report)) => return Ok((report, cancel_sent)),
            Ok(ProviderMsg::Rejected(rej)) => return Err(refused(rej)),
            Ok(ProviderMsg::Accepted { .. }) => {
                return Err(Attempt::Retry("the provider repeated itself".into()))
            }
            Err(e) => return Err(Attempt::Retry(format!("the provider went away: {e}"))),
        }
    }
}

/// Why a job is not sent to `provider`: it is reached only through a relay, and what to do.
fn only_relayed(provider: PeerId) -> String {
    format!(
        "provider {provider} is reachable only through a team relay (hole punching failed, \
         e.g. behind a symmetric NAT), and job data does not go through relays unless allowed: \
         rerun with --allow-relayed-data (or set allow_relayed_data = true in the config), \
         or forward the provider's port (gpunode doctor on it names the port)"
    )
}

/// Opens the job stream to `provider`: for a lease's only job, the variant on which the
/// provider ends the lease with the job (true), or, where the provider does not serve it
/// (an older version), the first job protocol (false).
pub(super) async fn open_job_stream(
    mut control: libp2p_stream::Control,
    provider: PeerId,
    one_job: bool,
) -> Result<(libp2p::Stream, bool), libp2p_stream::OpenStreamError> {
    if one_job {
        match control.open_stream(provider, JOB_ENDS_LEASE_PROTOCOL).await {
            Ok(s) => return Ok((s, true)),
            Err(libp2p_stream::OpenStreamError::UnsupportedProtocol(_)) => {}
            Err(e) => return Err(e),
        }
    }
    let s = control.open_stream(provider, JOB_PROTOCOL).await?;
    Ok((s, false))
}
