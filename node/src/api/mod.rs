//! The local API: HTTP over a Unix socket in the data directory (mode 0600), used by the
//! CLI to talk to the running daemon, plus `/metrics` in Prometheus text format (also
//! servable on a localhost TCP port).
//!
//! Routes: `GET /v1/status`, `GET /v1/offers?gpu_model=&min_gpu_mem=&gpus=&backend=`,
//! `GET /v1/leases`, `POST /v1/leases` (a [`crate::LeaseSpec`]),
//! `POST /v1/leases/{id}/renew` (`{"extend_ms": N}`), `POST /v1/leases/{id}/cancel`,
//! `GET /v1/jobs`, `POST /v1/jobs` (a [`crate::jobs::JobRequest`]), `GET /v1/jobs/{id}`,
//! `GET /v1/jobs/{id}/events?from=N&wait_ms=M&skip=KINDS&with=KINDS` (long poll), `POST /v1/jobs/{id}/cancel`,
//! `GET /v1/ledger?recent=N`, `GET /v1/ledger/verify`, `GET /v1/ledger/export?format=csv|json`,
//! `GET /v1/peers`, `GET /v1/team`, `POST /v1/team/invite` (role, uses, expires_ms),
//! `POST /v1/team/add` and `POST /v1/team/revoke` (`{"peer": ID}`), `GET|POST
//! /v1/team/policy` (`{"text": TOML}`), `GET /metrics`; and the dashboard's views:
//! `GET /v1/network?limit=N`, `GET /v1/machine?range=hour|day`, `GET /v1/queue`,
//! `GET /v1/utilization?format=json|csv`, `GET /v1/ledger/history?points=N`. The web
//! dashboard serves [`read_routes`] (every `GET` above but `/metrics`) as they are.
//! `docs/api.md` documents each answer.

mod client;

use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::extract::{Path as UrlPath, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use gpunode_protocol::advert::OfferFilter;
use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::watch;

pub use client::{ApiClient, ClientError};

use crate::metrics::Metrics;
use crate::{CancelOutcome, LeaseError, LeaseSpec, LeaseView, NodeHandle};

/// Why the local API could not start.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// A daemon already answers on the socket.
    #[error("a gpunode daemon is already running with this data dir (socket {0}); stop it first or use another --data-dir")]
    AlreadyRunning(PathBuf),
    /// The socket could not be created.
    #[error("cannot create API socket {path}: {source}")]
    Bind {
        /// The socket path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// Query parameters of `/v1/offers`.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct OffersQuery {
    /// GPU model or family.
    pub gpu_model: Option<String>,
    /// MIG slice profile.
    pub gpu_slice: Option<String>,
    /// Least memory per GPU, bytes.
    pub min_gpu_mem: Option<u64>,
    /// Least number of matching GPUs.
    pub gpus: Option<u32>,
    /// Backend.
    pub backend: Option<String>,
}

impl From<OffersQuery> for OfferFilter {
    fn from(q: OffersQuery) -> Self {
        OfferFilter {
            gpu_model: q.gpu_model,
            gpu_slice: q.gpu_slice,
            min_gpu_mem_bytes: q.min_gpu_mem,
            gpus: q.gpus,
            backend: q.backend,
        }
    }
}

/// Binds the socket: refuses if a daemon answers there, removes a stale file, sets 0600.
pub fn bind_socket(path: &Path) -> Result<UnixListener, ApiError> {
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(ApiError::AlreadyRunning(path.to_path_buf()));
        }
        let _ = std::fs::remove_file(path);
    }
    let err = |source| ApiError::Bind {
        path: path.to_path_buf(),
        source,
    };
    // Bound inside a fresh 0700 directory, made 0600 there, then moved into place: the
    // socket is never reachable by others, whatever the umask (a chmod after binding
    // in place would leave a window).
    let parent = path.parent().unwrap_or(Path::new("."));
    let private = parent.join(format!(".api-{:016x}", rand::random::<u64>()));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&private)
        .map_err(err)?;
    let staged = private.join("api.sock");
    let bound = UnixListener::bind(&staged)
        .and_then(|l| {
            std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o600))?;
            std::fs::rename(&staged, path)?;
            Ok(l)
        })
        .map_err(err);
    let _ = std::fs::remove_file(&staged);
    let _ = std::fs::remove_dir(&private);
    bound
}

