//! `org.corral.Corral1.Model`: one object per stored model.
//!
//! The object's data lives behind a mutex that [`follow`](super::follow) updates before
//! it emits `PropertiesChanged`; a method call in progress (a Load waiting for the model)
//! never blocks those updates.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use std::fmt::Write as _;

use zbus::message::Header;
use zbus::names::{InterfaceName, MemberName};
use zbus::object_server::{DispatchResult, Interface, SignalEmitter};
use zbus::zvariant::{OwnedValue, Value};
use zbus::{Connection, Message, ObjectServer, interface};

use super::error::Error;
use super::{Shared, lock, manager};
use crate::scheduler::device_use::model_devices;
use crate::scheduler::types::LoadedModel;
use crate::store::name::ModelName;
use crate::store::show::{BlobFacts, ModelDetails};

/// What a model object shows; `State` and the runner fields follow the scheduler.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct ModelData {
    pub name: String,
    pub short_name: String,
    pub digest: String,
    pub size: u64,
    pub details: HashMap<String, String>,
    pub facts: Facts,
    pub state: &'static str,
    pub last_error: String,
    pub pid: u32,
    pub gpu_layers: u32,
    pub total_layers: u32,
    pub vram_bytes: u64,
    pub ram_bytes: u64,
    /// The other models served by the same llama-server process.
    pub shared_with: Vec<String>,
}

/// What the store's files say about a model besides its size and details, as `GetAll`
/// shows it: read when the store changes, like the rest of [`ModelData`]. Its texts
/// (`System`, `Parameters`, `Modelfile`) are read when asked for ([`Model::stored`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Facts {
    pub context_length: u64,
    pub capabilities: Vec<String>,
    /// Microseconds since the epoch.
    pub modified_at: u64,
}

impl ModelData {
    /// Whether the views show a runner for it (loading, ready or unloading): a model
    /// without one has nothing to ask the scheduler about.
    fn has_runner(&self) -> bool {
        !matches!(self.state, "stopped" | "failed")
    }
}

impl Facts {
    /// A model's facts: its blobs' ([`Store::blob_facts`](crate::store::Store::blob_facts)),
    /// and when its manifest was written.
    pub fn new(blob: BlobFacts, modified: SystemTime) -> Self {
        Self {
            context_length: blob.context_length,
            capabilities: blob.capabilities.into_iter().map(str::to_owned).collect(),
            modified_at: epoch_micros(modified),
        }
    }
}

/// A model's data as shown now: replaced whole on each change, so that a reader (the
/// object tree) takes the current one without copying it.
pub(super) type Shown = Arc<Mutex<Arc<ModelData>>>;

pub(super) struct Model {
    pub shared: Arc<Shared>,
    pub data: Shown,
}

impl Model {
    fn get<T>(&self, read: impl FnOnce(&ModelData) -> T) -> T {
        read(&lock(&self.data))
    }

    /// The properties read from the scheduler, for this model alone.
    async fn live(&self) -> zbus::fdo::Result<Live> {
        let data = Arc::clone(&lock(&self.data));
        // A model without a runner has nothing to ask the scheduler about.
        if !data.has_runner() {
            return Ok(Live::default());
        }
        let loaded =
            self.shared.context.scheduler.loaded().await.map_err(|e| zbus::fdo::Error::Failed(e.to_string()))?;
        Ok(Live::of(&self.shared, &loaded, &data))
    }

    /// What the store holds for this model now, for its texts: read when a client asks
    /// (they can be large and few clients read them), from the store's details cache
    /// ([`Store::details_async`](crate::store::Store::details_async)). `None` for a model
    /// whose details cannot be read, which shows empty texts.
    async fn stored(&self) -> Option<Arc<ModelDetails>> {
        let name = ModelName::parse(&self.get(|d| d.name.clone())).ok()?;
        self.shared
            .context
            .store
            .details_async(&name)
            .await
            .inspect_err(
                |e| tracing::debug!(corral_model = %name, error = %e, "cannot read the details of {name} for D-Bus"),
            )
            .ok()
    }
}

#[interface(name = "org.corral.Corral1.Model")]
impl Model {
    /// As Manager.Load for this model; returns once it is ready.
    async fn load(&self, options: HashMap<String, OwnedValue>) -> Result<(), Error> {
        let name = self.get(|d| d.short_name.clone());
        manager::load(&self.shared, &name, &options).await.map(drop)
    }

    /// As Manager.Unload for this model; returns once its processes are reaped.
    async fn unload(&self) -> Result<(), Error> {
        let name = self.get(|d| d.short_name.clone());
        manager::unload(&self.shared, &name).await
    }

    #[zbus(property(emits_changed_signal = "const"))]
    fn name(&self) -> String {
        self.get(|d| d.name.clone())
    }

