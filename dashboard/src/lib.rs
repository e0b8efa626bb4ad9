//! The web dashboard of a gpunode daemon: one page (HTML, JS and CSS embedded in the
//! binary, nothing fetched from elsewhere, so it works offline) on a loopback TCP port,
//! the read-only routes of the local API under `/v1/` (the same handlers the Unix
//! socket serves, see `gpunode_node::api::read_routes`) and live updates as
//! Server-Sent Events on `/events` (see [`events`]).
//!
//! A loopback port is open to every user of the machine and to web pages the browser
//! shows, so everything but the page's static files asks for the daemon's access token:
//! `/?token=T` (the URL `gpunode dashboard` prints) sets it as a `SameSite=Strict`,
//! `HttpOnly` cookie and redirects to `/`. Requests naming another `Host` (DNS
//! rebinding) or sent by another site (`Sec-Fetch-Site`) are refused before that.

pub mod events;

use std::net::SocketAddr;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;
use gpunode_node::NodeHandle;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// The page and its assets, embedded at build time.
const INDEX_HTML: &str = include_str!("../static/index.html");
const APP_JS: &str = include_str!("../static/app.js");
const STYLE_CSS: &str = include_str!("../static/style.css");

/// The cookie that carries the access token.
const COOKIE: &str = "gpunode_dashboard";

/// What the content security policy allows: this origin only, no inline script.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// A random access token for one daemon run (32 hex digits).
pub fn new_token() -> String {
    hex::encode(rand::random::<[u8; 16]>())
}

/// Binds the dashboard's listener; refuses an address that is not loopback.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    if !addr.ip().is_loopback() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{addr} is not a loopback address"),
        ));
    }
    TcpListener::bind(addr).await
}

/// The URL that opens the dashboard at `addr` with `token`.
pub fn url(addr: SocketAddr, token: &str) -> String {
    format!("http://{addr}/?token={token}")
}

#[derive(Clone)]
struct Guard {
    port: u16,
    token: String,
}

/// The dashboard's router for a listener on `port`.
pub fn router(node: NodeHandle, port: u16, token: String) -> Router {
    let guard = Guard { port, token };
    let streams = events::Streams::default();
    let data = gpunode_node::api::read_routes()
        .route(
            "/events",
            get(move |node: State<NodeHandle>| events::stream(node, streams.clone())),
        )
        .with_state(node)
        .layer(middleware::from_fn_with_state(guard.clone(), require_token))
        .layer(middleware::from_fn(no_store));
    Router::new()
        .route("/", get(index))
        .route(
            "/app.js",
            get(|| async { asset(APP_JS, "text/javascript; charset=utf-8") }),
        )
        .route(
            "/style.css",
            get(|| async { asset(STYLE_CSS, "text/css; charset=utf-8") }),
        )
        .with_state(guard.clone())
        .merge(data)
        .layer(middleware::from_fn_with_state(guard, check_origin))
        .layer(middleware::from_fn(secure_headers))
}

/// Serves the dashboard on `listener` until `stop` turns true.
pub async fn serve(
    listener: TcpListener,
    node: NodeHandle,
    token: String,
    mut stop: watch::Receiver<bool>,
) {
    let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
    let app = router(node, port, token);
    let _ = axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            let _ = stop.wait_for(|s| *s).await;
        })
        .await;
}

fn asset(text: &'static str, kind: &'static str) -> Response {
    ([(header::CONTENT_TYPE, kind)], text).into_response()
}

/// `/`: the page; `/?token=T` with the right token sets the cookie and drops the token
/// from the address bar.
async fn index(State(guard): State<Guard>, request: Request) -> Response {
    let query = request.uri().query().unwrap_or("");
    let given = query
        .split('&')
        .find_map(|kv| kv.strip_prefix("token="))
        .map(str::to_string);
    match given {
        Some(t) if same(&t, &guard.token) => {
            let cookie = format!("{COOKIE}={t}; Path=/; HttpOnly; SameSite=Strict");
            let mut r = Redirect::to("/").into_response();
            if let Ok(v) = HeaderValue::from_str(&cookie) {
                r.headers_mut().insert(header::SET_COOKIE, v);
            }
            r
        }
        Some(_) => refuse(
            StatusCode::UNAUTHORIZED,
            "this dashboard link is out of date: the daemon restarted since. Run `gpunode dashboard` for the current one.",
        ),
        None => asset(INDEX_HTML, "text/html; charset=utf-8"),
    }
}

