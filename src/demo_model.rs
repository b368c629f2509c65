//! Tiny random-weight GGUF models that the real llama.cpp `llama-server` loads and runs in
//! milliseconds: a llama chat model and a bert embedding model, a few hundred KB each.
//!
//! The weights are random, so the text is gibberish, but the files are deterministic (a
//! fixed seed) and behave predictably:
//!
//! * llama: the output rows of every token that is not a plain text piece (`<unk>`,
//!   `<s>`, `</s>`, `<|im_start|>`, `<|im_end|>`, the byte tokens except the newline
//!   `<0x0A>`) are zero, so their logit is 0 while the text pieces' logits spread with
//!   σ≈8.  Sampling never picks them: a generation never stops early, runs for exactly
//!   `n_predict` tokens, and its output is valid UTF-8 (ASCII plus newlines).
//! * bert: mean pooling, non-causal attention, 64-dimensional embeddings.

use std::collections::HashSet;
use std::io;
use std::path::Path;

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
const N_LAYER: u32 = 4;
const N_EMBD: u32 = 64;
const N_FF: u32 = 128;
const N_HEAD: u32 = 4;
const N_HEAD_KV: u32 = 2;
const LLAMA_CONTEXT: u32 = 2048;
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

/// Writes the tiny llama chat model: 4 layers, 64-wide, 4 heads over 2 KV heads, context
/// 2048, F16 weights, a sentencepiece vocabulary with byte fallback and a `ChatML` template.
pub fn write_tiny_llama(path: &Path) -> io::Result<()> {
    tiny_llama()?.write_file(path)
}

/// Writes the tiny bert embedding model for `llama-server --embeddings`: 4 layers,
/// 64-dimensional mean-pooled embeddings, context 512, a word-piece vocabulary.
pub fn write_tiny_bert(path: &Path) -> io::Result<()> {
    tiny_bert()?.write_file(path)
}

/// The bytes [`write_tiny_llama`] writes.
pub fn tiny_llama_bytes() -> io::Result<Vec<u8>> {
    Ok(tiny_llama()?.to_bytes())
}

/// The bytes of the tiny llama with `extra` metadata pairs added (for tests of what is
/// made of hostile metadata).
pub fn tiny_llama_bytes_with(extra: Vec<(String, GgufValue)>) -> io::Result<Vec<u8>> {
    let mut w = tiny_llama()?;
    for (key, value) in extra {
        w.add_metadata(&key, value)?;
    }
    Ok(w.to_bytes())
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

fn tiny_llama() -> io::Result<GgufWriter> {
    let vocab = llama_vocab();
    let n_vocab = vocab.len();
    let head_dim = N_EMBD / N_HEAD;
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "llama")?;
    w.add_metadata("general.name", "corral-tiny-llama")?;
    w.add_metadata("general.file_type", FILE_TYPE_MOSTLY_F16)?;
    w.add_metadata("llama.context_length", LLAMA_CONTEXT)?;
    w.add_metadata("llama.embedding_length", N_EMBD)?;
    w.add_metadata("llama.block_count", N_LAYER)?;
    w.add_metadata("llama.feed_forward_length", N_FF)?;
    w.add_metadata("llama.attention.head_count", N_HEAD)?;
    w.add_metadata("llama.attention.head_count_kv", N_HEAD_KV)?;
    w.add_metadata("llama.rope.dimension_count", head_dim)?;
    w.add_metadata("llama.rope.freq_base", 10_000f32)?;
    w.add_metadata("llama.attention.layer_norm_rms_epsilon", 1e-5f32)?;
    w.add_metadata("llama.vocab_size", n_vocab)?;
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

    let mut t = Tensors { writer: &mut w, rng: SplitMix64(SEED) };
    let token_embd = t.random(N_EMBD * n_vocab, 1.0);
    t.add("token_embd.weight", &[N_EMBD, n_vocab], TensorType::F16, &token_embd)?;
    for i in 0..N_LAYER {
        t.vector(&format!("blk.{i}.attn_norm.weight"), N_EMBD, 1.0)?;
        t.matrix(&format!("blk.{i}.attn_q.weight"), N_EMBD, N_HEAD * head_dim)?;
        t.matrix(&format!("blk.{i}.attn_k.weight"), N_EMBD, N_HEAD_KV * head_dim)?;
        t.matrix(&format!("blk.{i}.attn_v.weight"), N_EMBD, N_HEAD_KV * head_dim)?;
        t.matrix(&format!("blk.{i}.attn_output.weight"), N_HEAD * head_dim, N_EMBD)?;
        t.vector(&format!("blk.{i}.ffn_norm.weight"), N_EMBD, 1.0)?;
        t.matrix(&format!("blk.{i}.ffn_gate.weight"), N_EMBD, N_FF)?;
        t.matrix(&format!("blk.{i}.ffn_up.weight"), N_EMBD, N_FF)?;
        t.matrix(&format!("blk.{i}.ffn_down.weight"), N_FF, N_EMBD)?;
    }
    t.vector("output_norm.weight", N_EMBD, 1.0)?;
    // After the RMS norm the hidden state has unit scale, so unit-variance output rows give
    // logits with σ = √64 = 8: peaked, and far above the zero rows.
    let mut output = t.random(N_EMBD * n_vocab, 1.0);
    for (row, (token, &ty)) in output.chunks_mut(N_EMBD as usize).zip(vocab.tokens.iter().zip(&vocab.types)) {
        if ty != NORMAL && token != "<0x0A>" {
            row.fill(0.0);
        }
    }
    t.add("output.weight", &[N_EMBD, n_vocab], TensorType::F16, &output)?;
    Ok(w)
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
    use super::{
        BYTE, CONTROL, NORMAL, SPACE, SplitMix64, UNKNOWN, bert_vocab, llama_vocab, tiny_bert, tiny_llama,
        write_tiny_bert, write_tiny_llama,
    };

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
        assert_ne!(tiny_llama().expect("llama").to_bytes(), tiny_bert().expect("bert").to_bytes());
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
        let bytes = tiny_llama().expect("llama").to_bytes();
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
