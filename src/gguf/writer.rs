//! Writes GGUF v3 files: collect metadata and tensors in a [`GgufWriter`], then write it out.
//! A tensor's values are given when it is added, or, for files too large to hold in memory,
//! declared then and supplied one tensor at a time while the file is written
//! ([`GgufWriter::write_streamed`]).

use std::collections::HashSet;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;

use super::{
    DEFAULT_ALIGNMENT, GgufArray, GgufValue, KEY_ALIGNMENT, MAGIC, MAX_TENSOR_DIMS, MAX_TENSOR_NAME_LEN, TensorType,
    VERSION, f32_to_f16_bits,
};

/// A GGUF file being built in memory.  Metadata and tensors are written in the order they
/// were added; tensor data is encoded when added, except for tensors added with
/// [`Self::add_tensor_later`], whose values come when the file is written.
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
    /// The number of values: the product of `dims`.
    count: u64,
    /// The encoded values, or `None` when they are supplied at write time.
    data: Option<Vec<u8>>,
}

impl Tensor {
    fn byte_len(&self) -> u64 {
        self.count * self.ty.element_size() as u64
    }
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
        let count = check_tensor(name, dims)?;
        if count != values.len() as u64 {
            return Err(invalid(format!("tensor {name}: dimensions {dims:?} do not hold {} values", values.len())));
        }
        let mut data = Vec::with_capacity(values.len() * ty.element_size());
        encode(ty, values, &mut data);
        self.push_tensor(Tensor { name: name.to_owned(), dims: dims.to_vec(), ty, count, data: Some(data) })
    }

    /// Declares a tensor of `ty` whose values are supplied only when the file is written,
    /// by the callback of [`Self::write_streamed`]: a large file is then written one tensor
    /// at a time and never held whole in memory.  `dims` as for [`Self::add_tensor`].
    pub fn add_tensor_later(&mut self, name: &str, dims: &[u64], ty: TensorType) -> io::Result<()> {
        let count = check_tensor(name, dims)?;
        self.push_tensor(Tensor { name: name.to_owned(), dims: dims.to_vec(), ty, count, data: None })
    }

    fn push_tensor(&mut self, tensor: Tensor) -> io::Result<()> {
        if !self.tensor_names.insert(tensor.name.clone()) {
            return Err(invalid(format!("tensor {:?} added twice", tensor.name)));
        }
        self.tensors.push(tensor);
        Ok(())
    }

    /// Writes the whole file to `out`.  Fails (`InvalidInput`, before writing anything)
    /// when a tensor was added with [`Self::add_tensor_later`]: use [`Self::write_streamed`].
    pub fn write_to(&self, out: impl Write) -> io::Result<()> {
        self.check_in_memory()?;
        self.write_streamed(out, |name, _| Err(invalid(format!("tensor {name}: no values to supply"))))
    }

    /// Fails when a tensor's values are supplied only at write time.
    fn check_in_memory(&self) -> io::Result<()> {
        match self.tensors.iter().find(|t| t.data.is_none()) {
            Some(tensor) => Err(invalid(format!("tensor {}: its values are supplied at write time", tensor.name))),
            None => Ok(()),
        }
    }

    /// Writes the whole file to `out`, asking `data` for the data of each tensor added with
    /// [`Self::add_tensor_later`], in the order the tensors were added: it gets the tensor's
    /// name and an empty buffer to fill with exactly its encoded values (little-endian
    /// elements of its type, as [`encode`] makes them; else the write fails with
    /// `InvalidData`).  The buffer is reused, so memory stays at one tensor's data.
    pub fn write_streamed(
        &self,
        out: impl Write,
        mut data: impl FnMut(&str, &mut Vec<u8>) -> io::Result<()>,
    ) -> io::Result<()> {
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
            offset += tensor.byte_len().next_multiple_of(alignment);
        }
        out.pad(alignment)?;
        let mut supplied = Vec::new();
        for tensor in &self.tensors {
            if let Some(data) = &tensor.data {
                out.bytes(data)?;
            } else {
                supplied.clear();
                data(&tensor.name, &mut supplied)?;
                if supplied.len() as u64 != tensor.byte_len() {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("tensor {}: {} bytes supplied for {}", tensor.name, supplied.len(), tensor.byte_len()),
                    ));
                }
                out.bytes(&supplied)?;
            }
            out.pad(alignment)?;
        }
        out.inner.flush()
    }

    /// The whole file as bytes.
    ///
    /// # Panics
    ///
    /// When a tensor was added with [`Self::add_tensor_later`].
    #[must_use]
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut bytes = Vec::new();
        self.write_to(&mut bytes).expect("all values are in memory, and writing to a Vec cannot fail");
        bytes
    }

    /// Writes the whole file to `path`, replacing any file there.  Fails as
    /// [`Self::write_to`] does, before creating the file.
    pub fn write_file(&self, path: &Path) -> io::Result<()> {
        self.check_in_memory()?;
        self.write_file_streamed(path, |name, _| Err(invalid(format!("tensor {name}: no values to supply"))))
    }

    /// [`Self::write_streamed`] to the file `path`, replacing any file there.
    pub fn write_file_streamed(
        &self,
        path: &Path,
        data: impl FnMut(&str, &mut Vec<u8>) -> io::Result<()>,
    ) -> io::Result<()> {
        let mut file = BufWriter::with_capacity(1 << 20, File::create(path)?);
        self.write_streamed(&mut file, data)?;
        file.into_inner().map_err(io::IntoInnerError::into_error)?.sync_all()
    }
}

