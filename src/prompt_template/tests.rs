use std::fmt::Write as _;
use std::time::{Duration, Instant};

use super::{
    Limits, MAX_NESTING, MAX_OUTPUT, MAX_RENDERS, MAX_SOURCE, MAX_VALUE, Renderer, STACK_SIZE, TemplateError,
    render_blocking, render_here,
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

/// Trim markers as Go's `text/template` applies them (what Ollama's users get): next to
/// any character (gtmpl's own trimming sliced inside one of several bytes, and the
/// template failed to parse), only ASCII white space trimmed, a tab or a line break
/// as the marker's space, comments left out with their markers applied.
#[test]
fn trim_markers_trim_as_go_does_next_to_any_character() {
    let cases = [
        ("日本 \n{{- .Prompt }}", "日本hi"),
        ("é{{- .Prompt -}}\t\nà", "éhià"),
        ("«  {{- .System }}»", "«be brief»"),
        ("「{{- .Prompt -}}」", "「hi」"),
        // Not white space to Go: a no-break space, an ideographic space.
        ("a\u{a0}{{- .Prompt }}", "a\u{a0}hi"),
        ("{{ .Prompt -}}\u{3000}x", "hi\u{3000}x"),
        ("a \t\n{{-\t.Prompt\n-}}\r\n b", "ahib"),
        ("a {{- /* a note */ -}} b", "ab"),
        ("a {{/* a note */}} b", "a  b"),
        ("ü {{- /* a note */}} ü", "ü ü"),
        // No marker: a negative number.
        ("x {{-3}} y", "x -3 y"),
        ("{{ if .Prompt -}} \n 是 \n {{- end }}", "是"),
    ];
    for (template, expected) in cases {
        assert_eq!(run(template).map_err(|e| e.to_string()).as_deref(), Ok(expected), "{template:?}");
    }
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
    // 3^6 copies of 24 KiB: about 17 MiB, within the steps and copies.
    let text = "x".repeat(24 << 10);
    let ranges = format!("{}{text}{}", "{{ range $ }}".repeat(6), "{{ end }}".repeat(6));
    let error = run(&ranges).expect_err("too much output");
    assert!(matches!(error, TemplateError::OutputTooLarge(MAX_OUTPUT)), "{error:?}");
    assert_eq!(error.to_string(), "template output is larger than 16 MiB");
    // Just under: fine.
    let ranges = format!("{}{text}{}", "{{ range $ }}".repeat(5), "{{ end }}".repeat(5));
    assert_eq!(run(&ranges).expect("fits").len(), 243 * text.len());
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
    assert!(error.to_string().contains("more than 64 MiB"), "{error}");
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
    let out = Renderer::default().render("{{ .Prompt }}", &FIELDS).await.expect("renders");
    assert_eq!(out, "hi");
    let limits = Limits { time: Duration::from_millis(50), steps: u64::MAX, copies: u64::MAX, ..Limits::default() };
    let slow = format!("{}x{}", "{{ range $ }}".repeat(14), "{{ end }}".repeat(14));
    let error = Renderer::new(limits).render(&slow, &FIELDS).await.expect_err("slow");
    assert!(matches!(error, TemplateError::Timeout(_)), "{error:?}");
    let deep = nested(1000).remove(0).1;
    assert!(matches!(Renderer::default().render(&deep, &FIELDS).await, Err(TemplateError::TooDeep(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renders_past_the_slots_wait_and_then_are_refused_as_busy() {
    let limits = Limits { time: Duration::from_millis(50), steps: u64::MAX, copies: u64::MAX, ..Limits::default() };
    let renderer = Renderer::new(limits);
    // Millions of steps that write nothing (so the writer never sees the deadline): each
    // outlives its deadline and keeps its slot until its thread ends, seconds later.
    let silent = format!("{}{}", "{{ range $ }}".repeat(13), "{{ end }}".repeat(13));
    let mut running = Vec::new();
    for _ in 0..MAX_RENDERS {
        let (renderer, silent) = (renderer.clone(), silent.clone());
        running.push(tokio::spawn(async move { renderer.render(&silent, &FIELDS).await }));
    }
    for task in running {
        let result = task.await.expect("task");
        assert!(matches!(result, Err(TemplateError::Timeout(_))), "{result:?}");
    }
    let error = renderer.render("{{ .Prompt }}", &FIELDS).await.expect_err("busy");
    assert!(matches!(error, TemplateError::Busy(MAX_RENDERS)), "{error:?}");
    assert_eq!(error.to_string(), "too many templates are rendering at once (4); try again");
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

#[test]
fn what_follows_a_syntax_error_never_reaches_gtmpl() {
    // gtmpl accepts an escaped template name (the scan refuses it) and would parse on
    // into the nesting after it, which the scan never read.
    let deep = format!("{}x{}", "{{ if 1 }}".repeat(3000), "{{ end }}".repeat(3000));
    for head in [r#"{{ define "a" }}x{{ end }}{{ template "\x61" }}"#, "{{ print \u{a0}\n 1 }}"] {
        let error = run(&format!("{head}{deep}")).expect_err(head);
        assert!(matches!(error, TemplateError::Syntax(_)), "{head}: {error:?}");
    }
}
