//! Random-weight GGUF models that the real llama.cpp `llama-server` loads and runs: a tiny
//! llama chat model and a tiny bert embedding model, a few hundred KB each, loaded in
//! milliseconds; and llamas of any [`LlamaShape`], such as the rig's ([`LlamaShape::rig`]),
//! big enough to split across devices, written tensor by tensor without holding the file.
//!
//! The weights are random, so the text is gibberish, but the files are deterministic (a
//! fixed seed) and behave predictably:
//!
//! * llama: the output rows of every token that is not a plain text piece (`<unk>`,
//!   `<s>`, `</s>`, `<|im_start|>`, `<|im_end|>`, the byte tokens except the newline
//!   `<0x0A>`) are zero, so their logit is 0 while the text pieces' logits spread with
//!   σ≈√`n_embd` (8 for the tiny one).  Sampling never picks them: a generation never stops
//!   early, runs for exactly `n_predict` tokens, and its output is valid UTF-8 (ASCII plus
//!   newlines).
//! * bert: mean pooling, non-causal attention, 64-dimensional embeddings.

use std::collections::HashSet;
use std::io;
use std::path::Path;

use crate::gguf::writer::encode;
use crate::gguf::{GgufValue, GgufWriter, TensorType};

/// Token types (`enum llama_token_type`).
const NORMAL: i32 = 1;
const UNKNOWN: i32 = 2;
const CONTROL: i32 = 3;
const BYTE: i32 = 6;

/// `general.file_type`: `LLAMA_FTYPE_MOSTLY_F16` (2-D weights F16, the rest F32).
const FILE_TYPE_MOSTLY_F16: u32 = 1;
/// `<arch>.pooling_type`: `LLAMA_POOLING_TYPE_MEAN`.
const POOLING_MEAN: u32 = 1;

const SEED: u64 = 0x636f_7272_616c; // "corral"
/// The tiny bert's shape.
const N_LAYER: u32 = 4;
const N_EMBD: u32 = 64;
const N_FF: u32 = 128;
const N_HEAD: u32 = 4;
const BERT_CONTEXT: u32 = 512;

/// The word-initial space of sentencepiece and of llama.cpp's word-piece (U+2581).
const SPACE: char = '\u{2581}';

/// `ChatML`, the template llama.cpp recognises by its `<|im_start|>` marker.
const CHATML_TEMPLATE: &str = concat!(
    "{% for message in messages %}",
    r"{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}",
    "{% endfor %}",
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
);

/// Whole words in the vocabularies (about 100); the rest of any text is spelled out.
const WORDS: &str = "the be to of and in that have it for not on with he as you do at this but his by from \
    they we say her she or an will my one all would there their what so up out if about who get which go me \
    when make can like time no just him know take people into year your good some could them see other than \
    then now look only come its over think also back after use two how our work first well way even new want \
    because any these give day most us hello world model server llama test tiny token text answer question \
    yes ok chat corral";

/// The hyperparameters of a random-weight llama, and how its weights are drawn.  Everything
/// else is fixed: the vocabulary (about 650 tokens), the `ChatML` template, F16 matrices and
/// F32 norms, and the seed, so a shape always gives the same bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LlamaShape {
    /// `general.name`.
    pub name: &'static str,
    /// Transformer blocks (`llama.block_count`).
    pub n_layer: u32,
    /// Hidden width (`llama.embedding_length`); a multiple of `n_head`.
    pub n_embd: u32,
    /// Feed-forward width (`llama.feed_forward_length`).
    pub n_ff: u32,
    /// Attention heads; a multiple of `n_head_kv`.
    pub n_head: u32,
    /// Key/value heads (grouped-query attention when fewer than `n_head`).
    pub n_head_kv: u32,
    /// The training context (`llama.context_length`), llama-server's default `-c`.
    pub context: u32,
    /// How the random weights are drawn.
    pub weights: Weights,
}

/// How a llama's random weights are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Weights {
    /// Close to normal (the sum of 12 uniforms), drawn one by one and rounded to F16: the
    /// tiny models' weights, kept so that their bytes never change, but about 130 ns a
    /// weight in a debug build (15 s for 100 MiB).
    Normal,
    /// Made as F16 bits, four from each 64-bit draw: a random sign and significand over a
    /// fixed exponent, so magnitudes are uniform over [a, 2a), with the power of two `a` that
    /// gives a standard deviation within √2 of the one asked for.  100 MiB in about a second
    /// in a debug build, for the models that tests write; their text is gibberish too.
    RandomBits,
}