    #[zbus(property(emits_changed_signal = "const"))]
    fn short_name(&self) -> String {
        self.get(|d| d.short_name.clone())
    }

    #[zbus(property)]
    fn digest(&self) -> String {
        self.get(|d| d.digest.clone())
    }

    #[zbus(property)]
    fn size(&self) -> u64 {
        self.get(|d| d.size)
    }

    #[zbus(property)]
    fn details(&self) -> HashMap<String, String> {
        self.get(|d| d.details.clone())
    }

    #[zbus(property(emits_changed_signal = "invalidates"))]
    async fn system(&self) -> String {
        self.stored().await.and_then(|d| d.system.clone()).unwrap_or_default()
    }

    #[zbus(property(emits_changed_signal = "invalidates"))]
    async fn parameters(&self) -> String {
        self.stored().await.map(|d| d.parameters_text()).unwrap_or_default()
    }

    #[zbus(property)]
    fn context_length(&self) -> u64 {
        self.get(|d| d.facts.context_length)
    }

    #[zbus(property)]
    fn capabilities(&self) -> Vec<String> {
        self.get(|d| d.facts.capabilities.clone())
    }

    #[zbus(property(emits_changed_signal = "invalidates"))]
    async fn modelfile(&self) -> String {
        let Some(details) = self.stored().await else { return String::new() };
        // What the syntax cannot express comes as comments, as in /api/show.
        details
            .modelfile(&self.shared.context.store)
            .unwrap_or_else(|e| e.to_string().lines().fold(String::new(), |out, line| out + "# " + line + "\n"))
    }

    #[zbus(property)]
    fn modified_at(&self) -> u64 {
        self.get(|d| d.facts.modified_at)
    }

    #[zbus(property)]
    fn state(&self) -> String {
        self.get(|d| d.state.to_owned())
    }

    #[zbus(property)]
    fn last_error(&self) -> String {
        self.get(|d| d.last_error.clone())
    }

    #[zbus(property)]
    fn pid(&self) -> u32 {
        self.get(|d| d.pid)
    }

    #[zbus(property)]
    fn gpu_layers(&self) -> u32 {
        self.get(|d| d.gpu_layers)
    }

    #[zbus(property)]
    fn total_layers(&self) -> u32 {
        self.get(|d| d.total_layers)
    }

    #[zbus(property)]
    fn vram_bytes(&self) -> u64 {
        self.get(|d| d.vram_bytes)
    }

    #[zbus(property)]
    fn ram_bytes(&self) -> u64 {
        self.get(|d| d.ram_bytes)
    }

    /// The other models served by the same runner (same weights and load options).
    #[zbus(property)]
    fn shared_with(&self) -> Vec<String> {
        self.get(|d| d.shared_with.clone())
    }

    /// Read from the scheduler on each get: it changes with every request.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn expires_at(&self) -> zbus::fdo::Result<u64> {
        Ok(self.live().await?.expires_at)
    }

    #[zbus(property(emits_changed_signal = "false"))]
    fn tokens_per_second(&self) -> f64 {
        self.shared.context.tokens.speed(&self.get(|d| d.short_name.clone()))
    }

    #[zbus(property(emits_changed_signal = "false"))]
    async fn active_requests(&self) -> zbus::fdo::Result<u32> {
        Ok(self.live().await?.active_requests)
    }

    /// Where its runner's memory is, read from the scheduler on each get.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn devices(&self) -> zbus::fdo::Result<Vec<(String, String, u64)>> {
        Ok(self.live().await?.devices)
    }

    /// Its runner's memory on each device by llama.cpp's name: planned before the load
    /// (0 when there was no plan for that device) and what llama.cpp allocated there.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn memory(&self) -> zbus::fdo::Result<Vec<(String, u64, u64)>> {
        Ok(self.live().await?.memory)
    }
}

/// The properties left out of `GetAll` (and so of `GetManagedObjects` and
/// `InterfacesAdded`), read one at a time with `Get`: sd-bus's "explicit" properties,
/// annotated `org.freedesktop.systemd1.Explicit` as sd-bus does. Three are texts a
/// registry writes (up to a mebibyte each, the Modelfile several), which would otherwise
/// make every walk of the tree carry them and let a few models push its reply past the
/// bus's message limit; five are asked of the scheduler on each read and never signalled.
pub(super) const EXPLICIT: [&str; 8] =
    ["System", "Parameters", "Modelfile", "ExpiresAt", "TokensPerSecond", "ActiveRequests", "Devices", "Memory"];

