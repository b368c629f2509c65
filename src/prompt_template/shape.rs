//! A template's shape, read without recursion before gtmpl sees it: its blocks, its
//! `{{template}}` calls and its actions, so that nesting, recursion and an upper bound
//! on the work of a render are known in advance.
//!
//! The scan follows gtmpl's lexer where it decides what is an action (delimiters,
//! comments, quoted strings, parentheses), so both see the same structure; where the scan
//! finds the structure broken gtmpl's parser fails at the same place.
//!
//! Trim markers (`{{- ` and ` -}}`) and comments are applied by the scan itself, as Go's
//! `text/template` applies them (only space, tab, carriage return and newline are white
//! space there), and gtmpl gets the template without them ([`Shape::source`]): gtmpl's
//! own trimming counts the bytes of the character before the white space wrongly and
//! slices inside it when that character takes more than one byte (its lexer's thread
//! panics and the template fails to parse), trims Unicode white space that Go keeps, and
//! knows a marker only with a space, not a tab or a line break.

use std::collections::HashMap;

/// Why a scan stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum ScanError {
    /// Blocks and parentheses nest deeper than allowed.
    TooDeep,
    /// A template calls itself, directly or through others.
    Recursive(String),
    /// The structure is broken: what and where.
    Syntax(String),
}

/// Steps and copies, added up saturating.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Work {
    /// Everything gtmpl evaluates: actions, their words, text.
    steps: u64,
    /// Evaluations that copy a value: fields, variables, `.`, function calls.
    copies: u64,
}

impl Work {
    fn add(self, other: Self) -> Self {
        Self { steps: self.steps.saturating_add(other.steps), copies: self.copies.saturating_add(other.copies) }
    }

    fn times(self, n: u64) -> Self {
        Self { steps: self.steps.saturating_mul(n), copies: self.copies.saturating_mul(n) }
    }
}

/// One piece of a template body.
#[derive(Debug)]
enum Node {
    /// Text or a plain action, `at` its nesting (blocks around it, plus parentheses).
    Unit { work: Work, at: usize },
    /// `if`, `with` or `range` (`else if` is an `if` inside the `else`).
    Block { range: bool, pipe: Work, at: usize, then: Vec<Node>, otherwise: Vec<Node> },
    /// `{{template "name" pipeline}}`, or the call a `{{block}}` makes.
    Call { name: String, pipe: Work, at: usize },
}

/// What is open while scanning.
#[derive(Debug)]
enum Open {
    If,
    Range,
    With,
    Define(String),
    Block(String),
}

#[derive(Debug)]
struct Frame {
    open: Open,
    pipe: Work,
    /// Its own nesting, with its pipeline's parentheses.
    at: usize,
    then: Vec<Node>,
    otherwise: Vec<Node>,
    in_else: bool,
    /// An `else if`'s `if`, closed by the same `{{end}}` as the one it continues.
    chained: bool,
}

/// A scanned template: the main body (named "", gtmpl's name for it) and the bodies
/// `define` and `block` name, with no call cycles.
#[derive(Debug)]
pub(super) struct Shape {
    /// Bodies by name, each name's in the order callees before callers.
    order: Vec<(String, Vec<Node>)>,
    /// The longest quoted string, in bytes.
    longest_literal: usize,
    /// The template with its trim markers applied and its comments left out.
    source: String,
}

/// An upper bound on what rendering a [`Shape`] takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Cost {
    /// Deepest nesting, with `{{template}}` calls expanded.
    pub depth: usize,
    /// Evaluation steps.
    pub steps: u64,
    /// Value copies.
    pub copies: u64,
}

