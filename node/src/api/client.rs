//! Client side of the local API: HTTP/1.1 over the daemon's Unix socket, one
//! connection kept open between calls (a command such as `gpunode run` makes several).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;
use tokio::net::UnixStream;

/// Why a call to the daemon failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No daemon listens on the socket.
    #[error("no gpunode daemon is running with this data dir (socket {0})")]
    NotRunning(PathBuf),
    /// The connection broke or the reply was not HTTP.
    #[error("talking to the daemon failed: {0}")]
    Transport(String),
    /// The daemon answered with an error.
    #[error("the daemon answered {status}: {body}")]
    Status {
        /// HTTP status.
        status: u16,
        /// Its message.
        body: String,
    },
    /// The reply did not decode.
    #[error("unexpected reply from the daemon: {0}")]
    Decode(String),
}

/// A connection to the daemon, ready for its next request.
type Connection = SendRequest<Full<Bytes>>;

/// Talks to the daemon whose socket is at `socket`.
#[derive(Debug, Clone)]
pub struct ApiClient {
    socket: PathBuf,
    /// The connection the last call finished with, for the next one. A call takes it
    /// out while it runs, so calls at the same time (a job followed while its cancel is
    /// sent) each get a connection of their own.
    idle: Arc<Mutex<Option<Connection>>>,
}

impl ApiClient {
    /// A client for the socket at `socket` (nothing is opened yet).
    pub fn new(socket: &Path) -> ApiClient {
        ApiClient {
            socket: socket.to_path_buf(),
            idle: Arc::default(),
        }
    }

    /// Whether a daemon answers on the socket (the connection is kept for the next
    /// call).
    pub async fn is_running(&self) -> bool {
        match self.connection().await {
            Ok(conn) => {
                self.put_back(conn);
                true
            }
            Err(_) => false,
        }
    }

    /// The idle connection if it is still open, or a new one.
    async fn connection(&self) -> Result<Connection, ClientError> {
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(mut conn) = idle {
            if !conn.is_closed() && conn.ready().await.is_ok() {
                return Ok(conn);
            }
        }
        let stream = UnixStream::connect(&self.socket)
            .await
            .map_err(|_| ClientError::NotRunning(self.socket.clone()))?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| ClientError::Transport(e.to_string()))?;
        // Drives the connection until the daemon closes it or the last sender is dropped.
        tokio::spawn(conn);
        Ok(sender)
    }

    /// Keeps `conn` for the next call, unless another call already put one back.
    fn put_back(&self, conn: Connection) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.is_none() {
            *idle = Some(conn);
        }
    }

    /// `GET path`, returning the body text.
    pub async fn get_text(&self, path_and_query: &str) -> Result<String, ClientError> {
        self.request(hyper::Method::GET, path_and_query, None).await
    }

    /// `POST path` with a JSON body, decoding the JSON answer.
    pub async fn post_json<B: serde::Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<T, ClientError> {
        let body = serde_json::to_vec(body).map_err(|e| ClientError::Decode(e.to_string()))?;
        let text = self.request(hyper::Method::POST, path, Some(body)).await?;
        serde_json::from_str(&text).map_err(|e| ClientError::Decode(e.to_string()))
    }

    async fn request(
        &self,
        method: hyper::Method,
        path_and_query: &str,
        body: Option<Vec<u8>>,
    ) -> Result<String, ClientError> {
        let mut sender = self.connection().await?;
        let request = hyper::Request::builder()
            .method(method)
            .uri(path_and_query)
            .header(hyper::header::HOST, "gpunode")
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| ClientError::Transport(e.to_string()))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| ClientError::Transport(e.to_string()))?;
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| ClientError::Transport(e.to_string()))?
            .to_bytes();
        self.put_back(sender);
        let text = String::from_utf8_lossy(&body).into_owned();
        if !status.is_success() {
            return Err(ClientError::Status {
                status: status.as_u16(),
                body: text,
            });
        }
        Ok(text)
    }

    /// `GET path`, decoding the JSON body.
    pub async fn get_json<T: DeserializeOwned>(
        &self,
        path_and_query: &str,
    ) -> Result<T, ClientError> {
        let text = self.get_text(path_and_query).await?;
        serde_json::from_str(&text).map_err(|e| ClientError::Decode(e.to_string()))
    }
}
