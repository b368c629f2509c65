//! `run MODEL [PROMPT]`: a chat with a model over corrald's HTTP API (`/api/chat`,
//! streamed), on TCP or a UNIX socket.

use std::io::{IsTerminal, Write};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};

use super::error::CtlError;
use super::host::Host;
use super::job::{Progress, Sink, View};
use super::output::{print, print_json};

/// corrald's HTTP API, as one client reaches it: where, and with which token.
#[derive(Debug, Clone)]
pub struct Api {
    /// Where the API is.
    pub host: Host,
    /// A bearer token, if the daemon wants one.
    pub token: Option<String>,
}

/// A streaming request body: chunks of a file read on a thread of its own.
pub type Upload = http_body_util::StreamBody<
    futures_util::stream::BoxStream<'static, Result<hyper::body::Frame<Bytes>, std::io::Error>>,
>;

impl Api {
    /// Sends `request` (its path and method set) with the Host and token headers, on a
    /// connection of its own. Every request of corralctl's to the HTTP API goes here.
    pub async fn send<B>(&self, request: Request<B>) -> Result<hyper::Response<hyper::body::Incoming>, CtlError>
    where
        B: hyper::body::Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let (mut parts, body) = request.into_parts();
        // A path prefix of the host's (`OLLAMA_HOST=http://proxy/ollama`) goes first.
        let path = parts.uri.path_and_query().map_or("/", hyper::http::uri::PathAndQuery::as_str);
        parts.uri = self.host.target(path).parse().map_err(|_| {
            CtlError::Invalid(format!("{} with {path} is not a valid request target", self.host.describe()))
        })?;
        parts.headers.insert(hyper::header::HOST, self.host.header().parse().expect("a valid Host header"));
        if let Some(token) = &self.token {
            let value = format!("Bearer {token}")
                .parse()
                .map_err(|_| CtlError::Invalid("the API token is not a valid header value".into()))?;
            parts.headers.insert(hyper::header::AUTHORIZATION, value);
        }
        let request = Request::from_parts(parts, body);
        let unreachable = |detail: String| CtlError::HttpUnreachable { host: self.host.describe(), detail };
        match &self.host {
            Host::Tcp { authority, .. } => {
                let stream = tokio::net::TcpStream::connect(authority).await.map_err(|e| unreachable(e.to_string()))?;
                send_on(stream, request).await
            }
            Host::Unix(path) => {
                let stream = tokio::net::UnixStream::connect(path).await.map_err(|e| unreachable(e.to_string()))?;
                send_on(stream, request).await
            }
        }
        .map_err(|e| unreachable(e.to_string()))
    }

    /// `POST path` with a JSON body; the answer's status and body once it is a success,
    /// else the API's error.
    pub async fn post_json(
        &self,
        path: &str,
        body: &serde_json::Value,
    ) -> Result<hyper::Response<hyper::body::Incoming>, CtlError> {
        let request = Request::post(path)
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .expect("a valid request");
        self.checked(self.send(request).await?).await
    }

    /// The response if its status is a success, else its error message as a [`CtlError`].
    pub async fn checked(
        &self,
        response: hyper::Response<hyper::body::Incoming>,
    ) -> Result<hyper::Response<hyper::body::Incoming>, CtlError> {
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        // An error's body is a line or two; one past the bound (or cut off) leaves the status.
        let bytes = whole(response.into_body(), ERROR_MAX).await.unwrap_or_default();
        let message = serde_json::from_slice::<Chunk>(&bytes)
            .ok()
            .and_then(|c| c.error)
            .unwrap_or_else(|| String::from_utf8_lossy(&bytes).trim().to_owned());
        let message = if message.is_empty() { status.to_string() } else { message };
        Err(match status {
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
                CtlError::HttpDenied { host: self.host.describe(), message }
            }
            StatusCode::SERVICE_UNAVAILABLE => CtlError::HttpUnavailable { message },
            _ => CtlError::Http { message },
        })
    }

    /// `POST /api/show` for `model`: its JSON, `None` when there is no such model.
    pub async fn show(&self, model: &str) -> Result<Option<serde_json::Value>, CtlError> {
        let request = Request::post("/api/show")
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(serde_json::json!({ "model": model }).to_string())))
            .expect("a valid request");
        let response = self.send(request).await?;
        if response.status() == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        let response = self.checked(response).await?;
        let bytes = whole(response.into_body(), MAX_LINE).await?;
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| CtlError::Http { message: format!("an unexpected reply to show: {e}") })
    }

    /// `POST /api/pull` for `model`, its progress shown on standard error as `pull` shows it.
    pub async fn pull(&self, model: &str, insecure: bool, terminal: bool) -> Result<(), CtlError> {
        let body = serde_json::json!({ "model": model, "insecure": insecure, "stream": true });
        let response = self.post_json("/api/pull", &body).await?;
        let mut view = View::new(if terminal { Progress::Bar } else { Progress::Lines }, Sink::Stderr);
        let result = ndjson(response.into_body(), |line| {
            let progress: PullProgress = serde_json::from_slice(line)
                .map_err(|e| CtlError::Http { message: format!("an unexpected line from pull ({e})") })?;
            if let Some(error) = progress.error {
                return Err(CtlError::Http { message: error });
            }
            view.set(&progress.status, progress.total, progress.completed);
            Ok(progress.status == "success")
        })
        .await;
        view.finish();
        match result {
            Ok(true) => Ok(()),
            Ok(false) => Err(CtlError::Http { message: "the pull ended before it was done".into() }),
            Err(e) => Err(e),
        }
    }

    /// `HEAD /api/blobs/<digest>`: whether corrald has the blob.
    pub async fn has_blob(&self, digest: &str) -> Result<bool, CtlError> {
        let request = Request::head(format!("/api/blobs/{digest}")).body(Full::new(Bytes::new())).expect("a request");
        let response = self.send(request).await?;
        if response.status() == StatusCode::NOT_FOUND {
            return Ok(false);
        }
        self.checked(response).await.map(|_| true)
    }

    /// `POST /api/blobs/<digest>` with `body`, `size` bytes (corrald checks the digest).
    pub async fn upload_blob(&self, digest: &str, size: u64, body: Upload) -> Result<(), CtlError> {
        let request = Request::post(format!("/api/blobs/{digest}"))
            .header(hyper::header::CONTENT_TYPE, "application/octet-stream")
            .header(hyper::header::CONTENT_LENGTH, size)
            .body(body)
            .expect("a valid request");
        self.checked(self.send(request).await?).await.map(drop)
    }
}

