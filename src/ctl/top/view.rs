//! Drawing `corralctl top`: the [`State`] laid out on whatever size the terminal has.
//!
//! From the top: a header line, one memory bar per device, the models table, the latest
//! events, and a status line. When the screen is short the events go first, then
//! devices beyond the host; when it is narrow the table drops its least useful columns
//! and the bars their text. Characters tell the bars' parts apart without colour
//! (`█` corral, `▓` other processes, `░` free), for terminals and logs without it.

use std::time::SystemTime;

use ratatui::Frame;
use ratatui::backend::TestBackend;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Cell, Clear, HighlightSpacing, Paragraph, Row as TableRow, Table, TableState, Wrap};

use super::model::{Bar, Row, State, clock};

/// What the status line shows when there is no news.
pub const HINTS: &str = "↑↓/j k select · u unload · ? help · q quit";

const HELP: &[&str] = &[
    "corralctl top: corrald's devices, models, queue and events",
    "",
    "↑ ↓ or k j   select a model",
    "u            unload the selected model",
    "?            show or hide this help",
    "q, Esc, ^C   quit",
    "",
    "Memory bars: █ corral's runners  ▓ other processes  ░ free",
    "GPU use by other processes is as found at corrald's start.",
];

/// A column of the models table: header, width, and when to drop it (higher goes first).
struct Column {
    header: &'static str,
    width: u16,
    drop_rank: u8,
    cell: fn(&Row) -> String,
}

const COLUMNS: &[Column] = &[
    Column { header: "STATE", width: 9, drop_rank: 0, cell: |r| r.state.clone() },
    Column { header: "PID", width: 7, drop_rank: 6, cell: |r| r.pid.clone() },
    Column { header: "WHERE", width: 9, drop_rank: 3, cell: |r| r.place.clone() },
    Column { header: "VRAM", width: 10, drop_rank: 2, cell: |r| r.vram.clone() },
    Column { header: "RAM", width: 10, drop_rank: 1, cell: |r| r.ram.clone() },
    Column { header: "TOK/S", width: 5, drop_rank: 2, cell: |r| r.speed.clone() },
    Column { header: "REQ", width: 3, drop_rank: 5, cell: |r| r.active.to_string() },
    Column { header: "UNLOADS", width: 10, drop_rank: 1, cell: |r| r.until.clone() },
];

/// The narrowest the name column gets before other columns are dropped.
const NAME_MIN: u16 = 12;

/// Draws the whole screen; `hints` shows the keys in an idle status line.
pub fn draw(frame: &mut Frame<'_>, state: &State, now: SystemTime, hints: bool) {
    let area = frame.area();
    let rows = state.rows(now);
    let bars = state.bars();
    let [header, body, status] =
        Layout::vertical([Constraint::Length(1), Constraint::Min(0), Constraint::Length(1)]).areas(area);
    frame.render_widget(
        Paragraph::new(Line::from(state.header()).style(Style::new().add_modifier(Modifier::BOLD))),
        header,
    );

    // Heights: devices first (host at least), the table at least its title, header and
    // two rows, events with what is left (at most half).
    let mut rest = body.height;
    let devices_h = u16::try_from(bars.len() + 1).unwrap_or(u16::MAX).min(rest.saturating_sub(4)).max(rest.min(2));
    rest -= devices_h;
    let table_need = u16::try_from(rows.len().max(1) + 2).unwrap_or(u16::MAX).max(4);
    let events_h = if state.events.is_empty() {
        0
    } else {
        let wanted = u16::try_from(state.events.len() + 1).unwrap_or(u16::MAX);
        wanted.min(rest.saturating_sub(table_need)).min(rest / 2)
    };
    let events_h = if events_h < 2 { 0 } else { events_h };
    let [devices, models, events] =
        Layout::vertical([Constraint::Length(devices_h), Constraint::Min(0), Constraint::Length(events_h)]).areas(body);

    draw_devices(frame, &bars, devices);
    draw_models(frame, &rows, models);
    draw_events(frame, state, events);
    let line = if !state.status.is_empty() {
        Line::from(state.status.as_str()).style(Style::new().add_modifier(Modifier::REVERSED))
    } else if hints {
        Line::from(HINTS).style(Style::new().fg(Color::DarkGray))
    } else {
        Line::default()
    };
    frame.render_widget(Paragraph::new(line), status);
    if state.help {
        draw_help(frame, area);
    }
}

