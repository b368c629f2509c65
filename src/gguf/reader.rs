//! Reads what a GGUF file says about itself: the header, every metadata key/value pair
//! and every tensor's info record (name, dimensions, type, offset), but no tensor data.
//! Versions 2 and 3 are read; version 1 and big-endian files are refused.
//!
//! # Why not a crate
//!
//! Written here because none of the crates on crates.io fit (checked May 2026):
//! `candle-core`'s `gguf_file` and `gguf-rs` allocate a string or tensor buffer of the
//! declared length before reading it (`vec![0; len]`), so an 8-byte length field can ask
//! for exabytes, and `candle-core` brings a tensor library with it; `ggus` works on an
//! in-memory slice and `unwrap`s while decoding values; `gguf` (0.1) parses a whole
//! buffer with `nom` and has no limits; `gguf-rs-lib` has limits but accepts only
//! version 3 and needs a newer Rust than this crate's 1.85.  The format is small: a
//! reader with the checks below is a few hundred lines.
//!
//! # Hostile input
//!
//! Every count and length is checked, before anything is allocated for it, against a
//! hard limit ([`Limits`]) and, when the file's length is known, against the bytes that
//! remain (each element needs at least a known number of bytes on disk).  What the
//! decoded metadata would take in memory is charged to a budget
//! ([`Limits::max_total_bytes`]), and buffers grow with the bytes actually read, never
//! with a declared length, so a stream of unknown length cannot make the reader
//! allocate much more than it has been sent.  Nothing panics on any input.  The default
//! limits, far above any real model:
//!
//! | what                        | limit     | real models                               |
//! |-----------------------------|-----------|-------------------------------------------|
//! | metadata pairs              | 65 536    | 20–100                                    |
//! | tensors                     | 1 048 576 | up to a few thousand                      |
//! | key length                  | 64 KiB    | under 100 bytes                           |
//! | string value length         | 64 MiB    | `tokenizer.huggingface.json`: up to ~35 MB |
//! | array length                | 16 Mi     | vocabularies and merges: up to ~500 000   |
//! | array nesting               | 8 levels  | llama.cpp reads none                      |
//! | tensor name length          | 63 bytes  | llama.cpp's own limit                     |
//! | tensor dimensions           | 4         | ggml's own limit                          |
//! | decoded metadata and infos  | 256 MiB   | 10–20 MB for a 256k-token vocabulary      |

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{self, BufReader, Read, Seek, SeekFrom};
use std::mem::size_of;
use std::path::{Path, PathBuf};

use super::{
    DEFAULT_ALIGNMENT, GgufArray, GgufValue, KEY_ALIGNMENT, MAGIC, MAX_TENSOR_DIMS, MAX_TENSOR_NAME_LEN,
    MIN_READ_VERSION, TensorType, VERSION, value_type,
};

/// The hard limits a file must stay within; see the [module documentation](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The most metadata key/value pairs.
    pub max_kv_count: u64,
    /// The most tensors.
    pub max_tensor_count: u64,
    /// The longest metadata key, in bytes.
    pub max_key_len: u64,
    /// The longest string value (also each string in an array), in bytes.
    pub max_string_len: u64,
    /// The most elements in one array (nested arrays count separately).
    pub max_array_len: u64,
    /// How deeply arrays may nest: 1 allows arrays but no arrays of arrays.
    pub max_array_depth: u32,
    /// The most memory the decoded metadata and tensor infos may take, in bytes (an
    /// estimate: the size of each value, string and record, not the allocator's slack).
    pub max_total_bytes: u64,
}

impl Limits {
    /// The defaults, far above any real model.
    pub const DEFAULT: Self = Self {
        max_kv_count: 1 << 16,
        max_tensor_count: 1 << 20,
        max_key_len: 64 << 10,
        max_string_len: 64 << 20,
        max_array_len: 16 << 20,
        max_array_depth: 8,
        max_total_bytes: 256 << 20,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Why a file could not be read.  Offsets count bytes from the start of the file.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The file could not be opened.
    #[error("cannot open GGUF file {}: {source}", path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// What the system said.
        #[source]
        source: io::Error,
    },
    /// Reading failed for a reason other than the end of the file.
    #[error("cannot read GGUF file: {source} (while reading {what} at offset {offset})")]
    Io {
        /// What was being read.
        what: String,
        /// Where.
        offset: u64,
        /// What the system said.
        #[source]
        source: io::Error,
    },
    /// The file ended in the middle of something.
    #[error(
        "truncated GGUF file: expected {needed} bytes for {what} at offset {offset}, file has {file_len} bytes \
         (an incomplete download or copy?)"
    )]
    Truncated {
        /// What was being read.
        what: String,
        /// Where it starts.
        offset: u64,
        /// The bytes it needs.
        needed: u64,
        /// Where the file ended.
        file_len: u64,
    },
    /// A count or length asks for more bytes than the rest of the file holds.
    #[error(
        "truncated or corrupt GGUF file: {what} at offset {offset} is {value}, which needs at least {needed} \
         more bytes, but only {remaining} remain"
    )]
    PastEnd {
        /// The count or length.
        what: String,
        /// Where it was read.
        offset: u64,
        /// Its value.
        value: u64,
        /// The fewest bytes it needs.
        needed: u64,
        /// The bytes left in the file after it.
        remaining: u64,
    },
    /// The file does not start with `GGUF`.
    #[error("not a GGUF file: it starts with {} rather than \"GGUF\"", show_magic(*found))]
    BadMagic {
        /// The first four bytes.
        found: [u8; 4],
    },
    /// A version other than 2 or 3.
    #[error("{}", version_message(*version))]
    UnsupportedVersion {
        /// The version in the header.
        version: u32,
    },
    /// A big-endian file (GGUF 3 allows them; llama.cpp on x86 and ARM does not load them).
    #[error(
        "big-endian GGUF file (version {version}): only little-endian files are read; \
         use the little-endian conversion of this model"
    )]
    BigEndian {
        /// The version, byte-swapped back.
        version: u32,
    },
    /// A count or length beyond what this reader accepts (see [`Limits`]).
    #[error("corrupt or unsupported GGUF file: {what} at offset {offset} is {value}, more than the limit of {limit}")]
    LimitExceeded {
        /// What is too large.
        what: String,
        /// Where it was read.
        offset: u64,
        /// Its value.
        value: u64,
        /// The most allowed.
        limit: u64,
    },
    /// A key, string or tensor name that is not UTF-8.
    #[error("corrupt GGUF file: {what} is not valid UTF-8 (bad byte at offset {offset})")]
    InvalidUtf8 {
        /// What was being read.
        what: String,
        /// The first byte that is not UTF-8.
        offset: u64,
    },
    /// A value type id outside the format's 0 to 12.
    #[error("corrupt GGUF file: {what} at offset {offset} is {type_id}, not a known value type (0 to 12)")]
    UnknownValueType {
        /// What was being read.
        what: String,
        /// Where.
        offset: u64,
        /// The type id.
        type_id: u32,
    },
    /// The same metadata key twice.
    #[error("corrupt GGUF file: metadata key {key:?} appears twice (again at offset {offset})")]
    DuplicateKey {
        /// The key.
        key: String,
        /// Where it appears the second time.
        offset: u64,
    },
    /// `general.alignment` is not a `u32` power of two.
    #[error("corrupt GGUF file: {KEY_ALIGNMENT} must be a u32 power of two, not {found}")]
    InvalidAlignment {
        /// The value found, as Rust debug text.
        found: String,
    },
    /// A tensor info record that cannot be right.
    #[error("corrupt GGUF file: tensor #{index} {name:?} (info at offset {offset}) {problem}")]
    InvalidTensor {
        /// The tensor's position, from 0.
        index: u64,
        /// Its name.
        name: String,
        /// Where its record starts.
        offset: u64,
        /// What is wrong.
        problem: String,
    },
}

