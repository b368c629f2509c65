//! `corralctl top`'s D-Bus side: one subscription to every signal under corrald's root
//! path (PropertiesChanged, InterfacesAdded/Removed, the Manager's own signals), taken
//! before the first read so no change falls between; the first read (the Manager's
//! properties, `GetManagedObjects`, and the loaded models' counters); the counters
//! corrald does not signal (`QueueDepth`, `ActiveRequests`, `ExpiresAt`,
//! `TokensPerSecond`) read again on each refresh; and Unload.
//! Everything read is decoded into the view model's [`Update`]s.

use std::collections::HashMap;

use futures_util::StreamExt as _;
use zbus::MessageStream;
use zbus::message::{Message, Type};
use zbus::zvariant::{OwnedObjectPath, OwnedValue};

use super::model::{Gpu, ManagerProp, ModelProp, Signal, Update};
use crate::ctl::bus::{Bus, OrBus};
use crate::ctl::error::CtlError;

const SERVICE: &str = "org.corral.Corral1";
const ROOT: &str = "/org/corral/Corral1";
const MANAGER: &str = "org.corral.Corral1.Manager";
const MODEL: &str = "org.corral.Corral1.Model";

/// The model properties `top` shows that are not signalled (explicit properties, read
/// with `Get` at the first read and on each refresh).
const COUNTERS: [&str; 3] = ["ExpiresAt", "ActiveRequests", "TokensPerSecond"];

/// Signals are queued here while the screen is drawn; beyond this, the oldest are lost
/// and the next refresh catches up.
const QUEUED: usize = 1024;

/// The signals of corrald's objects, from now on.
pub struct Signals {
    stream: MessageStream,
}

impl Signals {
    /// Subscribes (call it before [`snapshot`]).
    pub async fn subscribe(bus: &Bus) -> Result<Self, CtlError> {
        let rule = zbus::MatchRule::builder().msg_type(Type::Signal).path_namespace(ROOT).or_bus(bus)?.build();
        let stream = MessageStream::for_match_rule(rule, bus.connection(), Some(QUEUED)).await.or_bus(bus)?;
        Ok(Self { stream })
    }

    /// The next signal's updates; `None` when the connection closed.
    pub async fn next(&mut self) -> Option<Vec<Update>> {
        loop {
            match self.stream.next().await? {
                Ok(message) => return Some(decode(&message)),
                Err(e) => tracing::debug!(error = %e, "unreadable D-Bus message"),
            }
        }
    }
}

/// Everything there is to know now: the Manager's properties and every model object's,
/// after a [`Update::Reset`].
pub async fn snapshot(bus: &Bus) -> Result<Vec<Update>, CtlError> {
    let mut updates = vec![Update::Reset, manager_props(bus, true).await?];
    let objects = zbus::fdo::ObjectManagerProxy::builder(bus.connection())
        .destination(SERVICE)
        .and_then(|b| b.path(ROOT))
        .or_bus(bus)?
        .build()
        .await
        .or_bus(bus)?;
    let mut live = Vec::new();
    for (path, interfaces) in objects.get_managed_objects().await.map_err(zbus::Error::from).or_bus(bus)? {
        if let Some(props) = interfaces.iter().find(|(name, _)| name.as_str() == MODEL).map(|(_, p)| p) {
            let state = props.get("State").and_then(|s| s.downcast_ref::<&str>().ok());
            if matches!(state, Some("loading" | "ready" | "unloading")) {
                live.push(path.to_string());
            }
            updates.push(Update::Model { path: path.to_string(), props: model_props(props) });
        }
    }
    updates.extend(counters(bus, live).await?);
    Ok(updates)
}