/// Scans `source`, refusing nesting past `max_depth` as soon as it is seen, and call
/// cycles.
pub(super) fn scan(source: &str, max_depth: usize) -> Result<Shape, ScanError> {
    let mut scanner =
        Scanner { main: Vec::new(), frames: Vec::new(), bodies: HashMap::new(), max_depth, longest_literal: 0 };
    let bytes = source.as_bytes();
    let mut out = String::with_capacity(source.len());
    // Whether the text after the last action loses its leading white space.
    let mut trim_next = false;
    let mut pos = 0;
    while let Some(found) = source[pos..].find("{{") {
        if found > 0 {
            let at = scanner.check(scanner.frames.len())?;
            scanner.append(Node::Unit { work: Work { steps: 1, copies: 0 }, at });
        }
        let open = pos + found;
        let mut at = open + 2;
        let trim_before = left_marker(&bytes[at..]);
        if trim_before {
            at += 2;
        }
        out.push_str(trimmed(&source[pos..open], trim_next, trim_before));
        if source[at..].starts_with("/*") {
            let end = source[at + 2..]
                .find("*/")
                .map(|i| at + 2 + i + 2)
                .ok_or_else(|| syntax(source, open, "unclosed comment"))?;
            let (close, trim_after) = right_delimiter(&bytes[end..])
                .ok_or_else(|| syntax(source, open, "comment ends before the closing delimiter"))?;
            (pos, trim_next) = (end + close, trim_after);
            continue;
        }
        // Parentheses are counted as they open: gtmpl's parser recurses into them even in
        // an action that never closes.
        let room = max_depth.saturating_sub(scanner.frames.len());
        let (action, body_end, end) = lex_action(source, bytes, at, room).map_err(|e| match e {
            ScanError::Syntax(m) => syntax(source, open, &m),
            other => other,
        })?;
        scanner.longest_literal = scanner.longest_literal.max(action.longest_literal);
        scanner.action(&action).map_err(|e| match e {
            ScanError::Syntax(m) => syntax(source, open, &m),
            other => other,
        })?;
        // A space on each side: what gtmpl reads after `{{` and before `}}` is then never a
        // trim marker or a comment (`{{- - x}}` keeps a `- ` once its marker is gone).
        out.push_str("{{ ");
        out.push_str(&source[at..body_end]);
        out.push_str(" }}");
        (pos, trim_next) = (end, end - body_end > 2);
    }
    if pos < source.len() {
        let at = scanner.check(scanner.frames.len())?;
        scanner.append(Node::Unit { work: Work { steps: 1, copies: 0 }, at });
        out.push_str(trimmed(&source[pos..], trim_next, false));
    }
    if let Some(frame) = scanner.frames.last() {
        let what = match &frame.open {
            Open::If => "if",
            Open::Range => "range",
            Open::With => "with",
            Open::Define(_) => "define",
            Open::Block(_) => "block",
        };
        return Err(ScanError::Syntax(format!("unclosed {{{{{what}}}}}: missing {{{{end}}}}")));
    }
    let mut bodies = scanner.bodies;
    // A `define ""` adds to the main body, as gtmpl keeps one tree per name.
    bodies.entry(String::new()).or_default().extend(scanner.main);
    order(bodies, scanner.longest_literal, out)
}

/// White space as Go's `text/template` trims it.
const TRIMMED: [char; 4] = [' ', '\t', '\r', '\n'];

fn is_trimmed_space(c: u8) -> bool {
    TRIMMED.contains(&char::from(c))
}

/// Whether an action (just inside its `{{`) starts with a trim marker: `-` and white space.
fn left_marker(rest: &[u8]) -> bool {
    rest.len() >= 2 && rest[0] == b'-' && is_trimmed_space(rest[1])
}

/// The closing delimiter at the start of `rest`, if there is one: its length, and whether
/// it carries a trim marker (white space and `-` before `}}`).
fn right_delimiter(rest: &[u8]) -> Option<(usize, bool)> {
    if rest.starts_with(b"}}") {
        Some((2, false))
    } else if rest.len() >= 4 && is_trimmed_space(rest[0]) && rest[1..].starts_with(b"-}}") {
        Some((4, true))
    } else {
        None
    }
}

/// `text` without its leading white space if `start`, its trailing if `end`.
fn trimmed(text: &str, start: bool, end: bool) -> &str {
    let text = if start { text.trim_start_matches(TRIMMED) } else { text };
    if end { text.trim_end_matches(TRIMMED) } else { text }
}

fn syntax(source: &str, at: usize, message: &str) -> ScanError {
    let line = source[..at].matches('\n').count() + 1;
    ScanError::Syntax(format!("line {line}: {message}"))
}

