//! `run MODEL [PROMPT]`: a chat with a model over corrald's HTTP API (`/api/chat`,
//! streamed), on TCP or a UNIX socket.

use std::io::{BufRead, IsTerminal, Write};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};

use super::error::CtlError;
use super::output::{print, print_json};

/// Where corrald's HTTP API is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Host {
    /// `host:port` over TCP, from an `http://` URL.
    Tcp(String),
    /// A UNIX socket.
    Unix(std::path::PathBuf),
}

impl Host {
    /// Reads `--host`/`CORRAL_HOST`: `http://host[:port]` (port 11434 by default), a bare
    /// `host:port`, an absolute socket path, or `unix:PATH`.
    pub fn parse(value: &str) -> Result<Self, CtlError> {
        let value = value.trim();
        if let Some(path) = value.strip_prefix("unix://").or_else(|| value.strip_prefix("unix:")) {
            return Ok(Self::Unix(path.into()));
        }
        if value.starts_with('/') {
            return Ok(Self::Unix(value.into()));
        }
        if value.starts_with("https://") {
            return Err(CtlError::Invalid(format!(
                "--host {value}: https is not supported; use http:// on loopback or the UNIX socket"
            )));
        }
        let rest = value.strip_prefix("http://").unwrap_or(value);
        let authority = rest.split('/').next().unwrap_or_default();
        if authority.is_empty()
            || authority.contains(char::is_whitespace)
            || value.contains("://") && !value.starts_with("http://")
        {
            return Err(CtlError::Invalid(format!(
                "--host {value}: expected http://HOST[:PORT] or a UNIX socket path such as /run/corral.sock"
            )));
        }
        let has_port =
            authority.rsplit_once(':').is_some_and(|(host, port)| !host.ends_with(':') && port.parse::<u16>().is_ok());
        Ok(Self::Tcp(if has_port { authority.to_owned() } else { format!("{authority}:11434") }))
    }

    fn describe(&self) -> String {
        match self {
            Self::Tcp(authority) => format!("http://{authority}"),
            Self::Unix(path) => path.display().to_string(),
        }
    }

    /// The Host header: the UNIX socket has none of its own, and `localhost` passes the
    /// daemon's DNS-rebinding check.
    fn header(&self) -> &str {
        match self {
            Self::Tcp(authority) => authority,
            Self::Unix(_) => "localhost",
        }
    }
}

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
        let mut request = Request::post("/api/chat")
            .header(hyper::header::HOST, self.host.header())
            .header(hyper::header::CONTENT_TYPE, "application/json");
        if let Some(token) = &self.token {
            request = request.header(hyper::header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let request = request.body(Full::new(Bytes::from(body.to_string()))).expect("a valid request");
        let unreachable = |detail: String| CtlError::HttpUnreachable { host: self.host.describe(), detail };

        let response = match &self.host {
            Host::Tcp(authority) => {
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

#[cfg(test)]
mod tests {
    use super::Host;

    #[test]
    fn hosts_are_urls_or_socket_paths() {
        assert_eq!(Host::parse("http://127.0.0.1:11434").expect("url"), Host::Tcp("127.0.0.1:11434".into()));
        assert_eq!(Host::parse("http://localhost").expect("url"), Host::Tcp("localhost:11434".into()));
        assert_eq!(Host::parse("127.0.0.1:8080").expect("bare"), Host::Tcp("127.0.0.1:8080".into()));
        assert_eq!(Host::parse("http://[::1]:9/").expect("v6"), Host::Tcp("[::1]:9".into()));
        assert_eq!(Host::parse("/run/corral.sock").expect("path"), Host::Unix("/run/corral.sock".into()));
        assert_eq!(Host::parse("unix:/run/corral.sock").expect("unix:"), Host::Unix("/run/corral.sock".into()));
        for bad in ["https://example.org", "ftp://x", "", "http://"] {
            let e = Host::parse(bad).expect_err(bad);
            assert!(e.to_string().starts_with(&format!("--host {}", bad.trim())), "{e}");
        }
    }
}
