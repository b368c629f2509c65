//! What the answer to a ranged GET of a blob must be, whichever way its body is received
//! (the HTTP client in [`download`](super::download), or the plain-HTTP reader in
//! [`plain_http`](super::plain_http)), and the errors that name what was wrong with it.

use reqwest::StatusCode;

use super::RegistryError;
use super::protocol::Remote;

/// One ranged GET of `first..end` of a blob, for the errors of its answer, whichever way
/// its body is received.
pub(super) struct Asked<'a> {
    pub(super) remote: &'a Remote,
    /// `blob <digest> of <repo>:<tag>`.
    pub(super) what: &'a str,
    pub(super) first: u64,
    pub(super) end: u64,
}

impl Asked<'_> {
    /// The answer is not one to the range.
    pub(super) fn bad_range(&self, detail: String) -> RegistryError {
        RegistryError::BadRange { registry: self.remote.registry.clone(), what: self.what.to_owned(), detail }
    }

    /// The body goes on past the range.
    pub(super) fn overlong(&self) -> RegistryError {
        let (first, last) = (self.first, self.end - 1);
        self.bad_range(format!("asked for {} bytes ({first}-{last}), got more", self.end - first))
    }

    /// The body broke off after `received` bytes.
    pub(super) fn truncated(&self, received: u64, detail: String) -> RegistryError {
        RegistryError::Truncated {
            registry: self.remote.registry.clone(),
            what: self.what.to_owned(),
            received,
            expected: self.end - self.first,
            first: self.first,
            last: self.end - 1,
            detail,
        }
    }
}

/// The reason a part stopped when the download's writer did (a failed write, which
/// [`Landing::finish`](super::landing::Landing::finish) reports) or the download was
/// given up.
pub(super) fn writing_stopped() -> RegistryError {
    RegistryError::io("a file operation failed", std::io::Error::other("the download's writing stopped"))
}

/// How the head of an answer to a ranged GET of `first..end` of a blob of `size` bytes
/// fits the question: `Ok(true)` when the part's bytes follow, `Ok(false)` for an error
/// status (to report as such), `Err` with what is wrong with an answer to the range.
pub(super) fn check_range_answer(
    status: StatusCode,
    content_range: Option<&str>,
    content_length: Option<u64>,
    first: u64,
    end: u64,
    size: u64,
) -> Result<bool, String> {
    let last = end - 1;
    match status {
        StatusCode::PARTIAL_CONTENT => match content_range.and_then(parse_content_range) {
            Some((a, b, total)) if a == first && b == last && total.is_none_or(|t| t == size) => {}
            _ => {
                return Err(format!(
                    "asked for bytes {first}-{last} of {size}, got 206 with Content-Range {}",
                    content_range.unwrap_or("(none)")
                ));
            }
        },
        StatusCode::OK if first == 0 && end == size => {}
        StatusCode::OK => {
            return Err(format!(
                "asked for bytes {first}-{last} of {size}, got 200 (the whole blob): the server ignores Range"
            ));
        }
        StatusCode::RANGE_NOT_SATISFIABLE => {
            return Err(format!(
                "asked for bytes {first}-{last}, got 416 (range not satisfiable): the blob is not {size} bytes long"
            ));
        }
        _ => return Ok(false),
    }
    let expected = end - first;
    match content_length {
        Some(length) if length != expected => {
            Err(format!("asked for {expected} bytes ({first}-{last}), got Content-Length {length}"))
        }
        _ => Ok(true),
    }
}

/// `bytes <first>-<last>/<total or *>`, a range that exists: `first <= last < total`.
#[must_use]
pub fn parse_content_range(value: &str) -> Option<(u64, u64, Option<u64>)> {
    let rest = value.trim().strip_prefix("bytes ")?;
    let (range, total) = rest.split_once('/')?;
    let (first, last) = range.split_once('-')?;
    let total = if total.trim() == "*" { None } else { Some(total.trim().parse().ok()?) };
    let (first, last) = (first.trim().parse().ok()?, last.trim().parse().ok()?);
    (first <= last && total.is_none_or(|total| last < total)).then_some((first, last, total))
}

#[cfg(test)]
mod tests {
    use super::parse_content_range;

    #[test]
    fn content_ranges_parse() {
        assert_eq!(parse_content_range("bytes 0-99/1000"), Some((0, 99, Some(1000))));
        assert_eq!(parse_content_range("bytes 5-9/*"), Some((5, 9, None)));
        for bad in ["bytes */1000", "0-99/1000", "bytes 0-/1000", "bytes a-b/c", "bytes 9-5/10", "bytes 0-10/10"] {
            assert_eq!(parse_content_range(bad), None, "{bad}");
        }
    }
    proptest::proptest! {
        /// A range written as a server sends it parses back; one that does not exist
        /// (backwards, or past the end) is refused.
        #[test]
        fn content_ranges_round_trip(first in 0u64..u64::MAX, len in 0u64..1 << 40, past in 1u64..1 << 40, star: bool) {
            let last = first.saturating_add(len);
            let total = last.checked_add(past);
            let written = format!("bytes {first}-{last}/{}", total.map_or("*".to_owned(), |t| t.to_string()));
            let expected = if star || total.is_none() { None } else { total };
            let written = if star { format!("bytes {first}-{last}/*") } else { written };
            proptest::prop_assert_eq!(parse_content_range(&written), Some((first, last, expected)));
            if first < last {
                proptest::prop_assert_eq!(parse_content_range(&format!("bytes {last}-{first}/*")), None);
            }
            proptest::prop_assert_eq!(parse_content_range(&format!("bytes {first}-{last}/{last}")), None);
        }
    }
}
