//! Writes GGUF v3 files: collect metadata and tensors in a [`GgufWriter`], then write it out.

use std::collections::HashSet;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;

use super::{
    DEFAULT_ALIGNMENT, GgufArray, GgufValue, KEY_ALIGNMENT, MAGIC, MAX_TENSOR_DIMS, MAX_TENSOR_NAME_LEN, TensorType,
    VERSION, f32_to_f16_bits,
};

/// A GGUF file being built in memory.  Metadata and tensors are written in the order they
/// were added; tensor data is encoded when added.
#[derive(Debug, Clone, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, GgufValue)>,
    keys: HashSet<String>,
    tensors: Vec<Tensor>,
    tensor_names: HashSet<String>,
}

#[derive(Debug, Clone)]
struct Tensor {
    name: String,
    dims: Vec<u64>,
    ty: TensorType,
    data: Vec<u8>,
}

fn invalid(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, message)
}

impl GgufWriter {
    /// An empty file: no metadata, no tensors.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one metadata pair.  Fails on a repeated key, and on a `general.alignment` that
    /// is not a `u32` power of two.
    pub fn add_metadata(&mut self, key: &str, value: impl Into<GgufValue>) -> io::Result<()> {
        let value = value.into();
        if key == KEY_ALIGNMENT && !matches!(value, GgufValue::U32(a) if a.is_power_of_two()) {
            return Err(invalid(format!("{KEY_ALIGNMENT} must be a u32 power of two, not {value:?}")));
        }
        if !self.keys.insert(key.to_owned()) {
            return Err(invalid(format!("metadata key {key:?} added twice")));
        }
        self.metadata.push((key.to_owned(), value));
        Ok(())
    }

    /// The data alignment: `general.alignment` if set, else 32.
    #[must_use]
    pub fn alignment(&self) -> u32 {
        self.metadata
            .iter()
            .find_map(|(key, value)| match value {
                GgufValue::U32(a) if key == KEY_ALIGNMENT => Some(*a),
                _ => None,
            })
            .unwrap_or(DEFAULT_ALIGNMENT)
    }

    /// Adds a tensor of `ty` holding `values`, converted from `f32`.  `dims` lists the
    /// sizes innermost first (ggml's `ne`): a matrix of `rows` rows of `cols` values is
    /// `[cols, rows]`, and `values` holds it row after row.
    pub fn add_tensor(&mut self, name: &str, dims: &[u64], ty: TensorType, values: &[f32]) -> io::Result<()> {
        if name.is_empty() || name.len() > MAX_TENSOR_NAME_LEN {
            return Err(invalid(format!("tensor name {name:?} must have 1 to {MAX_TENSOR_NAME_LEN} bytes")));
        }
        if dims.is_empty() || dims.len() > MAX_TENSOR_DIMS || dims.contains(&0) {
            return Err(invalid(format!("tensor {name}: dimensions {dims:?} must be 1 to 4 non-zero sizes")));
        }
        let count = dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
        if count != Some(values.len() as u64) {
            return Err(invalid(format!("tensor {name}: dimensions {dims:?} do not hold {} values", values.len())));
        }
        if !self.tensor_names.insert(name.to_owned()) {
            return Err(invalid(format!("tensor {name:?} added twice")));
        }
        let data = match ty {
            TensorType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            TensorType::F16 => values.iter().flat_map(|&v| f32_to_f16_bits(v).to_le_bytes()).collect(),
        };
        self.tensors.push(Tensor { name: name.to_owned(), dims: dims.to_vec(), ty, data });
        Ok(())
    }

    /// Writes the whole file to `out`.
    pub fn write_to(&self, out: impl Write) -> io::Result<()> {
        let alignment = u64::from(self.alignment());
        let mut out = Out { inner: out, position: 0 };
        out.bytes(&MAGIC)?;
        out.u32(VERSION)?;
        out.u64(self.tensors.len() as u64)?;
        out.u64(self.metadata.len() as u64)?;
        for (key, value) in &self.metadata {
            out.string(key)?;
            out.u32(value.type_id())?;
            out.value(value)?;
        }
        let mut offset = 0;
        for tensor in &self.tensors {
            out.string(&tensor.name)?;
            out.u32(u32::try_from(tensor.dims.len()).expect("at most 4 dimensions"))?;
            for &dim in &tensor.dims {
                out.u64(dim)?;
            }
            out.u32(tensor.ty.id())?;
            out.u64(offset)?;
            offset += (tensor.data.len() as u64).next_multiple_of(alignment);
        }
        out.pad(alignment)?;
        for tensor in &self.tensors {
            out.bytes(&tensor.data)?;
            out.pad(alignment)?;
        }
        out.inner.flush()
    }