struct ApiError500(String);

impl IntoResponse for ApiError500 {
    fn into_response(self) -> Response {
        (StatusCode::SERVICE_UNAVAILABLE, self.0).into_response()
    }
}

async fn status(State(node): State<NodeHandle>) -> Result<Json<crate::NodeStatus>, ApiError500> {
    node.status()
        .await
        .map(Json)
        .map_err(|e| ApiError500(e.to_string()))
}

async fn offers(
    State(node): State<NodeHandle>,
    Query(q): Query<OffersQuery>,
) -> Result<Json<Vec<crate::OfferView>>, ApiError500> {
    node.find_offers(q.into())
        .await
        .map(Json)
        .map_err(|e| ApiError500(e.to_string()))
}

/// Body of `POST /v1/leases/{id}/renew`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RenewBody {
    /// How much later the lease should end, ms.
    pub extend_ms: u64,
}

struct LeaseApiError(LeaseError);

impl IntoResponse for LeaseApiError {
    fn into_response(self) -> Response {
        let status = match &self.0 {
            LeaseError::Invalid(_) => StatusCode::BAD_REQUEST,
            LeaseError::NotFound(_) => StatusCode::NOT_FOUND,
            LeaseError::NoProviders(_)
            | LeaseError::AllRefused(_)
            | LeaseError::Queued { .. }
            | LeaseError::Refused(_) => StatusCode::CONFLICT,
            LeaseError::Node(_) => StatusCode::SERVICE_UNAVAILABLE,
        };
        (status, self.0.to_string()).into_response()
    }
}

async fn list_leases(State(node): State<NodeHandle>) -> Result<Json<Vec<LeaseView>>, ApiError500> {
    node.list_leases()
        .await
        .map(Json)
        .map_err(|e| ApiError500(e.to_string()))
}

async fn request_lease(
    State(node): State<NodeHandle>,
    Json(spec): Json<LeaseSpec>,
) -> Result<Json<LeaseView>, LeaseApiError> {
    node.request_lease(spec)
        .await
        .map(Json)
        .map_err(LeaseApiError)
}

async fn renew_lease(
    State(node): State<NodeHandle>,
    UrlPath(id): UrlPath<String>,
    Json(body): Json<RenewBody>,
) -> Result<Json<LeaseView>, LeaseApiError> {
    node.renew_lease(&id, std::time::Duration::from_millis(body.extend_ms))
        .await
        .map(Json)
        .map_err(LeaseApiError)
}

async fn cancel_lease(
    State(node): State<NodeHandle>,
    UrlPath(id): UrlPath<String>,
) -> Result<Json<CancelOutcome>, LeaseApiError> {
    node.cancel_lease(&id)
        .await
        .map(Json)
        .map_err(LeaseApiError)
}

/// Query of `GET /v1/jobs/{id}/events`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct EventsQuery {
    /// Position to read from (the `next` of the previous page).
    #[serde(default)]
    pub from: usize,
    /// How long to wait for new events when there are none, ms (at most 1000).
    #[serde(default)]
    pub wait_ms: u64,
    /// Kinds of event that do not end the wait by themselves, comma-separated
    /// (`leased,started`): they come with the next page instead.
    #[serde(default)]
    pub skip: String,
    /// Kinds a follower sees only when it asks for them, comma-separated (`done`:
    /// the result and outputs are in, before the receipt settles).
    #[serde(default)]
    pub with: String,
}

/// Longest a events request waits, so a daemon shutdown is never held up for long.
const MAX_EVENTS_WAIT_MS: u64 = 1000;

/// A job that could not be found or acted on, as an HTTP answer.
fn job_error(e: crate::jobs::table::JobLookupError) -> Response {
    use crate::jobs::table::JobLookupError;
    let status = match e {
        JobLookupError::Unknown(_) => StatusCode::NOT_FOUND,
        JobLookupError::AlreadyEnded { .. } => StatusCode::CONFLICT,
        JobLookupError::NoId | JobLookupError::Ambiguous(_) | JobLookupError::Closed => {
            StatusCode::BAD_REQUEST
        }
    };
    (status, e.to_string()).into_response()
}