fn show_magic(bytes: [u8; 4]) -> String {
    let hex: Vec<String> = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("{} ({:?})", hex.join(" "), String::from_utf8_lossy(&bytes))
}

fn version_message(version: u32) -> String {
    if version < MIN_READ_VERSION {
        format!(
            "GGUF version {version} is not supported: version 1 was a short-lived 2023 draft; \
             convert the model again with a current llama.cpp"
        )
    } else {
        format!(
            "GGUF version {version} is not supported: this reader knows versions {MIN_READ_VERSION} to {VERSION} \
             (a newer format, or a corrupt header)"
        )
    }
}

/// One tensor's info record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The name, such as `blk.0.attn_q.weight`.
    pub name: String,
    /// The sizes, innermost first (ggml's `ne`); at most 4, each and their product below 2^63.
    pub dims: Vec<u64>,
    /// The element type id (`enum ggml_type`: 0 = F32, 1 = F16, 8 = `Q8_0`, …), not checked.
    pub type_id: u32,
    /// Where the data starts, relative to [`GgufFile::data_offset`]; a multiple of the alignment.
    pub offset: u64,
}

impl TensorInfo {
    /// The number of elements: the product of the dimensions (1 for none).
    #[must_use]
    pub fn element_count(&self) -> u64 {
        self.dims.iter().fold(1u64, |n, &d| n.saturating_mul(d))
    }
}

/// What a GGUF file holds before its tensor data.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufFile {
    version: u32,
    metadata: Vec<(String, GgufValue)>,
    index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    alignment: u32,
    tensor_infos_end: u64,
    data_offset: u64,
}

impl GgufFile {
    /// Reads from a stream of unknown length, within the default [`Limits`].  Lengths
    /// cannot be checked against the rest of the file, so a truncated file is noticed only
    /// where it ends, and one cut just after its tensor infos is not noticed at all.
    pub fn read(reader: impl Read) -> Result<Self, ReadError> {
        Self::read_with(reader, None, &Limits::DEFAULT)
    }

    /// Reads a file held in memory.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, ReadError> {
        Self::read_with(bytes, Some(bytes.len() as u64), &Limits::DEFAULT)
    }

    /// Reads from the current position of `reader` to its end, whose position it finds
    /// by seeking.  Offsets in errors count from the starting position.
    pub fn read_seekable<R: Read + Seek>(mut reader: R) -> Result<Self, ReadError> {
        let io = |source| ReadError::Io { what: "the file length".into(), offset: 0, source };
        let start = reader.stream_position().map_err(io)?;
        let end = reader.seek(SeekFrom::End(0)).map_err(io)?;
        reader.seek(SeekFrom::Start(start)).map_err(io)?;
        Self::read_with(reader, Some(end.saturating_sub(start)), &Limits::DEFAULT)
    }

    /// Opens and reads the file at `path` (buffered; only the metadata is read).
    pub fn open(path: &Path) -> Result<Self, ReadError> {
        let open = |source| ReadError::Open { path: path.to_owned(), source };
        let file = File::open(path).map_err(open)?;
        let len = file.metadata().map_err(open)?.len();
        Self::read_with(BufReader::with_capacity(64 << 10, file), Some(len), &Limits::DEFAULT)
    }

    /// Reads from `reader` within `limits`.  With `len`, the stream is taken to end there
    /// (bytes beyond are not read) and every length is checked against what remains.
    pub fn read_with(reader: impl Read, len: Option<u64>, limits: &Limits) -> Result<Self, ReadError> {
        let mut source = Source {
            inner: reader.take(len.unwrap_or(u64::MAX)),
            pos: 0,
            len,
            limits: *limits,
            used: 0,
            place: Place::Header,
            element: None,
        };
        source.file()
    }

    /// The format version: 2 or 3.
    #[must_use]
    pub const fn version(&self) -> u32 {
        self.version
    }

    /// The metadata pairs, in file order; no key appears twice.
    #[must_use]
    pub fn metadata(&self) -> &[(String, GgufValue)] {
        &self.metadata
    }

    /// The value of metadata key `key`.
    #[must_use]
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// The value of metadata key `key` if it is a string.
    #[must_use]
    pub fn get_str(&self, key: &str) -> Option<&str> {
        match self.get(key) {
            Some(GgufValue::String(s)) => Some(s),
            _ => None,
        }
    }

    /// The tensor info records, in file order; no name appears twice.
    #[must_use]
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The data alignment: `general.alignment`, or 32 when absent.
    #[must_use]
    pub const fn alignment(&self) -> u32 {
        self.alignment
    }

    /// Where the tensor info records end: the size of everything but the padding and data.
    #[must_use]
    pub const fn tensor_infos_end(&self) -> u64 {
        self.tensor_infos_end
    }

    /// Where the tensor data starts: the end of the tensor infos rounded up to the alignment.
    #[must_use]
    pub const fn data_offset(&self) -> u64 {
        self.data_offset
    }
}

/// What is being read, for error messages.
enum Place {
    Header,
    /// The key of metadata pair #n.
    Key(u64),
    /// The value of a metadata pair.
    Value {
        index: u64,
        key: String,
    },
    /// A tensor info record, and the name once read.
    Tensor {
        index: u64,
        name: Option<String>,
    },
    /// The padding after the tensor infos.
    Padding,
}

/// The fewest bytes of a file a string (its length) or an array (its type and count) take.
const STRING_MIN: u64 = 8;
const ARRAY_MIN: u64 = 12;
/// The fewest bytes a metadata pair takes: an empty key, a type, a one-byte value.
const KV_MIN: u64 = 8 + 4 + 1;
/// The fewest bytes a tensor info takes: an empty name, no dimensions, a type, an offset.
const TENSOR_INFO_MIN: u64 = 8 + 4 + 4 + 8;
/// The most elements reserved ahead of reading them; beyond that a vector grows as read.
const RESERVE_MAX: u64 = 4096;

/// A stream being read: where it is, where it ends if known, and what has been spent.
struct Source<R> {
    inner: io::Take<R>,
    pos: u64,
    len: Option<u64>,
    limits: Limits,
    /// The bytes charged to [`Limits::max_total_bytes`] so far.
    used: u64,
    place: Place,
    /// The element of the innermost array being read.
    element: Option<u64>,
}

