//! Feeds arbitrary text as a request `template` (with fixed `.System`, `.Prompt` and
//! `.Response`) to the bounded renderer. A panic outside the render thread, a stack
//! overflow, an allocation over libFuzzer's `-rss_limit_mb`, a hang, or output past the
//! output limit is a bug.

#![no_main]

use std::sync::Once;

use corral::prompt_template::{Limits, MAX_OUTPUT, TemplateError, render_blocking};
use libfuzzer_sys::fuzz_target;

static HOOK: Once = Once::new();

fuzz_target!(|data: &[u8]| {
    HOOK.call_once(|| {
        // A panic inside gtmpl stays on the render thread (the daemon answers 400); only
        // a panic anywhere else aborts, as libFuzzer's hook would.
        let abort = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if std::thread::current().name() == Some("corral-template") {
                eprintln!("contained on the render thread: {info}");
            } else {
                abort(info);
            }
        }));
    });
    let Ok(template) = std::str::from_utf8(data) else { return };
    let fields = [("System", "You are brief."), ("Prompt", "Why is the sky blue?"), ("Suffix", ""), ("Response", "")];
    match render_blocking(template, &fields, &Limits::default()) {
        Ok(out) => assert!(out.len() <= MAX_OUTPUT, "{} bytes of output", out.len()),
        Err(TemplateError::Thread(e)) => panic!("no render thread: {e}"),
        Err(e) => {
            let _ = e.to_string();
        }
    }
});
