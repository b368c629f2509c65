//! Where corralctl's HTTP commands find corrald's API: `--host`, else `CORRAL_HOST`, else
//! `OLLAMA_HOST`, else `127.0.0.1:11434`.
//!
//! Every source is read as Ollama's clients read `OLLAMA_HOST`, so a value that works for
//! `ollama` works here: the scheme is optional (`http` when left out), the port is 11434
//! when there is no scheme (80 with `http://`), a path is kept as a prefix (a reverse
//! proxy's), and an unspecified address (`0.0.0.0`, `::`, what a server is told to bind)
//! means this machine's loopback. Unlike Ollama, a value that does not parse is an error
//! naming its source, not a silent default; and a UNIX socket is reached with an absolute
//! path or `unix:PATH`.

use std::net::IpAddr;
use std::path::PathBuf;

use super::error::CtlError;

/// Ollama's port.
const DEFAULT_PORT: u16 = 11434;

/// Where corrald's HTTP API is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Host {
    /// TCP.
    Tcp {
        /// `host:port` to connect to (IPv6 in brackets), also sent as `Host`.
        authority: String,
        /// A path prefix put before every request's path (`/ollama`), or empty.
        base: String,
    },
    /// A UNIX socket.
    Unix(PathBuf),
}

impl Default for Host {
    fn default() -> Self {
        Self::Tcp { authority: format!("127.0.0.1:{DEFAULT_PORT}"), base: String::new() }
    }
}

impl Host {
    /// The API named by `--host` (`flag`), else by `CORRAL_HOST`, else by `OLLAMA_HOST`
    /// (the variables' values as given; an empty variable counts as unset), else the default.
    pub fn resolve(flag: Option<&str>, corral_host: Option<&str>, ollama_host: Option<&str>) -> Result<Self, CtlError> {
        if let Some(value) = flag {
            return Self::parse(value).map_err(|why| CtlError::Invalid(format!("--host {value}: {why}")));
        }
        for (name, value) in [("CORRAL_HOST", corral_host), ("OLLAMA_HOST", ollama_host)] {
            if let Some(value) = value.filter(|v| !unquote(v).is_empty()) {
                return Self::parse(value).map_err(|why| CtlError::Invalid(format!("{name}={value}: {why}")));
            }
        }
        Ok(Self::default())
    }

    /// Reads one value; `Err` says what is wrong with it.
    pub fn parse(value: &str) -> Result<Self, String> {
        let value = unquote(value);
        if let Some(path) = value.strip_prefix("unix://").or_else(|| value.strip_prefix("unix:")) {
            if !path.starts_with('/') {
                return Err(format!("the socket path \"{path}\" is not absolute"));
            }
            return Ok(Self::Unix(path.into()));
        }
        if value.starts_with('/') {
            return Ok(Self::Unix(value.into()));
        }
        if value.is_empty() {
            return Err("expected [http://]HOST[:PORT][/PATH] or a UNIX socket path such as /run/corral.sock".into());
        }
        let (rest, default_port) = match value.split_once("://") {
            None => (value, DEFAULT_PORT),
            Some((scheme, rest)) if scheme.eq_ignore_ascii_case("http") => (rest, 80),
            Some((scheme, _)) if scheme.eq_ignore_ascii_case("https") => {
                return Err("https is not supported; use http:// (on loopback or a trusted network) or the UNIX \
                            socket"
                    .into());
            }
            Some((scheme, _)) => return Err(format!("the scheme \"{scheme}\" is not http")),
        };
        let (hostport, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (host, port) = split_host_port(hostport)?;
        let port = match port {
            None => default_port,
            Some(text) => match text.parse::<u16>() {
                Ok(port) if port != 0 => port,
                _ => return Err(format!("the port \"{text}\" is not a number from 1 to 65535")),
            },
        };
        let host = match host.parse::<IpAddr>() {
            // A server's bind-everything address: the client connects to this machine.
            Ok(ip) if ip.is_unspecified() && ip.is_ipv4() => "127.0.0.1".to_owned(),
            Ok(ip) if ip.is_unspecified() => "[::1]".to_owned(),
            Ok(IpAddr::V6(ip)) => format!("[{ip}]"),
            Ok(IpAddr::V4(ip)) => ip.to_string(),
            Err(_) if host.is_empty() => "127.0.0.1".to_owned(),
            Err(_) if host.bytes().all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b)) => host.to_owned(),
            Err(_) => return Err(format!("\"{host}\" is not a host name or IP address")),
        };
        let base = path.trim_end_matches('/');
        let base = if base.is_empty() { String::new() } else { format!("/{base}") };
        Ok(Self::Tcp { authority: format!("{host}:{port}"), base })
    }

    /// How messages name it.
    #[must_use]
    pub fn describe(&self) -> String {
        match self {
            Self::Tcp { authority, base } => format!("http://{authority}{base}"),
            Self::Unix(path) => path.display().to_string(),
        }
    }

    /// The `Host` header: the UNIX socket has none of its own, and `localhost` passes the
    /// daemon's DNS-rebinding check.
    #[must_use]
    pub fn header(&self) -> &str {
        match self {
            Self::Tcp { authority, .. } => authority,
            Self::Unix(_) => "localhost",
        }
    }

    /// The request target for the API path `path` (`/api/chat`).
    #[must_use]
    pub fn target(&self, path: &str) -> String {
        match self {
            Self::Tcp { base, .. } => format!("{base}{path}"),
            Self::Unix(_) => path.to_owned(),
        }
    }
}

