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
use serde::ser::{SerializeMap, SerializeStruct, Serializer};
use zbus::interface;
use zbus::object_server::SignalEmitter;
use zbus::zvariant::{ObjectPath, OwnedObjectPath, Type, Value};

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
    #[serde(serialize_with = "variant")]
    name: &'a str,
    #[serde(serialize_with = "variant")]
    short_name: &'a str,
    #[serde(serialize_with = "variant")]
    digest: &'a str,
    #[serde(serialize_with = "variant")]
    size: u64,
    #[serde(serialize_with = "variant")]
    details: &'a HashMap<String, String>,
    #[serde(serialize_with = "variant")]
    context_length: u64,
    #[serde(serialize_with = "variant")]
    capabilities: &'a [String],
    #[serde(serialize_with = "variant")]
    modified_at: u64,
    #[serde(serialize_with = "variant")]
    state: &'a str,
    #[serde(serialize_with = "variant")]
    last_error: &'a str,
    #[serde(serialize_with = "variant")]
    pid: u32,
    #[serde(serialize_with = "variant")]
    gpu_layers: u32,
    #[serde(serialize_with = "variant")]
    total_layers: u32,
    #[serde(serialize_with = "variant")]
    vram_bytes: u64,
    #[serde(serialize_with = "variant")]
    ram_bytes: u64,
    #[serde(serialize_with = "variant")]
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
    #[serde(serialize_with = "variant")]
    kind: &'a str,
    #[serde(serialize_with = "variant")]
    model: &'a str,
    #[serde(serialize_with = "variant")]
    state: &'a str,
    #[serde(serialize_with = "variant")]
    status: &'a str,
    #[serde(serialize_with = "variant")]
    total: u64,
    #[serde(serialize_with = "variant")]
    completed: u64,
    #[serde(serialize_with = "variant")]
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

/// A property's D-Bus signature, as the text a variant carries.
trait Signed {
    const SIGNATURE: &'static str;
}

impl Signed for &str {
    const SIGNATURE: &'static str = "s";
}

impl Signed for u64 {
    const SIGNATURE: &'static str = "t";
}

impl Signed for u32 {
    const SIGNATURE: &'static str = "u";
}

impl Signed for &HashMap<String, String> {
    const SIGNATURE: &'static str = "a{ss}";
}

impl Signed for &[String] {
    const SIGNATURE: &'static str = "as";
}

/// Serializes `value` as a variant, as zvariant's `as_value` does (a struct in a variant's
/// place: its signature's text, then the value), but with the text a constant: `as_value`
/// formats each value's signature into a new string, which zbus's two passes over a reply
/// (sizing, then writing) did 32 000 times for the tree of 1 000 models.
fn variant<T: Signed + Serialize, S: Serializer>(value: &T, serializer: S) -> Result<S::Ok, S::Error> {
    let mut variant = serializer.serialize_struct("Variant", 2)?;
    variant.serialize_field("signature", T::SIGNATURE)?;
    variant.serialize_field("value", value)?;
    variant.end()
}