async fn submit_job(
    State(node): State<NodeHandle>,
    Json(req): Json<crate::jobs::JobRequest>,
) -> Json<crate::jobs::JobView> {
    Json(node.submit_job(req))
}

async fn list_jobs(State(node): State<NodeHandle>) -> Json<Vec<crate::jobs::JobView>> {
    Json(node.list_jobs())
}

async fn get_job(State(node): State<NodeHandle>, UrlPath(id): UrlPath<String>) -> Response {
    match node.get_job(&id) {
        Ok(v) => Json(v).into_response(),
        Err(e) => job_error(e),
    }
}

async fn cancel_job(State(node): State<NodeHandle>, UrlPath(id): UrlPath<String>) -> Response {
    match node.cancel_job(&id) {
        Ok(id) => Json(serde_json::json!({ "job_id": id })).into_response(),
        Err(e) => job_error(e),
    }
}

async fn job_events(
    State(node): State<NodeHandle>,
    UrlPath(id): UrlPath<String>,
    Query(q): Query<EventsQuery>,
) -> Response {
    let wait = std::time::Duration::from_millis(q.wait_ms.min(MAX_EVENTS_WAIT_MS));
    let skip = crate::jobs::table::Skip::parse(&q.skip).with(&q.with);
    match node.job_events_skipping(&id, q.from, wait, &skip).await {
        Ok(page) => Json(page).into_response(),
        Err(e) => job_error(e),
    }
}

/// Query of `GET /v1/ledger`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct LedgerQuery {
    /// How many recent entries to include (default 20).
    #[serde(default)]
    pub recent: Option<usize>,
}

/// Query of `GET /v1/ledger/export`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ExportQuery {
    /// `csv` or `json`.
    #[serde(default)]
    pub format: Option<String>,
}

async fn ledger(State(node): State<NodeHandle>, Query(q): Query<LedgerQuery>) -> Response {
    match node.ledger_view(q.recent.unwrap_or(20).min(10_000)) {
        Ok(v) => Json(v).into_response(),
        Err(e) => ApiError500(e.to_string()).into_response(),
    }
}

/// Query of `/v1/ledger/verify`.
#[derive(Debug, Deserialize)]
pub struct VerifyQuery {
    /// The last check's report when the chain has not grown since (default: check now).
    #[serde(default)]
    pub reuse: bool,
}

async fn verify_ledger(State(node): State<NodeHandle>, Query(q): Query<VerifyQuery>) -> Response {
    match node.verify_ledger(q.reuse).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => ApiError500(e.to_string()).into_response(),
    }
}

async fn export_ledger(State(node): State<NodeHandle>, Query(q): Query<ExportQuery>) -> Response {
    let format = match q.format.as_deref().unwrap_or("csv").parse() {
        Ok(f) => f,
        Err(m) => return (StatusCode::BAD_REQUEST, m).into_response(),
    };
    match node.export_ledger(format).await {
        Ok(text) => text.into_response(),
        Err(e) => ApiError500(e.to_string()).into_response(),
    }
}

async fn peers(State(node): State<NodeHandle>) -> Json<Vec<crate::ledger::views::PeerView>> {
    Json(node.peers_view())
}

/// Body of `POST /v1/team/invite`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InviteBody {
    /// Role of the joiner.
    pub role: gpunode_protocol::team::Role,
    /// How many joins it allows.
    pub uses: u32,
    /// When it expires, unix ms.
    pub expires_ms: u64,
}

/// Body of `POST /v1/team/add` and `/v1/team/revoke`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MemberBody {
    /// The peer.
    pub peer: String,
    /// Role (for add).
    #[serde(default)]
    pub role: Option<gpunode_protocol::team::Role>,
}

fn team_error(e: crate::team::TeamOpError) -> Response {
    (StatusCode::BAD_REQUEST, e.to_string()).into_response()
}

fn parse_peer(text: &str) -> Result<libp2p::PeerId, String> {
    text.trim()
        .parse()
        .map_err(|_| format!("'{text}' is not a peer id (12D3KooW...)"))
}