/// The Manager's properties: all of them `first`, else the unsignalled `QueueDepth`.
async fn manager_props(bus: &Bus, first: bool) -> Result<Update, CtlError> {
    let manager = bus.manager().await?;
    let mut props = vec![ManagerProp::QueueDepth(manager.queue_depth().await.or_bus(bus)?)];
    if first {
        let gpus = manager.gpus().await.or_bus(bus)?;
        props.extend([
            ManagerProp::Version(manager.version().await.or_bus(bus)?),
            ManagerProp::Gpus(
                gpus.into_iter()
                    .map(|(id, name, driver, total, usable)| Gpu { id, name, driver, total, usable })
                    .collect(),
            ),
            ManagerProp::HostMemory(manager.host_memory().await.or_bus(bus)?),
            ManagerProp::MaxQueue(manager.max_queue().await.or_bus(bus)?),
            ManagerProp::MaxLoadedModels(manager.max_loaded_models().await.or_bus(bus)?),
        ]);
    }
    Ok(Update::Manager(props))
}

/// The counters corrald does not signal: the queue, and each model in `paths`' requests
/// and expiry. A model gone meanwhile is skipped (its removal is signalled).
pub async fn refresh(bus: &Bus, paths: Vec<String>) -> Result<Vec<Update>, CtlError> {
    let mut updates = vec![manager_props(bus, false).await?];
    updates.extend(counters(bus, paths).await?);
    Ok(updates)
}

/// Each model in `paths`' [`COUNTERS`]: explicit properties, not in `GetAll`, so each is
/// read on its own.
async fn counters(bus: &Bus, paths: Vec<String>) -> Result<Vec<Update>, CtlError> {
    let mut updates = Vec::with_capacity(paths.len());
    for path in paths {
        let Ok(object) = OwnedObjectPath::try_from(path.as_str()) else { continue };
        let proxy = zbus::fdo::PropertiesProxy::builder(bus.connection())
            .destination(SERVICE)
            .and_then(|b| b.path(object))
            .or_bus(bus)?
            .build()
            .await
            .or_bus(bus)?;
        let Ok(interface) = zbus::names::InterfaceName::try_from(MODEL) else { continue };
        let mut props = HashMap::new();
        for counter in COUNTERS {
            if let Ok(value) = proxy.get(interface.clone(), counter).await {
                props.insert(counter.to_owned(), value);
            }
        }
        if !props.is_empty() {
            updates.push(Update::Model { path, props: model_props(&props) });
        }
    }
    Ok(updates)
}

/// Unloads the model `name`, as `corralctl unload` does (the same permission).
pub async fn unload(bus: &Bus, name: &str) -> Result<(), CtlError> {
    bus.manager().await?.unload(name).await.or_bus(bus)
}

/// A signal's updates (none for one `top` does not follow).
fn decode(message: &Message) -> Vec<Update> {
    let header = message.header();
    let (Some(interface), Some(member), Some(path)) = (header.interface(), header.member(), header.path()) else {
        return Vec::new();
    };
    let body = message.body();
    let update = match (interface.as_str(), member.as_str()) {
        ("org.freedesktop.DBus.Properties", "PropertiesChanged") => {
            let Ok((iface, changed, _)) = body.deserialize::<(String, HashMap<String, OwnedValue>, Vec<String>)>()
            else {
                return Vec::new();
            };
            match iface.as_str() {
                MODEL => Update::Model { path: path.to_string(), props: model_props(&changed) },
                MANAGER => Update::Manager(
                    changed
                        .iter()
                        .filter_map(|(name, value)| match name.as_str() {
                            "MaxQueue" => value.downcast_ref::<u32>().ok().map(ManagerProp::MaxQueue),
                            "MaxLoadedModels" => value.downcast_ref::<u32>().ok().map(ManagerProp::MaxLoadedModels),
                            _ => None,
                        })
                        .collect(),
                ),
                _ => return Vec::new(),
            }
        }
        ("org.freedesktop.DBus.ObjectManager", "InterfacesAdded") => {
            let Ok((object, interfaces)) =
                body.deserialize::<(OwnedObjectPath, HashMap<String, HashMap<String, OwnedValue>>)>()
            else {
                return Vec::new();
            };
            match interfaces.get(MODEL) {
                Some(props) => Update::Model { path: object.to_string(), props: model_props(props) },
                None => return Vec::new(),
            }
        }
        ("org.freedesktop.DBus.ObjectManager", "InterfacesRemoved") => {
            let Ok((object, interfaces)) = body.deserialize::<(OwnedObjectPath, Vec<String>)>() else {
                return Vec::new();
            };
            if !interfaces.iter().any(|i| i == MODEL) {
                return Vec::new();
            }
            Update::ModelRemoved { path: object.to_string() }
        }
        (MANAGER, "ModelLoaded") => match body.deserialize::<(String, OwnedObjectPath, u32)>() {
            Ok((name, _, pid)) => Update::Signal(Signal::Loaded { name, pid }),
            Err(_) => return Vec::new(),
        },
        (MANAGER, "ModelUnloaded") => match body.deserialize::<(String, OwnedObjectPath, String)>() {
            Ok((name, _, reason)) => Update::Signal(Signal::Unloaded { name, reason }),
            Err(_) => return Vec::new(),
        },
        (MANAGER, "OffloadReported") => match body.deserialize::<(String, OwnedObjectPath, u32, u32, u64, u64)>() {
            Ok((name, _, gpu_layers, total_layers, vram, ram)) => {
                Update::Signal(Signal::Offload { name, gpu_layers, total_layers, vram, ram })
            }
            Err(_) => return Vec::new(),
        },
        (MANAGER, "JobFinished") => match body.deserialize::<(OwnedObjectPath, bool, String)>() {
            Ok((job, success, error)) => Update::Signal(Signal::JobFinished { job: job.to_string(), success, error }),
            Err(_) => return Vec::new(),
        },
        _ => return Vec::new(),
    };
    vec![update]
}