/// An action's words as the parser sees them, and its cost.
#[derive(Debug, Default)]
struct Action {
    /// The first two words (or strings), which say what the action is.
    first: Option<Token>,
    /// The longest quoted string, in bytes.
    longest_literal: usize,
    second: Option<Token>,
    work: Work,
    parens: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    Word(String),
    /// A quoted string's text; `None` when it holds escapes (left uninterpreted).
    Text(Option<String>),
    Other,
}

/// Reads the action starting at `pos` (just inside `{{` and its trim marker) the way
/// gtmpl's lexer does, with at most `room` parentheses open; returns it, where its body
/// ends (its closing delimiter or trim marker starts) and where the text after it starts.
fn lex_action(source: &str, bytes: &[u8], mut pos: usize, room: usize) -> Result<(Action, usize, usize), ScanError> {
    let fail = |message: &str| ScanError::Syntax(message.to_owned());
    let mut action = Action { work: Work { steps: 1, copies: 0 }, ..Action::default() };
    let mut depth = 0usize;
    loop {
        if let Some((close, _)) = right_delimiter(&bytes[pos..]) {
            if depth > 0 {
                return Err(fail("unclosed left parenthesis"));
            }
            return Ok((action, pos, pos + close));
        }
        let Some(&c) = bytes.get(pos) else { return Err(fail("unclosed action")) };
        // gtmpl's lexer steps back one byte, not one character, after the character that
        // ends a token: a non-ASCII one there makes it slice inside a character and panic
        // (on a thread of its own). Such characters are fine in quoted strings only.
        if !c.is_ascii() {
            return Err(fail("a non-ASCII character in an action must be inside a quoted string"));
        }
        pos += 1;
        match c {
            b'\r' | b'\n' => return Err(fail("unclosed action")),
            b'"' | b'\'' => {
                let start = pos;
                let mut escaped = false;
                let mut any_escape = false;
                loop {
                    // gtmpl's lexer: a backslash escapes the next byte; a run of them too.
                    match bytes.get(pos) {
                        None | Some(b'\n') => return Err(fail("unterminated quoted string")),
                        Some(b'\\') => {
                            escaped = true;
                            any_escape = true;
                            pos += 1;
                            continue;
                        }
                        Some(&q) if q == c && !escaped => break,
                        Some(_) => {}
                    }
                    escaped = false;
                    pos += 1;
                }
                let text = (!any_escape).then(|| source[start..pos].to_owned());
                action.longest_literal = action.longest_literal.max(pos - start);
                pos += 1;
                push(&mut action, if c == b'"' { Token::Text(text) } else { Token::Other }, true);
            }
            b'`' => {
                let end = source[pos..].find('`').ok_or_else(|| fail("unterminated raw quoted string"))?;
                let text = source[pos..pos + end].to_owned();
                action.longest_literal = action.longest_literal.max(end);
                pos += end + 1;
                push(&mut action, Token::Text(Some(text)), true);
            }
            b'(' => {
                depth += 1;
                if depth > room {
                    return Err(ScanError::TooDeep);
                }
                action.parens = action.parens.max(depth);
                push(&mut action, Token::Other, false);
            }
            b')' => {
                depth = depth.checked_sub(1).ok_or_else(|| fail("unexpected right parenthesis"))?;
            }
            b'$' | b'.' => {
                // A variable or a field (chained fields each copy: one token per dot).
                while pos < bytes.len() && is_word(bytes[pos]) {
                    pos += 1;
                }
                push(&mut action, Token::Other, true);
            }
            c if c.is_ascii_whitespace() => {
                // gtmpl's lexer takes a run of spaces whole, line breaks included (a
                // break only ends an action where a token would start).
                while pos < bytes.len() && bytes[pos].is_ascii_whitespace() && right_delimiter(&bytes[pos..]).is_none()
                {
                    pos += 1;
                }
            }
            c if is_word(c) || c == b'+' || c == b'-' => {
                let start = pos - 1;
                while pos < bytes.len() && (is_word(bytes[pos]) || bytes[pos] == b'.' && bytes[start].is_ascii_digit())
                {
                    pos += 1;
                }
                // A word may be a function call, which makes a value.
                push(&mut action, Token::Word(source[start..pos].to_owned()), true);
            }
            _ => push(&mut action, Token::Other, false),
        }
    }
}