/// One NDJSON line of `/api/pull`'s stream.
#[derive(Debug, Deserialize)]
struct PullProgress {
    #[serde(default)]
    status: String,
    #[serde(default)]
    total: u64,
    #[serde(default)]
    completed: u64,
    #[serde(default)]
    error: Option<String>,
}

/// The most bytes of one line of an NDJSON reply, or of a whole JSON reply (corrald's are
/// under a few kilobytes; a show of a model with megabytes of text, a few megabytes).
const MAX_LINE: usize = 64 << 20;

/// The most bytes of an error's body read (an API error is a line).
const ERROR_MAX: usize = 1 << 20;

/// A whole reply body, at most `limit` bytes of it (more is an error naming the bound).
async fn whole<B>(body: B, limit: usize) -> Result<Bytes, CtlError>
where
    B: hyper::body::Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let bytes = http_body_util::Limited::new(body, limit).collect().await.map_err(|e| {
        let message = if e.is::<http_body_util::LengthLimitError>() {
            format!("the reply is longer than {}", bytesize::ByteSize::b(limit as u64).display().iec())
        } else {
            format!("the reply broke off: {e}")
        };
        CtlError::Http { message }
    })?;
    Ok(bytes.to_bytes())
}

/// Reads an NDJSON body, one line at a time, until `line` says it is done (`Ok(true)`);
/// `Ok(false)` when the body ended first.
async fn ndjson(
    mut body: hyper::body::Incoming,
    mut line: impl FnMut(&[u8]) -> Result<bool, CtlError>,
) -> Result<bool, CtlError> {
    let mut pending = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| CtlError::Http { message: format!("the reply broke off: {e}") })?;
        let Ok(data) = frame.into_data() else { continue };
        if lines(&mut pending, &data, &mut line)? {
            return Ok(true);
        }
    }
    let rest = pending.trim_ascii();
    Ok(!rest.is_empty() && line(rest)?)
}

