//! Fixtures for the integration tests. Each one tears down what it started in `Drop`.

#![allow(dead_code, reason = "each test module uses only part of the fixtures")]

pub mod api;
pub mod bus;
pub mod container;
pub mod corrald;
pub mod dbus;
pub mod http;
pub mod journald;
pub mod llama;
pub mod netns;
pub mod notify;
pub mod registry;
pub mod rpc_process;
pub mod setup;