async fn team(State(node): State<NodeHandle>) -> Response {
    match node.team_view().await {
        Ok(v) => Json(v).into_response(),
        Err(e) => team_error(e),
    }
}

async fn team_invite(State(node): State<NodeHandle>, Json(b): Json<InviteBody>) -> Response {
    match node.team_invite_here(b.role, b.uses, b.expires_ms).await {
        Ok(token) => Json(serde_json::json!({ "token": token.encode() })).into_response(),
        Err(e) => team_error(e),
    }
}

async fn team_add(State(node): State<NodeHandle>, Json(b): Json<MemberBody>) -> Response {
    let peer = match parse_peer(&b.peer) {
        Ok(p) => p,
        Err(m) => return (StatusCode::BAD_REQUEST, m).into_response(),
    };
    let role = b.role.unwrap_or(gpunode_protocol::team::Role::Member);
    match node.team_add(peer, role).await {
        Ok(()) => Json(serde_json::json!({ "added": peer.to_string() })).into_response(),
        Err(e) => team_error(e),
    }
}

async fn team_revoke(State(node): State<NodeHandle>, Json(b): Json<MemberBody>) -> Response {
    let peer = match parse_peer(&b.peer) {
        Ok(p) => p,
        Err(m) => return (StatusCode::BAD_REQUEST, m).into_response(),
    };
    match node.team_revoke(peer).await {
        Ok(()) => Json(serde_json::json!({ "revoked": peer.to_string() })).into_response(),
        Err(e) => team_error(e),
    }
}

async fn team_policy(State(node): State<NodeHandle>) -> Response {
    match node.team() {
        Some(t) => t.policy_text().unwrap_or_default().into_response(),
        None => team_error(crate::team::TeamOpError::NoTeam),
    }
}

/// Body of `POST /v1/team/policy`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PolicyBody {
    /// The policy file's text (TOML).
    pub text: String,
}

async fn set_team_policy(State(node): State<NodeHandle>, Json(b): Json<PolicyBody>) -> Response {
    match node.team_set_policy(&b.text).await {
        Ok(seq) => Json(serde_json::json!({ "seq": seq })).into_response(),
        Err(e) => team_error(e),
    }
}

async fn metrics_text(metrics: Arc<Metrics>) -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        metrics.encode(),
    )
        .into_response()
}

/// Query of `GET /v1/network`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct NetworkQuery {
    /// Most providers listed (default 1000, at most 20,000).
    #[serde(default)]
    pub limit: Option<usize>,
}

/// `GET /v1/network`: every provider this node holds a verified advert of.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NetworkView {
    /// Providers known in all.
    pub total: usize,
    /// Team members first, then by price, at most `limit`.
    pub providers: Vec<crate::views::ProviderView>,
}

async fn network(State(node): State<NodeHandle>, Query(q): Query<NetworkQuery>) -> Response {
    let mut providers = match node.known_providers().await {
        Ok(p) => p,
        Err(e) => return ApiError500(e.to_string()).into_response(),
    };
    providers.sort_by(|a, b| {
        b.in_team
            .cmp(&a.in_team)
            .then(
                a.offer
                    .price_per_gpu_hour
                    .total_cmp(&b.offer.price_per_gpu_hour),
            )
            .then_with(|| a.offer.peer_id.cmp(&b.offer.peer_id))
    });
    let total = providers.len();
    providers.truncate(q.limit.unwrap_or(1000).min(20_000));
    Json(NetworkView { total, providers }).into_response()
}

/// Query of `GET /v1/machine`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct MachineQuery {
    /// `hour` (default) or `day`.
    #[serde(default)]
    pub range: crate::overview::PlotRange,
}

async fn machine(State(node): State<NodeHandle>, Query(q): Query<MachineQuery>) -> Response {
    match node.machine_view(q.range).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => ApiError500(e.to_string()).into_response(),
    }
}

async fn provider_queue(State(node): State<NodeHandle>) -> Response {
    match node.provider_queue().await {
        Ok(v) => Json(v).into_response(),
        Err(e) => ApiError500(e.to_string()).into_response(),
    }
}