    /// The whole file as bytes.
    #[must_use]
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut bytes = Vec::new();
        self.write_to(&mut bytes).expect("writing to a Vec cannot fail");
        bytes
    }

    /// Writes the whole file to `path`, replacing any file there.
    pub fn write_file(&self, path: &Path) -> io::Result<()> {
        let mut file = BufWriter::new(File::create(path)?);
        self.write_to(&mut file)?;
        file.into_inner().map_err(io::IntoInnerError::into_error)?.sync_all()
    }
}

/// A writer that counts its position, for the padding.
struct Out<W> {
    inner: W,
    position: u64,
}

impl<W: Write> Out<W> {
    fn bytes(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.inner.write_all(bytes)?;
        self.position += bytes.len() as u64;
        Ok(())
    }

    fn u32(&mut self, v: u32) -> io::Result<()> {
        self.bytes(&v.to_le_bytes())
    }

    fn u64(&mut self, v: u64) -> io::Result<()> {
        self.bytes(&v.to_le_bytes())
    }

    fn string(&mut self, s: &str) -> io::Result<()> {
        self.u64(s.len() as u64)?;
        self.bytes(s.as_bytes())
    }

    fn pad(&mut self, alignment: u64) -> io::Result<()> {
        const ZEROS: [u8; 64] = [0; 64];
        while self.position % alignment != 0 {
            let n = (alignment - self.position % alignment).min(ZEROS.len() as u64);
            self.bytes(&ZEROS[..usize::try_from(n).expect("at most 64")])?;
        }
        Ok(())
    }

    fn value(&mut self, value: &GgufValue) -> io::Result<()> {
        match value {
            GgufValue::U8(v) => self.bytes(&v.to_le_bytes()),
            GgufValue::I8(v) => self.bytes(&v.to_le_bytes()),
            GgufValue::U16(v) => self.bytes(&v.to_le_bytes()),
            GgufValue::I16(v) => self.bytes(&v.to_le_bytes()),
            GgufValue::U32(v) => self.bytes(&v.to_le_bytes()),
            GgufValue::I32(v) => self.bytes(&v.to_le_bytes()),
            GgufValue::F32(v) => self.bytes(&v.to_le_bytes()),
            GgufValue::Bool(v) => self.bytes(&[u8::from(*v)]),
            GgufValue::String(v) => self.string(v),
            GgufValue::Array(v) => self.array(v),
            GgufValue::U64(v) => self.bytes(&v.to_le_bytes()),
            GgufValue::I64(v) => self.bytes(&v.to_le_bytes()),
            GgufValue::F64(v) => self.bytes(&v.to_le_bytes()),
        }
    }