type Result<T, E = ReadError> = std::result::Result<T, E>;

impl<R: Read> Source<R> {
    /// `item` where it is being read, such as `the key length of metadata pair #3`.
    fn what(&self, item: &str) -> String {
        let item = match self.element {
            Some(i) => format!("{item} (array element {i})"),
            None => item.to_owned(),
        };
        match &self.place {
            Place::Header | Place::Padding => item,
            Place::Key(index) => format!("{item} of metadata pair #{index}"),
            Place::Value { index, key } => format!("{item} of metadata key {key:?} (pair #{index})"),
            Place::Tensor { index, name: None } => format!("{item} of tensor info #{index}"),
            Place::Tensor { index, name: Some(name) } => format!("{item} of tensor #{index} {name:?}"),
        }
    }

    fn limit(&self, item: &str, offset: u64, value: u64, limit: u64) -> Result<()> {
        if value > limit {
            return Err(ReadError::LimitExceeded { what: self.what(item), offset, value, limit });
        }
        Ok(())
    }

    /// Checks that `value` (read at `offset`), needing at least `needed` more bytes, fits
    /// in what remains of a file of known length.
    fn room(&self, item: &str, offset: u64, value: u64, needed: u64) -> Result<()> {
        if let Some(len) = self.len {
            let remaining = len.saturating_sub(self.pos);
            if needed > remaining {
                return Err(ReadError::PastEnd { what: self.what(item), offset, value, needed, remaining });
            }
        }
        Ok(())
    }

    /// Charges `bytes` of memory to the budget.
    fn charge(&mut self, bytes: u64) -> Result<()> {
        self.used = self.used.saturating_add(bytes);
        if self.used > self.limits.max_total_bytes {
            let what = format!("the memory the decoded metadata needs (at {})", self.what("this point"));
            return Err(ReadError::LimitExceeded {
                what,
                offset: self.pos,
                value: self.used,
                limit: self.limits.max_total_bytes,
            });
        }
        Ok(())
    }

    /// Reads exactly `buf.len()` bytes.
    fn fill(&mut self, buf: &mut [u8], item: &str) -> Result<()> {
        let start = self.pos;
        let mut done = 0;
        while done < buf.len() {
            match self.inner.read(&mut buf[done..]) {
                Ok(0) => {
                    return Err(ReadError::Truncated {
                        what: self.what(item),
                        offset: start,
                        needed: buf.len() as u64,
                        file_len: start + done as u64,
                    });
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(ReadError::Io { what: self.what(item), offset: start + done as u64, source });
                }
            }
        }
        self.pos += buf.len() as u64;
        Ok(())
    }

    fn bytes<const N: usize>(&mut self, item: &str) -> Result<[u8; N]> {
        let mut buf = [0; N];
        self.fill(&mut buf, item)?;
        Ok(buf)
    }

    fn u32(&mut self, item: &str) -> Result<u32> {
        self.bytes(item).map(u32::from_le_bytes)
    }

    fn u64(&mut self, item: &str) -> Result<u64> {
        self.bytes(item).map(u64::from_le_bytes)
    }

