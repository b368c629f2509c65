//! corral's integration tests: one binary, real parts, really started.
//!
//! Each `support` module wraps one real piece (a notify listener, llama-server,
//! journald, a private D-Bus, systemd as PID 1) with a teardown that always runs.

mod support;

mod admin_habits;

mod check_config;
mod clients;
mod containment;
mod ctl;
mod dbus_access;
mod dbus_api;
mod dbus_bounds;
mod dbus_contract;
mod dbus_jobs;
mod devices;
mod edge_habits;
mod exact_fit;
mod fake_runner;
mod faults;
mod http_api;
mod http_generate;
mod http_openai;
mod http_store;
mod journald;
mod llama_server;
mod load_failures;
mod models_habits;
mod packages;
mod private_bus;
mod projection;
mod projection_cache;
mod registry;
mod rig_devices;
mod scheduling;
mod security_http;
mod security_store_content;
mod security_store_fs;
mod security_template;
mod shipped;
mod socket_activation;
mod supervision;
mod systemd_container;
mod term_habits;
mod top_habits;
mod worker_unit;
mod workers_netns;