impl LlamaShape {
    /// The tiny llama: 4 layers, 64-wide, 4 heads over 2 KV heads, context 2048; 0.45 MiB.
    #[must_use]
    pub const fn tiny() -> Self {
        Self {
            name: "corral-tiny-llama",
            n_layer: 4,
            n_embd: 64,
            n_ff: 128,
            n_head: 4,
            n_head_kv: 2,
            context: 2048,
            weights: Weights::Normal,
        }
    }

    /// The rig's llama, big enough to split across devices and to measure memory in MiB:
    /// 16 layers of 7.5 MiB (512-wide, feed-forward 2048, 8 heads over 4 KV heads), about
    /// 121 MiB of F16 weights in all; an F16 KV cache of 1 KiB per cell and layer (32 MiB
    /// at `-c 2048`); context 4096.
    #[must_use]
    pub const fn rig() -> Self {
        Self {
            name: "corral-rig-llama",
            n_layer: 16,
            n_embd: 512,
            n_ff: 2048,
            n_head: 8,
            n_head_kv: 4,
            context: 4096,
            weights: Weights::RandomBits,
        }
    }

    fn head_dim(&self) -> u32 {
        self.n_embd / self.n_head
    }

    fn check(&self) -> io::Result<()> {
        let sizes = [self.n_layer, self.n_embd, self.n_ff, self.n_head, self.n_head_kv, self.context];
        if sizes.contains(&0) || self.n_embd % self.n_head != 0 || self.n_head % self.n_head_kv != 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("not a llama shape: {self:?}")));
        }
        Ok(())
    }

    /// The bytes of its tensors' data (weights, norms), without the header or padding.
    #[must_use]
    pub fn tensor_bytes(&self) -> u64 {
        let n_vocab = llama_vocab().len();
        llama_tensors(self, n_vocab).iter().map(|t| t.count() * t.ty.element_size() as u64).sum()
    }
}

/// Writes a random-weight llama chat model of `shape`, one tensor at a time (memory stays at
/// the largest tensor's values), with the tiny llama's vocabulary (sentencepiece with byte
/// fallback) and `ChatML` template, so chats work.  Deterministic: the same shape gives the
/// same bytes.
pub fn write_llama(path: &Path, shape: &LlamaShape) -> io::Result<()> {
    let llama = Llama::new(shape, Vec::new())?;
    llama.writer.write_file_streamed(path, llama.data())
}

/// Writes the tiny llama chat model ([`LlamaShape::tiny`]): F16 weights, a sentencepiece
/// vocabulary with byte fallback and a `ChatML` template.
pub fn write_tiny_llama(path: &Path) -> io::Result<()> {
    write_llama(path, &LlamaShape::tiny())
}

/// Writes the tiny bert embedding model for `llama-server --embeddings`: 4 layers,
/// 64-dimensional mean-pooled embeddings, context 512, a word-piece vocabulary.
pub fn write_tiny_bert(path: &Path) -> io::Result<()> {
    tiny_bert()?.write_file(path)
}

/// The bytes [`write_tiny_llama`] writes.
pub fn tiny_llama_bytes() -> io::Result<Vec<u8>> {
    tiny_llama_bytes_with(Vec::new())
}

/// The bytes of the tiny llama with `extra` metadata pairs added (for tests of what is
/// made of hostile metadata).
pub fn tiny_llama_bytes_with(extra: Vec<(String, GgufValue)>) -> io::Result<Vec<u8>> {
    let llama = Llama::new(&LlamaShape::tiny(), extra)?;
    let mut bytes = Vec::new();
    llama.writer.write_streamed(&mut bytes, llama.data())?;
    Ok(bytes)
}

/// The bytes [`write_tiny_bert`] writes.
pub fn tiny_bert_bytes() -> io::Result<Vec<u8>> {
    Ok(tiny_bert()?.to_bytes())
}

/// A vocabulary: parallel token, score and type lists, without duplicate tokens.
#[derive(Default)]
struct Vocab {
    tokens: Vec<String>,
    scores: Vec<f32>,
    types: Vec<i32>,
    seen: HashSet<String>,
}

impl Vocab {
    fn add(&mut self, token: impl Into<String>, score: f32, ty: i32) {
        let token = token.into();
        if self.seen.insert(token.clone()) {
            self.tokens.push(token);
            self.scores.push(score);
            self.types.push(ty);
        }
    }

    fn len(&self) -> u32 {
        u32::try_from(self.tokens.len()).expect("a tiny vocabulary")
    }
}