/// Adds `data` to the unfinished line `pending` and hands `line` each line it completes,
/// until `line` says it is done (`Ok(true)`). What waits holds no line end, so only the new
/// bytes are searched for one (searching it all per piece grew with the square of a long
/// line); a line past [`MAX_LINE`] is an error.
fn lines(
    pending: &mut Vec<u8>,
    data: &[u8],
    line: &mut impl FnMut(&[u8]) -> Result<bool, CtlError>,
) -> Result<bool, CtlError> {
    let mut from = pending.len();
    pending.extend_from_slice(data);
    let mut start = 0;
    while let Some(at) = pending[from..].iter().position(|&b| b == b'\n') {
        let text = pending[start..from + at].trim_ascii();
        (start, from) = (from + at + 1, from + at + 1);
        if !text.is_empty() && line(text)? {
            return Ok(true);
        }
    }
    pending.drain(..start);
    if pending.len() > MAX_LINE {
        let limit = bytesize::ByteSize::b(MAX_LINE as u64).display().iec();
        return Err(CtlError::Http { message: format!("a line of the reply is longer than {limit}") });
    }
    Ok(false)
}

/// One message of the conversation.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Message {
    /// system, user or assistant.
    pub role: String,
    /// The text.
    pub content: String,
}

/// One NDJSON line of `/api/chat`'s stream; the last carries the timings.
#[derive(Debug, Default, Deserialize)]
struct Chunk {
    #[serde(default)]
    message: Option<Message>,
    #[serde(default)]
    done: bool,
    #[serde(default)]
    error: Option<String>,
    #[serde(flatten)]
    stats: Stats,
}

/// What `--verbose` shows after a reply: the timings of `/api/chat`'s last line.
#[derive(Debug, Default, Clone, Copy, Deserialize, Serialize)]
pub struct Stats {
    #[serde(default)]
    total_duration: u64,
    #[serde(default)]
    load_duration: u64,
    #[serde(default)]
    prompt_eval_count: u64,
    #[serde(default)]
    prompt_eval_duration: u64,
    #[serde(default)]
    eval_count: u64,
    #[serde(default)]
    eval_duration: u64,
}

impl Stats {
    /// The lines `ollama run --verbose` prints, with durations for people.
    #[must_use]
    pub fn summary(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let mut line = |label: &str, value: String| {
            let label = format!("{label}:");
            let _ = writeln!(out, "{label:<22}{value}");
        };
        line("total duration", duration(self.total_duration));
        line("load duration", duration(self.load_duration));
        line("prompt eval count", format!("{} token(s)", self.prompt_eval_count));
        if self.prompt_eval_duration > 0 {
            line("prompt eval duration", duration(self.prompt_eval_duration));
            line("prompt eval rate", rate(self.prompt_eval_count, self.prompt_eval_duration));
        }
        line("eval count", format!("{} token(s)", self.eval_count));
        if self.eval_duration > 0 {
            line("eval duration", duration(self.eval_duration));
            line("eval rate", rate(self.eval_count, self.eval_duration));
        }
        out
    }
}

/// Nanoseconds as people read them: `5.59 s`, `350 ms`, `12.3 ms`, `850 µs`, `1m 5s`.
#[must_use]
pub fn duration(nanos: u64) -> String {
    #[allow(clippy::cast_precision_loss)]
    let value = nanos as f64;
    let significant = |v: f64, unit: &str| {
        if v >= 100.0 {
            format!("{v:.0} {unit}")
        } else if v >= 10.0 {
            format!("{v:.1} {unit}")
        } else {
            format!("{v:.2} {unit}")
        }
    };
    match nanos {
        0 => "0 s".to_owned(),
        n if n >= 60_000_000_000 => format!("{}m {}s", n / 60_000_000_000, n / 1_000_000_000 % 60),
        n if n >= 1_000_000_000 => significant(value / 1e9, "s"),
        n if n >= 1_000_000 => significant(value / 1e6, "ms"),
        _ => significant(value / 1e3, "µs"),
    }
}

