//! `GET /metrics`: the scheduler's state and counters in Prometheus' text format.
//!
//! Names start with `corral_`; per-runner series carry `model`, `state` and `runner`
//! labels. The runner's id keeps each series unique: a model can have two runners at
//! once (one draining beside its replacement after its load options changed, or two
//! load-option variants), and a scrape must never show one series twice.  Per-device
//! series (`corral_device_memory_bytes`) carry the device's stable id, unique in the
//! inventory, with its kind and `state` (total, usable, used).

use std::fmt::Write as _;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::state::AppState;
use crate::scheduler::device_use::{self, DeviceUse};
use crate::scheduler::types::Stats;

/// The handler.
pub async fn metrics(State(app): State<AppState>) -> Result<Response, ApiError> {
    let snapshot = app.scheduler.stats().await.map_err(|e| super::error::scheduler_view(&e, "/metrics"))?;
    let mut text = render(&snapshot);
    let fleet = app.fleet.now();
    text.push_str(&render_devices(&device_use::usage(&fleet.inventory, &snapshot.loaded)));
    text.push_str(&render_workers(&fleet.workers));
    let (prompt, generated) = app.tokens.totals();
    let _ = writeln!(
        text,
        "# HELP corral_prompt_tokens_total Prompt tokens processed for /api/chat, /api/generate and /v1/*.\n\
         # TYPE corral_prompt_tokens_total counter\ncorral_prompt_tokens_total {prompt}\n\
         # HELP corral_generated_tokens_total Tokens generated for /api/chat, /api/generate and /v1/*.\n\
         # TYPE corral_generated_tokens_total counter\ncorral_generated_tokens_total {generated}"
    );
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response())
}

/// The text exposition of `stats`.
#[must_use]
pub fn render(stats: &Stats) -> String {
    let mut out = String::new();
    let c = &stats.counters;
    let mut metric = |name: &str, kind: &str, help: &str, value: u64| {
        let _ = writeln!(out, "# HELP corral_{name} {help}\n# TYPE corral_{name} {kind}\ncorral_{name} {value}");
    };
    metric("queue_depth", "gauge", "Requests waiting for a model to load.", stats.queue_depth as u64);
    metric("loads_total", "counter", "Model loads started.", c.loads);
    metric("load_failures_total", "counter", "Model loads that failed.", c.load_failures);
    metric("unloads_total", "counter", "Runners stopped.", c.unloads);
    metric("evictions_total", "counter", "Runners chosen to make room for another model.", c.evictions);
    metric("crashes_total", "counter", "Runners that died on their own.", c.crashes);
    metric("requests_total", "counter", "Requests given a runner.", c.leases);
    metric("requests_refused_total", "counter", "Requests refused because the queue was full.", c.queue_full);
    let _ = writeln!(
        out,
        "# HELP corral_load_seconds_total Time spent in successful loads.\n# TYPE corral_load_seconds_total counter\ncorral_load_seconds_total {}.{:03}",
        c.load_millis / 1000,
        c.load_millis % 1000
    );
    let _ = writeln!(out, "# HELP corral_loaded_models Runners, by state.\n# TYPE corral_loaded_models gauge");
    for state in ["loading", "ready", "unloading"] {
        let n = stats.loaded.iter().filter(|m| m.state == state).count();
        let _ = writeln!(out, "corral_loaded_models{{state=\"{state}\"}} {n}");
    }
    let series = [
        ("runner_vram_bytes", "GPU memory a runner uses (measured once loaded)."),
        ("runner_ram_bytes", "Host memory a runner uses besides (measured once loaded)."),
        ("runner_active_requests", "Requests holding a runner."),
    ];
    for (name, help) in series {
        let _ = writeln!(out, "# HELP corral_{name} {help}\n# TYPE corral_{name} gauge");
        for m in &stats.loaded {
            let value = match name {
                "runner_vram_bytes" => m.footprint.vram,
                "runner_ram_bytes" => m.footprint.ram,
                _ => u64::from(m.leases),
            };
            let _ = writeln!(
                out,
                "corral_{name}{{model=\"{}\",state=\"{}\",runner=\"{}\"}} {value}",
                escape(&m.name),
                m.state,
                m.id
            );
        }
    }
    // What each load planned on each device next to what llama.cpp allocated there.
    let _ = writeln!(
        out,
        "# HELP corral_runner_device_memory_bytes A runner's memory on each device and the host: planned before \
         the load, actual as llama.cpp reported it.\n# TYPE corral_runner_device_memory_bytes gauge"
    );
    for m in &stats.loaded {
        for d in &m.devices {
            let figures = d.planned.map(|p| ("planned", p)).into_iter().chain([("actual", d.actual)]);
            for (kind, value) in figures {
                let _ = writeln!(
                    out,
                    "corral_runner_device_memory_bytes{{model=\"{}\",runner=\"{}\",device=\"{}\",kind=\"{kind}\"}} {value}",
                    escape(&m.name),
                    m.id,
                    escape(&d.device),
                );
            }
        }
    }
    out
}