/// Compares two tokens in time that does not depend on where they differ.
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

fn refuse(status: StatusCode, why: &str) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        why.to_string(),
    )
        .into_response()
}

/// The token from the cookie or an `Authorization: Bearer` header.
fn token_of(headers: &HeaderMap) -> Option<String> {
    if let Some(bearer) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    {
        return Some(bearer.trim().to_string());
    }
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|kv| {
            kv.trim()
                .strip_prefix(&format!("{COOKIE}="))
                .map(str::to_string)
        })
}

async fn require_token(State(guard): State<Guard>, request: Request, next: Next) -> Response {
    match token_of(request.headers()) {
        Some(t) if same(&t, &guard.token) => next.run(request).await,
        _ => refuse(
            StatusCode::UNAUTHORIZED,
            "open the dashboard with the link `gpunode dashboard` prints (it carries the access token)",
        ),
    }
}

/// Whether `host` (a `Host` header) names this machine's loopback at `port`.
fn loopback_host(host: &str, port: u16) -> bool {
    let Some((name, p)) = host.rsplit_once(':') else {
        return false;
    };
    if p.parse::<u16>().ok() != Some(port) {
        return false;
    }
    let name = name.trim_start_matches('[').trim_end_matches(']');
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Refuses a `Host` that is not this loopback address (a DNS-rebinding page names its
/// own domain) and requests another site sent (`Sec-Fetch-Site`).
async fn check_origin(State(guard): State<Guard>, request: Request, next: Next) -> Response {
    let headers = request.headers();
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !loopback_host(host, guard.port) {
        return refuse(
            StatusCode::MISDIRECTED_REQUEST,
            "the dashboard answers only at 127.0.0.1 or localhost",
        );
    }
    let site = headers
        .get("sec-fetch-site")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("none");
    if !matches!(site, "same-origin" | "none") {
        return refuse(
            StatusCode::FORBIDDEN,
            "requests from other sites are refused",
        );
    }
    next.run(request).await
}

async fn secure_headers(request: Request, next: Next) -> Response {
    let mut r = next.run(request).await;
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    r
}

async fn no_store(request: Request<Body>, next: Next) -> Response {
    let mut r = next.run(request).await;
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_hosts_at_our_port_are_answered() {
        for ok in [
            "127.0.0.1:4171",
            "localhost:4171",
            "[::1]:4171",
            "LOCALHOST:4171",
        ] {
            assert!(loopback_host(ok, 4171), "{ok}");
        }
        for bad in [
            "evil.example:4171",
            "127.0.0.1:80",
            "127.0.0.1",
            "",
            "10.0.0.1:4171",
            "127.0.0.1.evil.example:4171",
        ] {
            assert!(!loopback_host(bad, 4171), "{bad}");
        }
    }

    #[test]
    fn tokens_come_from_the_cookie_or_a_bearer_header() {
        let mut h = HeaderMap::new();
        assert_eq!(token_of(&h), None);
        h.insert(
            header::COOKIE,
            HeaderValue::from_static("a=b; gpunode_dashboard=abc"),
        );
        assert_eq!(token_of(&h).as_deref(), Some("abc"));
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer xyz"),
        );
        assert_eq!(token_of(&h).as_deref(), Some("xyz"));
        assert!(same("abc", "abc"));
        assert!(!same("abc", "abd"));
        assert!(!same("abc", "abcd"));
        assert_eq!(new_token().len(), 32);
        assert_ne!(new_token(), new_token());
    }
}