/// The sentencepiece vocabulary: `<unk>`=0, `<s>`=1, `</s>`=2, `<|im_start|>`=3,
/// `<|im_end|>`=4, the 256 byte tokens, `▁` and printable ASCII, then every prefix of
/// each `▁word` (sentencepiece merges two pieces at a time, highest score first, so
/// `▁hello` is reached only through `▁h`, `▁he`, …; longer prefixes score higher).
fn llama_vocab() -> Vocab {
    let mut v = Vocab::default();
    v.add("<unk>", 0.0, UNKNOWN);
    v.add("<s>", 0.0, CONTROL);
    v.add("</s>", 0.0, CONTROL);
    v.add("<|im_start|>", 0.0, CONTROL);
    v.add("<|im_end|>", 0.0, CONTROL);
    for byte in 0..=255u8 {
        v.add(format!("<0x{byte:02X}>"), 0.0, BYTE);
    }
    v.add(SPACE, -1000.0, NORMAL);
    for c in '!'..='~' {
        v.add(c, -1000.0, NORMAL);
    }
    for word in WORDS.split_whitespace() {
        let piece: Vec<char> = std::iter::once(SPACE).chain(word.chars()).collect();
        for len in 2..=piece.len() {
            let score = -1000.0 + 10.0 * f32::from(u8::try_from(len).expect("a short word"));
            v.add(piece[..len].iter().collect::<String>(), score, NORMAL);
        }
    }
    v
}

/// The word-piece vocabulary in llama.cpp's form: `[PAD]`=0, `[UNK]`=1, `[CLS]`=2,
/// `[SEP]`=3, `[MASK]`=4, then each printable non-uppercase ASCII character as a
/// word-initial `▁c` and as a continuation `c`, then the `▁word`s.  Word-piece lowercases
/// and matches the longest piece, so no prefixes are needed.
fn bert_vocab() -> Vocab {
    let mut v = Vocab::default();
    for special in ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] {
        v.add(special, 0.0, CONTROL);
    }
    for c in ('!'..='~').filter(|c| !c.is_ascii_uppercase()) {
        v.add(format!("{SPACE}{c}"), 0.0, NORMAL);
        v.add(c, 0.0, NORMAL);
    }
    for word in WORDS.split_whitespace() {
        v.add(format!("{SPACE}{word}"), 0.0, NORMAL);
    }
    v
}

/// `splitmix64`: deterministic, a few lines, and fixed forever, which a crate's generator
/// need not be; the weights only have to be arbitrary, not good.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn uniform(&mut self) -> f64 {
        f64::from_bits(0x3ff0_0000_0000_0000 | (self.next_u64() >> 12)) - 1.0
    }

    /// Close to standard normal: the sum of 12 uniforms less 6 (mean 0, variance 1).  Only
    /// additions, so every platform computes the same bits, unlike `ln`/`cos`.
    fn normal(&mut self) -> f64 {
        (0..12).map(|_| self.uniform()).sum::<f64>() - 6.0
    }
}

/// Adds tensors to a writer, drawing random weights from one generator in a fixed order.
struct Tensors<'a> {
    writer: &'a mut GgufWriter,
    rng: SplitMix64,
}

impl Tensors<'_> {
    /// Random values with standard deviation `std`.
    #[allow(clippy::cast_possible_truncation, reason = "weights are stored as f32 or f16 by design")]
    fn random(&mut self, len: u32, std: f64) -> Vec<f32> {
        (0..len).map(|_| (self.rng.normal() * std) as f32).collect()
    }

    /// A random F16 matrix of `rows` rows of `cols` values, scaled like `1/√cols`.
    fn matrix(&mut self, name: &str, cols: u32, rows: u32) -> io::Result<()> {
        let values = self.random(cols * rows, f64::from(cols).sqrt().recip());
        self.add(name, &[cols, rows], TensorType::F16, &values)
    }

    /// An F32 vector of `len` copies of `value` (norm weights and biases).
    fn vector(&mut self, name: &str, len: u32, value: f32) -> io::Result<()> {
        self.add(name, &[len], TensorType::F32, &vec![value; len as usize])
    }

    fn add(&mut self, name: &str, dims: &[u32], ty: TensorType, values: &[f32]) -> io::Result<()> {
        let dims: Vec<u64> = dims.iter().map(|&d| u64::from(d)).collect();
        self.writer.add_tensor(name, &dims, ty, values)
    }
}

