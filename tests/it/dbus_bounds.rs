//! What a model holds cannot make the D-Bus object tree large. A registry writes a model's
//! texts (system prompt, licenses, template: up to a mebibyte each) and its config blob's
//! facts; the texts are explicit properties, read one at a time with `Get`, and a fact
//! past its bound makes the config count as damaged. Before, every walk of the tree
//! (`GetManagedObjects`) carried every model's texts: a dozen such models pushed the
//! reply past the system bus's 32 MiB message limit, and the bus dropped corrald.
//! Likewise, introspecting a parent lists the models without describing their interface,
//! and a tree of more models than one message can describe is refused, not sent.

use std::collections::HashMap;

use corral::dbus::proxy::{ManagerProxy, ModelProxy};
use corral::store::Store;
use corral::store::manifest::{self, Layer, Manifest};
use corral::store::name::ModelName;
use zbus::proxy::CacheProperties;
use zbus::zvariant::{OwnedObjectPath, OwnedValue};

use crate::support::container::poll_until_async;
use crate::support::dbus::BusDaemon;

/// How many names the big model is stored under: with its texts in every object, the
/// tree would be over the bus's 32 MiB limit.
const NAMES: usize = 12;
/// The store's bound on one text layer.
const TEXT: usize = 1 << 20;
const WAIT: std::time::Duration = std::time::Duration::from_secs(60);
/// How many models, with names and facts at their bounds, make the tree (about 2.5 KB an
/// object) and the introspection of `/` (about 1.4 KB a node: 31.5 MB at 22 000 models)
/// larger than the bus's 32 MiB message limit.
const MANY: usize = 25_000;

/// A layer of `media_type` holding `bytes`, written into `store`.
fn layer(store: &Store, media_type: &str, bytes: &[u8]) -> Layer {
    let (digest, size) = store.write_blob(bytes, None).expect("write a blob");
    Layer { media_type: media_type.to_owned(), digest, size, from: None }
}

/// `GetManagedObjects`' whole reply, as the bus delivered it, or its error.
async fn call_tree(connection: &zbus::Connection) -> zbus::Result<zbus::Message> {
    connection
        .call_method(
            Some("org.corral.Corral1"),
            "/org/corral/Corral1",
            Some("org.freedesktop.DBus.ObjectManager"),
            "GetManagedObjects",
            &(),
        )
        .await
}

/// The error name and text `answer` is, or (to poll on) what it is instead.
fn refused(answer: zbus::Result<zbus::Message>) -> Result<(String, String), String> {
    match answer {
        Err(zbus::Error::MethodError(name, text, _)) => Ok((name.to_string(), text.unwrap_or_default())),
        Ok(reply) => Err(format!("a reply of {} bytes", reply.data().len())),
        Err(e) => Err(e.to_string()),
    }
}