/// Checks a tensor's name and dimensions; returns its number of values.
fn check_tensor(name: &str, dims: &[u64]) -> io::Result<u64> {
    if name.is_empty() || name.len() > MAX_TENSOR_NAME_LEN {
        return Err(invalid(format!("tensor name {name:?} must have 1 to {MAX_TENSOR_NAME_LEN} bytes")));
    }
    if dims.is_empty() || dims.len() > MAX_TENSOR_DIMS || dims.contains(&0) {
        return Err(invalid(format!("tensor {name}: dimensions {dims:?} must be 1 to 4 non-zero sizes")));
    }
    dims.iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d))
        .ok_or_else(|| invalid(format!("tensor {name}: dimensions {dims:?} overflow")))
}

/// Appends `values` encoded as `ty` (little-endian, F16 rounded to nearest even) to `out`.
pub fn encode(ty: TensorType, values: &[f32], out: &mut Vec<u8>) {
    match ty {
        TensorType::F32 => values.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        TensorType::F16 => values.iter().for_each(|&v| out.extend_from_slice(&f32_to_f16_bits(v).to_le_bytes())),
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
    use super::{GgufWriter, encode};

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
    fn streamed_tensors_give_the_same_bytes_as_tensors_in_memory() {
        let values: [(&str, &[u64], TensorType, Vec<f32>); 3] = [
            ("a", &[3, 2], TensorType::F16, vec![1.0, -2.0, 0.5, 0.0, 65504.0, 0.1]),
            ("b", &[5], TensorType::F32, vec![7.0, 8.0, 9.0, 10.0, 11.0]),
            ("c", &[1], TensorType::F16, vec![0.25]),
        ];
        let mut in_memory = GgufWriter::new();
        let mut streamed = GgufWriter::new();
        for w in [&mut in_memory, &mut streamed] {
            w.add_metadata("general.name", "m").expect("kv");
        }
        for (name, dims, ty, v) in &values {
            in_memory.add_tensor(name, dims, *ty, v).expect("tensor");
        }
        // Mixed: the first one in memory, the others supplied at write time.
        streamed.add_tensor(values[0].0, values[0].1, values[0].2, &values[0].3).expect("tensor");
        for (name, dims, ty, _) in &values[1..] {
            streamed.add_tensor_later(name, dims, *ty).expect("declared");
        }
        let supply = |name: &str, out: &mut Vec<u8>| {
            assert!(out.is_empty(), "the buffer comes empty");
            let (_, _, ty, v) = values.iter().find(|v| v.0 == name).expect("known");
            encode(*ty, v, out);
            Ok(())
        };
        let mut asked = Vec::new();
        let mut bytes = Vec::new();
        streamed
            .write_streamed(&mut bytes, |name, out| {
                asked.push(name.to_owned());
                supply(name, out)
            })
            .expect("streamed");
        assert_eq!(asked, ["b", "c"], "asked in order, only for the deferred ones");
        assert_eq!(bytes, in_memory.to_bytes());

        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("m.gguf");
        streamed.write_file_streamed(&path, supply).expect("written");
        assert_eq!(std::fs::read(&path).expect("read"), bytes);
    }

    #[test]
    fn streamed_tensors_need_their_values_at_write_time() {
        let mut w = GgufWriter::new();
        w.add_tensor_later("t", &[2, 2], TensorType::F16).expect("declared");
        let refused = w.write_to(Vec::new()).expect_err("no values to write");
        assert_eq!(refused.kind(), ErrorKind::InvalidInput);
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("m.gguf");
        assert_eq!(w.write_file(&path).expect_err("no values").kind(), ErrorKind::InvalidInput);
        assert!(!path.exists(), "refused before the file is made");
        let short = w.write_streamed(Vec::new(), |_, out| {
            encode(TensorType::F16, &[1.0; 3], out);
            Ok(())
        });
        assert_eq!(short.expect_err("3 values for 4 places").kind(), ErrorKind::InvalidData);
        let long = w.write_streamed(Vec::new(), |_, out| {
            encode(TensorType::F32, &[1.0; 4], out);
            Ok(())
        });
        assert_eq!(long.expect_err("F32 for F16").kind(), ErrorKind::InvalidData);
        let failed = w.write_streamed(Vec::new(), |_, _| Err(std::io::Error::other("no more")));
        assert_eq!(failed.expect_err("the callback's error").to_string(), "no more");
        assert_eq!(
            w.add_tensor_later("t", &[1], TensorType::F32).expect_err("twice").kind(),
            ErrorKind::InvalidInput,
            "a name is still used once"
        );
        assert!(w.add_tensor_later("u", &[u64::MAX, 2], TensorType::F32).is_err(), "overflow");
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