/// The properties `GetAll` gives: every other one, each bounded in size.
pub(super) const SHOWN: [&str; 16] = [
    "Name",
    "ShortName",
    "Digest",
    "Size",
    "Details",
    "ContextLength",
    "Capabilities",
    "ModifiedAt",
    "State",
    "LastError",
    "Pid",
    "GpuLayers",
    "TotalLayers",
    "VramBytes",
    "RamBytes",
    "SharedWith",
];

/// `org.corral.Corral1.Model` as served: [`Model`]'s interface with its [`EXPLICIT`]
/// properties left out of `GetAll` and annotated in the introspection data (made once
/// per indentation level and shared by every model object). zbus has no such property
/// flag, so this implements its `Interface` by hand, handing everything else to the one
/// the macro wrote.
pub(super) struct ModelObject(pub Model);

#[zbus::export::async_trait::async_trait]
impl Interface for ModelObject {
    fn name() -> InterfaceName<'static> {
        <Model as Interface>::name()
    }

    fn spawn_tasks_for_methods(&self) -> bool {
        self.0.spawn_tasks_for_methods()
    }

    async fn get(
        &self,
        property: &str,
        server: &ObjectServer,
        connection: &Connection,
        header: Option<&Header<'_>>,
        emitter: &SignalEmitter<'_>,
    ) -> Option<zbus::fdo::Result<OwnedValue>> {
        Interface::get(&self.0, property, server, connection, header, emitter).await
    }

    async fn get_all(
        &self,
        server: &ObjectServer,
        connection: &Connection,
        header: Option<&Header<'_>>,
        emitter: &SignalEmitter<'_>,
    ) -> zbus::fdo::Result<HashMap<String, OwnedValue>> {
        let mut all = HashMap::with_capacity(SHOWN.len());
        for property in SHOWN {
            if let Some(value) = Interface::get(&self.0, property, server, connection, header, emitter).await {
                all.insert(property.to_owned(), value?);
            }
        }
        Ok(all)
    }

    async fn set_mut(
        &mut self,
        property: &str,
        value: &Value<'_>,
        server: &ObjectServer,
        connection: &Connection,
        header: Option<&Header<'_>>,
        emitter: &SignalEmitter<'_>,
    ) -> Option<zbus::fdo::Result<()>> {
        self.0.set_mut(property, value, server, connection, header, emitter).await
    }

    fn call<'call>(
        &'call self,
        server: &'call ObjectServer,
        connection: &'call Connection,
        message: &'call Message,
        name: MemberName<'call>,
    ) -> DispatchResult<'call> {
        self.0.call(server, connection, message, name)
    }

    fn call_mut<'call>(
        &'call mut self,
        server: &'call ObjectServer,
        connection: &'call Connection,
        message: &'call Message,
        name: MemberName<'call>,
    ) -> DispatchResult<'call> {
        self.0.call_mut(server, connection, message, name)
    }

    fn introspect_to_writer(&self, writer: &mut dyn std::fmt::Write, level: usize) {
        // zbus writes the interfaces of a node's whole subtree when a client introspects
        // it: the interfaces of the node asked about at indentation 2, a child's at 4 and
        // deeper. D-Bus lets a parent list a child as a bare node, and a client that wants
        // a model's interface introspects the model; written in full for every child,
        // each model's 4 KB would make the models' node's reply grow without bound, past
        // the system bus's 32 MiB message limit (which costs corrald its bus connection)
        // at a few thousand models.
        if level > OWN_LEVEL {
            return;
        }
        let mut xml = String::new();
        self.0.introspect_to_writer(&mut xml, level);
        let _ = writer.write_str(&with_explicit_annotations(&xml));
    }
}

/// The indentation zbus writes the interfaces of the object a client introspects at.
const OWN_LEVEL: usize = 2;

/// `xml` (the macro's introspection data) with each [`EXPLICIT`] property annotated
/// `org.freedesktop.systemd1.Explicit`, as sd-bus writes it: inside the property's
/// element, one step deeper.
fn with_explicit_annotations(xml: &str) -> String {
    // (where the property's opening tag ends, whether it closes itself, its indent)
    let mut tags: Vec<(usize, bool, usize)> = EXPLICIT
        .iter()
        .filter_map(|property| {
            let start = xml.find(&format!("<property name=\"{property}\""))?;
            let indent = start - xml[..start].rfind('\n').map_or(0, |newline| newline + 1);
            let end = start + xml[start..].find('>')?;
            Some((end, xml[..end].ends_with('/'), indent))
        })
        .collect();
    tags.sort_unstable();
    let mut out = String::with_capacity(xml.len() + tags.len() * 100);
    let mut copied = 0;
    for (end, closed, indent) in tags {
        let inner = indent + 2;
        let annotation = "<annotation name=\"org.freedesktop.systemd1.Explicit\" value=\"true\"/>";
        if closed {
            out.push_str(&xml[copied..end - 1]);
            let _ = write!(out, ">\n{:inner$}{annotation}\n{:indent$}</property>", "", "");
        } else {
            out.push_str(&xml[copied..=end]);
            let _ = write!(out, "\n{:inner$}{annotation}", "");
        }
        copied = end + 1;
    }
    out.push_str(&xml[copied..]);
    out
}

