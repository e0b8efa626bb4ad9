//! A job's stream opened while its lease's acceptance travels: the stream's protocol
//! negotiation (a round trip) overlaps the provider's activation instead of following
//! it. Nothing is sent on it until the lease is active; a stream opened for an offer
//! that did not become a lease is closed with a `Cancel`, which the provider takes
//! quietly.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures::AsyncWriteExt;
use gpunode_protocol::job::RequesterMsg;
use libp2p::{PeerId, Stream};
use tokio::sync::oneshot;

use super::OPEN_TIMEOUT;
use crate::loop_client::LoopClient;
use crate::router::framing;
use crate::views::LinkPath;

/// A job stream (and whether it is on the protocol where the provider ends the lease
/// with the job), opened or being opened ahead of the lease it is for.
#[derive(Default)]
pub(super) struct StreamAhead {
    slot: Mutex<Option<Opening>>,
}

/// How long a stream opened ahead is used for: well inside the provider's deadline for
/// a stream's first message (`FIRST_MESSAGE_DEADLINE`, 10 s), so a lease whose
/// acceptance took long gets a fresh stream rather than one about to be dropped.
const FRESH: Duration = Duration::from_secs(5);

/// A stream being opened to one provider, since `at`.
struct Opening {
    provider: PeerId,
    at: Instant,
    stream: oneshot::Receiver<(Stream, bool)>,
}

impl StreamAhead {
    /// Starts opening a one-job stream to `provider` through `control`, replacing one
    /// opened for an earlier offer. Unless `relayed_ok`, nothing is opened where the
    /// provider is reached only through a relay (job data does not go that way; the
    /// attempt waits for a hole punch and opens its own).
    pub(super) fn open(
        &self,
        control: &libp2p_stream::Control,
        client: &LoopClient,
        provider: PeerId,
        relayed_ok: bool,
    ) {
        let (tx, rx) = oneshot::channel();
        let (control, client) = (control.clone(), client.clone());
        tokio::spawn(async move {
            if !relayed_ok && !matches!(client.path_to(provider).await, Ok(Some(LinkPath::Direct)))
            {
                return;
            }
            let opening = super::transfer::open_job_stream(control, provider, true);
            if let Ok(Ok(opened)) = tokio::time::timeout(OPEN_TIMEOUT, opening).await {
                if let Err((stream, _)) = tx.send(opened) {
                    close_unused(stream).await;
                }
            }
        });
        let earlier = self
            .slot
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .replace(Opening {
                provider,
                at: Instant::now(),
                stream: rx,
            });
        if let Some(earlier) = earlier {
            earlier.discard();
        }
    }

    /// The stream opened ahead to `provider`, once it is open, if that is within
    /// [`FRESH`] of asking; `None` when there is none (the caller opens its own).
    pub(super) async fn take(&self, provider: PeerId) -> Option<(Stream, bool)> {
        let mut opening = self.clear_if(|o| o.provider == provider)?;
        let left = FRESH.saturating_sub(opening.at.elapsed());
        match tokio::time::timeout(left, &mut opening.stream).await {
            Ok(Ok(opened)) => Some(opened),
            Ok(Err(_)) => None,
            Err(_) => {
                opening.discard();
                None
            }
        }
    }

    /// Closes the stream opened ahead, if any: its offer did not become a lease.
    pub(super) fn clear(&self) {
        self.clear_if(|_| false);
    }

    /// Takes the opening out of the slot and returns it if `keep` says so; otherwise
    /// discards it.
    fn clear_if(&self, keep: impl FnOnce(&Opening) -> bool) -> Option<Opening> {
        let opening = self.slot.lock().unwrap_or_else(|p| p.into_inner()).take()?;
        if keep(&opening) {
            return Some(opening);
        }
        opening.discard();
        None
    }
}

impl Drop for StreamAhead {
    fn drop(&mut self) {
        if let Some(opening) = self
            .slot
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            opening.discard();
        }
    }
}

impl Opening {
    /// Closes the stream, once open, without a job on it.
    fn discard(self) {
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Ok((stream, _)) = self.stream.await {
                    close_unused(stream).await;
                }
            });
        }
    }
}

/// Tells the provider no job comes on `stream`, and closes it.
pub(super) async fn close_unused(mut stream: Stream) {
    let _ = framing::write_message(&mut stream, &RequesterMsg::Cancel).await;
    let _ = stream.close().await;
}
