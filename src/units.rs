//! Numbers for people in messages: bytes in binary units ("1.2 GiB") and counts ("1
//! model"); durations are [`crate::durations`]. Structured fields keep the raw numbers.

/// Bytes in binary units, "1.2 GiB" (plain "512 B" below a KiB).
#[must_use]
pub fn bytes(n: u64) -> String {
    bytesize::ByteSize::b(n).display().iec().to_string()
}

/// `n` and a noun, with the noun's plural unless `n` is 1: "1 model", "2 models".
#[must_use]
pub fn count(n: usize, singular: &str, plural: &str) -> String {
    format!("{n} {}", if n == 1 { singular } else { plural })
}

#[cfg(test)]
mod tests {
    use super::{bytes, count};

    #[test]
    fn numbers_read_as_people_write_them() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1_288_490_189), "1.2 GiB");
        assert_eq!(count(1, "model", "models"), "1 model");
        assert_eq!(count(0, "model", "models"), "0 models");
    }
}