fn title(text: &str, legend: &[(&str, Style)]) -> Line<'static> {
    let mut spans = vec![Span::styled(text.to_owned(), Style::new().add_modifier(Modifier::BOLD))];
    for (label, style) in legend {
        spans.push(Span::raw("  "));
        spans.push(Span::styled((*label).to_owned(), *style));
    }
    Line::from(spans)
}

fn corral_style() -> Style {
    Style::new().fg(Color::Green)
}

fn other_style() -> Style {
    Style::new().fg(Color::Yellow)
}

fn free_style() -> Style {
    Style::new().fg(Color::DarkGray)
}

fn draw_devices(frame: &mut Frame<'_>, bars: &[Bar], area: Rect) {
    if area.height == 0 {
        return;
    }
    let mut lines =
        vec![title("MEMORY", &[("█ corral", corral_style()), ("▓ other", other_style()), ("░ free", free_style())])];
    for bar in bars.iter().take(usize::from(area.height - 1)) {
        lines.push(bar_line(bar, area.width));
    }
    frame.render_widget(Paragraph::new(lines), area);
}

/// `label  [bar]  summary (detail)`, the text shortened to leave the bar room.
fn bar_line(bar: &Bar, width: u16) -> Line<'static> {
    const LABEL: usize = 8;
    let label: String = bar.label.chars().take(LABEL).collect();
    let full = bar.summary();
    let short = format!("free {}", crate::ctl::output::size(bar.free));
    // The full text only beside a bar of thirty cells; the short one beside ten.
    let room = |bar: usize| usize::from(width).saturating_sub(LABEL + 1 + bar + 1);
    let mut text = if full.chars().count() <= room(30) {
        full
    } else if short.chars().count() <= room(10) {
        short
    } else {
        String::new()
    };
    // On wide screens, what the device is; the bar keeps at least half the width.
    let detail = format!("  {}", bar.detail);
    if usize::from(width) >= 2 * (LABEL + 1 + text.chars().count() + detail.chars().count()) {
        text.push_str(&detail);
    }
    let used = LABEL + 1 + text.chars().count() + usize::from(!text.is_empty());
    let bar_w = u16::try_from(usize::from(width).saturating_sub(used)).unwrap_or(0);
    let (c, o, f) = bar.cells(bar_w);
    let cells = |n: u16, ch: &str| ch.repeat(usize::from(n));
    let mut spans = vec![
        Span::raw(format!("{label:<LABEL$} ")),
        Span::styled(cells(c, "█"), corral_style()),
        Span::styled(cells(o, "▓"), other_style()),
        Span::styled(cells(f, "░"), free_style()),
    ];
    if !text.is_empty() {
        spans.push(Span::raw(format!(" {text}")));
    }
    Line::from(spans)
}

/// The columns that fit `width` beside a name of at least [`NAME_MIN`].
fn columns_for(width: u16) -> Vec<&'static Column> {
    let mut kept: Vec<&Column> = COLUMNS.iter().collect();
    // The highlight symbol takes two cells; each column one more for spacing.
    let needed = |cols: &[&Column]| cols.iter().map(|c| c.width + 1).sum::<u16>() + 2 + NAME_MIN;
    while needed(&kept) > width {
        let Some(worst) = kept.iter().enumerate().max_by_key(|(_, c)| c.drop_rank).map(|(i, _)| i) else { break };
        if kept[worst].drop_rank == 0 {
            break;
        }
        kept.remove(worst);
    }
    kept
}

fn draw_models(frame: &mut Frame<'_>, rows: &[Row], area: Rect) {
    if area.height == 0 {
        return;
    }
    let [heading, table_area] = Layout::vertical([Constraint::Length(1), Constraint::Min(0)]).areas(area);
    frame.render_widget(Paragraph::new(title("MODELS", &[])), heading);
    if rows.is_empty() {
        let none = Paragraph::new("  no model is loaded").style(Style::new().fg(Color::DarkGray));
        frame.render_widget(none, table_area);
        return;
    }
    let columns = columns_for(area.width);
    let mut widths = vec![Constraint::Min(NAME_MIN)];
    widths.extend(columns.iter().map(|c| Constraint::Length(c.width)));
    let header = TableRow::new(std::iter::once("NAME").chain(columns.iter().map(|c| c.header)))
        .style(Style::new().add_modifier(Modifier::BOLD));
    let body = rows.iter().map(|row| {
        let style = match row.state.as_str() {
            "failed" => Style::new().fg(Color::Red),
            "loading" | "unloading" => Style::new().fg(Color::Yellow),
            _ => Style::new(),
        };
        let cells =
            std::iter::once(Cell::from(row.name.clone())).chain(columns.iter().map(|c| Cell::from((c.cell)(row))));
        TableRow::new(cells).style(style)
    });
    let table = Table::new(body, widths)
        .header(header)
        .column_spacing(1)
        .row_highlight_style(Style::new().add_modifier(Modifier::REVERSED))
        .highlight_symbol("> ")
        .highlight_spacing(HighlightSpacing::Always);
    let mut selection = TableState::default().with_selected(rows.iter().position(|r| r.selected));
    frame.render_stateful_widget(table, table_area, &mut selection);
}

