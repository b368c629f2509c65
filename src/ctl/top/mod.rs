//! `corralctl top`: a live full-screen view of corrald (devices, loaded models, the
//! queue, the latest events), driven by D-Bus signals, with a refresh each second for
//! the counters corrald does not signal.
//!
//! - [`model`]: the view model, pure (updates in, rows and bars out);
//! - [`view`]: drawing it with ratatui, on any size;
//! - [`bus`]: the D-Bus subscription, reads and Unload.
//!
//! It needs a terminal on standard input and output; without one it refuses (exit 1)
//! and points at `--once`, which prints one snapshot as text (or JSON with `--json`) and
//! works anywhere.

pub mod bus;
pub mod model;
pub mod view;

use std::io::IsTerminal as _;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use ratatui::crossterm::event::{self, Event, KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use serde::Serialize;
use tokio::sync::mpsc;

use self::bus::Signals;
use self::model::{State, Update};
use super::bus::Bus;
use super::error::CtlError;
use super::output::{print, print_json};

/// How often the unsignalled counters (queue, requests, expiry) and host memory are read.
const REFRESH: Duration = Duration::from_secs(1);

/// Where host memory is read (`meminfo`): the daemon is on this machine, D-Bus being local.
const PROC: &str = "/proc";

/// `top`'s options.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Print one snapshot and exit.
    pub once: bool,
    /// The snapshot as JSON.
    pub json: bool,
    /// Which bus.
    pub bus: crate::ctl::bus::Choice,
}

/// Runs `top`.
pub async fn run(options: Options) -> Result<(), CtlError> {
    let terminal = std::io::stdout().is_terminal() && std::io::stdin().is_terminal();
    if !options.once && !terminal {
        return Err(CtlError::Invalid(
            "corralctl top needs a terminal on standard input and output; \
             for one snapshot as text use `corralctl top --once` (or `corralctl --json top --once`)"
                .to_owned(),
        ));
    }
    // Reading only: `top` never starts a stopped corrald.
    let bus = Bus::connect(options.bus, crate::ctl::bus::Access::Read).await?;
    // Subscribed before the first read, so no change falls between them.
    let mut signals = Signals::subscribe(&bus).await?;
    let mut state = State::default();
    let now = SystemTime::now();
    for update in bus::snapshot(&bus).await? {
        state.apply(update, now);
    }
    read_host(&mut state, now);
    if options.once {
        return snapshot(&state, options.json, now);
    }
    let mut screen = ratatui::try_init().map_err(|source| {
        // Whatever part of the set-up happened is undone.
        let _ = ratatui::try_restore();
        io("cannot set up the terminal", source)
    })?;
    let result = interact(&mut screen, &bus, &mut signals, state).await;
    let shown = screen.show_cursor();
    drop(screen);
    let restored = ratatui::try_restore();
    result?;
    shown.and(restored).map_err(|source| io("cannot restore the terminal", source))
}

fn io(what: &str, source: std::io::Error) -> CtlError {
    CtlError::Io { what: what.to_owned(), source }
}

fn read_host(state: &mut State, now: SystemTime) {
    // Without /proc (a container), the bar shows corral's share alone.
    if let Ok(host) = crate::gpu::host::read(Path::new(PROC)) {
        state.apply(Update::Host(host), now);
    }
}

/// `--once`: the screen as text, or the view model as JSON.
fn snapshot(state: &State, json: bool, now: SystemTime) -> Result<(), CtlError> {
    if json {
        #[derive(Serialize)]
        struct Snapshot<'a> {
            version: &'a str,
            queue_depth: u32,
            max_queue: u32,
            max_loaded_models: u32,
            devices: Vec<model::Bar>,
            models: Vec<model::Row>,
            events: &'a std::collections::VecDeque<model::Event>,
        }
        return print_json(&Snapshot {
            version: &state.version,
            queue_depth: state.queue_depth,
            max_queue: state.max_queue,
            max_loaded_models: state.max_loaded_models,
            devices: state.bars(),
            models: state.rows(now),
            events: &state.events,
        });
    }
    print(&view::text(state, now, 80))
}

/// What the loop waits for besides signals.
enum Input {
    Key(KeyEvent),
    Resize,
    Unloaded(String, Result<(), CtlError>),
}