    fn array(&mut self, array: &GgufArray) -> io::Result<()> {
        self.u32(array.element_type_id())?;
        self.u64(array.len() as u64)?;
        match array {
            GgufArray::U8(v) => self.bytes(v),
            GgufArray::I8(v) => v.iter().try_for_each(|x| self.bytes(&x.to_le_bytes())),
            GgufArray::U16(v) => v.iter().try_for_each(|x| self.bytes(&x.to_le_bytes())),
            GgufArray::I16(v) => v.iter().try_for_each(|x| self.bytes(&x.to_le_bytes())),
            GgufArray::U32(v) => v.iter().try_for_each(|x| self.bytes(&x.to_le_bytes())),
            GgufArray::I32(v) => v.iter().try_for_each(|x| self.bytes(&x.to_le_bytes())),
            GgufArray::F32(v) => v.iter().try_for_each(|x| self.bytes(&x.to_le_bytes())),
            GgufArray::Bool(v) => v.iter().try_for_each(|&x| self.bytes(&[u8::from(x)])),
            GgufArray::String(v) => v.iter().try_for_each(|x| self.string(x)),
            GgufArray::U64(v) => v.iter().try_for_each(|x| self.bytes(&x.to_le_bytes())),
            GgufArray::I64(v) => v.iter().try_for_each(|x| self.bytes(&x.to_le_bytes())),
            GgufArray::F64(v) => v.iter().try_for_each(|x| self.bytes(&x.to_le_bytes())),
            GgufArray::Array(v) => v.iter().try_for_each(|x| self.array(x)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::ErrorKind;

    use super::super::{GgufArray, GgufValue, TensorType, value_type};
    use super::GgufWriter;

    /// Reads back what the writer wrote, byte by byte, so that each test states the layout.
    struct Cursor<'a> {
        bytes: &'a [u8],
        at: usize,
    }

    impl Cursor<'_> {
        fn take(&mut self, n: usize) -> &[u8] {
            let slice = &self.bytes[self.at..self.at + n];
            self.at += n;
            slice
        }
        fn u8(&mut self) -> u8 {
            self.take(1)[0]
        }
        fn u32(&mut self) -> u32 {
            u32::from_le_bytes(self.take(4).try_into().expect("4 bytes"))
        }
        fn u64(&mut self) -> u64 {
            u64::from_le_bytes(self.take(8).try_into().expect("8 bytes"))
        }
        fn string(&mut self) -> String {
            let len = usize::try_from(self.u64()).expect("length");
            String::from_utf8(self.take(len).to_vec()).expect("utf-8")
        }
    }

    #[test]
    fn smallest_file_has_the_exact_layout() {
        let mut w = GgufWriter::new();
        w.add_metadata("general.architecture", "x").expect("kv");
        w.add_tensor("t", &[2], TensorType::F32, &[1.0, -2.0]).expect("tensor");
        let mut want = Vec::new();
        want.extend_from_slice(b"GGUF");
        want.extend_from_slice(&[3, 0, 0, 0]); // version
        want.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0]); // tensor count
        want.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0]); // metadata count
        want.extend_from_slice(&[20, 0, 0, 0, 0, 0, 0, 0]);
        want.extend_from_slice(b"general.architecture");
        want.extend_from_slice(&[8, 0, 0, 0]); // string
        want.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0]);
        want.extend_from_slice(b"x");
        want.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0]);
        want.extend_from_slice(b"t");
        want.extend_from_slice(&[1, 0, 0, 0]); // one dimension
        want.extend_from_slice(&[2, 0, 0, 0, 0, 0, 0, 0]);
        want.extend_from_slice(&[0, 0, 0, 0]); // F32
        want.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0]); // offset
        assert_eq!(want.len(), 98);
        want.resize(128, 0); // padding up to the data alignment
        want.extend_from_slice(&1f32.to_le_bytes());
        want.extend_from_slice(&(-2f32).to_le_bytes());
        want.resize(160, 0); // the data is padded too
        assert_eq!(w.to_bytes(), want);
    }

    #[test]
    fn every_metadata_type_round_trips() {
        let values: Vec<GgufValue> = vec![
            GgufValue::U8(0xab),
            GgufValue::I8(-5),
            GgufValue::U16(0xbeef),
            GgufValue::I16(-300),
            GgufValue::U32(0xdead_beef),
            GgufValue::I32(-70_000),
            GgufValue::F32(1.5),
            GgufValue::Bool(true),
            GgufValue::String("héllo ▁".into()),
            GgufValue::U64(u64::MAX - 1),
            GgufValue::I64(i64::MIN + 1),
            GgufValue::F64(-0.25),
            GgufArray::String(vec!["<s>".into(), String::new(), "▁the".into()]).into(),
            GgufArray::I32(vec![1, -2, 3]).into(),
            GgufArray::F32(vec![0.5, -1000.0]).into(),
            GgufArray::Bool(vec![false, true]).into(),
            GgufArray::U8(vec![1, 2, 3]).into(),
        ];
        let mut w = GgufWriter::new();
        for (i, v) in values.iter().enumerate() {
            w.add_metadata(&format!("k{i}"), v.clone()).expect("kv");
        }
        let bytes = w.to_bytes();
        let mut c = Cursor { bytes: &bytes, at: 0 };
        assert_eq!(c.take(4), b"GGUF");
        assert_eq!(c.u32(), 3);
        assert_eq!(c.u64(), 0);
        assert_eq!(c.u64(), values.len() as u64);
        for (i, v) in values.iter().enumerate() {
            assert_eq!(c.string(), format!("k{i}"));
            assert_eq!(c.u32(), v.type_id());
            let got = match v.type_id() {
                value_type::UINT8 => GgufValue::U8(c.u8()),
                value_type::INT8 => GgufValue::I8(i8::from_le_bytes([c.u8()])),
                value_type::UINT16 => GgufValue::U16(u16::from_le_bytes(c.take(2).try_into().expect("2"))),
                value_type::INT16 => GgufValue::I16(i16::from_le_bytes(c.take(2).try_into().expect("2"))),
                value_type::UINT32 => GgufValue::U32(c.u32()),
                value_type::INT32 => GgufValue::I32(i32::from_le_bytes(c.take(4).try_into().expect("4"))),
                value_type::FLOAT32 => GgufValue::F32(f32::from_le_bytes(c.take(4).try_into().expect("4"))),
                value_type::BOOL => GgufValue::Bool(c.u8() == 1),
                value_type::STRING => GgufValue::String(c.string()),
                value_type::UINT64 => GgufValue::U64(c.u64()),
                value_type::INT64 => GgufValue::I64(i64::from_le_bytes(c.take(8).try_into().expect("8"))),
                value_type::FLOAT64 => GgufValue::F64(f64::from_le_bytes(c.take(8).try_into().expect("8"))),
                value_type::ARRAY => {
                    let ty = c.u32();
                    let n = usize::try_from(c.u64()).expect("count");
                    GgufValue::Array(match ty {
                        value_type::STRING => GgufArray::String((0..n).map(|_| c.string()).collect()),
                        value_type::INT32 => GgufArray::I32(
                            (0..n).map(|_| i32::from_le_bytes(c.take(4).try_into().expect("4"))).collect(),
                        ),
                        value_type::FLOAT32 => GgufArray::F32(
                            (0..n).map(|_| f32::from_le_bytes(c.take(4).try_into().expect("4"))).collect(),
                        ),
                        value_type::BOOL => GgufArray::Bool((0..n).map(|_| c.u8() == 1).collect()),
                        value_type::UINT8 => GgufArray::U8(c.take(n).to_vec()),
                        other => panic!("unexpected element type {other}"),
                    })
                }
                other => panic!("unexpected type {other}"),
            };
            assert_eq!(&got, v);
        }
        // No tensors: the file ends right after the metadata.
        assert_eq!(c.at, bytes.len());
    }

    #[test]
    fn tensors_are_aligned_and_f16_is_encoded() {
        let mut w = GgufWriter::new();
        w.add_metadata("general.alignment", 64u32).expect("alignment");
        assert_eq!(w.alignment(), 64);
        w.add_tensor("a.weight", &[3, 2], TensorType::F16, &[1.0, -2.0, 0.5, 0.0, 65504.0, 0.1]).expect("a");
        w.add_tensor("b", &[1], TensorType::F32, &[7.0]).expect("b");
        let bytes = w.to_bytes();
        let mut c = Cursor { bytes: &bytes, at: 0 };
        c.take(4 + 4);
        assert_eq!(c.u64(), 2);
        assert_eq!(c.u64(), 1);
        assert_eq!(c.string(), "general.alignment");
        assert_eq!(c.u32(), value_type::UINT32);
        assert_eq!(c.u32(), 64);
        assert_eq!(c.string(), "a.weight");
        assert_eq!(c.u32(), 2);
        assert_eq!((c.u64(), c.u64()), (3, 2));
        assert_eq!(c.u32(), TensorType::F16.id());
        assert_eq!(c.u64(), 0);
        assert_eq!(c.string(), "b");
        assert_eq!(c.u32(), 1);
        assert_eq!(c.u64(), 1);
        assert_eq!(c.u32(), TensorType::F32.id());
        assert_eq!(c.u64(), 64, "12 bytes of F16 data padded to the alignment");
        let data = c.at.next_multiple_of(64);
        assert!(bytes[c.at..data].iter().all(|&b| b == 0));
        let halves: Vec<u16> = bytes[data..data + 12].chunks(2).map(|h| u16::from_le_bytes([h[0], h[1]])).collect();
        assert_eq!(halves, [0x3c00, 0xc000, 0x3800, 0x0000, 0x7bff, 0x2e66]);
        assert_eq!(&bytes[data + 64..data + 68], &7f32.to_le_bytes());
        assert_eq!(bytes.len(), data + 128);
    }

    #[test]
    fn invalid_input_is_refused() {
        let mut w = GgufWriter::new();
        w.add_metadata("a", 1u32).expect("first");
        let refused = |r: std::io::Result<()>| r.expect_err("must be refused").kind() == ErrorKind::InvalidInput;
        assert!(refused(w.add_metadata("a", 2u32)), "duplicate key");
        assert!(refused(w.add_metadata("general.alignment", 48u32)), "not a power of two");
        assert!(refused(w.add_metadata("general.alignment", 64u64)), "not a u32");
        assert!(refused(w.add_tensor("t", &[2, 2], TensorType::F32, &[0.0; 3])), "wrong count");
        assert!(refused(w.add_tensor("t", &[0], TensorType::F32, &[])), "zero dimension");
        assert!(refused(w.add_tensor("t", &[1; 5], TensorType::F32, &[0.0])), "five dimensions");
        assert!(refused(w.add_tensor(&"n".repeat(64), &[1], TensorType::F32, &[0.0])), "long name");
        w.add_tensor(&"n".repeat(63), &[1], TensorType::F32, &[0.0]).expect("63 bytes is fine");
        assert!(refused(w.add_tensor(&"n".repeat(63), &[1], TensorType::F32, &[0.0])), "duplicate tensor");
        assert_eq!(w.alignment(), 32);
    }

    #[test]
    fn write_file_writes_the_same_bytes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("m.gguf");
        let mut w = GgufWriter::new();
        w.add_metadata("general.name", "m").expect("kv");
        w.add_tensor("x", &[4], TensorType::F16, &[1.0; 4]).expect("tensor");
        w.write_file(&path).expect("write");
        assert_eq!(std::fs::read(&path).expect("read"), w.to_bytes());
    }
}