/// A Model object's properties as typed values; unknown or mistyped ones are left out.
fn model_props(props: &HashMap<String, OwnedValue>) -> Vec<ModelProp> {
    let text = |v: &OwnedValue| v.downcast_ref::<&str>().ok().map(str::to_owned);
    let word = |v: &OwnedValue| v.downcast_ref::<u32>().ok();
    let long = |v: &OwnedValue| v.downcast_ref::<u64>().ok();
    props
        .iter()
        .filter_map(|(name, v)| match name.as_str() {
            "Name" => text(v).map(ModelProp::Name),
            "ShortName" => text(v).map(ModelProp::ShortName),
            "State" => text(v).map(ModelProp::State),
            "LastError" => text(v).map(ModelProp::LastError),
            "Pid" => word(v).map(ModelProp::Pid),
            "GpuLayers" => word(v).map(ModelProp::GpuLayers),
            "TotalLayers" => word(v).map(ModelProp::TotalLayers),
            "VramBytes" => long(v).map(ModelProp::VramBytes),
            "RamBytes" => long(v).map(ModelProp::RamBytes),
            "ExpiresAt" => long(v).map(ModelProp::ExpiresAt),
            "ActiveRequests" => word(v).map(ModelProp::ActiveRequests),
            "TokensPerSecond" => v.downcast_ref::<f64>().ok().map(|speed| {
                // Tenths, saturating: a display value, never negative.
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                let tenths = (speed * 10.0).round().clamp(0.0, f64::from(u32::MAX)) as u32;
                ModelProp::TokensPerSecond(tenths)
            }),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use zbus::zvariant::{OwnedValue, Str};

    use super::super::model::ModelProp;
    use super::model_props;

    #[test]
    fn model_properties_decode_by_name_and_type() {
        let mut props: HashMap<String, OwnedValue> = HashMap::new();
        props.insert("State".into(), OwnedValue::from(Str::from("ready")));
        props.insert("Pid".into(), OwnedValue::from(7u32));
        props.insert("VramBytes".into(), OwnedValue::from(9u64));
        props.insert("Pid2".into(), OwnedValue::from(1u32));
        props.insert("RamBytes".into(), OwnedValue::from(Str::from("not a number")));
        let mut got = model_props(&props);
        got.sort_by_key(|p| format!("{p:?}"));
        assert_eq!(got, [ModelProp::Pid(7), ModelProp::State("ready".into()), ModelProp::VramBytes(9)]);
    }
}