async fn utilization(State(node): State<NodeHandle>, Query(q): Query<ExportQuery>) -> Response {
    let report = node.utilization();
    match q.format.as_deref().unwrap_or("json") {
        "json" => Json(report).into_response(),
        "csv" => (
            [
                (axum::http::header::CONTENT_TYPE, "text/csv; charset=utf-8"),
                (
                    axum::http::header::CONTENT_DISPOSITION,
                    "attachment; filename=\"gpunode-utilization.csv\"",
                ),
            ],
            crate::overview::utilization_csv(&report),
        )
            .into_response(),
        other => (
            StatusCode::BAD_REQUEST,
            format!("unknown format '{other}': use json or csv"),
        )
            .into_response(),
    }
}

/// Query of `GET /v1/ledger/history`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct HistoryQuery {
    /// Most points (default 500, at most 2000).
    #[serde(default)]
    pub points: Option<usize>,
}

async fn balance_history(
    State(node): State<NodeHandle>,
    Query(q): Query<HistoryQuery>,
) -> Response {
    match node.balance_history(q.points.unwrap_or(500)).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => ApiError500(e.to_string()).into_response(),
    }
}

/// Every read-only route of the API (all `GET`s but `/metrics`): what the Unix socket
/// serves to the CLI and the web dashboard serves to the page, the same handlers.
pub fn read_routes() -> Router<NodeHandle> {
    Router::new()
        .route("/v1/status", get(status))
        .route("/v1/offers", get(offers))
        .route("/v1/leases", get(list_leases))
        .route("/v1/jobs", get(list_jobs))
        .route("/v1/jobs/{id}", get(get_job))
        .route("/v1/jobs/{id}/events", get(job_events))
        .route("/v1/ledger", get(ledger))
        .route("/v1/ledger/verify", get(verify_ledger))
        .route("/v1/ledger/export", get(export_ledger))
        .route("/v1/ledger/history", get(balance_history))
        .route("/v1/peers", get(peers))
        .route("/v1/team", get(team))
        .route("/v1/team/policy", get(team_policy))
        .route("/v1/network", get(network))
        .route("/v1/machine", get(machine))
        .route("/v1/queue", get(provider_queue))
        .route("/v1/utilization", get(utilization))
}

/// Serves the full API on the Unix socket at `path` until `stop` turns true, then
/// removes the socket file.
pub async fn serve_unix(
    listener: UnixListener,
    path: PathBuf,
    node: NodeHandle,
    mut stop: watch::Receiver<bool>,
) {
    let metrics = node.metrics().clone();
    // The listener's own address is where it was bound, not where it was moved.
    let path = Some(path);
    let app = read_routes()
        .route("/v1/leases", post(request_lease))
        .route("/v1/leases/{id}/renew", post(renew_lease))
        .route("/v1/leases/{id}/cancel", post(cancel_lease))
        .route("/v1/jobs", post(submit_job))
        .route("/v1/jobs/{id}/cancel", post(cancel_job))
        .route("/v1/team/invite", post(team_invite))
        .route("/v1/team/add", post(team_add))
        .route("/v1/team/revoke", post(team_revoke))
        .route("/v1/team/policy", post(set_team_policy))
        .route("/metrics", get(move || metrics_text(metrics.clone())))
        .with_state(node);
    let _ = axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            let _ = stop.wait_for(|s| *s).await;
        })
        .await;
    if let Some(path) = path {
        let _ = std::fs::remove_file(path);
    }
}

/// Serves only `/metrics` on a localhost TCP listener until `stop` turns true.
pub async fn serve_metrics(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    mut stop: watch::Receiver<bool>,
) {
    let app = Router::new().route("/metrics", get(move || metrics_text(metrics.clone())));
    let _ = axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            let _ = stop.wait_for(|s| *s).await;
        })
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_socket_is_private_from_the_start_and_leaves_nothing_behind() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("api.sock");
        let listener = bind_socket(&path).expect("bind");
        let mode = std::fs::metadata(&path)
            .expect("socket")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        // Only the socket is there: no staging directory was left.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .expect("dir")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("api.sock")]);
        // It answers at its final path, and a second daemon is refused.
        assert!(std::os::unix::net::UnixStream::connect(&path).is_ok());
        assert!(matches!(
            bind_socket(&path),
            Err(ApiError::AlreadyRunning(_))
        ));
        drop(listener);
    }
}
