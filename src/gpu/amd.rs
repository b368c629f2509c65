//! AMD GPUs through sysfs: `<sys>/class/drm/card<N>/device/` of vendor `0x1002`.
//!
//! The amdgpu driver reports `mem_info_vram_total` and `mem_info_vram_used` in bytes.
//! Optional: `product_name` (often empty on consumer cards), `unique_id` (the id
//! `ROCR_VISIBLE_DEVICES` accepts as `GPU-<unique_id>`), the PCI address from `uevent`,
//! and the driver version from `<sys>/module/amdgpu/version` (DKMS builds only).

use std::path::{Path, PathBuf};

use super::{Backend, Gpu};

/// AMD's PCI vendor id.
pub const AMD_VENDOR: u32 = 0x1002;

/// Why one card could not be read.
#[derive(Debug, thiserror::Error)]
pub enum AmdError {
    /// A file could not be read.
    #[error("{}: cannot read: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A file does not hold the number it should.
    #[error("{}: {text:?} is not a number", path.display())]
    NotANumber {
        /// The file.
        path: PathBuf,
        /// What it holds.
        text: String,
    },
}

/// The AMD GPUs under `<sys>/class/drm`, in card order, indexed from 0.
///
/// Cards of other vendors and connector or render nodes (`card0-DP-1`, `renderD128`) are
/// skipped; an AMD card whose memory cannot be read is skipped with a debug log line (this
/// runs for every inventory).
#[must_use]
pub fn gpus(sys: &Path) -> Vec<Gpu> {
    let drm = sys.join("class/drm");
    let entries = match std::fs::read_dir(&drm) {
        Ok(entries) => entries,
        Err(e) => {
            tracing::debug!("no AMD GPUs: {}: {e}", drm.display());
            return Vec::new();
        }
    };
    let mut cards: Vec<(u32, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|entry| Some((card_number(entry.file_name().to_str()?)?, entry.path().join("device"))))
        .collect();
    cards.sort_unstable();
    let driver = read_trimmed(&sys.join("module/amdgpu/version")).ok().filter(|v| !v.is_empty());

    let mut gpus = Vec::new();
    for (number, device) in cards {
        match read_card(&device) {
            Ok(Some(card)) => {
                let index = u32::try_from(gpus.len()).unwrap_or(u32::MAX);
                gpus.push(Gpu {
                    index,
                    id: card.id.unwrap_or_else(|| format!("card{number}")),
                    name: card.name,
                    backend: Backend::Rocm,
                    total_bytes: card.total,
                    free_bytes: card.total.saturating_sub(card.used),
                    driver: driver.clone(),
                    compute: None,
                    endpoint: None,
                });
            }
            Ok(None) => {}
            Err(e) => tracing::debug!("skipping AMD GPU card{number}: {e}"),
        }
    }
    gpus
}

/// What one AMD card says about itself.
struct Card {
    id: Option<String>,
    name: String,
    total: u64,
    used: u64,
}

/// Reads one `card<N>/device` directory; `None` when it is not AMD's.
fn read_card(device: &Path) -> Result<Option<Card>, AmdError> {
    // Devices that are not on PCI (simpledrm, virtual displays) have no vendor.
    let vendor = read_trimmed(&device.join("vendor")).unwrap_or_default();
    if parse_hex(&vendor) != Some(AMD_VENDOR) {
        return Ok(None);
    }
    let total = read_number(&device.join("mem_info_vram_total"))?;
    let used = read_number(&device.join("mem_info_vram_used"))?;
    let optional = |file: &str| read_trimmed(&device.join(file)).ok().filter(|s| !s.is_empty());
    let id = optional("unique_id")
        .map(|uid| format!("GPU-{uid}"))
        .or_else(|| optional("uevent").as_deref().and_then(pci_slot).map(str::to_owned));
    let name = optional("product_name")
        .or_else(|| optional("device").map(|id| format!("AMD GPU {id}")))
        .unwrap_or_else(|| "AMD GPU".to_owned());
    Ok(Some(Card { id, name, total, used }))
}

/// The `N` of a `card<N>` entry; `None` for connectors (`card0-DP-1`) and anything else.
#[must_use]
pub fn card_number(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("card")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// A sysfs hex id like `0x1002`.
#[must_use]
pub fn parse_hex(text: &str) -> Option<u32> {
    u32::from_str_radix(text.trim().strip_prefix("0x")?, 16).ok()
}

/// `PCI_SLOT_NAME` from a device's `uevent`.
#[must_use]
pub fn pci_slot(uevent: &str) -> Option<&str> {
    uevent.lines().find_map(|line| line.strip_prefix("PCI_SLOT_NAME=")).map(str::trim).filter(|s| !s.is_empty())
}

fn read_trimmed(path: &Path) -> Result<String, AmdError> {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_owned())
        .map_err(|source| AmdError::Read { path: path.to_owned(), source })
}