fn rate(count: u64, nanos: u64) -> String {
    #[allow(clippy::cast_precision_loss)]
    let per_second = count as f64 / (nanos as f64 / 1e9);
    format!("{per_second:.2} tokens/s")
}

/// A chat session with one model.
#[derive(Debug)]
pub struct Chat {
    /// The HTTP API.
    pub api: Api,
    /// The model.
    pub model: String,
    /// `--json`: one JSON object per reply instead of streamed text.
    pub json: bool,
    /// Model options sent with each request (`options` of `/api/chat`).
    pub options: serde_json::Map<String, serde_json::Value>,
    /// `format`: `"json"` or a JSON schema.
    pub format: Option<serde_json::Value>,
    /// `keep_alive`, as given.
    pub keep_alive: Option<String>,
    /// `--verbose`: the timings after each reply, on standard error.
    pub verbose: bool,
    /// The system message set with `/set system`, sent first.
    pub system: Option<String>,
    /// The conversation so far.
    pub history: Vec<Message>,
}

impl Chat {
    /// Sends `prompt`, streams the reply to standard output (unless `json`), and keeps both
    /// in the history once the reply is whole. Returns the reply.
    pub async fn turn(&mut self, prompt: &str) -> Result<String, CtlError> {
        let user = Message { role: "user".into(), content: prompt.to_owned() };
        let (reply, stats) = self.send(&user).await?;
        self.history.push(user);
        self.history.push(Message { role: "assistant".into(), content: reply.clone() });
        if self.json {
            let mut object = serde_json::json!({ "model": self.model, "message": self.history.last() });
            if self.verbose {
                if let (Some(object), Ok(serde_json::Value::Object(stats))) =
                    (object.as_object_mut(), serde_json::to_value(stats))
                {
                    object.extend(stats);
                }
            }
            print_json(&object)?;
        } else {
            print(if reply.ends_with('\n') { "\n" } else { "\n\n" })?;
            if self.verbose {
                let _ = writeln!(std::io::stderr().lock(), "{}", stats.summary());
            }
        }
        Ok(reply)
    }

    /// The messages of a request: the system message, the conversation, the new one.
    fn messages(&self, user: &Message) -> Vec<Message> {
        let system = self.system.iter().map(|s| Message { role: "system".into(), content: s.clone() });
        system.chain(self.history.iter().cloned()).chain(std::iter::once(user.clone())).collect()
    }

    async fn send(&self, user: &Message) -> Result<(String, Stats), CtlError> {
        let mut body = serde_json::json!({
            "model": self.model, "messages": self.messages(user), "stream": true, "options": self.options,
        });
        if let Some(format) = &self.format {
            body["format"] = format.clone();
        }
        if let Some(keep_alive) = &self.keep_alive {
            body["keep_alive"] = serde_json::Value::String(keep_alive.clone());
        }
        let response = self.api.post_json("/api/chat", &body).await?;
        let mut reply = String::new();
        let mut stats = Stats::default();
        let done = ndjson(response.into_body(), |line| {
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
            if chunk.done {
                stats = chunk.stats;
            }
            Ok(chunk.done)
        })
        .await?;
        if done {
            Ok((reply, stats))
        } else {
            Err(CtlError::Http { message: "the reply ended before it was done".into() })
        }
    }
}

async fn send_on<S, B>(stream: S, request: Request<B>) -> Result<hyper::Response<hyper::body::Incoming>, hyper::Error>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    sender.send_request(request).await
}

/// Makes sure `model` is there before a conversation: like `ollama run`, a model the
/// store lacks is pulled (its progress on standard error).
pub async fn ensure_model(api: &Api, model: &str, insecure: bool) -> Result<(), CtlError> {
    if api.show(model).await?.is_some() {
        return Ok(());
    }
    let terminal = std::io::stderr().is_terminal();
    api.pull(model, insecure, terminal)
        .await
        .map_err(|e| CtlError::Http { message: format!("model '{model}' not found, and pulling it failed: {e}") })
}