/// The per-device series of `devices`.
#[must_use]
pub fn render_devices(devices: &[DeviceUse]) -> String {
    let mut out = String::from(
        "# HELP corral_device_memory_bytes Memory of each device and the host: total, usable by corral, used by \
         corral's runners.\n# TYPE corral_device_memory_bytes gauge\n",
    );
    for d in devices {
        for (state, value) in [("total", d.total_bytes), ("usable", d.usable_bytes), ("used", d.used_bytes)] {
            let _ = writeln!(
                out,
                "corral_device_memory_bytes{{device=\"{}\",kind=\"{}\",state=\"{state}\"}} {value}",
                escape(&d.name),
                d.kind
            );
        }
    }
    out
}

/// Each worker's health: up (1) or down (0), and the last check's connection time.
#[must_use]
pub fn render_workers(workers: &[crate::workers::WorkerStatus]) -> String {
    if workers.is_empty() {
        return String::new();
    }
    let mut out = String::from(
        "# HELP corral_worker_up Whether each RPC worker is up (its devices in use).\n# TYPE corral_worker_up gauge\n",
    );
    for w in workers {
        let _ = writeln!(
            out,
            "corral_worker_up{{worker=\"{}\",address=\"{}\"}} {}",
            escape(&w.name),
            escape(&w.address),
            u8::from(w.up)
        );
    }
    out.push_str(
        "# HELP corral_worker_rtt_seconds The last health check's connection time to each RPC worker.\n\
         # TYPE corral_worker_rtt_seconds gauge\n",
    );
    for w in workers.iter().filter(|w| w.rtt.is_some()) {
        let rtt = w.rtt.unwrap_or_default().as_secs_f64();
        let _ = writeln!(out, "corral_worker_rtt_seconds{{worker=\"{}\"}} {rtt:.6}", escape(&w.name));
    }
    out.push_str(
        "# HELP corral_worker_checks_total Health checks of each RPC worker.\n# TYPE corral_worker_checks_total counter\n",
    );
    for w in workers {
        let _ = writeln!(out, "corral_worker_checks_total{{worker=\"{}\"}} {}", escape(&w.name), w.checks);
    }
    out
}