fn draw_events(frame: &mut Frame<'_>, state: &State, area: Rect) {
    if area.height == 0 {
        return;
    }
    let mut lines = vec![title("EVENTS (UTC)", &[])];
    for event in state.events.iter().take(usize::from(area.height - 1)) {
        let style = if event.bad { Style::new().fg(Color::Red) } else { Style::new() };
        lines.push(Line::from(vec![
            Span::styled(clock(event.at), Style::new().fg(Color::DarkGray)),
            Span::raw(" "),
            Span::styled(event.text.clone(), style),
        ]));
    }
    frame.render_widget(Paragraph::new(lines), area);
}

fn draw_help(frame: &mut Frame<'_>, area: Rect) {
    let width = u16::try_from(HELP.iter().map(|l| l.chars().count()).max().unwrap_or(0) + 4).unwrap_or(u16::MAX);
    let height = u16::try_from(HELP.len() + 2).unwrap_or(u16::MAX);
    let width = width.min(area.width);
    let height = height.min(area.height);
    let popup = Rect { x: area.x + (area.width - width) / 2, y: area.y + (area.height - height) / 2, width, height };
    let block = ratatui::widgets::Block::bordered().title(" help: any key closes ");
    let text: Vec<Line<'_>> = HELP.iter().map(|l| Line::from(*l)).collect();
    frame.render_widget(Clear, popup);
    frame.render_widget(Paragraph::new(text).block(block).wrap(Wrap { trim: false }), popup);
}