#[cfg(test)]
mod tests {
    use super::{MAX_LINE, Stats, duration, lines};

    /// The lines `pieces` make, fed one after the other; and what is left unfinished.
    fn split(pieces: &[&[u8]]) -> (Vec<String>, Vec<u8>) {
        let mut pending = Vec::new();
        let mut seen = Vec::new();
        for piece in pieces {
            let done = lines(&mut pending, piece, &mut |l: &[u8]| {
                seen.push(String::from_utf8_lossy(l).into_owned());
                Ok(false)
            });
            assert!(!done.expect("within bounds"));
        }
        (seen, pending)
    }

    #[test]
    fn reply_lines_are_the_same_however_the_pieces_fall() {
        let reply = b"{\"a\":1}\n\n  {\"b\":2}\r\n{\"c\":3}";
        let whole = split(&[reply]);
        assert_eq!(whole, (vec!["{\"a\":1}".to_owned(), "{\"b\":2}".to_owned()], b"{\"c\":3}".to_vec()));
        for cut in 0..=reply.len() {
            assert_eq!(split(&[&reply[..cut], &reply[cut..]]), whole, "cut at {cut}");
        }
        let bytes: Vec<&[u8]> = reply.chunks(1).collect();
        assert_eq!(split(&bytes), whole);
    }

    /// A whole reply is read up to its bound; past it, the error names the bound.
    #[tokio::test]
    async fn a_whole_reply_is_read_within_its_bound() {
        let body = http_body_util::Full::new(hyper::body::Bytes::from(vec![b'x'; 1 << 20]));
        assert_eq!(super::whole(body.clone(), 1 << 20).await.expect("at the bound").len(), 1 << 20);
        let error = super::whole(body, (1 << 20) - 1).await.expect_err("past the bound");
        assert!(error.to_string().contains("the reply is longer than 1024.0 KiB"), "{error}");
    }

    /// A line of 16 MiB in 8 KiB pieces is read once, whole; a line past the bound is an
    /// error naming it, not memory without end.
    #[test]
    fn a_long_line_is_read_whole_and_an_endless_one_refused() {
        let long = [vec![b'x'; 16 << 20], b"\n".to_vec()].concat();
        let pieces: Vec<&[u8]> = long.chunks(8 << 10).collect();
        let (seen, pending) = split(&pieces);
        assert_eq!((seen.len(), seen[0].len(), pending.len()), (1, 16 << 20, 0));
        let mut pending = Vec::new();
        let piece = vec![b'x'; 1 << 20];
        let mut never = |_: &[u8]| -> Result<bool, super::CtlError> { unreachable!("no line ends") };
        let error = (0..=MAX_LINE >> 20)
            .find_map(|_| lines(&mut pending, &piece, &mut never).err())
            .expect("refused past the bound");
        assert!(error.to_string().contains("a line of the reply is longer than 64.0 MiB"), "{error}");
    }

    #[test]
    fn durations_are_for_people() {
        assert_eq!(duration(5_593_436_487), "5.59 s");
        assert_eq!(duration(350_000_000), "350 ms");
        assert_eq!(duration(12_345_678), "12.3 ms");
        assert_eq!(duration(850_000), "850 µs");
        assert_eq!(duration(65_000_000_000), "1m 5s");
    }

    #[test]
    fn verbose_prints_ollamas_timings() {
        let stats: Stats = serde_json::from_str(
            r#"{"total_duration": 2000000000, "load_duration": 500000000, "prompt_eval_count": 10,
                "prompt_eval_duration": 100000000, "eval_count": 20, "eval_duration": 1000000000}"#,
        )
        .expect("stats");
        assert_eq!(
            stats.summary(),
            "total duration:       2.00 s\nload duration:        500 ms\nprompt eval count:    10 token(s)\n\
             prompt eval duration: 100 ms\nprompt eval rate:     100.00 tokens/s\neval count:           20 token(s)\n\
             eval duration:        1.00 s\neval rate:            20.00 tokens/s\n"
        );
    }
}
