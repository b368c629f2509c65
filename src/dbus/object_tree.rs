//! `org.freedesktop.DBus.ObjectManager` at the root: every model and job object with the
//! properties `GetAll` gives, in one reply.
//!
//! zbus's own object manager answers `GetManagedObjects` by asking each object for its
//! properties as generic variants, one owned value per property: at 1 000 models that is
//! 24 000 of them built, serialized and freed, about 35 ms. This one serializes the
//! models' shared data as it stands, through typed dictionaries. A model's explicit
//! properties (texts of any size, and what only the scheduler knows) are not in it, as
//! they are not in `GetAll` ([`super::model::EXPLICIT`]), so the walk asks nobody and each
//! object's part of the reply is bounded. zbus still emits `InterfacesAdded` and
//! `InterfacesRemoved` (it recognises the interface by its name).

use std::collections::HashMap;
use std::sync::Arc;

use serde::Serialize;
use serde::ser::{SerializeMap, Serializer};
use zbus::interface;
use zbus::object_server::SignalEmitter;
use zbus::zvariant::{ObjectPath, OwnedObjectPath, Type, Value, as_value};

use super::job::JobData;
use super::model::ModelData;
use super::{Shared, lock, model_path};

const MODEL_INTERFACE: &str = "org.corral.Corral1.Model";
const JOB_INTERFACE: &str = "org.corral.Corral1.Job";

pub(super) struct ObjectTree {
    pub shared: Arc<Shared>,
}

#[interface(name = "org.freedesktop.DBus.ObjectManager")]
impl ObjectTree {
    /// Every object below this one: for each, its interfaces with all their properties,
    /// as `org.freedesktop.DBus.Properties.GetAll` gives them.
    fn get_managed_objects(&self) -> Tree {
        let models = lock(&self.shared.models)
            .values()
            .map(|d| {
                let data = Arc::clone(&lock(d));
                (model_path(&data.short_name), data)
            })
            .collect();
        Tree { models, jobs: lock(&self.shared.jobs).shown() }
    }

    /// An object appeared, or gained interfaces (emitted by zbus's object server).
    #[zbus(signal)]
    async fn interfaces_added(
        emitter: &SignalEmitter<'_>,
        object_path: ObjectPath<'_>,
        interfaces_and_properties: HashMap<&str, HashMap<&str, Value<'_>>>,
    ) -> zbus::Result<()>;

    /// An object went, or lost interfaces (emitted by zbus's object server).
    #[zbus(signal)]
    async fn interfaces_removed(
        emitter: &SignalEmitter<'_>,
        object_path: ObjectPath<'_>,
        interfaces: Vec<&str>,
    ) -> zbus::Result<()>;
}

/// The reply of `GetManagedObjects`: a snapshot, serialized without copying it into
/// variants (zbus serializes a reply twice: once to size it, then to write it).
#[derive(Type)]
#[zvariant(signature = "a{oa{sa{sv}}}")]
pub(super) struct Tree {
    models: Vec<(OwnedObjectPath, Arc<ModelData>)>,
    jobs: Vec<(OwnedObjectPath, JobData)>,
}

impl Serialize for Tree {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.models.len() + self.jobs.len()))?;
        for (path, data) in &self.models {
            map.serialize_entry(path, &One(MODEL_INTERFACE, ModelProps::new(data)))?;
        }
        for (path, data) in &self.jobs {
            map.serialize_entry(path, &One(JOB_INTERFACE, JobProps::new(data)))?;
        }
        map.end()
    }
}

/// An object's interfaces: here always one, with its properties.
struct One<P>(&'static str, P);

impl<P: Serialize> Serialize for One<P> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(1))?;
        map.serialize_entry(self.0, &self.1)?;
        map.end()
    }
}

/// `org.corral.Corral1.Model`'s properties as `GetAll` gives them ([`super::model::SHOWN`]),
/// named as the interface names them.
#[derive(Serialize, Type)]
#[zvariant(signature = "a{sv}")]
#[serde(rename_all = "PascalCase")]
struct ModelProps<'a> {
    #[serde(with = "as_value")]
    name: &'a str,
    #[serde(with = "as_value")]
    short_name: &'a str,
    #[serde(with = "as_value")]
    digest: &'a str,
    #[serde(with = "as_value")]
    size: u64,
    #[serde(with = "as_value")]
    details: &'a HashMap<String, String>,
    #[serde(with = "as_value")]
    context_length: u64,
    #[serde(with = "as_value")]
    capabilities: &'a [String],
    #[serde(with = "as_value")]
    modified_at: u64,
    #[serde(with = "as_value")]
    state: &'a str,
    #[serde(with = "as_value")]
    last_error: &'a str,
    #[serde(with = "as_value")]
    pid: u32,
    #[serde(with = "as_value")]
    gpu_layers: u32,
    #[serde(with = "as_value")]
    total_layers: u32,
    #[serde(with = "as_value")]
    vram_bytes: u64,
    #[serde(with = "as_value")]
    ram_bytes: u64,
    #[serde(with = "as_value")]
    shared_with: &'a [String],
}

impl<'a> ModelProps<'a> {
    fn new(d: &'a ModelData) -> Self {
        Self {
            name: &d.name,
            short_name: &d.short_name,
            digest: &d.digest,
            size: d.size,
            details: &d.details,
            context_length: d.facts.context_length,
            capabilities: &d.facts.capabilities,
            modified_at: d.facts.modified_at,
            state: d.state,
            last_error: &d.last_error,
            pid: d.pid,
            gpu_layers: d.gpu_layers,
            total_layers: d.total_layers,
            vram_bytes: d.vram_bytes,
            ram_bytes: d.ram_bytes,
            shared_with: &d.shared_with,
        }
    }
}

/// `org.corral.Corral1.Job`'s properties.
#[derive(Serialize, Type)]
#[zvariant(signature = "a{sv}")]
#[serde(rename_all = "PascalCase")]
struct JobProps<'a> {
    #[serde(with = "as_value")]
    kind: &'a str,
    #[serde(with = "as_value")]
    model: &'a str,
    #[serde(with = "as_value")]
    state: &'a str,
    #[serde(with = "as_value")]
    status: &'a str,
    #[serde(with = "as_value")]
    total: u64,
    #[serde(with = "as_value")]
    completed: u64,
    #[serde(with = "as_value")]
    error: &'a str,
}

impl<'a> JobProps<'a> {
    fn new(d: &'a JobData) -> Self {
        Self {
            kind: d.kind,
            model: &d.model,
            state: d.state,
            status: &d.status,
            total: d.total,
            completed: d.completed,
            error: &d.error,
        }
    }
}
