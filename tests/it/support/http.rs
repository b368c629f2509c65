//! A minimal HTTP/1.1 client over TCP or UNIX sockets, enough to check status, headers and body.

use std::fmt::Write as _;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

/// A response, read to the end (requests send `Connection: close`).
#[derive(Debug)]
pub struct Response {
    /// The status code.
    pub status: u16,
    /// Header lines as `(lower-case name, value)`.
    pub headers: Vec<(String, String)>,
    /// The body, de-chunked.
    pub body: String,
}

impl Response {
    /// The first header with this (lower-case) name.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", self.body))
    }
}

/// Sends a request over any connected stream.
pub fn request(mut stream: impl Read + Write, method: &str, path: &str, body: Option<&str>) -> Response {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    if let Some(body) = body {
        let _ = write!(head, "Content-Type: application/json\r\nContent-Length: {}\r\n", body.len());
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).expect("send request");
    if let Some(body) = body {
        stream.write_all(body.as_bytes()).expect("send body");
    }
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).expect("read response");
    parse(&raw)
}

/// `request` over TCP.
pub fn tcp(addr: SocketAddr, method: &str, path: &str) -> Response {
    let stream = connect(&addr.to_string(), || TcpStream::connect(addr));
    stream.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    request(stream, method, path, None)
}

/// `request` over a UNIX socket.
pub fn unix(socket: &Path, method: &str, path: &str, body: Option<&str>) -> Response {
    let stream = connect(&socket.display().to_string(), || UnixStream::connect(socket));
    stream.set_read_timeout(Some(Duration::from_secs(120))).expect("timeout");
    request(stream, method, path, body)
}

/// Connects, retrying while the other side has not started listening yet (a process that
/// was just spawned), for at most 30 s.
pub fn connect<S>(what: &str, mut attempt: impl FnMut() -> std::io::Result<S>) -> S {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match attempt() {
            Ok(stream) => return stream,
            Err(e)
                if Instant::now() < deadline
                    && matches!(e.kind(), ErrorKind::ConnectionRefused | ErrorKind::NotFound) =>
            {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("connect {what}: {e}"),
        }
    }
}

/// Parses a whole response as read from a connection that the server closed.
pub fn parse(raw: &[u8]) -> Response {
    let text = String::from_utf8_lossy(raw);
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no header end in {text:?}"));
    let mut lines = head.split("\r\n");
    let status_line = lines.next().expect("status line");
    let status = status_line.split(' ').nth(1).and_then(|s| s.parse().ok()).expect("status code");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let chunked = headers.iter().any(|(n, v)| n == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked { dechunk(rest) } else { rest.to_owned() };
    Response { status, headers, body }
}

fn dechunk(mut rest: &str) -> String {
    let mut body = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).expect("chunk size");
        if size == 0 {
            break;
        }
        body.push_str(&after[..size]);
        rest = &after[size + 2..];
    }
    body
}