/// Reads the terminal's events on a thread of its own (crossterm's reads block), until
/// `stop` is set.
fn read_terminal(tx: mpsc::UnboundedSender<Input>, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            // A bounded wait, so that `stop` is seen.
            match event::poll(Duration::from_millis(100)) {
                Ok(false) => {}
                Ok(true) => {
                    let input = match event::read() {
                        Ok(Event::Key(key)) if key.kind != KeyEventKind::Release => Input::Key(key),
                        Ok(Event::Resize(..)) => Input::Resize,
                        Ok(_) => continue,
                        Err(_) => break,
                    };
                    if tx.send(input).is_err() {
                        break;
                    }
                }
                Err(_) => break,
            }
        }
    })
}

async fn interact(
    screen: &mut ratatui::DefaultTerminal,
    bus: &Bus,
    signals: &mut Signals,
    mut state: State,
) -> Result<(), CtlError> {
    let (tx, mut inputs) = mpsc::unbounded_channel();
    let stop = Arc::new(AtomicBool::new(false));
    let reader = read_terminal(tx.clone(), Arc::clone(&stop));
    let mut tick = tokio::time::interval(REFRESH);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Raw mode turns Ctrl-C into a key; a SIGINT or SIGTERM sent from elsewhere ends
    // `top` the same way, with the terminal restored.
    let watch = |kind| tokio::signal::unix::signal(kind).map_err(|source| io("cannot watch for signals", source));
    let mut terminate = watch(tokio::signal::unix::SignalKind::terminate())?;
    let mut interrupt = watch(tokio::signal::unix::SignalKind::interrupt())?;
    let mut lost = false;
    let result = loop {
        let draw = screen.draw(|frame| view::draw(frame, &state, SystemTime::now(), true));
        if let Err(source) = draw {
            break Err(io("cannot draw", source));
        }
        tokio::select! {
            updates = signals.next() => {
                let Some(updates) = updates else {
                    break Err(CtlError::Bus("the connection to the bus closed".to_owned()));
                };
                let now = SystemTime::now();
                for update in updates {
                    state.apply(update, now);
                }
            }
            _ = tick.tick() => {
                let now = SystemTime::now();
                // After corrald was out of reach, everything is read again: a restarted
                // corrald does not say that its old objects went away.
                let read = if lost { bus::snapshot(bus).await } else { bus::refresh(bus, state.live_paths()).await };
                match read {
                    Ok(updates) => {
                        if lost {
                            state.status.clear();
                        }
                        lost = false;
                        for update in updates {
                            state.apply(update, now);
                        }
                    }
                    Err(e) => {
                        lost = true;
                        state.status = format!("cannot read corrald: {e}");
                    }
                }
                read_host(&mut state, now);
            }
            input = inputs.recv() => match input {
                None => break Ok(()),
                Some(Input::Resize) => {}
                Some(Input::Unloaded(name, outcome)) => {
                    state.status = match outcome {
                        Ok(()) => format!("unloaded {name}"),
                        Err(e) => e.to_string(),
                    };
                }
                Some(Input::Key(key)) => {
                    if key_pressed(key, &mut state, bus, &tx) {
                        break Ok(());
                    }
                }
            },
            _ = terminate.recv() => break Ok(()),
            _ = interrupt.recv() => break Ok(()),
        }
    };
    stop.store(true, Ordering::Relaxed);
    let _ = reader.join();
    result
}

/// Acts on a key; true to quit.
fn key_pressed(key: KeyEvent, state: &mut State, bus: &Bus, tx: &mpsc::UnboundedSender<Input>) -> bool {
    let ctrl_c = key.modifiers.contains(KeyModifiers::CONTROL) && key.code == KeyCode::Char('c');
    if ctrl_c || matches!(key.code, KeyCode::Char('q') | KeyCode::Esc) && !state.help {
        return true;
    }
    // The last outcome stays until the next key.
    state.status.clear();
    if state.help {
        // Any key closes the help (Esc and q too, without quitting).
        state.help = false;
        return false;
    }
    match key.code {
        KeyCode::Char('?') | KeyCode::F(1) => state.help = true,
        KeyCode::Down | KeyCode::Char('j') => state.move_selection(true),
        KeyCode::Up | KeyCode::Char('k') => state.move_selection(false),
        KeyCode::Char('u') => match state.selected_name() {
            None => "no model selected".clone_into(&mut state.status),
            Some(name) => {
                let short =
                    state.rows(SystemTime::now()).into_iter().find(|r| r.selected).map_or(name.clone(), |r| r.name);
                state.status = format!("unloading {short}…");
                let (bus, tx) = (bus.clone(), tx.clone());
                // In a task: the screen keeps moving while the runner stops.
                tokio::spawn(async move {
                    let outcome = bus::unload(&bus, &name).await;
                    let _ = tx.send(Input::Unloaded(short, outcome));
                });
            }
        },
        _ => {}
    }
    false
}
