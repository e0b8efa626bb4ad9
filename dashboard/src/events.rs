//! Live updates: `GET /events` is a Server-Sent Events stream that names the part of
//! the page that changed (`jobs`, `machine`, `credits`, `network`, `queue`, `team`), so
//! the page fetches only that part again. Each stream looks at cheap fingerprints of the
//! node's state every [`TICK`] (the network and the team, which cost more to look at,
//! every other tick); at most [`MAX_STREAMS`] are open at once per dashboard.

use std::collections::hash_map::DefaultHasher;
use std::convert::Infallible;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::Stream;
use gpunode_node::NodeHandle;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// How often a stream looks for changes.
pub const TICK: Duration = Duration::from_millis(250);
/// Streams open at once (one per open tab).
pub const MAX_STREAMS: usize = 16;

/// The parts of the page, in the order they are checked.
const SECTIONS: [&str; 6] = ["jobs", "machine", "credits", "queue", "network", "team"];

/// The streams open now.
#[derive(Clone)]
pub struct Streams(Arc<Semaphore>);

impl Default for Streams {
    fn default() -> Self {
        Streams(Arc::new(Semaphore::new(MAX_STREAMS)))
    }
}

fn fingerprint(value: &impl serde::Serialize) -> u64 {
    let mut h = DefaultHasher::new();
    serde_json::to_vec(value).unwrap_or_default().hash(&mut h);
    h.finish()
}

/// A fingerprint of one section now (`None` when the node could not answer).
async fn look(node: &NodeHandle, section: &str) -> Option<u64> {
    match section {
        "jobs" => Some(fingerprint(&node.list_jobs())),
        "machine" => {
            let (samples, alerts) = node.history().read(|h| {
                let last = h.gpus().iter().map(|g| g.hour.back().map(|s| s.t_ms));
                (last.collect::<Vec<_>>(), h.alerts().len())
            });
            let status = node.status().await.ok()?;
            Some(fingerprint(&(
                samples,
                alerts,
                status.running_jobs,
                status.inventory,
            )))
        }
        "credits" => {
            let l = node.ledger_view(1).ok()?;
            Some(fingerprint(&(l.entries, l.balance, l.unsettled.len())))
        }
        "queue" => Some(fingerprint(&node.provider_queue().await.ok()?)),
        "network" => {
            let providers = node.known_providers().await.ok()?;
            let summary: Vec<_> = providers
                .iter()
                .map(|p| (&p.offer.peer_id, p.offer.seq, p.link))
                .collect();
            Some(fingerprint(&summary))
        }
        "team" => node.team_view().await.ok().map(|t| fingerprint(&t.members)),
        _ => None,
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// `GET /events`.
pub async fn stream(State(node): State<NodeHandle>, streams: Streams) -> Response {
    let Ok(permit) = streams.0.clone().try_acquire_owned() else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{MAX_STREAMS} dashboard pages are open already; close one"),
        )
            .into_response();
    };
    Sse::new(changes(node, permit))
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

fn changes(
    node: NodeHandle,
    permit: OwnedSemaphorePermit,
) -> impl Stream<Item = Result<Event, Infallible>> {
    futures::stream::unfold(
        (
            node,
            permit,
            Vec::<Option<u64>>::new(),
            Vec::<&str>::new(),
            0u64,
        ),
        |(node, permit, mut seen, mut due, mut ticks)| async move {
            loop {
                if let Some(section) = due.pop() {
                    let event = Event::default()
                        .event(section)
                        .data(serde_json::json!({ "at_ms": unix_ms() }).to_string());
                    return Some((Ok(event), (node, permit, seen, due, ticks)));
                }
                if !seen.is_empty() {
                    tokio::time::sleep(TICK).await;
                }
                ticks += 1;
                let mut now = Vec::with_capacity(SECTIONS.len());
                for (i, s) in SECTIONS.iter().enumerate() {
                    let costly = matches!(*s, "network" | "team");
                    if costly && ticks % 2 == 0 && !seen.is_empty() {
                        now.push(seen[i]);
                    } else {
                        now.push(look(&node, s).await);
                    }
                }
                if !seen.is_empty() {
                    due = SECTIONS
                        .iter()
                        .zip(now.iter().zip(&seen))
                        .filter(|(_, (a, b))| a != b)
                        .map(|(s, _)| *s)
                        .collect();
                } else {
                    // The first look only sets the baseline; the page has just loaded.
                    due = vec!["hello"];
                }
                seen = now;
            }
        },
    )
}
