//! Feeds arbitrary bytes to the GGUF metadata reader and to everything drawn from what it
//! reads.  Any panic, or an allocation over libFuzzer's `-rss_limit_mb`, is a bug.

#![no_main]

use corral::gguf::metadata::{ModelInfo, model_info};
use corral::gguf::reader::GgufFile;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Once with the length known (every count checked against it), once as a stream.
    for file in [GgufFile::from_bytes(data), GgufFile::read(data)] {
        match file {
            Ok(file) => {
                if let Ok(info) = ModelInfo::from_file(&file) {
                    let _ = (info.kind(), info.file_type_name(), info.kv_cache_bytes(u64::MAX, 4));
                    let _ = (info.kv_head_count_max(), info.kv_cache_bytes(4096, 1));
                }
                let _ = model_info(&file, true);
                let _ = model_info(&file, false);
            }
            Err(e) => {
                let _ = e.to_string();
            }
        }
    }
});