/// A label value with `\`, `"` and newlines escaped, as the format requires.
fn escape(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{DeviceUse, escape, render, render_devices, render_workers};
    use crate::scheduler::keep_alive::KeepAlive;
    use crate::scheduler::policy::{Footprint, Placement};
    use crate::scheduler::types::{Counters, LoadedModel, Stats};

    #[test]
    fn the_text_format_has_every_series() {
        let stats = Stats {
            counters: Counters {
                loads: 3,
                load_failures: 1,
                load_millis: 2500,
                unloads: 2,
                evictions: 1,
                crashes: 1,
                leases: 7,
                queue_full: 4,
            },
            queue_depth: 5,
            loaded: vec![LoadedModel {
                devices: Vec::new(),
                id: 1,
                name: "tiny:latest".into(),
                names: vec!["tiny:latest".into()],
                key: crate::scheduler::key::RunnerKey::new(
                    crate::scheduler::key::Weights::of(crate::store::digest::Digest::of(b"tiny")),
                    &crate::supervisor::command::LoadOptions::default(),
                ),
                state: "ready",
                placement: Placement::Cpu,
                footprint: Footprint { vram: 0, ram: 5_000_000 },
                leases: 2,
                expires_at: None,
                keep_alive: KeepAlive::For(Duration::from_secs(300)),
                pid: Some(42),
                context_length: 2048,
                offload: None,
            }],
        };
        let text = render(&stats);
        for line in [
            "corral_queue_depth 5",
            "corral_loads_total 3",
            "corral_load_failures_total 1",
            "corral_load_seconds_total 2.500",
            "corral_unloads_total 2",
            "corral_evictions_total 1",
            "corral_crashes_total 1",
            "corral_requests_total 7",
            "corral_requests_refused_total 4",
            "corral_loaded_models{state=\"ready\"} 1",
            "corral_loaded_models{state=\"loading\"} 0",
            "corral_runner_ram_bytes{model=\"tiny:latest\",state=\"ready\",runner=\"1\"} 5000000",
            "corral_runner_active_requests{model=\"tiny:latest\",state=\"ready\",runner=\"1\"} 2",
            "# TYPE corral_loads_total counter",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }

    #[test]
    fn each_device_has_three_unique_series() {
        let device = |kind, name: &str, used| DeviceUse {
            kind,
            name: name.into(),
            description: String::new(),
            total_bytes: 100,
            usable_bytes: 90,
            used_bytes: used,
        };
        let text = render_devices(&[device("rpc", "rpc:h:1#0", 7), device("host", "host", 3)]);
        for line in [
            "# TYPE corral_device_memory_bytes gauge",
            "corral_device_memory_bytes{device=\"rpc:h:1#0\",kind=\"rpc\",state=\"total\"} 100",
            "corral_device_memory_bytes{device=\"rpc:h:1#0\",kind=\"rpc\",state=\"usable\"} 90",
            "corral_device_memory_bytes{device=\"rpc:h:1#0\",kind=\"rpc\",state=\"used\"} 7",
            "corral_device_memory_bytes{device=\"host\",kind=\"host\",state=\"used\"} 3",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
        let series: Vec<&str> =
            text.lines().filter(|l| !l.starts_with('#')).map(|l| l.rsplit_once(' ').expect("value").0).collect();
        let unique: std::collections::BTreeSet<&&str> = series.iter().collect();
        assert_eq!((series.len(), unique.len()), (6, 6), "{text}");
    }

    #[test]
    fn workers_are_up_or_down_with_their_round_trip() {
        assert_eq!(render_workers(&[]), "", "no workers, no series");
        let worker = |name: &str, up: bool, rtt: Option<Duration>| crate::workers::WorkerStatus {
            name: name.into(),
            address: "10.0.0.2:50052".into(),
            up,
            devices: Vec::new(),
            last_error: String::new(),
            rtt,
            since: std::time::UNIX_EPOCH,
            checks: 7,
        };
        let text = render_workers(&[worker("a\"b", true, Some(Duration::from_micros(250))), worker("c", false, None)]);
        assert!(text.contains("corral_worker_up{worker=\"a\\\"b\",address=\"10.0.0.2:50052\"} 1\n"), "{text}");
        assert!(text.contains("corral_worker_up{worker=\"c\",address=\"10.0.0.2:50052\"} 0\n"), "{text}");
        assert!(text.contains("corral_worker_rtt_seconds{worker=\"a\\\"b\"} 0.000250\n"), "{text}");
        assert!(!text.contains("corral_worker_rtt_seconds{worker=\"c\"}"), "no check answered: no rtt");
        assert!(text.contains("corral_worker_checks_total{worker=\"c\"} 7\n"), "{text}");
    }
}