/// The value without surrounding blanks and quotes, as Ollama reads its variables.
fn unquote(value: &str) -> &str {
    value.trim().trim_matches(['"', '\'']).trim()
}

/// `host[:port]`, `[v6][:port]` or a bare IPv6 address, split; brackets removed.
fn split_host_port(hostport: &str) -> Result<(&str, Option<&str>), String> {
    if let Some(rest) = hostport.strip_prefix('[') {
        let (inside, after) = rest.split_once(']').ok_or_else(|| format!("\"{hostport}\" lacks its \"]\""))?;
        return match after {
            "" => Ok((inside, None)),
            _ => after
                .strip_prefix(':')
                .map(|port| (inside, Some(port)))
                .ok_or_else(|| format!("\"{hostport}\" has something other than a port after its address")),
        };
    }
    match hostport.split_once(':') {
        // More than one colon: a bare IPv6 address.
        Some((_, rest)) if rest.contains(':') => Ok((hostport, None)),
        Some((host, port)) => Ok((host, Some(port))),
        None => Ok((hostport, None)),
    }
}

#[cfg(test)]
mod tests {
    use super::Host;

    fn tcp(authority: &str, base: &str) -> Host {
        Host::Tcp { authority: authority.into(), base: base.into() }
    }

    #[test]
    fn values_are_read_as_ollama_reads_ollama_host() {
        for (value, expected) in [
            ("", None),
            ("127.0.0.1", Some(tcp("127.0.0.1:11434", ""))),
            ("0.0.0.0", Some(tcp("127.0.0.1:11434", ""))),
            ("0.0.0.0:8080", Some(tcp("127.0.0.1:8080", ""))),
            (":11435", Some(tcp("127.0.0.1:11435", ""))),
            ("::", Some(tcp("[::1]:11434", ""))),
            ("[::]:9", Some(tcp("[::1]:9", ""))),
            ("::1", Some(tcp("[::1]:11434", ""))),
            ("[::1]:8080", Some(tcp("[::1]:8080", ""))),
            ("box.lan", Some(tcp("box.lan:11434", ""))),
            ("box.lan:1234", Some(tcp("box.lan:1234", ""))),
            ("http://box.lan", Some(tcp("box.lan:80", ""))),
            ("HTTP://box.lan:11434/", Some(tcp("box.lan:11434", ""))),
            ("http://127.0.0.1:11434", Some(tcp("127.0.0.1:11434", ""))),
            ("http://proxy.lan/ollama/", Some(tcp("proxy.lan:80", "/ollama"))),
            ("  \"0.0.0.0:11434\" ", Some(tcp("127.0.0.1:11434", ""))),
            ("'localhost'", Some(tcp("localhost:11434", ""))),
            ("/run/corral.sock", Some(Host::Unix("/run/corral.sock".into()))),
            ("unix:/run/corral.sock", Some(Host::Unix("/run/corral.sock".into()))),
            ("unix:///run/corral.sock", Some(Host::Unix("/run/corral.sock".into()))),
        ] {
            assert_eq!(Host::parse(value).ok(), expected, "{value:?}");
        }
        for (bad, why) in [
            ("https://example.org", "https is not supported"),
            ("ftp://x", "\"ftp\" is not http"),
            ("box:http", "\"http\" is not a number"),
            ("box:0", "\"0\" is not a number"),
            ("box:70000", "from 1 to 65535"),
            ("a b", "not a host name"),
            ("user@box", "not a host name"),
            ("[::1", "lacks"),
            ("unix:relative.sock", "not absolute"),
        ] {
            let error = Host::parse(bad).expect_err(bad);
            assert!(error.contains(why), "{bad}: {error}");
        }
    }

    #[test]
    fn the_flag_wins_then_corral_host_then_ollama_host() {
        let flag = Some("127.0.0.1:1");
        let corral = Some("127.0.0.2:2");
        let ollama = Some("0.0.0.0");
        assert_eq!(Host::resolve(flag, corral, ollama).expect("flag"), tcp("127.0.0.1:1", ""));
        assert_eq!(Host::resolve(None, corral, ollama).expect("corral"), tcp("127.0.0.2:2", ""));
        assert_eq!(Host::resolve(None, None, ollama).expect("ollama"), tcp("127.0.0.1:11434", ""));
        assert_eq!(Host::resolve(None, Some(" "), Some("box:5")).expect("empty"), tcp("box:5", ""));
        assert_eq!(Host::resolve(None, None, None).expect("default"), Host::default());
        assert_eq!(Host::default().describe(), "http://127.0.0.1:11434");

        let error = Host::resolve(None, None, Some("https://x")).expect_err("https").to_string();
        assert!(error.starts_with("OLLAMA_HOST=https://x: https is not supported"), "{error}");
        let error = Host::resolve(None, Some("x:y"), Some("fine")).expect_err("port").to_string();
        assert!(error.starts_with("CORRAL_HOST=x:y: the port \"y\""), "{error}");
        let error = Host::resolve(Some(""), None, None).expect_err("empty flag").to_string();
        assert!(error.starts_with("--host : expected"), "{error}");
    }

    #[test]
    fn requests_go_below_the_base_path() {
        let host = Host::parse("http://proxy.lan:8080/ollama").expect("parse");
        assert_eq!(host.target("/api/chat"), "/ollama/api/chat");
        assert_eq!(host.header(), "proxy.lan:8080");
        assert_eq!(host.describe(), "http://proxy.lan:8080/ollama");
        let unix = Host::parse("/run/corral.sock").expect("parse");
        assert_eq!((unix.target("/api/chat").as_str(), unix.header()), ("/api/chat", "localhost"));
    }
}
