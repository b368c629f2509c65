//! `run MODEL [PROMPT]`: a chat with a model over corrald's HTTP API (`/api/chat`,
//! streamed), on TCP or a UNIX socket.

use std::io::{BufRead, IsTerminal, Write};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};

use super::error::CtlError;
use super::host::Host;
use super::output::{print, print_json};

/// One message of the conversation.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Message {
    /// user or assistant.
    pub role: String,
    /// The text.
    pub content: String,
}

/// One NDJSON line of `/api/chat`'s stream.
#[derive(Debug, Deserialize)]
struct Chunk {
    #[serde(default)]
    message: Option<Message>,
    #[serde(default)]
    done: bool,
    #[serde(default)]
    error: Option<String>,
}

/// A chat session with one model.
#[derive(Debug)]
pub struct Chat {
    /// Where the API is.
    pub host: Host,
    /// A bearer token, if the daemon wants one.
    pub token: Option<String>,
    /// The model.
    pub model: String,
    /// `--json`: one JSON object per reply instead of streamed text.
    pub json: bool,
    /// Model options sent with each request (`options` of `/api/chat`).
    pub options: serde_json::Map<String, serde_json::Value>,
    /// The conversation so far.
    pub history: Vec<Message>,
}

impl Chat {
    /// Sends `prompt`, streams the reply to standard output (unless `json`), and keeps both
    /// in the history. Returns the reply.
    pub async fn turn(&mut self, prompt: &str) -> Result<String, CtlError> {
        self.history.push(Message { role: "user".into(), content: prompt.to_owned() });
        let reply = self.send().await;
        match reply {
            Ok(reply) => {
                self.history.push(Message { role: "assistant".into(), content: reply.clone() });
                if self.json {
                    print_json(&serde_json::json!({ "model": self.model, "message": self.history.last() }))?;
                } else {
                    print("\n")?;
                }
                Ok(reply)
            }
            Err(e) => {
                // A failed turn is not part of the conversation.
                self.history.pop();
                Err(e)
            }
        }
    }

    async fn send(&self) -> Result<String, CtlError> {
        let body = serde_json::json!({
            "model": self.model, "messages": self.history, "stream": true, "options": self.options,
        });
        let mut request = Request::post(self.host.target("/api/chat"))
            .header(hyper::header::HOST, self.host.header())
            .header(hyper::header::CONTENT_TYPE, "application/json");
        if let Some(token) = &self.token {
            request = request.header(hyper::header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let request = request.body(Full::new(Bytes::from(body.to_string()))).expect("a valid request");
        let unreachable = |detail: String| CtlError::HttpUnreachable { host: self.host.describe(), detail };

        let response = match &self.host {
            Host::Tcp { authority, .. } => {
                let stream = tokio::net::TcpStream::connect(authority).await.map_err(|e| unreachable(e.to_string()))?;
                send_on(stream, request).await
            }
            Host::Unix(path) => {
                let stream = tokio::net::UnixStream::connect(path).await.map_err(|e| unreachable(e.to_string()))?;
                send_on(stream, request).await
            }
        }
        .map_err(|e| unreachable(e.to_string()))?;

        let status = response.status();
        let mut body = response.into_body();
        if !status.is_success() {
            let bytes = body.collect().await.map(http_body_util::Collected::to_bytes).unwrap_or_default();
            let message = serde_json::from_slice::<Chunk>(&bytes)
                .ok()
                .and_then(|c| c.error)
                .unwrap_or_else(|| String::from_utf8_lossy(&bytes).trim().to_owned());
            let message = if message.is_empty() { status.to_string() } else { message };
            return Err(match status {
                StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
                    CtlError::HttpDenied { host: self.host.describe(), message }
                }
                _ => CtlError::Http { message },
            });
        }

        let mut reply = String::new();
        let mut pending = Vec::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| CtlError::Http { message: format!("the reply broke off: {e}") })?;
            let Ok(data) = frame.into_data() else { continue };
            pending.extend_from_slice(&data);
            while let Some(end) = pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = pending.drain(..=end).collect();
                if self.chunk(&line, &mut reply)? {
                    return Ok(reply);
                }
            }
        }
        if !pending.is_empty() && self.chunk(&pending, &mut reply)? {
            return Ok(reply);
        }
        Err(CtlError::Http { message: "the reply ended before it was done".into() })
    }

    /// Handles one NDJSON line; `true` once the reply is done.
    fn chunk(&self, line: &[u8], reply: &mut String) -> Result<bool, CtlError> {
        let line = line.trim_ascii();
        if line.is_empty() {
            return Ok(false);
        }
        let chunk: Chunk = serde_json::from_slice(line).map_err(|e| CtlError::Http {
            message: format!("an unexpected line in the reply ({e}): {}", String::from_utf8_lossy(line)),
        })?;
        if let Some(error) = chunk.error {
            return Err(CtlError::Http { message: error });
        }
        if let Some(message) = chunk.message {
            if !self.json {
                print(&message.content)?;
            }
            reply.push_str(&message.content);
        }
        Ok(chunk.done)
    }
}

async fn send_on<S>(
    stream: S,
    request: Request<Full<Bytes>>,
) -> Result<hyper::Response<hyper::body::Incoming>, hyper::Error>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    sender.send_request(request).await
}

/// `run`: one turn with `prompt`, or a conversation read line by line from standard input.
pub async fn run(mut chat: Chat, prompt: Option<&str>) -> Result<(), CtlError> {
    if let Some(prompt) = prompt {
        chat.turn(prompt).await?;
        return Ok(());
    }
    let interactive = std::io::stdin().is_terminal();
    let (lines_tx, mut lines) = tokio::sync::mpsc::channel::<std::io::Result<String>>(1);
    // Standard input blocks; a thread reads it so that the runtime does not.
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            if lines_tx.blocking_send(line).is_err() {
                break;
            }
        }
    });
    loop {
        if interactive {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, ">>> ");
            let _ = err.flush();
        }
        let Some(line) = lines.recv().await else { return Ok(()) };
        let line = line.map_err(|source| CtlError::Io { what: "reading standard input".into(), source })?;
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        if line == "/bye" || line == "/exit" {
            return Ok(());
        }
        match chat.turn(line).await {
            Ok(_) => {}
            // In a conversation, a failed turn is reported and the next line tried;
            // without a terminal, a script wants the failure.
            Err(e) if interactive => {
                let _ = writeln!(std::io::stderr(), "error: {e}");
            }
            Err(e) => return Err(e),
        }
    }
}