fn read_number(path: &Path) -> Result<u64, AmdError> {
    let text = read_trimmed(path)?;
    text.parse().map_err(|_| AmdError::NotANumber { path: path.to_owned(), text })
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::path::Path;

    use super::{Backend, card_number, gpus, parse_hex, pci_slot};

    const GIB: u64 = 1024 * 1024 * 1024;

    fn card(sys: &Path, entry: &str, files: &[(&str, &str)]) {
        let device = sys.join("class/drm").join(entry).join("device");
        fs::create_dir_all(&device).expect("mkdir");
        for (name, text) in files {
            fs::write(device.join(name), text).expect("write");
        }
    }

    #[test]
    fn reads_amd_cards_and_skips_the_rest() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sys = dir.path();
        let total = (24 * GIB).to_string();
        let used = GIB.to_string();
        card(
            sys,
            "card1",
            &[
                ("vendor", "0x1002\n"),
                ("device", "0x744c\n"),
                ("mem_info_vram_total", &format!("{total}\n")),
                ("mem_info_vram_used", &format!("{used}\n")),
                ("unique_id", "a1b2c3d4e5f60718\n"),
                ("product_name", "Radeon RX 7900 XTX\n"),
            ],
        );
        // A second AMD card with only what the driver always has.
        card(
            sys,
            "card10",
            &[
                ("vendor", "0x1002"),
                ("device", "0x73bf"),
                ("mem_info_vram_total", "1024"),
                ("mem_info_vram_used", "4096"),
                ("uevent", "DRIVER=amdgpu\nPCI_SLOT_NAME=0000:0a:00.0\n"),
                ("product_name", ""),
            ],
        );
        // An AMD card missing its memory files, an Intel card, connectors and render nodes.
        card(sys, "card2", &[("vendor", "0x1002"), ("mem_info_vram_total", "1024")]);
        card(sys, "card0", &[("vendor", "0x8086"), ("mem_info_vram_total", "1"), ("mem_info_vram_used", "0")]);
        card(sys, "card1-DP-1", &[("vendor", "0x1002"), ("mem_info_vram_total", "1"), ("mem_info_vram_used", "0")]);
        card(sys, "renderD128", &[("vendor", "0x1002"), ("mem_info_vram_total", "1"), ("mem_info_vram_used", "0")]);
        card(sys, "card3", &[("vendor", "0x1002"), ("mem_info_vram_total", "lots"), ("mem_info_vram_used", "0")]);
        card(sys, "card4", &[]);
        fs::write(sys.join("class/drm/version"), "drm 1.1.0\n").expect("write");
        fs::create_dir_all(sys.join("module/amdgpu")).expect("mkdir");
        fs::write(sys.join("module/amdgpu/version"), "6.8.5\n").expect("write");

        let found = gpus(sys);
        assert_eq!(found.len(), 2, "{found:#?}");
        let a = &found[0];
        assert_eq!((a.index, a.id.as_str(), a.name.as_str()), (0, "GPU-a1b2c3d4e5f60718", "Radeon RX 7900 XTX"));
        assert_eq!(a.backend, Backend::Rocm);
        assert_eq!((a.total_bytes, a.free_bytes), (24 * GIB, 23 * GIB));
        assert_eq!(a.driver.as_deref(), Some("6.8.5"));
        assert_eq!(a.compute, None);
        let b = &found[1];
        assert_eq!((b.index, b.id.as_str(), b.name.as_str()), (1, "0000:0a:00.0", "AMD GPU 0x73bf"));
        assert_eq!((b.total_bytes, b.free_bytes), (1024, 0), "used above total leaves nothing free");
    }

    #[test]
    fn without_ids_the_card_name_is_the_id() {
        let dir = tempfile::tempdir().expect("tempdir");
        card(dir.path(), "card7", &[("vendor", "0x1002"), ("mem_info_vram_total", "8"), ("mem_info_vram_used", "2")]);
        let found = gpus(dir.path());
        assert_eq!(found.len(), 1);
        assert_eq!((found[0].id.as_str(), found[0].name.as_str()), ("card7", "AMD GPU"));
        assert_eq!((found[0].free_bytes, found[0].driver.as_deref()), (6, None));
    }

    #[test]
    fn no_drm_class_means_no_gpus() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(gpus(dir.path()).is_empty());
        assert!(gpus(&dir.path().join("missing")).is_empty());
    }

    #[test]
    fn the_real_sysfs_never_fails() {
        for gpu in gpus(Path::new("/sys")) {
            assert_eq!(gpu.backend, Backend::Rocm);
            assert!(gpu.free_bytes <= gpu.total_bytes);
        }
    }

    #[test]
    fn pure_helpers() {
        assert_eq!(card_number("card0"), Some(0));
        assert_eq!(card_number("card12"), Some(12));
        for name in ["card", "card0-DP-1", "card-1", "renderD128", "version", "cardx", "card+1"] {
            assert_eq!(card_number(name), None, "{name}");
        }
        assert_eq!(parse_hex("0x1002\n"), Some(0x1002));
        assert_eq!(parse_hex("0x10de"), Some(0x10de));
        for text in ["1002", "0x", "0xzz", ""] {
            assert_eq!(parse_hex(text), None, "{text}");
        }
        assert_eq!(pci_slot("DRIVER=amdgpu\nPCI_SLOT_NAME=0000:03:00.0\n"), Some("0000:03:00.0"));
        assert_eq!(pci_slot("DRIVER=amdgpu\nPCI_SLOT_NAME=\n"), None);
        assert_eq!(pci_slot(""), None);
    }
}
