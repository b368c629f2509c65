//! Content digests: `sha256:<64 lower-case hex>`, stored as `blobs/sha256-<hex>`.

use std::fmt;
use std::io::Read;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::{Digest as _, Sha256};

/// A SHA-256 content digest.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest([u8; 32]);

/// Why a digest string is not valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid digest \"{0}\": expected sha256:<64 hex digits>")]
pub struct InvalidDigest(pub String);

impl Digest {
    /// Parses `sha256:<hex>` or `sha256-<hex>` (the file-name form), hex in either case.
    pub fn parse(s: &str) -> Result<Self, InvalidDigest> {
        let invalid = || InvalidDigest(s.chars().take(100).collect());
        let hex = s.strip_prefix("sha256:").or_else(|| s.strip_prefix("sha256-")).ok_or_else(invalid)?;
        if hex.len() != 64 {
            return Err(invalid());
        }
        let mut bytes = [0u8; 32];
        hex::decode_to_slice(hex, &mut bytes).map_err(|_| invalid())?;
        Ok(Self(bytes))
    }

    /// The digest of `data`.
    #[must_use]
    pub fn of(data: &[u8]) -> Self {
        Self(Sha256::digest(data).into())
    }

    /// The digest of everything `reader` yields, and its length.
    pub fn of_reader(mut reader: impl Read) -> std::io::Result<(Self, u64)> {
        let mut hasher = Hasher::default();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = reader.read(&mut buf)?;
            if n == 0 {
                return Ok(hasher.finish());
            }
            hasher.update(&buf[..n]);
        }
    }

    /// The hex part.
    #[must_use]
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }

    /// The blob's file name: `sha256-<hex>`.
    #[must_use]
    pub fn file_name(&self) -> String {
        format!("sha256-{}", self.hex())
    }
}

/// Hashes data as it streams by, counting bytes.
#[derive(Default)]
pub struct Hasher {
    sha: Sha256,
    len: u64,
}

impl Hasher {
    /// Adds bytes.
    pub fn update(&mut self, data: &[u8]) {
        self.sha.update(data);
        self.len += data.len() as u64;
    }

    /// The number of bytes hashed so far.
    #[must_use]
    pub fn hashed(&self) -> u64 {
        self.len
    }

    /// The digest and the number of bytes seen.
    #[must_use]
    pub fn finish(self) -> (Digest, u64) {
        (Digest(self.sha.finalize().into()), self.len)
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.hex())
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl std::str::FromStr for Digest {
    type Err = InvalidDigest;

    fn from_str(s: &str) -> Result<Self, InvalidDigest> {
        Self::parse(s)
    }
}

impl Serialize for Digest {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Digest {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        // Only the colon form is valid in manifests.
        if !s.starts_with("sha256:") {
            return Err(serde::de::Error::custom(InvalidDigest(s)));
        }
        Self::parse(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::Digest;

    const EMPTY: &str = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    #[test]
    fn digests_of_known_data() {
        assert_eq!(Digest::of(b"").to_string(), EMPTY);
        let (d, len) = Digest::of_reader(&b"hello"[..]).expect("read");
        assert_eq!(len, 5);
        assert_eq!(d, Digest::of(b"hello"));
        assert_eq!(d.file_name(), format!("sha256-{}", d.hex()));
    }

    #[test]
    fn both_spellings_parse_and_bad_ones_do_not() {
        let upper = EMPTY.replace("sha256:", "sha256-").to_uppercase().replace("SHA256-", "sha256-");
        assert_eq!(Digest::parse(&upper).expect("file form").to_string(), EMPTY);
        for bad in
            ["", "sha256:", "sha256:abc", "md5:00", &EMPTY.replace('e', "g"), &format!("{EMPTY}0"), "sha256:../../etc"]
        {
            let err = Digest::parse(bad).expect_err(bad);
            assert!(err.to_string().contains("expected sha256:<64 hex digits>"), "{err}");
        }
    }

    #[test]
    fn json_uses_the_colon_form_only() {
        let d: Digest = serde_json::from_str(&format!("\"{EMPTY}\"")).expect("json");
        assert_eq!(serde_json::to_string(&d).expect("json"), format!("\"{EMPTY}\""));
        assert!(serde_json::from_str::<Digest>(&format!("\"{}\"", EMPTY.replace(':', "-"))).is_err());
    }
    proptest::proptest! {
        /// A digest's two spellings, in either case, parse back to it; its file name is a
        /// plain path component.
        #[test]
        fn digests_round_trip(bytes in proptest::array::uniform32(proptest::prelude::any::<u8>())) {
            let d = Digest(bytes);
            proptest::prop_assert_eq!(Digest::parse(&d.to_string()), Ok(d));
            proptest::prop_assert_eq!(Digest::parse(&d.file_name()), Ok(d));
            proptest::prop_assert_eq!(Digest::parse(&format!("sha256:{}", d.hex().to_uppercase())), Ok(d));
            let json = serde_json::to_string(&d).expect("json");
            proptest::prop_assert_eq!(serde_json::from_str::<Digest>(&json).expect("json"), d);
            let name = d.file_name();
            proptest::prop_assert!(name.len() == 71 && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'));
        }

        /// Any other text is refused, and what is accepted is exactly 64 hex digits.
        #[test]
        fn only_64_hex_digits_are_accepted(text in "sha256[:-][0-9a-fA-Fg./]{0,70}") {
            let hex = &text[7..];
            let valid = hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit());
            proptest::prop_assert_eq!(Digest::parse(&text).is_ok(), valid, "{}", text);
        }
    }
}
