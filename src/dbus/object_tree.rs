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
use super::{Shared, TEXT, lock, model_path, reply_fits, texts};

const MODEL_INTERFACE: &str = "org.corral.Corral1.Model";
const JOB_INTERFACE: &str = "org.corral.Corral1.Job";

pub(super) struct ObjectTree {
    pub shared: Arc<Shared>,
}

#[interface(name = "org.freedesktop.DBus.ObjectManager")]
impl ObjectTree {
    /// Every object below this one: for each, its interfaces with all their properties,
    /// as `org.freedesktop.DBus.Properties.GetAll` gives them.
    ///
    /// Refused with `org.freedesktop.DBus.Error.LimitsExceeded` when the reply would not
    /// fit in one message of the system bus (tens of thousands of models): dbus-daemon
    /// drops a connection that sends a larger one, which would cost corrald the bus.
    fn get_managed_objects(&self) -> zbus::fdo::Result<Tree> {
        let models = lock(&self.shared.models)
            .values()
            .map(|d| {
                let data = Arc::clone(&lock(d));
                (model_path(&data.short_name), data)
            })
            .collect();
        let tree = Tree { models, jobs: lock(&self.shared.jobs).shown() };
        let what = format!("the object tree's {} objects", tree.models.len() + tree.jobs.len());
        reply_fits(tree.bytes_at_most(), &what, "ListModels lists the models, and each model's object answers GetAll")?;
        Ok(tree)
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

/// What one property can take besides its texts: the dictionary entry's padding (7), the
/// name (4 + at most 16 + 1), the variant's signature (at most 7), the value's padding (7)
/// and a number's or an array's length (8).
const PROPERTY: usize = 50;

/// `ModelProps`' and `JobProps`' fields.
const MODEL_PROPERTIES: usize = super::model::SHOWN.len();
const JOB_PROPERTIES: usize = 7;

/// What an object takes besides its path and properties: the entry's padding, the path's
/// length and NUL, the interfaces' array, its one entry and the interface's name.
const OBJECT: usize = 64;

impl Tree {
    /// An upper bound of the reply's bytes, from the texts' lengths (no serializing).
    fn bytes_at_most(&self) -> usize {
        let models = self.models.iter().map(|(path, d)| {
            let pairs = d.details.iter().map(|(k, v)| 8 + k.len() + TEXT + v.len() + TEXT).sum::<usize>();
            let lists = texts(&mut d.facts.capabilities.iter().chain(&d.shared_with).map(String::len));
            let strings = [d.name.as_str(), &d.short_name, &d.digest, &d.last_error, d.state];
            let strings = texts(&mut strings.into_iter().map(str::len));
            OBJECT + path.len() + MODEL_INTERFACE.len() + MODEL_PROPERTIES * PROPERTY + strings + pairs + lists
        });
        let jobs = self.jobs.iter().map(|(path, d)| {
            let strings = texts(&mut [d.kind, &d.model, d.state, &d.status, &d.error].into_iter().map(str::len));
            OBJECT + path.len() + JOB_INTERFACE.len() + JOB_PROPERTIES * PROPERTY + strings
        });
        8 + models.sum::<usize>() + jobs.sum::<usize>()
    }
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

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Arc;

    use zbus::zvariant::serialized::Context;
    use zbus::zvariant::{LE, OwnedObjectPath, to_bytes};

    use super::super::job::JobData;
    use super::super::model::{Facts, ModelData};
    use super::super::model_path;
    use super::Tree;

    fn model(name: &str, texts: usize, list: usize) -> (OwnedObjectPath, Arc<ModelData>) {
        let text = |c: char| c.to_string().repeat(texts);
        let data = ModelData {
            name: format!("registry.ollama.ai/library/{name}"),
            short_name: name.to_owned(),
            digest: format!("sha256:{}", "a".repeat(64)),
            size: u64::MAX,
            details: (0..list).map(|i| (format!("k{i}"), text('v'))).collect::<HashMap<_, _>>(),
            facts: Facts { capabilities: vec![text('c'); list], context_length: 1, ..Facts::default() },
            state: "ready",
            last_error: text('e'),
            pid: 1,
            shared_with: vec![text('s'); list],
            ..ModelData::default()
        };
        (model_path(name), Arc::new(data))
    }

    /// The bound the tree is refused by is a bound: never below what zvariant writes, for
    /// small and large texts, empty and long lists, padding of every remainder.
    #[test]
    fn the_reply_is_never_larger_than_its_bound_and_the_bound_not_far_above_it() {
        for (texts, list) in [(0, 0), (1, 1), (3, 2), (7, 5), (100, 3), (255, 9)] {
            let models = (0..5).map(|i| model(&format!("m{}:{}", "x".repeat(i), "t".repeat(texts % 7)), texts, list));
            let job = |n: usize| {
                let path = OwnedObjectPath::try_from(format!("/org/corral/Corral1/jobs/{n}")).expect("path");
                let text = "j".repeat(texts + n);
                let mut data = JobData::default();
                (data.kind, data.state) = ("pull", "running");
                (data.model, data.status, data.error) = (text.clone(), text.clone(), text);
                (path, data)
            };
            let tree = Tree { models: models.collect(), jobs: (0..3).map(job).collect() };
            let written = to_bytes(Context::new_dbus(LE, 0), &tree).expect("serialize").len();
            let bound = tree.bytes_at_most();
            assert!(written <= bound, "{texts}, {list}: {written} bytes written, bound {bound}");
            assert!(bound < 2 * written, "{texts}, {list}: {written} bytes written, bound {bound}");
        }
    }
}