    /// Reads `len` bytes, growing the buffer only as they arrive.
    fn byte_vec(&mut self, len: u64, item: &str) -> Result<Vec<u8>> {
        let start = self.pos;
        let mut buf = Vec::with_capacity(usize::try_from(len.min(64 << 10)).unwrap_or(0));
        let got = loop {
            match (&mut self.inner).take(len).read_to_end(&mut buf) {
                Ok(_) => break buf.len() as u64,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(ReadError::Io { what: self.what(item), offset: start + buf.len() as u64, source });
                }
            }
        };
        if got < len {
            return Err(ReadError::Truncated {
                what: self.what(item),
                offset: start,
                needed: len,
                file_len: start + got,
            });
        }
        self.pos += len;
        Ok(buf)
    }

    /// Reads a length-prefixed UTF-8 string of at most `max` bytes.
    fn string(&mut self, name: &str, max: u64) -> Result<String> {
        let len_item = format!("the length of {name}");
        let offset = self.pos;
        let len = self.u64(&len_item)?;
        self.limit(&len_item, offset, len, max)?;
        self.room(&len_item, offset, len, len)?;
        self.charge(len + size_of::<String>() as u64)?;
        let start = self.pos;
        let bytes = self.byte_vec(len, name)?;
        String::from_utf8(bytes).map_err(|e| ReadError::InvalidUtf8 {
            what: self.what(name),
            offset: start + e.utf8_error().valid_up_to() as u64,
        })
    }

    fn file(&mut self) -> Result<GgufFile> {
        let magic: [u8; 4] = self.bytes("the magic number")?;
        if magic != MAGIC {
            return Err(ReadError::BadMagic { found: magic });
        }
        let version = self.u32("the version")?;
        if version != 0 && version.trailing_zeros() >= 16 {
            // llama.cpp's test: a small version written big-endian reads as a huge one.
            return Err(ReadError::BigEndian { version: version.swap_bytes() });
        }
        if !(MIN_READ_VERSION..=VERSION).contains(&version) {
            return Err(ReadError::UnsupportedVersion { version });
        }
        let tensor_offset = self.pos;
        let tensor_count = self.u64("the tensor count")?;
        self.limit("the tensor count", tensor_offset, tensor_count, self.limits.max_tensor_count)?;
        let kv_offset = self.pos;
        let kv_count = self.u64("the metadata count")?;
        self.limit("the metadata count", kv_offset, kv_count, self.limits.max_kv_count)?;
        let kv_bytes = kv_count.saturating_mul(KV_MIN);
        self.room("the metadata count", kv_offset, kv_count, kv_bytes)?;
        let all_bytes = kv_bytes.saturating_add(tensor_count.saturating_mul(TENSOR_INFO_MIN));
        self.room("the tensor count", tensor_offset, tensor_count, all_bytes)?;

        let (metadata, index) = self.metadata(kv_count)?;
        let alignment = match index.get(KEY_ALIGNMENT).map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(GgufValue::U32(a)) if a.is_power_of_two() => *a,
            Some(other) => return Err(ReadError::InvalidAlignment { found: format!("{other:?}") }),
        };
        let tensors = self.tensors(tensor_count, alignment)?;
        let tensor_infos_end = self.pos;
        let data_offset = tensor_infos_end.next_multiple_of(u64::from(alignment));
        if let (Some(len), false) = (self.len, tensors.is_empty()) {
            self.place = Place::Padding;
            if data_offset > len {
                return Err(ReadError::Truncated {
                    what: "the padding before the tensor data".into(),
                    offset: tensor_infos_end,
                    needed: data_offset - tensor_infos_end,
                    file_len: len,
                });
            }
            let data_len = len - data_offset;
            for (index, t) in tensors.iter().enumerate() {
                // The size of F32 and F16 data is known; any other type needs a byte at least.
                let count = t.element_count();
                let (needed, at_least) = match TensorType::from_id(t.type_id) {
                    Some(ty) => (count.saturating_mul(ty.element_size() as u64), ""),
                    None => (count.min(1), "at least "),
                };
                if t.offset.saturating_add(needed) > data_len {
                    let unit = if needed == 1 { "byte" } else { "bytes" };
                    return Err(ReadError::InvalidTensor {
                        index: index as u64,
                        name: t.name.clone(),
                        offset: data_offset,
                        problem: format!(
                            "needs {at_least}{needed} {unit} from offset {} of the tensor data, which has only \
                             {data_len} bytes (truncated?)",
                            t.offset
                        ),
                    });
                }
            }
        }
        Ok(GgufFile { version, metadata, index, tensors, alignment, tensor_infos_end, data_offset })
    }

    #[allow(clippy::type_complexity, reason = "a private helper's two results")]
    fn metadata(&mut self, count: u64) -> Result<(Vec<(String, GgufValue)>, HashMap<String, usize>)> {
        let reserve = usize::try_from(count.min(RESERVE_MAX)).unwrap_or(0);
        let mut metadata = Vec::with_capacity(reserve);
        let mut index = HashMap::with_capacity(reserve);
        for i in 0..count {
            self.place = Place::Key(i);
            let key_offset = self.pos;
            let key = self.string("the key", self.limits.max_key_len)?;
            // The pair, and the key's second copy in the index.
            self.charge((size_of::<(String, GgufValue)>() + size_of::<String>() + key.len()) as u64)?;
            if index.contains_key(&key) {
                return Err(ReadError::DuplicateKey { key, offset: key_offset });
            }
            self.place = Place::Value { index: i, key: key.clone() };
            let type_offset = self.pos;
            let type_id = self.u32("the value type")?;
            let value = self.value(type_id, type_offset)?;
            index.insert(key.clone(), metadata.len());
            metadata.push((key, value));
        }
        Ok((metadata, index))
    }

    fn unknown_type(&self, item: &str, offset: u64, type_id: u32) -> ReadError {
        ReadError::UnknownValueType { what: self.what(item), offset, type_id }
    }

    fn value(&mut self, type_id: u32, type_offset: u64) -> Result<GgufValue> {
        Ok(match type_id {
            value_type::UINT8 => GgufValue::U8(self.bytes::<1>("a u8 value")?[0]),
            value_type::INT8 => GgufValue::I8(i8::from_le_bytes(self.bytes("an i8 value")?)),
            value_type::UINT16 => GgufValue::U16(u16::from_le_bytes(self.bytes("a u16 value")?)),
            value_type::INT16 => GgufValue::I16(i16::from_le_bytes(self.bytes("an i16 value")?)),
            value_type::UINT32 => GgufValue::U32(self.u32("a u32 value")?),
            value_type::INT32 => GgufValue::I32(i32::from_le_bytes(self.bytes("an i32 value")?)),
            value_type::FLOAT32 => GgufValue::F32(f32::from_le_bytes(self.bytes("an f32 value")?)),
            // llama.cpp reads any non-zero byte as true.
            value_type::BOOL => GgufValue::Bool(self.bytes::<1>("a bool value")?[0] != 0),
            value_type::STRING => GgufValue::String(self.string("the string", self.limits.max_string_len)?),
            value_type::ARRAY => GgufValue::Array(self.array(1)?),
            value_type::UINT64 => GgufValue::U64(self.u64("a u64 value")?),
            value_type::INT64 => GgufValue::I64(i64::from_le_bytes(self.bytes("an i64 value")?)),
            value_type::FLOAT64 => GgufValue::F64(f64::from_le_bytes(self.bytes("an f64 value")?)),
            other => return Err(self.unknown_type("the value type", type_offset, other)),
        })
    }

    /// Reads an array at nesting level `depth` (1 for a value's own array).
    fn array(&mut self, depth: u32) -> Result<GgufArray> {
        self.limit("the array nesting depth", self.pos, u64::from(depth), u64::from(self.limits.max_array_depth))?;
        let type_offset = self.pos;
        let elem_type = self.u32("the array element type")?;
        // The fewest bytes an element takes on disk, and what it takes in memory.
        let (disk, memory) = match elem_type {
            value_type::UINT8 | value_type::INT8 | value_type::BOOL => (1, 1),
            value_type::UINT16 | value_type::INT16 => (2, 2),
            value_type::UINT32 | value_type::INT32 | value_type::FLOAT32 => (4, 4),
            value_type::UINT64 | value_type::INT64 | value_type::FLOAT64 => (8, 8),
            value_type::STRING => (STRING_MIN, size_of::<String>() as u64),
            value_type::ARRAY => (ARRAY_MIN, size_of::<GgufArray>() as u64),
            other => return Err(self.unknown_type("the array element type", type_offset, other)),
        };
        let count_offset = self.pos;
        let count = self.u64("the array length")?;
        self.limit("the array length", count_offset, count, self.limits.max_array_len)?;
        self.room("the array length", count_offset, count, count.saturating_mul(disk))?;
        self.charge(count.saturating_mul(memory))?;
        let outer = self.element.take();
        let array = match elem_type {
            value_type::UINT8 => GgufArray::U8(self.byte_vec(count, "the u8 array")?),
            value_type::INT8 => GgufArray::I8(self.elements(count, |s| Ok(i8::from_le_bytes(s.bytes("an i8")?)))?),
            value_type::UINT16 => GgufArray::U16(self.elements(count, |s| Ok(u16::from_le_bytes(s.bytes("a u16")?)))?),
            value_type::INT16 => GgufArray::I16(self.elements(count, |s| Ok(i16::from_le_bytes(s.bytes("an i16")?)))?),
            value_type::UINT32 => GgufArray::U32(self.elements(count, |s| s.u32("a u32"))?),
            value_type::INT32 => GgufArray::I32(self.elements(count, |s| Ok(i32::from_le_bytes(s.bytes("an i32")?)))?),
            value_type::FLOAT32 => {
                GgufArray::F32(self.elements(count, |s| Ok(f32::from_le_bytes(s.bytes("an f32")?)))?)
            }
            value_type::BOOL => GgufArray::Bool(self.elements(count, |s| Ok(s.bytes::<1>("a bool")?[0] != 0))?),
            value_type::STRING => {
                GgufArray::String(self.elements(count, |s| s.string("the string", s.limits.max_string_len))?)
            }
            value_type::UINT64 => GgufArray::U64(self.elements(count, |s| s.u64("a u64"))?),
            value_type::INT64 => GgufArray::I64(self.elements(count, |s| Ok(i64::from_le_bytes(s.bytes("an i64")?)))?),
            value_type::FLOAT64 => {
                GgufArray::F64(self.elements(count, |s| Ok(f64::from_le_bytes(s.bytes("an f64")?)))?)
            }
            _ => GgufArray::Array(self.elements(count, |s| s.array(depth + 1))?),
        };
        self.element = outer;
        Ok(array)
    }

    fn elements<T>(&mut self, count: u64, mut read: impl FnMut(&mut Self) -> Result<T>) -> Result<Vec<T>> {
        let mut out = Vec::with_capacity(usize::try_from(count.min(RESERVE_MAX)).unwrap_or(0));
        for i in 0..count {
            self.element = Some(i);
            out.push(read(self)?);
        }
        self.element = None;
        Ok(out)
    }

    fn tensors(&mut self, count: u64, alignment: u32) -> Result<Vec<TensorInfo>> {
        let mut tensors = Vec::with_capacity(usize::try_from(count.min(RESERVE_MAX)).unwrap_or(0));
        let mut names = HashSet::with_capacity(tensors.capacity());
        for index in 0..count {
            self.place = Place::Tensor { index, name: None };
            let offset = self.pos;
            let name = self.string("the name", MAX_TENSOR_NAME_LEN as u64)?;
            self.place = Place::Tensor { index, name: Some(name.clone()) };
            let invalid = |name: &str, problem: String| ReadError::InvalidTensor {
                index,
                name: name.to_owned(),
                offset,
                problem,
            };
            let dims_offset = self.pos;
            let n_dims = self.u32("the dimension count")?;
            self.limit("the dimension count", dims_offset, u64::from(n_dims), MAX_TENSOR_DIMS as u64)?;
            let mut dims = Vec::with_capacity(MAX_TENSOR_DIMS);
            for _ in 0..n_dims {
                dims.push(self.u64("a dimension")?);
            }
            let count = dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d)).filter(|&n| n <= u64::MAX >> 1);
            if count.is_none() {
                return Err(invalid(&name, format!("has dimensions {dims:?}, more than 2^63-1 elements")));
            }
            let type_id = self.u32("the type id")?;
            let data_offset = self.u64("the data offset")?;
            if data_offset % u64::from(alignment) != 0 {
                let problem =
                    format!("has its data at offset {data_offset}, not a multiple of the alignment {alignment}");
                return Err(invalid(&name, problem));
            }
            let record = size_of::<TensorInfo>() + size_of::<String>() + 2 * name.len() + 8 * dims.len();
            self.charge(record as u64)?;
            if !names.insert(name.clone()) {
                return Err(invalid(&name, "appears twice".into()));
            }
            tensors.push(TensorInfo { name, dims, type_id, offset: data_offset });
        }
        Ok(tensors)
    }
}