/// Counts a token of `action`, keeping the first two.
fn push(action: &mut Action, token: Token, copies: bool) {
    action.work.steps = action.work.steps.saturating_add(1);
    if copies {
        action.work.copies = action.work.copies.saturating_add(1);
    }
    if action.first.is_none() {
        action.first = Some(token);
    } else if action.second.is_none() {
        action.second = Some(token);
    }
}

/// Letters, digits and `_` (non-ASCII characters are refused in actions, see
/// [`lex_action`]).
fn is_word(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

struct Scanner {
    main: Vec<Node>,
    frames: Vec<Frame>,
    bodies: HashMap<String, Vec<Node>>,
    max_depth: usize,
    longest_literal: usize,
}

impl Scanner {
    /// The list new nodes go to.
    fn current(&mut self) -> &mut Vec<Node> {
        match self.frames.last_mut() {
            Some(frame) if frame.in_else => &mut frame.otherwise,
            Some(frame) => &mut frame.then,
            None => &mut self.main,
        }
    }

    fn append(&mut self, node: Node) {
        self.current().push(node);
    }

    /// Checks a nesting (absolute: gtmpl's parser recurses through every level) and
    /// returns it relative to the enclosing `define` or `block`, whose body gtmpl
    /// executes as a call.
    fn check(&self, at: usize) -> Result<usize, ScanError> {
        if at > self.max_depth {
            return Err(ScanError::TooDeep);
        }
        let base = self.frames.iter().rposition(|f| matches!(f.open, Open::Define(_) | Open::Block(_)));
        Ok(at - base.unwrap_or(0))
    }

    fn open(&mut self, open: Open, pipe: Work, parens: usize, chained: bool) -> Result<(), ScanError> {
        let at = self.check(self.frames.len() + 1 + parens)?;
        self.frames.push(Frame { open, pipe, at, then: Vec::new(), otherwise: Vec::new(), in_else: false, chained });
        Ok(())
    }

    fn action(&mut self, action: &Action) -> Result<(), ScanError> {
        let keyword = match &action.first {
            Some(Token::Word(w)) => w.as_str(),
            _ => "",
        };
        let depth = self.frames.len();
        match keyword {
            "if" => self.open(Open::If, action.work, action.parens, false),
            "range" => self.open(Open::Range, action.work, action.parens, false),
            "with" => self.open(Open::With, action.work, action.parens, false),
            "define" => {
                if !self.frames.is_empty() {
                    return Err(ScanError::Syntax("{{define}} is allowed only at the top level".into()));
                }
                let name = name(action.second.as_ref())?;
                self.open(Open::Define(name), Work::default(), action.parens, false)
            }
            "block" => {
                let name = name(action.second.as_ref())?;
                self.open(Open::Block(name), action.work, action.parens, false)
            }
            "template" => {
                let name = name(action.second.as_ref())?;
                let at = self.check(depth + action.parens)?;
                self.append(Node::Call { name, pipe: action.work, at });
                Ok(())
            }
            "else" => {
                let Some(frame) = self.frames.last_mut() else {
                    return Err(ScanError::Syntax("unexpected {{else}}".into()));
                };
                if frame.in_else || !matches!(frame.open, Open::If | Open::Range | Open::With) {
                    return Err(ScanError::Syntax("unexpected {{else}}".into()));
                }
                frame.in_else = true;
                if action.second == Some(Token::Word("if".into())) {
                    // gtmpl nests the `if` inside the `else`: one level deeper each time.
                    self.open(Open::If, action.work, action.parens, true)?;
                }
                Ok(())
            }
            "end" => self.close(),
            _ => {
                let at = self.check(depth + action.parens)?;
                self.append(Node::Unit { work: action.work, at });
                Ok(())
            }
        }
    }

    /// `{{end}}`: closes the innermost block, with the `else if`s that continue it.
    fn close(&mut self) -> Result<(), ScanError> {
        loop {
            let Some(frame) = self.frames.pop() else {
                return Err(ScanError::Syntax("unexpected {{end}}".into()));
            };
            let chained = frame.chained;
            match frame.open {
                Open::If | Open::With | Open::Range => {
                    let range = matches!(frame.open, Open::Range);
                    let (pipe, at, then, otherwise) = (frame.pipe, frame.at, frame.then, frame.otherwise);
                    let node = Node::Block { range, pipe, at, then, otherwise };
                    self.append(node);
                }
                Open::Define(name) => self.bodies.entry(name).or_default().extend(frame.then),
                Open::Block(name) => {
                    self.bodies.entry(name.clone()).or_default().extend(frame.then);
                    // The call sits where the block does; the body counts the block's level.
                    let at = self.check(self.frames.len())?;
                    self.append(Node::Call { name, pipe: frame.pipe, at });
                }
            }
            if !chained {
                return Ok(());
            }
        }
    }
}

/// A `define`, `block` or `template` name: a string constant without escapes (so the
/// scan and gtmpl cannot read it differently).
fn name(token: Option<&Token>) -> Result<String, ScanError> {
    match token {
        Some(Token::Text(Some(name))) => Ok(name.clone()),
        Some(Token::Text(None)) => Err(ScanError::Syntax("template names with escapes are not supported".into())),
        _ => Err(ScanError::Syntax("a template name must be a quoted string".into())),
    }
}

/// Puts bodies in an order where every template comes after those it calls (a
/// depth-first walk, without recursion); refuses a cycle, naming a template on it.
fn order(mut bodies: HashMap<String, Vec<Node>>, longest_literal: usize, source: String) -> Result<Shape, ScanError> {
    let mut calls: HashMap<String, Vec<String>> = HashMap::new();
    for (name, nodes) in &bodies {
        let mut callees = Vec::new();
        let mut stack: Vec<&Node> = nodes.iter().collect();
        while let Some(node) = stack.pop() {
            match node {
                Node::Block { then, otherwise, .. } => stack.extend(then.iter().chain(otherwise)),
                Node::Call { name, .. } if bodies.contains_key(name) => callees.push(name.clone()),
                Node::Unit { .. } | Node::Call { .. } => {}
            }
        }
        callees.sort();
        callees.dedup();
        calls.insert(name.clone(), callees);
    }
    let mut names: Vec<&String> = calls.keys().collect();
    names.sort();
    // 1: on the walk's path; 2: done.
    let mut state: HashMap<&str, u8> = HashMap::new();
    let mut done: Vec<String> = Vec::with_capacity(calls.len());
    for root in names {
        if state.contains_key(root.as_str()) {
            continue;
        }
        state.insert(root, 1);
        let mut path: Vec<(&str, usize)> = vec![(root, 0)];
        while let Some((name, next)) = path.last_mut() {
            let callees = &calls[*name];
            if let Some(callee) = callees.get(*next) {
                *next += 1;
                match state.get(callee.as_str()) {
                    None => {
                        state.insert(callee, 1);
                        path.push((callee, 0));
                    }
                    Some(1) => return Err(ScanError::Recursive(callee.clone())),
                    Some(_) => {}
                }
            } else {
                state.insert(name, 2);
                done.push((*name).to_owned());
                path.pop();
            }
        }
    }
    let order = done
        .into_iter()
        .map(|name| {
            let nodes = bodies.remove(&name).unwrap_or_default();
            (name, nodes)
        })
        .collect();
    Ok(Shape { order, longest_literal, source })
}

impl Shape {
    /// The longest quoted string, in bytes: the largest value a literal may copy.
    pub(super) fn longest_literal(&self) -> usize {
        self.longest_literal
    }

    /// The template as gtmpl is to parse it: the trim markers applied (and gone) and the
    /// comments left out, with the same actions in the same places.
    pub(super) fn source(&self) -> &str {
        &self.source
    }

    /// The cost of rendering the main body when a `range` runs at most `range` times.
    pub(super) fn cost(&self, range: u64) -> Cost {
        let mut known: HashMap<&str, (Work, usize)> = HashMap::new();
        for (name, nodes) in &self.order {
            let work = work_of(nodes, range, &known);
            let depth = depth_of(nodes, &known);
            known.insert(name.as_str(), (work, depth));
        }
        let (work, depth) = known.get("").copied().unwrap_or_default();
        Cost { depth, steps: work.steps, copies: work.copies }
    }
}

/// An upper bound on the work of `nodes`: both branches of a condition, every `range`
/// run `range` times (each run copying its element), callees' work at each call.
/// Recurses once per nesting level, which the scan bounded.
fn work_of(nodes: &[Node], range: u64, known: &HashMap<&str, (Work, usize)>) -> Work {
    let one = Work { steps: 1, copies: 1 };
    nodes.iter().fold(Work::default(), |total, node| {
        total.add(match node {
            Node::Unit { work, .. } => *work,
            Node::Block { range: true, pipe, then, otherwise, .. } => pipe
                .add(one)
                .add(work_of(then, range, known).add(one).times(range))
                .add(work_of(otherwise, range, known)),
            Node::Block { range: false, pipe, then, otherwise, .. } => {
                pipe.add(work_of(then, range, known)).add(work_of(otherwise, range, known))
            }
            Node::Call { name, pipe, .. } => {
                pipe.add(one).add(known.get(name.as_str()).map_or(Work::default(), |(work, _)| *work))
            }
        })
    })
}

/// The deepest nesting in `nodes`, each call as deep as its site plus its callee (whose
/// body counts its own `define` or `block` level).
fn depth_of(nodes: &[Node], known: &HashMap<&str, (Work, usize)>) -> usize {
    nodes
        .iter()
        .map(|node| match node {
            Node::Unit { at, .. } => *at,
            Node::Block { at, then, otherwise, .. } => (*at).max(depth_of(then, known)).max(depth_of(otherwise, known)),
            Node::Call { name, at, .. } => at + known.get(name.as_str()).map_or(0, |(_, depth)| *depth),
        })
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use std::fmt::Write as _;

    use super::{ScanError, scan};

    fn cost(source: &str) -> super::Cost {
        scan(source, 64).expect("scans").cost(3)
    }

    #[test]
    fn nesting_counts_blocks_else_ifs_parentheses_and_calls() {
        assert_eq!(cost("{{ .Prompt }}").depth, 0);
        assert_eq!(cost("{{ if .A }}{{ .B }}{{ end }}").depth, 1);
        assert_eq!(cost("{{ if .A }}{{ (len (print .B)) }}{{ end }}").depth, 3);
        assert_eq!(cost("{{ if .A }}a{{ else if .B }}b{{ else if .C }}c{{ else }}d{{ end }}x").depth, 3);
        assert_eq!(
            cost(r#"{{ define "t" }}{{ if . }}x{{ end }}{{ end }}{{ if 1 }}{{ template "t" }}{{ end }}"#).depth,
            3
        );
        assert_eq!(cost(r#"{{ block "a" . }}{{ block "b" . }}{{ .X }}{{ end }}{{ end }}"#).depth, 2);
        let deep = format!("{}x{}", "{{if 1}}".repeat(65), "{{end}}".repeat(65));
        assert_eq!(scan(&deep, 64).expect_err("deep"), ScanError::TooDeep);
        let deep = format!("{{{{{}1{}}}}}", "(".repeat(65), ")".repeat(65));
        assert_eq!(scan(&deep, 64).expect_err("deep"), ScanError::TooDeep);
        let chain = format!("{{{{if 0}}}}{}{{{{end}}}}", "{{else if 0}}".repeat(64));
        assert_eq!(scan(&chain, 64).expect_err("deep"), ScanError::TooDeep);
    }

    #[test]
    fn strings_comments_and_trim_markers_hide_nothing() {
        // Delimiters and parentheses inside strings and comments are not structure.
        let text = r#"{{- /* {{if}} */ -}}{{ print "}} {{if" `(((` '"' }}{{ "a\"(" }}"#;
        assert_eq!(cost(text).depth, 0);
        assert!(matches!(scan("{{ print \"unterminated }}", 64), Err(ScanError::Syntax(_))));
        assert!(matches!(scan("{{ if 1 }}", 64), Err(ScanError::Syntax(m)) if m.contains("unclosed {{if}}")));
        assert!(matches!(scan("{{ end }}", 64), Err(ScanError::Syntax(_))));
        // A line break inside an action is fine after a space, as in gtmpl.
        assert_eq!(cost("{{ if and \n .A \n .B }}x{{ end }}").depth, 1);
        assert!(matches!(scan("{{ if\n.A }}x{{ end }}", 64), Err(ScanError::Syntax(_))));
    }

    #[test]
    fn gtmpl_gets_the_template_with_its_trim_markers_applied_and_its_comments_left_out() {
        let source = |text: &str| scan(text, 64).expect("scans").source().to_owned();
        assert_eq!(source("a {{- /* c */ -}} b {{- .X -}} c"), "ab{{ .X }}c");
        // Go's white space only (here a no-break space stays), a tab or a line break as
        // the marker's space, the body between the markers untouched.
        assert_eq!(source("\u{a0} \n{{-\t .X  \n-}}\u{a0}"), "\u{a0}{{  .X   }}\u{a0}");
        // A `-` without white space after it is a number, not a marker.
        assert_eq!(source("a {{-3}} b"), "a {{ -3 }} b");
        // Strings that look like markers or comments are left as they are.
        assert_eq!(source(r#"{{ print " -}}" "/*" }} x"#), r#"{{  print " -}}" "/*"  }} x"#);
        // What is left once a marker is gone never reads as another one (found by the
        // fuzzer): gtmpl would trim again, inside a character.
        assert_eq!(source("«{{- - 1 -}}»"), "«{{ - 1 }}»");
        assert_eq!(source("«{{- -}}»"), "«{{ - }}»");
    }

    #[test]
    fn non_ascii_characters_in_actions_only_in_quoted_strings() {
        // gtmpl's lexer panics on these (found by the fuzzer): refused before it runs.
        for bad in ["{{ ʚ;$a }}", "{{ .Prompt→ }}", "{{ $é := 1 }}", "{{ if .Préféré }}x{{ end }}"] {
            assert!(
                matches!(scan(bad, 64), Err(ScanError::Syntax(m)) if m.contains("non-ASCII")),
                "{bad}: {:?}",
                scan(bad, 64)
            );
        }
        scan("{{ \"→ é ʚ\" }} text → é {{/* ok */}}{{ `ʚ` }}", 64).expect("quoted and plain text are fine");
    }

    #[test]
    fn call_cycles_are_refused_and_chains_are_not() {
        let own = r#"{{define "a"}}{{template "a"}}{{end}}{{template "a"}}"#;
        assert_eq!(scan(own, 64).expect_err("cycle"), ScanError::Recursive("a".into()));
        let mutual = r#"{{define "a"}}{{template "b"}}{{end}}{{define "b"}}{{template "a"}}{{end}}"#;
        assert!(matches!(scan(mutual, 64), Err(ScanError::Recursive(n)) if n == "a" || n == "b"));
        let main = r#"{{define "a"}}{{template ""}}{{end}}{{template "a"}}"#;
        assert!(matches!(scan(main, 64), Err(ScanError::Recursive(_))));
        let block = r#"{{block "b" .}}{{template "b"}}{{end}}"#;
        assert_eq!(scan(block, 64).expect_err("cycle"), ScanError::Recursive("b".into()));
        let escaped = r#"{{define "a"}}x{{end}}{{template "\x61"}}"#;
        assert!(matches!(scan(escaped, 64), Err(ScanError::Syntax(m)) if m.contains("escapes")));
        let chain = r#"{{define "a"}}x{{end}}{{define "b"}}{{template "a"}}{{template "a"}}{{end}}{{template "b"}}"#;
        assert!(cost(chain).steps >= 4);
    }

    #[test]
    fn ranges_and_calls_multiply_the_work() {
        let one = cost("{{range $}}x{{end}}").steps;
        let two = cost("{{range $}}{{range $}}x{{end}}{{end}}").steps;
        assert!(two > 2 * one, "{one} {two}");
        let nested = format!("{}x{}", "{{range $}}".repeat(20), "{{end}}".repeat(20));
        assert!(cost(&nested).steps > 3u64.pow(20));
        let mut calls = String::from(r#"{{define "t0"}}x{{end}}"#);
        for i in 1..40 {
            let _ = write!(
                calls,
                r#"{{{{define "t{i}"}}}}{{{{template "t{}"}}}}{{{{template "t{}"}}}}{{{{end}}}}"#,
                i - 1,
                i - 1
            );
        }
        calls.push_str(r#"{{template "t39"}}"#);
        assert!(cost(&calls).steps > 1 << 39);
    }
}