/// `GetManagedObjects`' whole reply, which must be one.
async fn tree(connection: &zbus::Connection) -> zbus::Message {
    call_tree(connection).await.expect("GetManagedObjects")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_models_texts_and_facts_never_swell_the_object_tree() {
    let daemon = BusDaemon::start("");
    // Another program writes into the store (as a pull would): the chat model's weights,
    // with a mebibyte each of system prompt and two licenses, under many names; and one
    // model whose config names a family of 100 000 bytes.
    let store = Store::open(&daemon.path().join("models")).expect("store");
    let (chat, ..) = store.manifest(&ModelName::parse("chat").expect("name")).expect("chat's manifest");
    let system = "s".repeat(TEXT);
    let mut layers = chat.layers().to_vec();
    layers.push(layer(&store, manifest::SYSTEM, system.as_bytes()));
    layers.push(layer(&store, manifest::LICENSE, "l".repeat(TEXT).as_bytes()));
    layers.push(layer(&store, manifest::LICENSE, "k".repeat(TEXT).as_bytes()));
    let big = Manifest::new(chat.config().clone(), layers).expect("manifest");
    for i in 0..NAMES {
        store.write_manifest(&ModelName::parse(&format!("big{i}")).expect("name"), &big).expect("write");
    }
    let family = "f".repeat(100_000);
    let config = serde_json::json!({"model_format": "gguf", "model_family": family, "file_type": "F32"});
    let config = layer(&store, manifest::CONFIG_MEDIA_TYPE, config.to_string().as_bytes());
    let odd = Manifest::new(config, chat.layers().to_vec()).expect("manifest");
    store.write_manifest(&ModelName::parse("odd").expect("name"), &odd).expect("write");

    let connection = daemon.connect().await;
    let reply = poll_until_async(WAIT, "every model in the object tree", || async {
        let reply = tree(&connection).await;
        let objects: zbus::fdo::ManagedObjects = reply.body().deserialize().expect("a{oa{sa{sv}}}");
        let models = objects.keys().filter(|p| p.as_str().starts_with("/org/corral/Corral1/models/")).count();
        // chat, embed, the big ones and the odd one.
        if models == NAMES + 3 { Ok(reply) } else { Err(format!("{models} models")) }
    })
    .await;
    // Each object's share is small: names, digest, numbers, the bounded facts.
    let bytes = reply.data().len();
    assert!(bytes < (NAMES + 3) * 4096, "the tree's reply is {bytes} bytes");
    let objects: zbus::fdo::ManagedObjects = reply.body().deserialize().expect("a{oa{sa{sv}}}");

    let big0 = OwnedObjectPath::try_from("/org/corral/Corral1/models/big0_3alatest").expect("path");
    let shown: &HashMap<String, OwnedValue> = &objects[&big0]["org.corral.Corral1.Model"];
    for explicit in ["System", "Parameters", "Modelfile", "ExpiresAt", "TokensPerSecond", "ActiveRequests"] {
        assert!(!shown.contains_key(explicit), "{explicit} in the tree");
    }
    // Each text is whole when asked for.
    let model = ModelProxy::builder(&connection)
        .path(&big0)
        .expect("path")
        .cache_properties(CacheProperties::No)
        .build()
        .await
        .expect("proxy");
    assert_eq!(model.system().await.expect("System"), system);
    let modelfile = model.modelfile().await.expect("Modelfile");
    assert!(modelfile.len() > 3 * TEXT && modelfile.contains(&system), "a Modelfile of {} bytes", modelfile.len());

    // The over-long fact: the config counts as damaged, as in /api/tags.
    let odd = OwnedObjectPath::try_from("/org/corral/Corral1/models/odd_3alatest").expect("path");
    let details = HashMap::<String, String>::try_from(
        objects[&odd]["org.corral.Corral1.Model"]["Details"].try_clone().expect("clone"),
    )
    .expect("a{ss}");
    assert_eq!(details.get("family").map(String::as_str), Some(""), "{details:?}");
    let tags = crate::support::http::tcp(([127, 0, 0, 1], daemon.port).into(), "GET", "/api/tags");
    assert!(!tags.body.contains("fffff"), "the family in /api/tags");
    assert!(tags.body.contains("\"odd:latest\""), "{}", tags.body);

    // corrald is still on the bus, and its tree still answers.
    let bus = zbus::fdo::DBusProxy::new(&connection).await.expect("bus proxy");
    let name = zbus::names::BusName::try_from("org.corral.Corral1").expect("name");
    assert!(bus.name_has_owner(name).await.expect("NameHasOwner"), "corrald left the bus");
    assert_eq!(tree(&connection).await.data().len(), bytes);
}

/// The introspection data of `path`.
async fn introspect(connection: &zbus::Connection, path: &str) -> String {
    let reply = connection
        .call_method(Some("org.corral.Corral1"), path, Some("org.freedesktop.DBus.Introspectable"), "Introspect", &())
        .await
        .unwrap_or_else(|e| panic!("Introspect {path}: {e}"));
    reply.body().deserialize().expect("a string")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn introspecting_a_parent_lists_the_models_without_their_interface() {
    // zbus describes a node's whole subtree: with each model's interface in it (4 KB), the
    // root's reply would pass the bus's 32 MiB limit at a few thousand models.
    let daemon = BusDaemon::start("");
    let store = Store::open(&daemon.path().join("models")).expect("store");
    let (chat, ..) = store.manifest(&ModelName::parse("chat").expect("name")).expect("chat's manifest");
    for i in 0..NAMES {
        store.write_manifest(&ModelName::parse(&format!("copy{i}")).expect("name"), &chat).expect("write");
    }
    let connection = daemon.connect().await;
    let models = poll_until_async(WAIT, "a node per model", || async {
        let xml = introspect(&connection, "/org/corral/Corral1/models").await;
        // chat, embed and the copies.
        let nodes = xml.matches("<node name=").count();
        if nodes == NAMES + 2 { Ok(xml) } else { Err(format!("{nodes} nodes")) }
    })
    .await;
    for parent in ["/", "/org/corral/Corral1", "/org/corral/Corral1/models"] {
        let xml = introspect(&connection, parent).await;
        assert!(xml.contains("<node name=\"copy7_3alatest\">"), "{parent}: {xml}");
        assert!(!xml.contains("org.corral.Corral1.Model"), "{parent} describes the models' interface:\n{xml}");
        // What each model adds: its node and the standard interfaces zbus writes for it.
        assert!(xml.len() < 8192 + (NAMES + 2) * 2048, "{parent}: {} bytes", xml.len());
    }
    assert!(models.len() < (NAMES + 2) * 2048, "{} bytes", models.len());
    // A model's own object describes its interface, explicit properties included.
    let own = introspect(&connection, "/org/corral/Corral1/models/copy7_3alatest").await;
    let node = zbus_xml::Node::from_reader(own.as_bytes()).expect("the XML parses");
    let model = node
        .interfaces()
        .iter()
        .find(|i| i.name().as_str() == "org.corral.Corral1.Model")
        .unwrap_or_else(|| panic!("no Model interface:\n{own}"));
    assert!(model.properties().iter().any(|p| p.name().as_str() == "Modelfile"), "{own}");
    assert!(own.contains("org.freedesktop.systemd1.Explicit"), "{own}");
}

/// A store of more models than one message of the bus can describe: `GetManagedObjects`
/// and `Introspect` of `/` are refused with `LimitsExceeded` (dbus-daemon drops a
/// connection that sends more than its limit, which would have cost corrald the bus), and
/// corrald stays on the bus: `ListModels` lists every model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tree_larger_than_a_bus_message_is_refused_and_corrald_stays_on_the_bus() {
    let mut daemon = BusDaemon::start("");
    daemon.stop();
    // Written behind corrald's back, without a sync each: one manifest under many long
    // names, its config's facts at their bound.
    let store = Store::open(&daemon.path().join("models")).expect("store");
    let (chat, ..) = store.manifest(&ModelName::parse("chat").expect("name")).expect("chat's manifest");
    let fact = "f".repeat(250);
    let config = serde_json::json!({"model_format": fact, "model_family": fact, "model_families": [fact],
                                    "model_type": fact, "file_type": fact});
    let config = layer(&store, manifest::CONFIG_MEDIA_TYPE, config.to_string().as_bytes());
    let bytes = Manifest::new(config, chat.layers().to_vec()).expect("manifest").to_bytes();
    let library = daemon.path().join("models/manifests/registry.ollama.ai/library");
    let (padding, tag) = ("-".repeat(74), format!("t{}", "-".repeat(79)));
    for i in 0..MANY {
        let dir = library.join(format!("m{i:05}{padding}"));
        std::fs::create_dir(&dir).expect("mkdir");
        std::fs::write(dir.join(&tag), &bytes).expect("write the manifest");
    }
    daemon.start_again();

    let connection = daemon.connect().await;
    let (error, text) =
        poll_until_async(WAIT, "the object tree to be refused", || async { refused(call_tree(&connection).await) })
            .await;
    assert_eq!(error, "org.freedesktop.DBus.Error.LimitsExceeded", "{text}");
    assert!(text.contains("ListModels"), "{text}");
    let manager =
        ManagerProxy::builder(&connection).cache_properties(CacheProperties::No).build().await.expect("proxy");
    let models = manager.list_models().await.expect("ListModels, on the same connection of corrald's");
    assert_eq!(models.len(), MANY + 2, "every model");

    // zbus writes the introspection of `/` for the whole subtree, a node per model; the
    // bus socket answers for it.
    let (error, text) = poll_until_async(WAIT, "the introspection of / to be refused", || async {
        let introspect = Some("org.freedesktop.DBus.Introspectable");
        refused(connection.call_method(Some("org.corral.Corral1"), "/", introspect, "Introspect", &()).await)
    })
    .await;
    assert_eq!(error, "org.freedesktop.DBus.Error.LimitsExceeded", "{text}");
    assert!(text.contains("each object's own Introspect"), "{text}");
    let own = introspect(&connection, "/org/corral/Corral1/models/chat_3alatest").await;
    assert!(own.contains("org.corral.Corral1.Model"), "{own}");
    let models = manager.list_models().await.expect("ListModels, on the same connection of corrald's");
    assert_eq!(models.len(), MANY + 2, "every model, still");
}