/// A llama's metadata, before its tensors.
fn llama_metadata(shape: &LlamaShape, vocab: &Vocab) -> io::Result<GgufWriter> {
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "llama")?;
    w.add_metadata("general.name", shape.name)?;
    w.add_metadata("general.file_type", FILE_TYPE_MOSTLY_F16)?;
    w.add_metadata("llama.context_length", shape.context)?;
    w.add_metadata("llama.embedding_length", shape.n_embd)?;
    w.add_metadata("llama.block_count", shape.n_layer)?;
    w.add_metadata("llama.feed_forward_length", shape.n_ff)?;
    w.add_metadata("llama.attention.head_count", shape.n_head)?;
    w.add_metadata("llama.attention.head_count_kv", shape.n_head_kv)?;
    w.add_metadata("llama.rope.dimension_count", shape.head_dim())?;
    w.add_metadata("llama.rope.freq_base", 10_000f32)?;
    w.add_metadata("llama.attention.layer_norm_rms_epsilon", 1e-5f32)?;
    w.add_metadata("llama.vocab_size", vocab.len())?;
    w.add_metadata("tokenizer.ggml.model", "llama")?;
    w.add_metadata("tokenizer.ggml.tokens", vocab.tokens.clone())?;
    w.add_metadata("tokenizer.ggml.scores", vocab.scores.clone())?;
    w.add_metadata("tokenizer.ggml.token_type", vocab.types.clone())?;
    w.add_metadata("tokenizer.ggml.unknown_token_id", 0u32)?;
    w.add_metadata("tokenizer.ggml.bos_token_id", 1u32)?;
    w.add_metadata("tokenizer.ggml.eos_token_id", 2u32)?;
    w.add_metadata("tokenizer.ggml.eot_token_id", 4u32)?;
    w.add_metadata("tokenizer.ggml.add_bos_token", true)?;
    w.add_metadata("tokenizer.ggml.add_eos_token", false)?;
    w.add_metadata("tokenizer.chat_template", CHATML_TEMPLATE)?;
    Ok(w)
}

/// A llama ready to write: its metadata and declared tensors, and the plan that supplies
/// their data in order.
struct Llama {
    writer: GgufWriter,
    tensors: Vec<Planned>,
    vocab: Vocab,
    weights: Weights,
}

impl Llama {
    fn new(shape: &LlamaShape, extra: Vec<(String, GgufValue)>) -> io::Result<Self> {
        shape.check()?;
        let vocab = llama_vocab();
        let tensors = llama_tensors(shape, vocab.len());
        let mut writer = llama_metadata(shape, &vocab)?;
        for (key, value) in extra {
            writer.add_metadata(&key, value)?;
        }
        for t in &tensors {
            writer.add_tensor_later(&t.name, &t.dims(), t.ty)?;
        }
        Ok(Self { writer, tensors, vocab, weights: shape.weights })
    }

    /// The writer's data callback: each tensor's bytes, drawn from one generator in file
    /// order (so the order of draws is part of the bytes).
    fn data(&self) -> impl FnMut(&str, &mut Vec<u8>) -> io::Result<()> + '_ {
        let mut rng = SplitMix64(SEED);
        let mut next = self.tensors.iter();
        let mut values = Vec::new();
        move |name, out| {
            let t = next.next().filter(|t| t.name == name).expect("asked in the order added");
            t.data(self.weights, &mut rng, &self.vocab, &mut values, out);
            Ok(())
        }
    }
}

/// How a planned tensor's values are made.
#[derive(Debug, Clone, Copy)]
enum Fill {
    /// Every value the same (norm weights).
    Constant(f32),
    /// Random, with this standard deviation.
    Random(f64),
    /// The output matrix: rows of standard deviation 1, zero for the tokens that are not
    /// text.  After the RMS norm the hidden state has unit scale, so the text pieces'
    /// logits spread with σ≈√`n_embd`: peaked, and far above the zero rows' 0.
    Output,
}

/// Appends `count` values close to normal with standard deviation `std`.
#[allow(clippy::cast_possible_truncation, reason = "weights are stored as f32 or f16 by design")]
fn normal(count: usize, std: f64, rng: &mut SplitMix64, out: &mut Vec<f32>) {
    out.extend((0..count).map(|_| (rng.normal() * std) as f32));
}

/// Appends `count` F16 weights made as bits ([`Weights::RandomBits`]) with a standard
/// deviation within √2 of `std`.
fn random_bits(count: usize, std: f64, rng: &mut SplitMix64, out: &mut Vec<u8>) {
    // A magnitude uniform over [a, 2a) has a mean square of 7a²/3: a = std·√(3/7), taken
    // to the nearest power of two (from its bits, so every platform agrees).
    let a = std * (3.0f64 / 7.0).sqrt();
    let floor = i64::try_from((a.to_bits() >> 52) & 0x7ff).expect("11 bits") - 1023;
    let significand = f64::from_bits((a.to_bits() & 0x000f_ffff_ffff_ffff) | 0x3ff0_0000_0000_0000);
    let exponent = if significand >= std::f64::consts::SQRT_2 { floor + 1 } else { floor };
    // F16's biased exponent, kept to the normal numbers.
    let field = u64::try_from((exponent + 15).clamp(1, 30)).expect("clamped");
    let fixed = (field << 10) * 0x0001_0001_0001_0001;
    let end = out.len() + count * 2;
    while out.len() < end {
        // Sign and significand random in each of the four lanes, the exponent fixed.
        let lanes = (rng.next_u64() & 0x83ff_83ff_83ff_83ff) | fixed;
        let take = (end - out.len()).min(8);
        out.extend_from_slice(&lanes.to_le_bytes()[..take]);
    }
}