#[cfg(test)]
mod tests {
    use std::io::{self, Read};

    use super::super::{GgufArray, GgufValue, GgufWriter, TensorType, value_type};
    use super::{GgufFile, Limits, ReadError};

    /// The bytes of a tiny demo model, `"llama"` or `"bert"`.
    fn tiny(which: &str) -> Vec<u8> {
        match which {
            "llama" => crate::demo_model::tiny_llama_bytes(),
            _ => crate::demo_model::tiny_bert_bytes(),
        }
        .expect("build the model")
    }

    /// Builds a file byte by byte.
    struct Bytes(Vec<u8>);

    impl Bytes {
        fn header(version: u32, tensors: u64, kvs: u64) -> Self {
            Self(b"GGUF".to_vec()).u32(version).u64(tensors).u64(kvs)
        }
        fn raw(mut self, bytes: &[u8]) -> Self {
            self.0.extend_from_slice(bytes);
            self
        }
        fn u32(self, v: u32) -> Self {
            self.raw(&v.to_le_bytes())
        }
        fn u64(self, v: u64) -> Self {
            self.raw(&v.to_le_bytes())
        }
        fn str(self, s: &str) -> Self {
            self.u64(s.len() as u64).raw(s.as_bytes())
        }
        /// A metadata pair's key and type.
        fn key(self, key: &str, ty: u32) -> Self {
            self.str(key).u32(ty)
        }
    }

    fn err(bytes: &[u8]) -> ReadError {
        GgufFile::from_bytes(bytes).expect_err("must be refused")
    }

    fn stream_err(bytes: &[u8]) -> ReadError {
        GgufFile::read(bytes).expect_err("must be refused")
    }

    #[test]
    fn reads_the_tiny_llama_in_every_way() {
        let bytes = tiny("llama");
        let file = GgufFile::from_bytes(&bytes).expect("read");
        assert_eq!(file.version(), 3);
        assert_eq!(file.metadata().len(), 24);
        assert_eq!(file.metadata()[0].0, "general.architecture");
        assert_eq!(file.get_str("general.architecture"), Some("llama"));
        assert_eq!(file.get("llama.block_count"), Some(&GgufValue::U32(4)));
        assert_eq!(file.get_str("llama.block_count"), None);
        assert_eq!(file.get("nope"), None);
        let Some(GgufValue::Array(GgufArray::String(tokens))) = file.get("tokenizer.ggml.tokens") else {
            panic!("no tokens")
        };
        assert_eq!(&tokens[..3], ["<unk>", "<s>", "</s>"]);
        assert_eq!(file.tensors().len(), 2 + 4 * 9 + 1);
        let first = &file.tensors()[0];
        assert_eq!((first.name.as_str(), first.dims[0], first.type_id, first.offset), ("token_embd.weight", 64, 1, 0));
        assert_eq!(first.element_count(), 64 * tokens.len() as u64);
        assert_eq!(file.alignment(), 32);
        assert!(file.tensor_infos_end() <= file.data_offset());
        assert_eq!(file.data_offset() % 32, 0);
        assert!(file.data_offset() - file.tensor_infos_end() < 32);
        assert!(file.tensors().windows(2).all(|w| w[0].offset < w[1].offset));

        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("m.gguf");
        std::fs::write(&path, &bytes).expect("write");
        assert_eq!(GgufFile::open(&path).expect("open"), file);
        assert_eq!(GgufFile::read(bytes.as_slice()).expect("stream"), file);
        let mut cursor = io::Cursor::new(&bytes);
        assert_eq!(GgufFile::read_seekable(&mut cursor).expect("seekable"), file);
        let missing = GgufFile::open(&dir.path().join("missing.gguf")).expect_err("missing");
        assert!(matches!(missing, ReadError::Open { .. }), "{missing}");
        assert!(missing.to_string().starts_with("cannot open GGUF file /"), "{missing}");
    }

    #[test]
    fn reads_the_tiny_bert() {
        let file = GgufFile::from_bytes(&tiny("bert")).expect("read");
        assert_eq!(file.get_str("general.architecture"), Some("bert"));
        assert_eq!(file.get("bert.attention.causal"), Some(&GgufValue::Bool(false)));
        assert_eq!(file.tensors().len(), 5 + 4 * 16);
    }