/// The screen as plain text, `width` wide and as tall as it needs (at least 24 lines'
/// worth of room), for `--once`: trailing blanks trimmed, one line each.
#[must_use]
pub fn text(state: &State, now: SystemTime, width: u16) -> String {
    let needed = 2 + 1 + state.bars().len() + 3 + state.rows(now).len().max(1) + 1 + state.events.len().min(10);
    let height = u16::try_from(needed * 2).unwrap_or(u16::MAX).max(24);
    let mut terminal = ratatui::Terminal::new(TestBackend::new(width, height)).expect("a test backend never fails");
    terminal.draw(|frame| draw(frame, state, now, false)).expect("a test backend never fails");
    let buffer = terminal.backend().buffer();
    let mut lines: Vec<String> = (0..height)
        .map(|y| {
            let line: String = (0..width).map(|x| buffer[(x, y)].symbol()).collect();
            line.trim_end().to_owned()
        })
        .collect();
    // The height was generous; the blank middle and end go.
    lines.dedup_by(|a, b| a.is_empty() && b.is_empty());
    while lines.last().is_some_and(String::is_empty) {
        lines.pop();
    }
    lines.join("\n") + "\n"
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    use ratatui::Terminal;
    use ratatui::backend::TestBackend;

    use super::super::model::tests::sample;
    use super::super::model::{ModelProp, State, Update};
    use super::draw;

    fn now() -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(1_000)
    }

    fn screen(state: &State, width: u16, height: u16) -> Vec<String> {
        let mut terminal = Terminal::new(TestBackend::new(width, height)).expect("backend");
        terminal.draw(|f| draw(f, state, now(), true)).expect("draw");
        let buffer = terminal.backend().buffer();
        (0..height).map(|y| (0..width).map(|x| buffer[(x, y)].symbol()).collect::<String>()).collect()
    }

    fn find<'a>(lines: &'a [String], start: &str) -> &'a str {
        lines
            .iter()
            .find(|l| l.starts_with(start))
            .unwrap_or_else(|| panic!("no line starts {start:?}:\n{}", lines.join("\n")))
    }

    #[test]
    fn at_80x24_everything_fits() {
        let lines = screen(&sample(), 80, 24);
        let all = lines.join("\n");
        assert_eq!(lines[0].trim_end(), "corrald 0.1.0 · 3 of 3 loaded · queue 2 of 512", "{all}");
        assert!(lines[1].starts_with("MEMORY  █ corral  ▓ other  ░ free"), "{all}");
        let host = find(&lines, "host ");
        assert!(host.trim_end().ends_with(" free 20.0 GiB"), "{all}");
        assert!(host.chars().filter(|c| "█▓░".contains(*c)).count() >= 50, "the bar takes the room: {all}");
        assert!(host.contains('█') && host.contains('▓') && host.contains('░'), "{all}");
        assert!(find(&lines, "GPU-0 ").contains("free 15.0 GiB"), "{all}");
        assert!(find(&lines, "GPU-1 ").contains("free 3.0 GiB"), "{all}");
        let header = find(&lines, "  NAME");
        // At 80 columns the pid goes first (`corralctl ps` has it), the speed stays.
        for column in ["STATE", "WHERE", "VRAM", "RAM", "TOK/S", "REQ", "UNLOADS"] {
            assert!(header.contains(column), "{column} missing at 80 columns:\n{all}");
        }
        assert!(!header.contains("PID"), "{all}");
        assert!(find(&lines, "  big:q4").contains("loading"), "{all}");
        let tiny = find(&lines, "> tiny:latest");
        for cell in ["ready", "GPU 5/5", "6.0 GiB", "1.0 GiB", "12.5", " 1 ", "in 4m 59s"] {
            assert!(tiny.contains(cell), "{cell:?} missing from {tiny:?}:\n{all}");
        }
        assert!(lines.iter().any(|l| l.starts_with("EVENTS (UTC)")), "{all}");
        assert!(find(&lines, "00:16:40 ").contains("loaded tiny:latest (pid 4242)"), "{all}");
        assert!(lines[23].starts_with(super::HINTS), "{all}");
        assert!(lines.iter().all(|l| l.chars().count() == 80));
        assert!(!all.contains("idle:latest"), "stopped models are not listed:\n{all}");
    }

    #[test]
    fn a_large_terminal_shows_more_and_a_tiny_one_keeps_the_essentials() {
        let mut state = sample();
        for i in 0..30 {
            state.apply(
                Update::Model {
                    path: format!("/m/n{i:02}"),
                    props: vec![ModelProp::ShortName(format!("n{i:02}")), ModelProp::State("ready".into())],
                },
                now(),
            );
        }
        let big = screen(&state, 200, 60);
        let all = big.join("\n");
        let gpu = find(&big, "GPU-0 ");
        assert!(gpu.contains("corral 5.0 GiB · other 4.0 GiB · free 15.0 GiB of 24.0 GiB"), "{all}");
        assert!(gpu.contains("Big (cuda)"), "the device's name on a wide screen:\n{all}");
        assert!(all.contains("n29") && all.contains("tiny:latest"), "every row on a tall screen:\n{all}");
        assert!(all.contains("EVENTS (UTC)"), "{all}");

        let small = screen(&state, 60, 12);
        let all = small.join("\n");
        let header = find(&small, "  NAME");
        assert!(header.contains("STATE") && !header.contains("PID"), "narrow: the least useful columns go:\n{all}");
        assert!(find(&small, "host ").contains("free 20.0 GiB"), "{all}");
        assert!(find(&small, "> tiny:latest").contains("ready"), "the selection stays visible:\n{all}");
        assert!(!all.contains("EVENTS"), "short: events go first:\n{all}");
        assert!(small[11].starts_with("↑↓/j k select"), "{all}");

        let tiny = screen(&state, 20, 5);
        assert!(tiny.join("\n").contains("corrald"), "no panic, and still a header");
    }

    #[test]
    fn the_status_line_and_help_overlay_show() {
        let mut state = sample();
        state.status = "permission denied: unloading needs group corral".into();
        state.help = true;
        let lines = screen(&state, 80, 24);
        let all = lines.join("\n");
        assert!(lines[23].starts_with("permission denied: unloading needs group corral"), "{all}");
        assert!(all.contains("u            unload the selected model"), "{all}");
        assert!(all.contains("help: any key closes"), "{all}");
    }

    #[test]
    fn an_empty_daemon_says_so_and_the_snapshot_text_has_no_trailing_blanks() {
        let text = super::text(&State::default(), now(), 80);
        assert!(text.contains("no model is loaded"), "{text}");
        assert!(text.lines().all(|l| l == l.trim_end()), "{text:?}");
        assert!(!text.contains(super::HINTS), "no key hints in a snapshot: {text}");
        let full = super::text(&sample(), now(), 80);
        assert!(full.contains("tiny:latest") && full.contains("EVENTS (UTC)") && full.contains("GPU-1"), "{full}");
    }
}