/// One tensor of a llama, in file order.
struct Planned {
    name: String,
    /// Innermost first: `[cols]` or `[cols, rows]`.
    cols: u32,
    rows: Option<u32>,
    ty: TensorType,
    fill: Fill,
}

impl Planned {
    /// A random F16 matrix of `rows` rows of `cols` values, scaled like `1/√cols`.
    fn matrix(name: String, cols: u32, rows: u32) -> Self {
        Self { name, cols, rows: Some(rows), ty: TensorType::F16, fill: Fill::Random(f64::from(cols).sqrt().recip()) }
    }

    /// An F32 vector of `len` ones (norm weights).
    fn norm(name: String, len: u32) -> Self {
        Self { name, cols: len, rows: None, ty: TensorType::F32, fill: Fill::Constant(1.0) }
    }

    fn dims(&self) -> Vec<u64> {
        std::iter::once(self.cols).chain(self.rows).map(u64::from).collect()
    }

    fn count(&self) -> u64 {
        u64::from(self.cols) * u64::from(self.rows.unwrap_or(1))
    }

    /// Appends the tensor's encoded data to `out`; `values` is scratch space.
    fn data(&self, weights: Weights, rng: &mut SplitMix64, vocab: &Vocab, values: &mut Vec<f32>, out: &mut Vec<u8>) {
        let count = usize::try_from(self.count()).expect("a tensor that fits in memory");
        let std = match self.fill {
            Fill::Constant(value) => {
                values.clear();
                values.resize(count, value);
                return encode(self.ty, values, out);
            }
            Fill::Random(std) => std,
            Fill::Output => 1.0,
        };
        let start = out.len();
        match weights {
            Weights::Normal => {
                values.clear();
                normal(count, std, rng, values);
                encode(self.ty, values, out);
            }
            Weights::RandomBits => {
                assert_eq!(self.ty, TensorType::F16, "random bits are F16 weights");
                random_bits(count, std, rng, out);
            }
        }
        if matches!(self.fill, Fill::Output) {
            let row_bytes = self.cols as usize * self.ty.element_size();
            for (row, (token, &ty)) in out[start..].chunks_mut(row_bytes).zip(vocab.tokens.iter().zip(&vocab.types)) {
                if ty != NORMAL && token != "<0x0A>" {
                    row.fill(0);
                }
            }
        }
    }
}

/// A llama's tensors in the order they are written and their random values drawn.
fn llama_tensors(shape: &LlamaShape, n_vocab: u32) -> Vec<Planned> {
    let (n_embd, head_dim) = (shape.n_embd, shape.head_dim());
    let embedding =
        |name: &str, fill| Planned { name: name.into(), cols: n_embd, rows: Some(n_vocab), ty: TensorType::F16, fill };
    let mut t = vec![embedding("token_embd.weight", Fill::Random(1.0))];
    for i in 0..shape.n_layer {
        t.push(Planned::norm(format!("blk.{i}.attn_norm.weight"), n_embd));
        t.push(Planned::matrix(format!("blk.{i}.attn_q.weight"), n_embd, shape.n_head * head_dim));
        t.push(Planned::matrix(format!("blk.{i}.attn_k.weight"), n_embd, shape.n_head_kv * head_dim));
        t.push(Planned::matrix(format!("blk.{i}.attn_v.weight"), n_embd, shape.n_head_kv * head_dim));
        t.push(Planned::matrix(format!("blk.{i}.attn_output.weight"), shape.n_head * head_dim, n_embd));
        t.push(Planned::norm(format!("blk.{i}.ffn_norm.weight"), n_embd));
        t.push(Planned::matrix(format!("blk.{i}.ffn_gate.weight"), n_embd, shape.n_ff));
        t.push(Planned::matrix(format!("blk.{i}.ffn_up.weight"), n_embd, shape.n_ff));
        t.push(Planned::matrix(format!("blk.{i}.ffn_down.weight"), shape.n_ff, n_embd));
    }
    t.push(Planned::norm("output_norm.weight".into(), n_embd));
    t.push(embedding("output.weight", Fill::Output));
    t
}

