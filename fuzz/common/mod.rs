//! What several targets share: cutting an input into pieces the way a network or a pipe
//! might, so a stream parser can be checked against the same bytes given whole.

#![allow(dead_code, reason = "each target uses only some of it")]

/// Splits `data` into a seed (its first byte) and the rest, then cuts the rest into
/// pieces whose sizes (1 to 17 bytes, then 1 to 13, alternating) follow from the seed.
pub fn pieces(data: &[u8]) -> Vec<&[u8]> {
    let Some((&seed, mut rest)) = data.split_first() else { return Vec::new() };
    let sizes = [usize::from(seed % 17) + 1, usize::from(seed / 17 % 13) + 1];
    let mut out = Vec::new();
    let mut i = 0;
    while !rest.is_empty() {
        let (piece, after) = rest.split_at(sizes[i % 2].min(rest.len()));
        out.push(piece);
        rest = after;
        i += 1;
    }
    out
}

/// The text of `data`: as it is when it is UTF-8, else with its bad bytes replaced
/// (what a reader of text from outside does).
pub fn text(data: &[u8]) -> std::borrow::Cow<'_, str> {
    String::from_utf8_lossy(data)
}
