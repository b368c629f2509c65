//! Blob parts from a registry spoken to over plain HTTP, read by a blocking thread straight
//! into the landing's batch buffers.
//!
//! Why not through the HTTP client: there, each piece of a body (about 200 KB) is read by
//! the connection's task into the client's buffer, passed to the part's task through a
//! channel (a wake-up on each side) and copied into a batch buffer. On a pull from a
//! registry close by, the two cores are the limit (the registry, the receiving and the
//! hash share them), and that path cost corrald about 1.0–1.4 s of CPU per GiB where a
//! plain program with blocking reads needed 0.83 s (`docs/benchmarks.md`). Here the head is
//! exchanged on the runtime, then blocking reads fill the batch buffers from the socket
//! themselves, a batch (4 MiB) per trip to a blocking thread: one copy (the kernel's), no
//! wake-ups while data flows.
//!
//! Only what this path can do right is done here: one request, and an answer of 206 (or
//! 200 for the whole blob) with or without its length, or an error status with its body's
//! start. A redirect or a 401 (a token to fetch) and a chunked body go to the HTTP client,
//! which follows redirects and does the token dance; after a redirect every part does
//! ([`Remote::stop_reading_direct`]). HTTPS goes there too: TLS means a registry across a
//! network, whose link, not the CPU, is the limit.
//!
//! Every wait has the configured bound (`connect_timeout`, then `read_timeout` for each
//! read or write), the head at most [`MAX_HEAD`] bytes. A download given up shuts the
//! socket down, which ends a blocked read at once.

use std::io::Read as _;
use std::net::{Shutdown, TcpStream as StdStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use reqwest::StatusCode;
use reqwest::header::HeaderValue;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use super::landing::{Feed, Filling};
use super::partial::Partial;
use super::protocol::{EXCERPT_BYTES, Remote, excerpt_text};
use super::ranged::{Asked, check_range_answer, writing_stopped};
use super::{RegistryError, USER_AGENT};
use crate::durations::human;
use crate::sync::lock;

/// The most an answer's status line and headers may weigh.
const MAX_HEAD: usize = 64 << 10;
/// The most headers an answer may have.
const MAX_HEADERS: usize = 100;

/// How a part went.
pub(super) enum Fetched {
    /// Its bytes are handed to the landing.
    Landed,
    /// Not an answer for this path (a redirect, a 401, a chunked body): ask the HTTP client.
    Elsewhere,
}

/// What an answer's head says, as far as a blob part needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnswerHead {
    /// The status.
    pub status: StatusCode,
    /// `Content-Length`, when given.
    pub content_length: Option<u64>,
    /// `Content-Range`, when given.
    pub content_range: Option<String>,
    /// Any `Transfer-Encoding`: a body this path does not decode.
    pub encoded: bool,
    /// Where the body begins in what was read.
    pub length: usize,
}