    #[test]
    fn every_value_type_round_trips_including_nested_arrays() {
        let values: Vec<GgufValue> = vec![
            GgufValue::U8(0xab),
            GgufValue::I8(-5),
            GgufValue::U16(0xbeef),
            GgufValue::I16(-300),
            GgufValue::U32(0xdead_beef),
            GgufValue::I32(-70_000),
            GgufValue::F32(1.5),
            GgufValue::Bool(true),
            GgufValue::Bool(false),
            GgufValue::String("héllo ▁".into()),
            GgufValue::String(String::new()),
            GgufValue::U64(u64::MAX - 1),
            GgufValue::I64(i64::MIN + 1),
            GgufValue::F64(-0.25),
            GgufArray::U8(vec![1, 2, 3]).into(),
            GgufArray::I8(vec![-1, 2]).into(),
            GgufArray::U16(vec![1, 65535]).into(),
            GgufArray::I16(vec![-2, 3]).into(),
            GgufArray::U32(vec![7]).into(),
            GgufArray::I32(vec![1, -2, 3]).into(),
            GgufArray::F32(vec![0.5, -1000.0]).into(),
            GgufArray::Bool(vec![false, true]).into(),
            GgufArray::String(vec!["<s>".into(), String::new(), "▁the".into()]).into(),
            GgufArray::U64(vec![u64::MAX]).into(),
            GgufArray::I64(vec![i64::MIN]).into(),
            GgufArray::F64(vec![1e300]).into(),
            GgufArray::F32(Vec::new()).into(),
            GgufArray::Array(vec![
                GgufArray::U32(vec![1, 2]),
                GgufArray::String(vec!["x".into()]),
                GgufArray::Array(vec![GgufArray::Bool(vec![true]), GgufArray::Array(Vec::new())]),
            ])
            .into(),
        ];
        let mut w = GgufWriter::new();
        for (i, v) in values.iter().enumerate() {
            w.add_metadata(&format!("k{i}"), v.clone()).expect("kv");
        }
        w.add_tensor("t", &[2, 3], TensorType::F32, &[0.0; 6]).expect("tensor");
        let file = GgufFile::from_bytes(&w.to_bytes()).expect("read");
        let want: Vec<(String, GgufValue)> =
            values.into_iter().enumerate().map(|(i, v)| (format!("k{i}"), v)).collect();
        assert_eq!(file.metadata(), want.as_slice());
        assert_eq!(file.tensors()[0].dims, [2, 3]);
    }

    #[test]
    fn version_2_reads_like_version_3() {
        let mut bytes = tiny("llama");
        let v3 = GgufFile::from_bytes(&bytes).expect("v3");
        bytes[4] = 2;
        let v2 = GgufFile::from_bytes(&bytes).expect("v2");
        assert_eq!(v2.version(), 2);
        assert_eq!(v2.metadata(), v3.metadata());
        assert_eq!(v2.tensors(), v3.tensors());
        assert_eq!(v2.data_offset(), v3.data_offset());

        // A whole version 2 file by hand: u64 counts and lengths, as in version 3.
        let bytes = Bytes::header(2, 1, 2)
            .key("general.architecture", value_type::STRING)
            .str("gpt2")
            .key("general.alignment", value_type::UINT32)
            .u32(16)
            .str("w")
            .u32(2)
            .u64(2)
            .u64(2)
            .u32(0)
            .u64(0);
        let infos_end = bytes.0.len() as u64;
        let mut bytes = bytes.0;
        bytes.resize(bytes.len().next_multiple_of(16) + 16, 0);
        let file = GgufFile::from_bytes(&bytes).expect("hand-made v2");
        assert_eq!(file.version(), 2);
        assert_eq!(file.get_str("general.architecture"), Some("gpt2"));
        assert_eq!(file.alignment(), 16);
        assert_eq!(file.tensor_infos_end(), infos_end);
        assert_eq!(file.data_offset(), infos_end.next_multiple_of(16));
        assert_eq!(file.tensors()[0].dims, [2, 2]);
        assert_eq!(file.tensors()[0].element_count(), 4);
    }

    #[test]
    fn other_versions_and_big_endian_files_are_refused() {
        for version in [0, 1, 4, 99, u32::MAX] {
            let e = err(&Bytes::header(version, 0, 0).0);
            assert!(matches!(e, ReadError::UnsupportedVersion { version: v } if v == version), "{version}: {e}");
            assert!(e.to_string().contains(&format!("GGUF version {version} is not supported")), "{e}");
        }
        assert!(err(&Bytes::header(1, 0, 0).0).to_string().contains("convert the model again"));
        for version in [2u32, 3] {
            // A big-endian file: the magic is the same bytes, the numbers are swapped.
            let bytes = Bytes(b"GGUF".to_vec()).raw(&version.to_be_bytes()).raw(&[0; 16]);
            let e = err(&bytes.0);
            assert!(matches!(e, ReadError::BigEndian { version: v } if v == version), "{e}");
            assert!(e.to_string().starts_with("big-endian GGUF file"), "{e}");
        }
    }

    #[test]
    fn messages_say_what_where_and_how_much() {
        let e = err(&Bytes(b"GGUF".to_vec()).u32(3).raw(&[0, 0]).0);
        assert_eq!(
            e.to_string(),
            "truncated GGUF file: expected 8 bytes for the tensor count at offset 8, file has 10 bytes \
             (an incomplete download or copy?)"
        );
        let e = err(b"");
        assert!(matches!(e, ReadError::Truncated { offset: 0, needed: 4, file_len: 0, .. }), "{e}");
        assert!(e.to_string().contains("for the magic number at offset 0, file has 0 bytes"), "{e}");
        let e = err(b"GGML\x03\0\0\0");
        assert_eq!(e.to_string(), "not a GGUF file: it starts with 47 47 4d 4c (\"GGML\") rather than \"GGUF\"");
        let bytes = Bytes::header(3, 0, 2).key("a", value_type::UINT8).raw(&[1]).key("name", value_type::STRING).u64(9);
        let e = err(&bytes.raw(b"abc").0);
        assert_eq!(
            e.to_string(),
            "truncated or corrupt GGUF file: the length of the string of metadata key \"name\" (pair #1) at offset 54 \
             is 9, which needs at least 9 more bytes, but only 3 remain"
        );
        let bytes = Bytes::header(3, 0, 1).key("list", value_type::ARRAY).u32(value_type::STRING).u64(2).str("ok");
        let e = stream_err(&bytes.u64(5).raw(b"ab").0);
        assert_eq!(
            e.to_string(),
            "truncated GGUF file: expected 5 bytes for the string (array element 1) of metadata key \"list\" (pair #0) \
             at offset 70, file has 72 bytes (an incomplete download or copy?)"
        );
    }