fn tiny_bert() -> io::Result<GgufWriter> {
    let vocab = bert_vocab();
    let n_vocab = vocab.len();
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "bert")?;
    w.add_metadata("general.name", "corral-tiny-bert")?;
    w.add_metadata("general.file_type", FILE_TYPE_MOSTLY_F16)?;
    w.add_metadata("bert.context_length", BERT_CONTEXT)?;
    w.add_metadata("bert.embedding_length", N_EMBD)?;
    w.add_metadata("bert.block_count", N_LAYER)?;
    w.add_metadata("bert.feed_forward_length", N_FF)?;
    w.add_metadata("bert.attention.head_count", N_HEAD)?;
    w.add_metadata("bert.attention.layer_norm_epsilon", 1e-12f32)?;
    w.add_metadata("bert.attention.causal", false)?;
    w.add_metadata("bert.pooling_type", POOLING_MEAN)?;
    w.add_metadata("tokenizer.ggml.model", "bert")?;
    w.add_metadata("tokenizer.ggml.token_type_count", 2u32)?;
    w.add_metadata("tokenizer.ggml.tokens", vocab.tokens.clone())?;
    w.add_metadata("tokenizer.ggml.token_type", vocab.types.clone())?;
    w.add_metadata("tokenizer.ggml.padding_token_id", 0u32)?;
    w.add_metadata("tokenizer.ggml.unknown_token_id", 1u32)?;
    w.add_metadata("tokenizer.ggml.bos_token_id", 2u32)?; // [CLS]
    w.add_metadata("tokenizer.ggml.seperator_token_id", 3u32)?; // upstream's spelling
    w.add_metadata("tokenizer.ggml.mask_token_id", 4u32)?;
    w.add_metadata("tokenizer.ggml.add_bos_token", true)?;
    w.add_metadata("tokenizer.ggml.add_sep_token", true)?;

    let mut t = Tensors { writer: &mut w, rng: SplitMix64(SEED) };
    let token_embd = t.random(N_EMBD * n_vocab, 1.0);
    t.add("token_embd.weight", &[N_EMBD, n_vocab], TensorType::F16, &token_embd)?;
    // These two are added to F32 activations, and ggml's CPU add cannot take an F16 operand.
    let token_types = t.random(N_EMBD * 2, 0.02);
    t.add("token_types.weight", &[N_EMBD, 2], TensorType::F32, &token_types)?;
    let positions = t.random(N_EMBD * BERT_CONTEXT, 0.1);
    t.add("position_embd.weight", &[N_EMBD, BERT_CONTEXT], TensorType::F32, &positions)?;
    t.vector("token_embd_norm.weight", N_EMBD, 1.0)?;
    t.vector("token_embd_norm.bias", N_EMBD, 0.0)?;
    for i in 0..N_LAYER {
        for part in ["q", "k", "v", "output"] {
            t.matrix(&format!("blk.{i}.attn_{part}.weight"), N_EMBD, N_EMBD)?;
            t.vector(&format!("blk.{i}.attn_{part}.bias"), N_EMBD, 0.0)?;
        }
        t.vector(&format!("blk.{i}.attn_output_norm.weight"), N_EMBD, 1.0)?;
        t.vector(&format!("blk.{i}.attn_output_norm.bias"), N_EMBD, 0.0)?;
        t.matrix(&format!("blk.{i}.ffn_up.weight"), N_EMBD, N_FF)?;
        t.vector(&format!("blk.{i}.ffn_up.bias"), N_FF, 0.0)?;
        t.matrix(&format!("blk.{i}.ffn_down.weight"), N_FF, N_EMBD)?;
        t.vector(&format!("blk.{i}.ffn_down.bias"), N_EMBD, 0.0)?;
        t.vector(&format!("blk.{i}.layer_output_norm.weight"), N_EMBD, 1.0)?;
        t.vector(&format!("blk.{i}.layer_output_norm.bias"), N_EMBD, 0.0)?;
    }
    Ok(w)
}

#[cfg(test)]
mod tests {
    use sha2::{Digest as _, Sha256};

    use super::{
        BYTE, CONTROL, LlamaShape, NORMAL, SPACE, SplitMix64, UNKNOWN, bert_vocab, llama_vocab, random_bits, tiny_bert,
        tiny_llama_bytes, write_llama, write_tiny_bert, write_tiny_llama,
    };

    fn sha256(bytes: &[u8]) -> String {
        hex::encode(Sha256::digest(bytes))
    }