/// One ranged GET of `*at..end` as [`download::fetch_range`](super::download) makes it,
/// over plain HTTP; `*at` moves past every byte handed on.
pub(super) async fn fetch_range(
    remote: &Remote,
    partial: &Partial,
    feed: Feed,
    at: &mut u64,
    end: u64,
) -> Result<Fetched, RegistryError> {
    let config = remote.config();
    let what = &partial.what;
    let transport =
        |detail: String| RegistryError::Transport { registry: remote.registry.clone(), what: what.clone(), detail };
    let (first, last) = (*at, end - 1);
    let asked = Asked { remote, what, first, end };
    let url = remote.url(&format!("blobs/{}", partial.digest))?;
    let token = lock(&remote.token).clone();
    let (Some(host), Some(port)) = (url.host_str(), url.port_or_known_default()) else {
        return Ok(Fetched::Elsewhere);
    };
    if token.as_deref().is_some_and(|t| HeaderValue::from_str(t).is_err()) {
        // The HTTP client refuses it with its own error.
        return Ok(Fetched::Elsewhere);
    }
    let authority = url.port().map_or_else(|| host.to_owned(), |port| format!("{host}:{port}"));
    let path = url.query().map_or_else(|| url.path().to_owned(), |query| format!("{}?{query}", url.path()));
    let authorization = token.map_or_else(String::new, |token| format!("Authorization: Bearer {token}\r\n"));
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {authority}\r\nUser-Agent: {USER_AGENT}\r\nAccept: */*\r\n\
         Range: bytes={first}-{last}\r\n{authorization}Connection: close\r\n\r\n"
    );

    let connect = TcpStream::connect((host.trim_start_matches('[').trim_end_matches(']'), port));
    let mut stream = tokio::time::timeout(config.connect_timeout, connect)
        .await
        .map_err(|_| transport(format!("no connection to {authority} within {}", human(config.connect_timeout))))?
        .map_err(|e| transport(format!("cannot connect to {authority}: {e}")))?;
    let stalled = || transport(format!("no answer for {}", human(config.read_timeout)));
    tokio::time::timeout(config.read_timeout, stream.write_all(request.as_bytes()))
        .await
        .map_err(|_| stalled())?
        .map_err(|e| transport(format!("cannot send the request: {e}")))?;
    let mut read = Vec::with_capacity(8 << 10);
    let head = match read_head(&mut stream, &mut read, config.read_timeout).await {
        Ok(head) => head,
        Err(HeadFail::Stalled) => return Err(stalled()),
        Err(HeadFail::Read(e)) => return Err(transport(format!("cannot read the answer: {e}"))),
        Err(HeadFail::Closed) => return Err(transport("the connection closed before an answer".to_owned())),
        Err(HeadFail::TooLarge) => {
            return Err(protocol(remote, format!("an answer's head is larger than {MAX_HEAD} bytes")));
        }
        Err(HeadFail::Bad(detail)) => return Err(protocol(remote, detail)),
    };
    if head.status == StatusCode::UNAUTHORIZED || head.status.is_redirection() || head.encoded {
        if head.status.is_redirection() {
            remote.stop_reading_direct();
        }
        return Ok(Fetched::Elsewhere);
    }
    let checked =
        check_range_answer(head.status, head.content_range.as_deref(), head.content_length, first, end, partial.size);
    let body = read.split_off(head.length);
    match checked {
        Ok(true) => {}
        Ok(false) => {
            let body = read_excerpt(&mut stream, body, head.content_length, config.read_timeout).await;
            return Err(remote.status_error(what, head.status, excerpt_text(&body)));
        }
        Err(detail) => return Err(asked.bad_range(detail)),
    }

    let socket = stream.into_std().map_err(|e| transport(format!("cannot take the connection: {e}")))?;
    // A zero timeout is an error to the socket (it would mean none).
    let wait = config.read_timeout.max(Duration::from_millis(1));
    let setup = socket.set_nonblocking(false).and_then(|()| socket.set_read_timeout(Some(wait)));
    let stop = setup.and_then(|()| socket.try_clone()).map_err(|e| transport(format!("cannot set up: {e}")))?;
    let stop = Stop(Arc::new((AtomicBool::new(false), stop)));
    let receiving = Receiving {
        socket,
        stop: Arc::clone(&stop.0),
        filling: Filling::new(feed),
        first: body,
        at: *at,
        received: 0,
        expected: end - first,
        known_length: head.content_length.is_some(),
    };
    let (reached, outcome) = receiving.run().await?;
    drop(stop);
    *at = reached;
    match outcome {
        Ok(()) => Ok(Fetched::Landed),
        Err(Broke::Overlong) => Err(asked.overlong()),
        Err(Broke::Stopped) => Err(writing_stopped()),
        Err(Broke::Off { received, detail }) => Err(asked.truncated(
            received,
            detail.unwrap_or_else(|| format!("no data arrived for {}", human(config.read_timeout))),
        )),
    }
}

fn protocol(remote: &Remote, detail: String) -> RegistryError {
    RegistryError::Protocol { registry: remote.registry.clone(), detail }
}

/// The head of an HTTP/1.x answer, once `read` holds all of it (`None` until then); `Err`
/// for one that is not HTTP, has more than 100 headers, or an invalid or contradictory
/// `Content-Length`.
pub fn parse_answer_head(read: &[u8]) -> Result<Option<AnswerHead>, String> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut response = httparse::Response::new(&mut headers);
    let length = match response.parse(read) {
        Ok(httparse::Status::Complete(length)) => length,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(format!("a malformed answer ({e})")),
    };
    let status = response
        .code
        .and_then(|code| StatusCode::from_u16(code).ok())
        .ok_or_else(|| "an answer without a valid status".to_owned())?;
    let mut head = AnswerHead { status, content_length: None, content_range: None, encoded: false, length };
    for header in response.headers.iter() {
        let value = String::from_utf8_lossy(header.value);
        if header.name.eq_ignore_ascii_case("content-length") {
            let length = value.trim().parse().map_err(|_| format!("an invalid Content-Length \"{value}\""))?;
            if head.content_length.is_some_and(|known| known != length) {
                return Err("two different Content-Lengths".to_owned());
            }
            head.content_length = Some(length);
        } else if header.name.eq_ignore_ascii_case("content-range") {
            head.content_range = Some(value.into_owned());
        } else if header.name.eq_ignore_ascii_case("transfer-encoding") {
            head.encoded = true;
        }
    }
    Ok(Some(head))
}

/// Why no answer head was read.
#[derive(Debug)]
enum HeadFail {
    /// Nothing came for the read timeout.
    Stalled,
    /// Reading failed.
    Read(std::io::Error),
    /// The connection closed before the head ended.
    Closed,
    /// More than [`MAX_HEAD`] bytes without the head's end.
    TooLarge,
    /// Not an HTTP answer head ([`parse_answer_head`]'s reason).
    Bad(String),
}

/// Reads an answer's head into `read` (which then holds it and what came after it), each
/// read within `timeout`.
async fn read_head(
    stream: &mut (impl tokio::io::AsyncRead + Unpin),
    read: &mut Vec<u8>,
    timeout: Duration,
) -> Result<AnswerHead, HeadFail> {
    loop {
        let n = tokio::time::timeout(timeout, stream.read_buf(read))
            .await
            .map_err(|_| HeadFail::Stalled)?
            .map_err(HeadFail::Read)?;
        // A head ends at an empty line: it is parsed once one may have come (parsed at each
        // read, a head sent a byte at a time cost the square of its length).
        let fresh = &read[(read.len() - n).saturating_sub(2)..];
        let may_end = fresh.windows(2).any(|w| w == b"\n\n") || fresh.windows(3).any(|w| w == b"\n\r\n");
        if n > 0 && !may_end && read.len() < MAX_HEAD {
            continue;
        }
        match parse_answer_head(read) {
            Ok(Some(head)) => return Ok(head),
            Ok(None) if n == 0 => return Err(HeadFail::Closed),
            Ok(None) if read.len() < MAX_HEAD => {}
            Ok(None) => return Err(HeadFail::TooLarge),
            Err(detail) => return Err(HeadFail::Bad(detail)),
        }
    }
}

/// The start of an error answer's body: what came with the head, then up to
/// [`EXCERPT_BYTES`] and one more (to show it goes on), each read bounded by `wait`.
async fn read_excerpt(stream: &mut TcpStream, mut body: Vec<u8>, length: Option<u64>, wait: Duration) -> Vec<u8> {
    let cap = length.map_or(usize::MAX, |length| usize::try_from(length).unwrap_or(usize::MAX));
    while body.len() < cap.min(EXCERPT_BYTES + 1) {
        match tokio::time::timeout(wait, stream.read_buf(&mut body)).await {
            Ok(Ok(n)) if n > 0 => {}
            _ => break,
        }
    }
    body
}

/// Shuts the socket down when the part's future goes (also when the download is given
/// up), so that the receiving thread's blocked read ends at once.
struct Stop(Arc<(AtomicBool, StdStream)>);

impl Drop for Stop {
    fn drop(&mut self) {
        self.0.0.store(true, Ordering::Relaxed);
        let _ = self.0.1.shutdown(Shutdown::Both);
    }
}

/// Why a body stopped.
enum Broke {
    /// More than the range.
    Overlong,
    /// The writer stopped, or the download was given up.
    Stopped,
    /// The connection closed or failed (`detail`), or stalled (`None`).
    Off { received: u64, detail: Option<String> },
}

/// A part's body, read on blocking threads, one batch at a time.
struct Receiving {
    socket: StdStream,
    stop: Arc<(AtomicBool, StdStream)>,
    filling: Filling,
    /// What came with the head, not yet in a batch.
    first: Vec<u8>,
    /// Where the data not yet handed on belongs.
    at: u64,
    received: u64,
    expected: u64,
    /// Whether the answer said how long it is (then it ends there, else where the
    /// connection closes).
    known_length: bool,
}

impl Receiving {
    /// Reads the body into batches. Each batch is waited for on the runtime and filled on a
    /// blocking thread: a thread never waits for a free buffer, which the download's writer
    /// and hash threads (blocking ones too) give back. Returns how far the data handed on
    /// reaches, and how the body ended. Whatever arrived is handed on, also when the
    /// transfer broke off (a retry asks for the rest), but nothing of a body longer than the
    /// range: the server is not answering what was asked.
    async fn run(mut self) -> Result<(u64, Result<(), Broke>), RegistryError> {
        let outcome = loop {
            self.filling.ready(self.at).await;
            // The thread settles the end itself: also when this future is gone (the
            // download given up), what arrived is handed on.
            let (back, ended) = tokio::task::spawn_blocking(move || {
                let ended = self.fill().map(|outcome| self.settle(outcome));
                (self, ended)
            })
            .await
            .map_err(|_| RegistryError::io("a download's receiving thread", std::io::Error::other("it panicked")))?;
            self = back;
            if let Some(outcome) = ended {
                break outcome;
            }
        };
        Ok((self.at, outcome))
    }

    /// Hands on what is left at the end of the body.
    fn settle(&mut self, outcome: Result<(), Broke>) -> Result<(), Broke> {
        match outcome {
            Err(Broke::Overlong) => Err(Broke::Overlong),
            outcome if !self.filling.hand_on(&mut self.at) => outcome.and(Err(Broke::Stopped)),
            outcome => outcome,
        }
    }

    /// Reads into the batch being filled until it is handed on (`None`) or the body ends.
    fn fill(&mut self) -> Option<Result<(), Broke>> {
        let received = &mut self.received;
        loop {
            if *received == self.expected && self.known_length {
                return Some(Ok(()));
            }
            if self.stop.0.load(Ordering::Relaxed) {
                return Some(Err(Broke::Stopped));
            }
            // One byte past the range, where no length was given, shows a body too long.
            let left = self.expected - *received + u64::from(!self.known_length);
            let room = self.filling.room()?;
            let room_len = room.len().min(usize::try_from(left).unwrap_or(usize::MAX));
            let room = &mut room[..room_len];
            let n = if self.first.is_empty() {
                match self.socket.read(room) {
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                        return Some(Err(Broke::Off { received: *received, detail: None }));
                    }
                    Err(e) => return Some(Err(Broke::Off { received: *received, detail: Some(e.to_string()) })),
                }
            } else {
                let n = self.first.len().min(room.len());
                room[..n].copy_from_slice(&self.first[..n]);
                self.first.drain(..n);
                n
            };
            if n == 0 {
                if self.stop.0.load(Ordering::Relaxed) {
                    return Some(Err(Broke::Stopped));
                }
                return Some(if *received == self.expected {
                    Ok(())
                } else {
                    Err(Broke::Off { received: *received, detail: Some("the answer ended early".to_owned()) })
                });
            }
            if *received + n as u64 > self.expected {
                return Some(Err(Broke::Overlong));
            }
            *received += n as u64;
            if !self.filling.filled(n, &mut self.at) {
                return Some(Err(Broke::Stopped));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{HeadFail, MAX_HEAD, parse_answer_head as parse_head, read_head};
    use reqwest::StatusCode;
    use tokio::io::AsyncWriteExt as _;

    /// `answer` sent in pieces of at most `size` bytes (the pipe holds no more, so no read
    /// gets more), the connection kept open (`close`: closed) after it: what `read_head`
    /// makes of it.
    async fn head_of(answer: &[u8], size: usize, close: bool) -> (Result<super::AnswerHead, HeadFail>, Vec<u8>) {
        let (mut server, mut client) = tokio::io::duplex(size);
        let (done, read_done) = tokio::sync::oneshot::channel::<()>();
        let answer = answer.to_vec();
        let sender = tokio::spawn(async move {
            for piece in answer.chunks(size) {
                if server.write_all(piece).await.is_err() {
                    return;
                }
            }
            if !close {
                let _ = read_done.await;
            }
        });
        let mut read = Vec::new();
        let head = read_head(&mut client, &mut read, Duration::from_secs(5)).await;
        let _ = done.send(());
        drop(client);
        sender.await.expect("sender");
        (head, read)
    }

    /// The head is found wherever its end falls between reads, with either line end, while
    /// the connection stays open, and what came after it stays for the body; a head cut
    /// off, too large or no HTTP is named.
    #[tokio::test]
    async fn a_head_is_read_however_it_arrives() {
        let crlf = b"HTTP/1.1 206 Partial Content\r\nContent-Length: 4\r\n\r\nbody".as_slice();
        let lf = b"HTTP/1.1 206 Partial Content\nContent-Length: 4\n\nbody".as_slice();
        for answer in [crlf, lf] {
            for size in [1, 2, 3, 5, 7, answer.len()] {
                let (head, read) = head_of(answer, size, false).await;
                let head = head.unwrap_or_else(|e| panic!("{size}: {e:?}"));
                assert_eq!((head.status, head.content_length), (StatusCode::PARTIAL_CONTENT, Some(4)), "{size}");
                assert!(b"body".starts_with(&read[head.length..]), "{size}: {:?}", &read[head.length..]);
            }
        }
        let (head, _) = head_of(b"HTTP/1.1 206 Partial Content\r\nContent-Le", 3, true).await;
        assert!(matches!(head, Err(HeadFail::Closed)), "{head:?}");
        let (head, _) = head_of(b"SSH-2.0-OpenSSH_9.2\r\n", 1, true).await;
        assert!(matches!(&head, Err(HeadFail::Bad(why)) if why.starts_with("a malformed answer")), "{head:?}");
        let endless = [b"HTTP/1.1 200 OK\r\nX: ".as_slice(), &vec![b'x'; MAX_HEAD]].concat();
        let (head, _) = head_of(&endless, 4096, false).await;
        assert!(matches!(head, Err(HeadFail::TooLarge)), "{head:?}");
    }

    #[test]
    fn heads_parse_and_bad_ones_are_named() {
        let head = b"HTTP/1.1 206 Partial Content\r\nContent-Length: 10\r\nContent-Range: bytes 0-9/20\r\n\r\nbody";
        let parsed = parse_head(head).expect("valid").expect("complete");
        assert_eq!(parsed.status, StatusCode::PARTIAL_CONTENT);
        assert_eq!(parsed.content_length, Some(10));
        assert_eq!(parsed.content_range.as_deref(), Some("bytes 0-9/20"));
        assert!(!parsed.encoded);
        assert_eq!(&head[parsed.length..], b"body");

        assert!(parse_head(b"HTTP/1.1 206 Partial Content\r\nContent-Le").expect("valid so far").is_none());
        let chunked = parse_head(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n").expect("valid");
        assert!(chunked.expect("complete").encoded);
        for (bad, why) in [
            (&b"SSH-2.0-OpenSSH_9.2\r\n\r\n"[..], "a malformed answer"),
            (b"HTTP/1.1 206 OK\r\nContent-Length: ten\r\n\r\n", "an invalid Content-Length \"ten\""),
            (b"HTTP/1.1 206 OK\r\nContent-Length: 10\r\nContent-Length: 11\r\n\r\n", "two different Content-Lengths"),
        ] {
            let error = parse_head(bad).expect_err("refused");
            assert!(error.starts_with(why), "{error}");
        }
    }
}