    /// A name, a file, and a test of the error it must give.
    type Case = (&'static str, Vec<u8>, fn(&ReadError) -> bool);

    #[test]
    fn hostile_inputs_are_refused() {
        let h = || Bytes::header(3, 0, 1);
        let depth_bomb = (0..10_000).fold(h().key("bomb", value_type::ARRAY), |b, _| b.u32(value_type::ARRAY).u64(1));
        let cases: Vec<Case> = vec![
            ("bad magic", b"gguf\x03\0\0\0".to_vec(), |e| matches!(e, ReadError::BadMagic { .. })),
            ("magic cut short", b"GGU".to_vec(), |e| matches!(e, ReadError::Truncated { needed: 4, file_len: 3, .. })),
            ("huge tensor count", Bytes::header(3, u64::MAX, 0).0, |e| {
                matches!(e, ReadError::LimitExceeded { value: u64::MAX, limit: 1_048_576, .. })
            }),
            ("tensor count past the end", Bytes::header(3, 1000, 0).0, |e| {
                matches!(e, ReadError::PastEnd { value: 1000, needed: 24_000, remaining: 0, .. })
            }),
            ("huge kv count", Bytes::header(3, 0, u64::MAX).0, |e| {
                matches!(e, ReadError::LimitExceeded { value: u64::MAX, limit: 65_536, .. })
            }),
            ("kv count past the end", Bytes::header(3, 0, 60_000).0, |e| matches!(e, ReadError::PastEnd { .. })),
            ("huge key length", h().u64(u64::MAX).raw(&[0; 8]).0, |e| {
                matches!(e, ReadError::LimitExceeded { limit: 65_536, .. })
            }),
            ("key past the end", h().u64(100).raw(b"abcdefgh").0, |e| {
                matches!(e, ReadError::PastEnd { value: 100, remaining: 8, .. })
            }),
            ("invalid UTF-8 key", h().u64(3).raw(b"a\xff\xfe").u32(0).raw(&[0]).0, |e| {
                matches!(e, ReadError::InvalidUtf8 { offset: 33, .. })
            }),
            ("unknown value type", h().key("k", 13).raw(&[0; 8]).0, |e| {
                matches!(e, ReadError::UnknownValueType { type_id: 13, offset: 33, .. })
            }),
            ("unknown element type", h().key("k", value_type::ARRAY).u32(99).u64(0).0, |e| {
                matches!(e, ReadError::UnknownValueType { type_id: 99, offset: 37, .. })
            }),
            ("huge string length", h().key("k", value_type::STRING).u64(u64::MAX).0, |e| {
                matches!(e, ReadError::LimitExceeded { limit: 67_108_864, .. })
            }),
            ("string past the end", h().key("k", value_type::STRING).u64(1 << 20).raw(b"xyz").0, |e| {
                matches!(e, ReadError::PastEnd { remaining: 3, .. })
            }),
            ("invalid UTF-8 string", h().key("k", value_type::STRING).u64(4).raw(b"ab\xc3(").0, |e| {
                matches!(e, ReadError::InvalidUtf8 { offset: 47, .. })
                    && e.to_string().contains("the string of metadata key \"k\" (pair #0) is not valid UTF-8")
            }),
            ("huge array length", h().key("k", value_type::ARRAY).u32(value_type::UINT8).u64(u64::MAX).0, |e| {
                matches!(e, ReadError::LimitExceeded { limit: 16_777_216, .. })
            }),
            (
                "array past the end",
                h().key("k", value_type::ARRAY).u32(value_type::UINT64).u64(1000).raw(&[0; 64]).0,
                |e| matches!(e, ReadError::PastEnd { value: 1000, needed: 8000, remaining: 64, .. }),
            ),
            (
                "string array past the end",
                h().key("k", value_type::ARRAY).u32(value_type::STRING).u64(10).u64(0).0,
                |e| matches!(e, ReadError::PastEnd { value: 10, needed: 80, remaining: 8, .. }),
            ),
            ("nesting depth bomb", depth_bomb.0, |e| matches!(e, ReadError::LimitExceeded { value: 9, limit: 8, .. })),
            ("duplicate key", Bytes::header(3, 0, 2).key("k", 0).raw(&[1]).key("k", 0).raw(&[2]).0, |e| {
                matches!(e, ReadError::DuplicateKey { offset: 38, .. })
            }),
            ("alignment not a power of two", h().key("general.alignment", value_type::UINT32).u32(48).0, |e| {
                matches!(e, ReadError::InvalidAlignment { .. })
            }),
            ("alignment zero", h().key("general.alignment", value_type::UINT32).u32(0).0, |e| {
                matches!(e, ReadError::InvalidAlignment { .. })
            }),
            ("alignment not a u32", h().key("general.alignment", value_type::UINT64).u64(32).0, |e| {
                matches!(e, ReadError::InvalidAlignment { .. })
            }),
        ];
        for (name, bytes, expected) in cases {
            let e = err(&bytes);
            assert!(expected(&e), "{name}: {e:?}");
            // Also from a stream of unknown length: refused too, if perhaps for another reason.
            stream_err(&bytes);
        }
    }

    #[test]
    fn bad_tensor_infos_are_refused() {
        // One pair, then one tensor info with `dims`, type 0 and `offset`, then `data` bytes.
        let file = |name: &str, dims: &[u64], offset: u64, data: usize| {
            let b = Bytes::header(3, 1, 0).str(name).u32(u32::try_from(dims.len()).expect("dims"));
            let mut b = dims.iter().fold(b, |b, &d| b.u64(d)).u32(0).u64(offset).0;
            b.resize(b.len().next_multiple_of(32) + data, 0);
            GgufFile::from_bytes(&b)
        };
        file("ok", &[4], 0, 16).expect("a valid file");
        file("", &[], 0, 4).expect("no name, no dimensions: a scalar");
        let problem = |r: Result<GgufFile, ReadError>| match r {
            Err(ReadError::InvalidTensor { problem, .. }) => problem,
            other => panic!("{other:?}"),
        };
        assert!(problem(file("t", &[u64::MAX], 0, 0)).contains("more than 2^63-1 elements"));
        assert!(problem(file("t", &[1 << 32, 1 << 31], 0, 0)).contains("more than 2^63-1 elements"));
        assert!(problem(file("t", &[4], 8, 64)).contains("not a multiple of the alignment 32"));
        assert!(
            problem(file("t", &[4], 64, 32)).contains("from offset 64 of the tensor data, which has only 32 bytes")
        );
        let e = file("t", &[1; 5], 0, 0).expect_err("five dimensions");
        assert!(matches!(e, ReadError::LimitExceeded { value: 5, limit: 4, .. }), "{e}");
        assert!(e.to_string().contains("the dimension count of tensor #0 \"t\""), "{e}");
        let e = file(&"n".repeat(64), &[1], 0, 0).expect_err("long name");
        assert!(matches!(e, ReadError::LimitExceeded { value: 64, limit: 63, .. }), "{e}");
        assert!(problem(file("t", &[4], 0, 15)).contains("needs 16 bytes from offset 0"));
        assert!(problem(file("t", &[4, 2], 0, 31)).contains("needs 32 bytes from offset 0"));
        let mut b = Bytes::header(3, 1, 0).str("q").u32(1).u64(32).u32(8).u64(32).0; // Q8_0: 34 bytes per 32
        b.resize(64 + 32, 0);
        assert!(problem(GgufFile::from_bytes(&b)).contains("needs at least 1 byte from offset 32"));
        b.push(0);
        GgufFile::from_bytes(&b).expect("only a byte is known to be needed");
        let b = Bytes::header(3, 1, 0).str("t").u32(1).u64(4).u32(0).u64(0).0;
        let e = err(&b);
        assert!(matches!(e, ReadError::Truncated { needed: 7, file_len: 57, .. }), "{e:?}");
        assert!(e.to_string().contains("for the padding before the tensor data at offset 57"), "{e}");

        let mut w = GgufWriter::new();
        w.add_tensor("a", &[1], TensorType::F32, &[0.0]).expect("a");
        w.add_tensor("b", &[1], TensorType::F32, &[0.0]).expect("b");
        let mut bytes = w.to_bytes();
        let second = bytes.windows(9).rposition(|w| w == b"\x01\0\0\0\0\0\0\0b").expect("second name") + 8;
        bytes[second] = b'a';
        assert!(problem(GgufFile::from_bytes(&bytes)).contains("appears twice"));
    }

    #[test]
    fn every_truncation_is_an_error() {
        let bytes = tiny("llama");
        let file = GgufFile::from_bytes(&bytes).expect("whole");
        let infos_end = usize::try_from(file.tensor_infos_end()).expect("small");
        let data = usize::try_from(file.data_offset()).expect("small");
        for len in 0..data {
            match GgufFile::from_bytes(&bytes[..len]) {
                Err(ReadError::Truncated { .. } | ReadError::PastEnd { .. }) => {}
                other => panic!("{len} bytes: {other:?}"),
            }
        }
        // Without the length, a cut is noticed where the reading reaches it.
        for len in 0..infos_end {
            match GgufFile::read(&bytes[..len]) {
                Err(ReadError::Truncated { file_len, .. }) => assert_eq!(file_len, len as u64),
                other => panic!("{len} bytes: {other:?}"),
            }
        }
        // Cut in the tensor data: the last tensor (F16, no padding after it) is a byte short.
        let e = GgufFile::from_bytes(&bytes[..bytes.len() - 1]).expect_err("a byte short");
        assert!(matches!(&e, ReadError::InvalidTensor { name, .. } if name == "output.weight"), "{e:?}");
    }

    /// `splitmix64`, for reproducible corruption.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: usize) -> usize {
            usize::try_from(self.next() % n as u64).expect("small")
        }
    }

    #[test]
    fn flipped_bytes_never_panic() {
        let mut bytes = tiny("llama");
        let region = usize::try_from(GgufFile::from_bytes(&bytes).expect("whole").data_offset()).expect("small");
        let original = bytes.clone();
        let mut rng = Rng(0x6767_7566);
        let (mut ok, mut refused) = (0, 0);
        for round in 0..10_000 {
            let flips = 1 + rng.below(4);
            let at: Vec<usize> = (0..flips).map(|_| rng.below(region)).collect();
            for &i in &at {
                #[allow(clippy::cast_possible_truncation, reason = "a random byte")]
                let noise = match rng.below(4) {
                    0 => 0xff,
                    1 => 0,
                    _ => (rng.next() as u8).max(1),
                };
                bytes[i] ^= noise;
            }
            match GgufFile::from_bytes(&bytes) {
                Ok(file) => {
                    ok += 1;
                    let _ = super::super::metadata::ModelInfo::from_file(&file);
                    let _ = super::super::metadata::model_info(&file, round % 2 == 0);
                }
                Err(e) => {
                    refused += 1;
                    assert!(!e.to_string().is_empty());
                }
            }
            if round % 8 == 0 {
                let _ = GgufFile::read(&bytes[..region]);
            }
            for &i in &at {
                bytes[i] = original[i];
            }
        }
        assert!(ok > 100 && refused > 100, "{ok} read, {refused} refused");
    }

    #[test]
    fn the_memory_budget_and_other_limits_hold() {
        let bytes = tiny("llama");
        let len = Some(bytes.len() as u64);
        let read = |limits: Limits| GgufFile::read_with(bytes.as_slice(), len, &limits);
        read(Limits::default()).expect("defaults");
        let e = read(Limits { max_total_bytes: 10_000, ..Limits::DEFAULT }).expect_err("budget");
        assert!(matches!(e, ReadError::LimitExceeded { limit: 10_000, .. }), "{e}");
        assert!(e.to_string().contains("the memory the decoded metadata needs"), "{e}");
        let e = read(Limits { max_array_len: 100, ..Limits::DEFAULT }).expect_err("array");
        assert!(e.to_string().contains("the array length of metadata key \"tokenizer.ggml.tokens\""), "{e}");
        let e = read(Limits { max_string_len: 100, ..Limits::DEFAULT }).expect_err("string");
        assert!(e.to_string().contains("\"tokenizer.chat_template\""), "{e}");
        let e = read(Limits { max_kv_count: 23, ..Limits::DEFAULT }).expect_err("kvs");
        assert!(matches!(e, ReadError::LimitExceeded { value: 24, limit: 23, offset: 16, .. }), "{e}");
        let e = read(Limits { max_tensor_count: 38, ..Limits::DEFAULT }).expect_err("tensors");
        assert!(matches!(e, ReadError::LimitExceeded { value: 39, limit: 38, offset: 8, .. }), "{e}");
        let e = read(Limits { max_key_len: 10, ..Limits::DEFAULT }).expect_err("keys");
        assert!(matches!(e, ReadError::LimitExceeded { value: 20, limit: 10, offset: 24, .. }), "{e}");
        let nested = GgufValue::from(GgufArray::Array(vec![GgufArray::Array(vec![GgufArray::U8(vec![1])])]));
        let mut w = GgufWriter::new();
        w.add_metadata("n", nested).expect("kv");
        let nested = w.to_bytes();
        let depth = |max_array_depth| {
            GgufFile::read_with(nested.as_slice(), None, &Limits { max_array_depth, ..Limits::DEFAULT })
        };
        depth(3).expect("three levels");
        assert!(matches!(depth(2), Err(ReadError::LimitExceeded { value: 3, limit: 2, .. })));
    }

    #[test]
    fn a_huge_declared_length_in_a_stream_allocates_nothing_much() {
        // 60 MiB declared, within the limit, with 3 bytes behind it: the buffer grows with
        // what arrives, so this fails fast whatever the length says.
        let bytes = Bytes::header(3, 0, 1).key("k", value_type::STRING).u64(60 << 20).raw(b"abc").0;
        match stream_err(&bytes) {
            ReadError::Truncated { needed, file_len, .. } => assert_eq!((needed, file_len), (60 << 20, 48)),
            other => panic!("{other:?}"),
        }
        let bytes = Bytes::header(3, 0, 1).key("k", value_type::ARRAY).u32(value_type::UINT64).u64(16 << 20).0;
        assert!(matches!(stream_err(&bytes), ReadError::Truncated { offset: 49, .. }));
    }

    #[test]
    fn read_failures_are_reported_with_the_place() {
        struct Failing(usize);
        impl Read for Failing {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                if self.0 == 0 {
                    return Err(io::Error::other("disk on fire"));
                }
                let n = buf.len().min(self.0);
                buf[..n].copy_from_slice(&b"GGUF\x03\0\0\0"[8 - self.0..8 - self.0 + n]);
                self.0 -= n;
                Ok(n)
            }
        }
        let e = GgufFile::read(Failing(8)).expect_err("fails");
        assert!(matches!(&e, ReadError::Io { offset: 8, .. }), "{e:?}");
        assert_eq!(e.to_string(), "cannot read GGUF file: disk on fire (while reading the tensor count at offset 8)");
    }
}