    #[test]
    fn models_are_deterministic_and_small() {
        let dir = tempfile::tempdir().expect("tempdir");
        for (name, write) in [("llama", write_tiny_llama as fn(&_) -> _), ("bert", write_tiny_bert)] {
            let (a, b) = (dir.path().join(format!("{name}-a.gguf")), dir.path().join(format!("{name}-b.gguf")));
            write(&a).expect("write");
            write(&b).expect("write again");
            let bytes = std::fs::read(&a).expect("read");
            assert_eq!(bytes, std::fs::read(&b).expect("read"), "{name}: same bytes twice");
            assert_eq!(&bytes[..4], b"GGUF");
            assert!((300_000..700_000).contains(&bytes.len()), "{name}: {} bytes", bytes.len());
        }
        assert_ne!(tiny_llama_bytes().expect("llama"), tiny_bert().expect("bert").to_bytes());
    }

    /// Other tests and stores name the tiny models by digest: these bytes never change.
    #[test]
    fn the_tiny_models_bytes_are_pinned() {
        const TINY_LLAMA: &str = "d2376fbc9eb5b055b2a8b221b58a899e757e7b2ef1f36be0ba08e4aedec63412";
        const TINY_BERT: &str = "99330bf8f1e2413a0b85c2200375f24a78a5a2ea20420bc675497317d371a539";
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tiny.gguf");
        write_llama(&path, &LlamaShape::tiny()).expect("streamed");
        assert_eq!(sha256(&std::fs::read(&path).expect("read")), TINY_LLAMA, "written tensor by tensor");
        assert_eq!(sha256(&tiny_llama_bytes().expect("llama")), TINY_LLAMA, "as bytes");
        assert_eq!(sha256(&tiny_bert().expect("bert").to_bytes()), TINY_BERT);
    }

    #[test]
    fn the_rig_llama_is_big_enough_to_split_and_written_quickly() {
        let rig = LlamaShape::rig();
        assert!(rig.n_layer >= 16, "{} layers", rig.n_layer);
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("rig.gguf");
        let start = std::time::Instant::now();
        write_llama(&path, &rig).expect("write");
        let took = start.elapsed();
        let len = std::fs::metadata(&path).expect("written").len();
        assert!(len >= 100 << 20, "{len} bytes");
        assert!(rig.tensor_bytes() >= 100 << 20 && rig.tensor_bytes() < len, "{} tensor bytes", rig.tensor_bytes());
        // About 1.3 s in a debug build on 2 cores.
        assert!(took < std::time::Duration::from_secs(15), "written in {took:?}");
        // Deterministic: the projections measured on it (docs/benchmarks.md) hold for these bytes.
        assert_eq!(
            sha256(&std::fs::read(&path).expect("read")),
            "3b39c9c5a28e1e5c83125737ec772bf2d17131aefdc8304edd824a923c9f9735"
        );
        let file = crate::gguf::reader::GgufFile::open(&path).expect("a GGUF file the reader accepts");
        let info = crate::gguf::metadata::ModelInfo::from_file(&file).expect("model facts");
        assert_eq!((info.architecture.as_str(), info.name.as_deref()), ("llama", Some("corral-rig-llama")));
        assert_eq!((info.block_count, info.embedding_length, info.context_length), (Some(16), Some(512), Some(4096)));
        assert_eq!(file.tensors().len(), 2 + 9 * 16 + 1);
    }