/// A model's properties that only the scheduler knows and that change with every
/// request, so are asked for on each read.
#[derive(Debug, Default)]
struct Live {
    expires_at: u64,
    active_requests: u32,
    devices: Vec<(String, String, u64)>,
    memory: Vec<(String, u64, u64)>,
}

impl Live {
    /// `data`'s live properties from `loaded` (the scheduler's runners).
    fn of(shared: &Shared, loaded: &[LoadedModel], data: &ModelData) -> Self {
        let name = &data.short_name;
        let serving = || loaded.iter().filter(|m| m.names.contains(name));
        let now = tokio::time::Instant::now();
        let expires_at = serving()
            .filter_map(|m| m.expires_at)
            .min()
            .map_or(0, |at| epoch_micros(SystemTime::now() + at.saturating_duration_since(now)));
        let active_requests = serving().map(|m| m.leases).sum();
        let (devices, memory) = serving().next().map_or_else(Default::default, |runner| {
            let devices = model_devices(&shared.context.fleet.inventory(), &runner.placement, runner.footprint)
                .into_iter()
                .map(|(kind, device, bytes)| (device, kind.to_owned(), bytes))
                .collect();
            let memory = runner.devices.iter().map(|d| (d.device.clone(), d.planned.unwrap_or(0), d.actual)).collect();
            (devices, memory)
        });
        Self { expires_at, active_requests, devices, memory }
    }
}

fn epoch_micros(time: SystemTime) -> u64 {
    let since = time.duration_since(SystemTime::UNIX_EPOCH).unwrap_or(Duration::ZERO);
    u64::try_from(since.as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::{EXPLICIT, SHOWN, with_explicit_annotations};

    const EXPLICIT_ANNOTATION: &str = "org.freedesktop.systemd1.Explicit";

    #[test]
    fn explicit_properties_are_annotated_and_no_other() {
        let xml = concat!(
            "<node>\n",
            "  <interface name=\"org.corral.Corral1.Model\">\n",
            "    <property name=\"Modelfile\" type=\"s\" access=\"read\">\n",
            "      <annotation name=\"org.freedesktop.DBus.Property.EmitsChangedSignal\" value=\"invalidates\"/>\n",
            "    </property>\n",
            "    <property name=\"ModelfileSize\" type=\"t\" access=\"read\"/>\n",
            "    <property name=\"Name\" type=\"s\" access=\"read\"/>\n",
            "    <property name=\"Memory\" type=\"a(stt)\" access=\"read\"/>\n",
            "  </interface>\n",
            "</node>\n",
        );
        let annotated = with_explicit_annotations(xml);
        assert!(
            annotated.contains(&format!(
                "    <property name=\"Modelfile\" type=\"s\" access=\"read\">\n      <annotation name=\"{EXPLICIT_ANNOTATION}\" value=\"true\"/>\n"
            )),
            "{annotated}"
        );
        let node = zbus_xml::Node::from_reader(annotated.as_bytes()).expect("still XML");
        let explicit: Vec<String> = node.interfaces()[0]
            .properties()
            .iter()
            .filter(|p| p.annotations().iter().any(|a| a.name() == EXPLICIT_ANNOTATION))
            .map(|p| p.name().to_string())
            .collect();
        assert_eq!(explicit, ["Modelfile", "Memory"]);
        assert!(
            annotated.contains(&format!(
                "    <property name=\"Memory\" type=\"a(stt)\" access=\"read\">\n      <annotation name=\"{EXPLICIT_ANNOTATION}\" value=\"true\"/>\n    </property>\n"
            )),
            "{annotated}"
        );
    }

    #[test]
    fn every_property_of_the_contract_is_shown_or_explicit() {
        let contract = include_str!("../../dbus/org.corral.Corral1.Model.xml");
        let node = zbus_xml::Node::from_reader(contract.as_bytes()).expect("the contract parses");
        let properties = node.interfaces()[0].properties();
        let explicit: Vec<String> = properties
            .iter()
            .filter(|p| p.annotations().iter().any(|a| a.name() == EXPLICIT_ANNOTATION && a.value() == "true"))
            .map(|p| p.name().to_string())
            .collect();
        let shown: Vec<String> =
            properties.iter().map(|p| p.name().to_string()).filter(|name| !explicit.contains(name)).collect();
        assert_eq!(explicit, EXPLICIT);
        assert_eq!(shown, SHOWN);
    }
}
