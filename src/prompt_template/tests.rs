use std::fmt::Write as _;
use std::time::{Duration, Instant};

use super::{
    Limits, MAX_NESTING, MAX_OUTPUT, MAX_SOURCE, MAX_VALUE, STACK_SIZE, TemplateError, render, render_blocking,
    render_here,
};

const FIELDS: [(&str, &str); 3] = [("System", "be brief"), ("Prompt", "hi"), ("Response", "")];

fn run(source: &str) -> Result<String, TemplateError> {
    render_blocking(source, &FIELDS, &Limits::default())
}

/// Each kind of nesting, `n` levels deep, around a field.
fn nested(n: usize) -> Vec<(&'static str, String)> {
    let around = |open: &str, close: &str| format!("{}{{{{ .Prompt }}}}{}", open.repeat(n), close.repeat(n));
    let mut chain = String::new();
    for i in 0..n {
        let _ = write!(chain, r#"{{{{ define "t{i}" }}}}{{{{ template "t{}" . }}}}{{{{ end }}}}"#, i + 1);
    }
    let _ = write!(chain, r#"{{{{ define "t{n}" }}}}{{{{ .Prompt }}}}{{{{ end }}}}{{{{ template "t0" . }}}}"#);
    vec![
        ("if", around("{{ if .Prompt }}", "{{ end }}")),
        ("with", around("{{ with $ }}", "{{ end }}")),
        ("range", around("{{ range $i, $v := $ }}{{ if eq $i \"Prompt\" }}", "{{ end }}{{ end }}")),
        (
            "else if",
            format!(
                "{{{{ if not .Prompt }}}}{}{{{{ else }}}}{{{{ .Prompt }}}}{{{{ end }}}}",
                "{{ else if not .Prompt }}".repeat(n)
            ),
        ),
        ("parentheses", format!("{{{{ print {}.Prompt{} }}}}", "(print ".repeat(n), ")".repeat(n))),
        ("template calls", chain),
        ("block", {
            let blocks = (0..n).fold(String::new(), |mut out, i| {
                let _ = write!(out, "{{{{ block \"b{i}\" . }}}}");
                out
            });
            format!("{blocks}{{{{ .Prompt }}}}{}", "{{ end }}".repeat(n))
        }),
    ]
}

#[test]
fn real_templates_render() {
    let chatml = "{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}{{ if .Prompt }}<|im_start|>user\n{{ .Prompt }}<|im_end|>\n{{ end }}<|im_start|>assistant\n{{ .Response }}<|im_end|>\n";
    assert_eq!(
        run(chatml).expect("renders"),
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"
    );
    let llama3 = "{{- /* a comment */ -}}\n{{ if .System }}<|start_header_id|>system<|end_header_id|>\n\n{{ .System }}<|eot_id|>{{ end }}<|start_header_id|>user<|end_header_id|>\n\n{{ .Prompt }}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n{{ .Response }}";
    assert!(run(llama3).expect("renders").ends_with("hi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"));
    let defined = r#"{{ define "turn" }}[{{ . }}]{{ end }}{{ template "turn" .System }}{{ block "user" .Prompt }}<{{ . }}>{{ end }}{{ printf "%s!" .Prompt }}"#;
    assert_eq!(run(defined).expect("renders"), "[be brief]<hi>hi!");
    let multiline = "{{ if and \n    .System \n    .Prompt }}both{{ end }}";
    assert_eq!(run(multiline).expect("renders"), "both");
    let printed = r#"{{ range $k, $v := $ }}{{ if eq $k "Prompt" }}{{ len $v }}{{ end }}{{ end }}"#;
    assert_eq!(run(printed).expect("renders"), "2");
}

#[test]
fn nesting_up_to_the_limit_renders_on_a_quarter_of_the_stack() {
    // The render thread's stack is STACK_SIZE; a quarter of it holds the deepest of
    // every kind, so the limit leaves a margin of four (in a debug build).
    let handle = std::thread::Builder::new()
        .stack_size(STACK_SIZE / 4)
        .spawn(|| {
            let fields: Vec<(String, String)> = FIELDS.iter().map(|&(k, v)| (k.to_owned(), v.to_owned())).collect();
            // Ranges run three times a level: deep ones are refused for their steps.
            for (kind, source) in nested(MAX_NESTING - 2).into_iter().filter(|(kind, _)| *kind != "range") {
                let deadline = Instant::now() + Duration::from_secs(60);
                let out = render_here(&source, &fields, &Limits::default(), deadline);
                assert!(out.as_deref().is_ok_and(|o| o.contains("hi")), "{kind}: {out:?}");
            }
        })
        .expect("thread");
    handle.join().expect("no overflow");
}

#[test]
fn deep_nesting_of_every_kind_is_refused() {
    for depth in [MAX_NESTING + 1, 1000] {
        for (kind, source) in nested(depth) {
            let error = run(&source).expect_err(kind);
            assert!(matches!(error, TemplateError::TooDeep(64)), "{kind} {depth}: {error:?}");
            assert_eq!(error.to_string(), "template nests deeper than 64 levels");
        }
    }
    // Unclosed, deep: refused for its depth before the missing ends are noticed; the
    // scan itself does not recurse, whatever the size.
    let error = run(&"{{ if 1 }}".repeat(5000)).expect_err("deep");
    assert!(matches!(error, TemplateError::TooDeep(_)), "{error:?}");
    let unlimited = Limits { source: usize::MAX, ..Limits::default() };
    let error = render_blocking(&"{{ (".repeat(1_000_000), &FIELDS, &unlimited).expect_err("deep");
    assert!(matches!(error, TemplateError::TooDeep(_)), "{error:?}");
}

#[test]
fn self_and_mutual_recursion_are_refused() {
    for (source, names) in [
        (r#"{{ define "loop" }}{{ template "loop" . }}{{ end }}{{ template "loop" . }}"#, &["loop"][..]),
        (
            r#"{{ define "a" }}{{ template "b" }}{{ end }}{{ define "b" }}{{ template "a" }}{{ end }}{{ template "a" }}"#,
            &["a", "b"],
        ),
        (r#"{{ define "a" }}x{{ if 1 }}{{ template "" }}{{ end }}{{ end }}{{ template "a" }}"#, &["", "a"]),
        (r#"{{ block "b" . }}{{ template "b" . }}{{ end }}"#, &["b"]),
    ] {
        let error = run(source).expect_err(source);
        let TemplateError::Recursive(name) = &error else { panic!("{source}: {error:?}") };
        assert!(names.contains(&name.as_str()), "{source}: {name}");
        assert!(error.to_string().contains("calls itself"), "{error}");
    }
}

#[test]
fn ranges_and_calls_that_multiply_work_are_refused_before_rendering() {
    // 3^12 runs of the innermost body: refused without running.
    let ranges = format!("{}x{}", "{{ range $ }}".repeat(12), "{{ end }}".repeat(12));
    let started = Instant::now();
    let error = run(&ranges).expect_err("too much");
    assert!(matches!(error, TemplateError::TooManySteps(_)), "{error:?}");
    assert!(error.to_string().contains("more than 100000 steps"), "{error}");
    // 2^40 calls of "t0" through a chain of templates that each call the next twice.
    let mut calls = String::from(r#"{{ define "t0" }}x{{ end }}"#);
    for i in 1..=40 {
        let _ = write!(
            calls,
            r#"{{{{ define "t{i}" }}}}{{{{ template "t{}" }}}}{{{{ template "t{}" }}}}{{{{ end }}}}"#,
            i - 1,
            i - 1
        );
    }
    calls.push_str(r#"{{ template "t40" }}"#);
    assert!(matches!(run(&calls), Err(TemplateError::TooManySteps(_))));
    assert!(started.elapsed() < Duration::from_secs(2), "refused before rendering");
}

#[test]
fn output_past_its_limit_stops_the_render() {
    // 3^7 copies of 8 KiB: about 17 MiB, within the steps.
    let text = "x".repeat(8 << 10);
    let ranges = format!("{}{text}{}", "{{ range $ }}".repeat(7), "{{ end }}".repeat(7));
    let error = run(&ranges).expect_err("too much output");
    assert!(matches!(error, TemplateError::OutputTooLarge(MAX_OUTPUT)), "{error:?}");
    assert_eq!(error.to_string(), "template output is larger than 16 MiB");
    // Just under: fine.
    let ranges = format!("{}{text}{}", "{{ range $ }}".repeat(6), "{{ end }}".repeat(6));
    assert_eq!(run(&ranges).expect("fits").len(), 729 * text.len());
}

#[test]
fn built_strings_past_their_limit_are_refused() {
    for source in [
        r#"{{ printf "%65536d" 1 }}"#,
        r#"{{ printf "%20000d" 1 }}"#,
        r#"{{ printf "%*d" 100000000 1 }}"#,
        r#"{{ printf "%.70000f" 1.5 }}"#,
        r#"{{ printf "%[1]s%[1]s%[1]s%[1]s%[1]s%[1]s%[1]s%[1]s%[1]s" (printf "%10000s" "x") }}"#,
    ] {
        let error = run(source).expect_err(source);
        assert!(matches!(error, TemplateError::ValueTooLarge(MAX_VALUE)), "{source}: {error:?}");
        assert!(error.to_string().contains("larger than 16 KiB"), "{error}");
    }
    // Doubling a string through variables stops at the limit.
    let mut doubling = String::from(r#"{{ $a := "0123456789abcdef" }}"#);
    for _ in 0..20 {
        doubling.push_str("{{ $a := print $a $a }}");
    }
    doubling.push_str("{{ len $a }}");
    let error = run(&doubling).expect_err("doubling");
    assert!(matches!(error, TemplateError::ValueTooLarge(_)), "{error:?}");
    // A built string no larger than its largest argument is fine at any size.
    let prompt = "p".repeat(MAX_VALUE * 2);
    let out = render_blocking(r#"{{ printf "%s" .Prompt }}"#, &[("Prompt", &prompt)], &Limits::default());
    assert_eq!(out.expect("as large as the prompt").len(), prompt.len());
}

#[test]
fn references_times_large_fields_are_bounded() {
    // A megabyte prompt referenced 500 times would copy 500 MiB.
    let prompt = "p".repeat(1 << 20);
    let source = format!("{{{{ if eq {} }}}}x{{{{ end }}}}", ".Prompt ".repeat(500));
    let error = render_blocking(&source, &[("Prompt", &prompt)], &Limits::default()).expect_err("copies");
    assert!(matches!(error, TemplateError::TooManyCopies(_)), "{error:?}");
    assert!(error.to_string().contains("more than 256 MiB"), "{error}");
    // Referenced a few times, it renders.
    let source = "{{ if .Prompt }}[{{ .Prompt }}]{{ end }}";
    let out = render_blocking(source, &[("Prompt", &prompt)], &Limits::default()).expect("renders");
    assert_eq!(out.len(), prompt.len() + 2);
}

#[test]
fn huge_sources_are_refused_before_anything_else() {
    let huge = "a".repeat(MAX_SOURCE + 1);
    let error = run(&huge).expect_err("huge");
    assert!(matches!(error, TemplateError::TooLong(MAX_SOURCE)), "{error:?}");
    assert_eq!(error.to_string(), "template is larger than 64 KiB");
    assert_eq!(run(&"a".repeat(MAX_SOURCE)).expect("fits").len(), MAX_SOURCE);
}

#[test]
fn a_slow_render_is_cut_off_at_its_deadline() {
    // Millions of small writes, with the steps allowed: only the clock stops it.
    let limits = Limits { time: Duration::from_millis(50), steps: u64::MAX, copies: u64::MAX, ..Limits::default() };
    let slow = format!("{}x{}", "{{ range $ }}".repeat(14), "{{ end }}".repeat(14));
    let started = Instant::now();
    let error = render_blocking(&slow, &FIELDS, &limits).expect_err("slow");
    assert!(matches!(error, TemplateError::Timeout(_)), "{error:?}");
    assert_eq!(error.to_string(), "template took longer than 50 ms to render");
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
}

#[tokio::test]
async fn the_async_render_waits_off_the_runtime_with_the_same_limits() {
    // A current-thread runtime: the render must not run on it.
    let out = render("{{ .Prompt }}", &FIELDS, &Limits::default()).await.expect("renders");
    assert_eq!(out, "hi");
    let limits = Limits { time: Duration::from_millis(50), steps: u64::MAX, copies: u64::MAX, ..Limits::default() };
    let slow = format!("{}x{}", "{{ range $ }}".repeat(14), "{{ end }}".repeat(14));
    let error = render(&slow, &FIELDS, &limits).await.expect_err("slow");
    assert!(matches!(error, TemplateError::Timeout(_)), "{error:?}");
    let deep = nested(1000).remove(0).1;
    assert!(matches!(render(&deep, &FIELDS, &Limits::default()).await, Err(TemplateError::TooDeep(_))));
}

#[test]
fn syntax_and_render_errors_keep_gtmpls_messages() {
    let error = run("{{ if .System }}unclosed").expect_err("unclosed");
    assert!(matches!(error, TemplateError::Syntax(_)), "{error:?}");
    assert!(error.to_string().starts_with("invalid template: "), "{error}");
    let error = run("{{ nosuchfunction 1 }}").expect_err("undefined");
    assert!(error.to_string().starts_with("invalid template: "), "{error}");
    let error = run(r#"{{ template "missing" }}"#).expect_err("missing");
    assert!(matches!(error, TemplateError::Render(_)), "{error:?}");
    assert!(error.to_string().contains("missing"), "{error}");
    let error = run(r#"{{ template "\x61" }}"#).expect_err("escaped name");
    assert!(matches!(error, TemplateError::Syntax(_)), "{error:?}");
}