    #[test]
    fn shapes_that_are_not_llamas_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("bad.gguf");
        for bad in [
            LlamaShape { n_layer: 0, ..LlamaShape::tiny() },
            LlamaShape { n_head: 3, ..LlamaShape::tiny() },
            LlamaShape { n_head_kv: 3, ..LlamaShape::tiny() },
        ] {
            let e = write_llama(&path, &bad).expect_err("refused");
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{bad:?}");
            assert!(!path.exists(), "nothing written for {bad:?}");
        }
    }

    #[test]
    fn llama_vocab_has_the_special_tokens_bytes_and_every_prefix() {
        let v = llama_vocab();
        assert_eq!(&v.tokens[..5], ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]);
        assert_eq!(&v.types[..5], [UNKNOWN, CONTROL, CONTROL, CONTROL, CONTROL]);
        assert_eq!(v.tokens[5], "<0x00>");
        assert_eq!(v.tokens[5 + 0x0a], "<0x0A>");
        assert_eq!(v.tokens[5 + 255], "<0xFF>");
        assert!(v.types[5..261].iter().all(|&t| t == BYTE));
        assert_eq!(v.tokens.len(), v.seen.len(), "no duplicates");
        assert!(v.tokens.contains(&SPACE.to_string()));
        assert!(v.tokens.iter().any(|t| t == "~") && v.tokens.iter().any(|t| t == "A"));
        for word in ["▁hello", "▁world", "▁question", "▁the"] {
            let chars: Vec<char> = word.chars().collect();
            for len in 2..=chars.len() {
                let prefix: String = chars[..len].iter().collect();
                assert!(v.seen.contains(&prefix), "{prefix} missing");
            }
        }
        let words = super::WORDS.split_whitespace().count();
        assert!((90..=120).contains(&words), "{words} words");
        assert!((500..800).contains(&v.tokens.len()), "{} tokens", v.tokens.len());
        let score = |t: &str| v.scores[v.tokens.iter().position(|x| x == t).expect(t)];
        assert!(score("▁hel") > score("▁he") && score("▁he") > score("h"));
    }

    #[test]
    fn bert_vocab_is_wordpiece_in_phantom_space_form() {
        let v = bert_vocab();
        assert_eq!(&v.tokens[..5], ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]);
        assert!(v.types[..5].iter().all(|&t| t == CONTROL));
        assert!(v.types[5..].iter().all(|&t| t == NORMAL));
        for t in ["▁a", "a", "▁hello", "▁!", "!"] {
            assert!(v.seen.contains(t), "{t} missing");
        }
        assert!(!v.seen.contains("A") && !v.seen.contains("▁A"), "WordPiece lowercases");
        assert_eq!(v.tokens.len(), v.seen.len(), "no duplicates");
    }

    #[test]
    fn llama_output_rows_of_non_text_tokens_are_zero() {
        let bytes = tiny_llama_bytes().expect("llama");
        let v = llama_vocab();
        // output.weight is the last tensor: n_vocab rows of 64 halves, then padding.
        let row_bytes = 64 * 2;
        let len = v.tokens.len() * row_bytes;
        let start = bytes.len() - len.next_multiple_of(32);
        let rows: Vec<&[u8]> = bytes[start..start + len].chunks(row_bytes).collect();
        for (i, row) in rows.iter().enumerate() {
            let zero = row.iter().all(|&b| b == 0);
            let should_be_zero = v.types[i] != NORMAL && v.tokens[i] != "<0x0A>";
            assert_eq!(zero, should_be_zero, "row {i} ({})", v.tokens[i]);
        }
    }

    #[test]
    fn random_bits_are_f16_weights_of_about_the_deviation_asked_for() {
        for std in [1.0, 0.5f64.sqrt(), 512f64.sqrt().recip(), 2048f64.sqrt().recip()] {
            let mut out = vec![0xaa];
            random_bits(40_001, std, &mut SplitMix64(7), &mut out);
            assert_eq!(out.len(), 1 + 2 * 40_001, "appended, an odd count too");
            assert_eq!(out[0], 0xaa, "what was there is kept");
            let xs: Vec<f64> = out[1..].chunks(2).map(|h| f16_to_f64(u16::from_le_bytes([h[0], h[1]]))).collect();
            let n = 40_001.0;
            let mean = xs.iter().sum::<f64>() / n;
            let sd = (xs.iter().map(|x| x * x).sum::<f64>() / n).sqrt();
            assert!(mean.abs() < 0.02 * std, "std {std}: mean {mean}");
            assert!(sd / std > 0.7 && sd / std < 1.42, "std {std}: got {sd}");
            let min = xs.iter().map(|x| x.abs()).fold(f64::INFINITY, f64::min);
            let max = xs.iter().map(|x| x.abs()).fold(0.0, f64::max);
            assert!(max < 2.0 * min, "std {std}: magnitudes in [a, 2a): {min}..{max}");
        }
    }

    /// A normal F16's value.
    fn f16_to_f64(bits: u16) -> f64 {
        let sign = if bits & 0x8000 == 0 { 1.0 } else { -1.0 };
        let exponent = i32::from((bits >> 10) & 0x1f);
        assert!((1..31).contains(&exponent), "{bits:#06x} is a normal number");
        sign * (1.0 + f64::from(bits & 0x3ff) / 1024.0) * 2f64.powi(exponent - 15)
    }

    #[test]
    fn the_generator_is_fixed() {
        // splitmix64's published first output for seed 0.
        assert_eq!(SplitMix64(0).next_u64(), 0xe220_a839_7b1d_cdaf);
        let mut rng = SplitMix64(1);
        let n = 20_000;
        let xs: Vec<f64> = (0..n).map(|_| rng.normal()).collect();
        let mean = xs.iter().sum::<f64>() / f64::from(n);
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / f64::from(n);
        assert!(mean.abs() < 0.05 && (var - 1.0).abs() < 0.05, "mean {mean}, variance {var}");
    }
}
