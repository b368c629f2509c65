//! Writes seed inputs for the `gguf_metadata` target into `corpus/gguf_metadata/`: the
//! header, metadata and tensor infos of corral's tiny demo models (their tensor data
//! would only slow the fuzzer down).

use std::path::Path;

use corral::demo_model::{write_tiny_bert, write_tiny_llama};
use corral::gguf::reader::GgufFile;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/gguf_metadata");
    std::fs::create_dir_all(&out)?;
    let scratch = tempfile_dir(&out)?;
    for (name, write) in [("tiny-llama", write_tiny_llama as fn(&Path) -> _), ("tiny-bert", write_tiny_bert)] {
        let model = scratch.join(name);
        write(&model)?;
        let bytes = std::fs::read(&model)?;
        std::fs::remove_file(&model)?;
        let end = usize::try_from(GgufFile::from_bytes(&bytes)?.data_offset())?;
        std::fs::write(out.join(format!("{name}.gguf")), &bytes[..end])?;
        println!("{name}: {end} bytes");
    }
    std::fs::remove_dir(&scratch)?;
    Ok(())
}

/// A scratch directory next to the corpus.
fn tempfile_dir(near: &Path) -> std::io::Result<std::path::PathBuf> {
    let dir = near.join(format!(".seed-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
