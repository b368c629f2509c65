//! The D-Bus contract, `dbus/org.corral.Corral1.*.xml`, checked in both directions: what
//! corrald serves is what the XML promises (every method, signal, argument, property,
//! type, access and annotation of our interfaces, explicit properties included), and the client proxies that corralctl
//! and the tests use (`src/dbus/proxy.rs`, read as Rust source) call exactly what the XML
//! promises, with its signatures, and cover every member of it.

use std::collections::{BTreeMap, BTreeSet};

use zbus_xml::{ArgDirection, Node};

use crate::support::container::repo_root;
use crate::support::dbus::BusDaemon;

/// Everything about an interface that a client depends on, as comparable lines.
fn shape(node: &Node<'_>, interface: &str) -> BTreeSet<String> {
    let iface = node
        .interfaces()
        .iter()
        .find(|i| i.name().as_str() == interface)
        .unwrap_or_else(|| panic!("no interface {interface} in the node"));
    let mut lines = BTreeSet::new();
    for m in iface.methods() {
        let args: Vec<String> = m
            .args()
            .iter()
            .map(|a| {
                let dir = match a.direction() {
                    Some(ArgDirection::Out) => "out",
                    _ => "in",
                };
                format!("{dir} {}: {}", a.name().unwrap_or("?"), a.ty().inner())
            })
            .collect();
        lines.insert(format!("method {}({})", m.name(), args.join(", ")));
    }
    for s in iface.signals() {
        let args: Vec<String> =
            s.args().iter().map(|a| format!("{}: {}", a.name().unwrap_or("?"), a.ty().inner())).collect();
        lines.insert(format!("signal {}({})", s.name(), args.join(", ")));
    }
    for p in iface.properties() {
        let (emits, explicit) = (emits(p), explicit(p));
        lines.insert(format!(
            "property {}: {} {:?} emits={emits} explicit={explicit}",
            p.name(),
            p.ty().inner(),
            p.access()
        ));
    }
    lines
}

/// Whether a property is left out of `GetAll` (sd-bus's `org.freedesktop.systemd1.Explicit`
/// annotation; absent means no).
fn explicit(p: &zbus_xml::Property<'_>) -> bool {
    p.annotations().iter().any(|a| a.name() == "org.freedesktop.systemd1.Explicit" && a.value() == "true")
}

/// A property's `EmitsChangedSignal` annotation; the specification's default is "true", so
/// an absent annotation says the same.
fn emits<'a>(p: &'a zbus_xml::Property<'_>) -> &'a str {
    p.annotations()
        .iter()
        .find(|a| a.name() == "org.freedesktop.DBus.Property.EmitsChangedSignal")
        .map_or("true", |a| a.value())
}

fn contract(interface: &str) -> String {
    let file = repo_root().join("dbus").join(format!("{interface}.xml"));
    std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()))
}

fn served(daemon: &BusDaemon, path: &str) -> String {
    let out = daemon.busctl(None, &["introspect", "--xml-interface", "org.corral.Corral1", path]);
    assert!(out.status.success(), "busctl introspect {path}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8")
}

fn assert_same(interface: &str, served_xml: &str) {
    let promised_xml = contract(interface);
    let promised = Node::from_reader(promised_xml.as_bytes()).expect("the contract parses");
    let served = Node::from_reader(served_xml.as_bytes()).expect("the served XML parses");
    let (promised, served) = (shape(&promised, interface), shape(&served, interface));
    let missing: Vec<_> = promised.difference(&served).collect();
    let extra: Vec<_> = served.difference(&promised).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{interface}: the daemon differs from dbus/{interface}.xml\n  promised, not served: {missing:#?}\n  served, not promised: {extra:#?}"
    );
}

#[test]
fn the_served_interfaces_match_the_xml_contract() {
    let daemon = BusDaemon::start("");
    assert_same("org.corral.Corral1.Manager", &served(&daemon, "/org/corral/Corral1"));
    assert_same("org.corral.Corral1.Model", &served(&daemon, "/org/corral/Corral1/models/chat_3alatest"));
    // A job to look at: a copy.
    let out = daemon.busctl(
        None,
        &[
            "call",
            "org.corral.Corral1",
            "/org/corral/Corral1",
            "org.corral.Corral1.Manager",
            "Copy",
            "ss",
            "chat",
            "chat-copy",
        ],
    );
    assert!(out.status.success(), "Copy: {}", String::from_utf8_lossy(&out.stderr));
    let job = String::from_utf8(out.stdout).expect("utf-8");
    let job = job.trim().strip_prefix("o ").expect("an object path").trim_matches('"').to_owned();
    assert!(job.starts_with("/org/corral/Corral1/jobs/"), "{job}");
    assert_same("org.corral.Corral1.Job", &served(&daemon, &job));
    // The root also serves the object manager, for discovery.
    let root = served(&daemon, "/org/corral/Corral1");
    assert!(root.contains("org.freedesktop.DBus.ObjectManager"), "{root}");
}

#[test]
fn the_comparison_catches_a_difference() {
    // The check above must be able to fail: a served interface lacking one method.
    let promised = contract("org.corral.Corral1.Manager");
    let altered = promised.replacen("<method name=\"Unload\">", "<method name=\"Unload2\">", 1);
    assert_ne!(promised, altered);
    let result = std::panic::catch_unwind(|| assert_same("org.corral.Corral1.Manager", &altered));
    let message = *result.expect_err("a difference must fail").downcast::<String>().expect("a message");
    assert!(message.contains("method Unload(in name: s)") && message.contains("Unload2"), "{message}");
    // And a property that is no longer explicit.
    let promised = contract("org.corral.Corral1.Model");
    let altered = promised.replacen(r#"<annotation name="org.freedesktop.systemd1.Explicit" value="true"/>"#, "", 1);
    assert_ne!(promised, altered);
    let result = std::panic::catch_unwind(|| assert_same("org.corral.Corral1.Model", &altered));
    let message = *result.expect_err("a difference must fail").downcast::<String>().expect("a message");
    assert!(message.contains("property System: s Read emits=invalidates explicit=true"), "{message}");
}

// ---- The client proxies against the XML ----

/// What a client depends on in one member, as D-Bus signatures.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Shape {
    Method {
        ins: String,
        outs: String,
    },
    Signal {
        args: String,
    },
    /// `read`/`write`: what the XML allows, or what the proxy does (a getter, a setter);
    /// `emits`: the `EmitsChangedSignal` value ("true" when absent).
    Property {
        ty: String,
        read: bool,
        write: bool,
        emits: String,
    },
}

impl Shape {
    fn kind(&self) -> &'static str {
        match self {
            Self::Method { .. } => "method",
            Self::Signal { .. } => "signal",
            Self::Property { .. } => "property",
        }
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Method { ins, outs } => write!(f, "({ins}) -> ({outs})"),
            Self::Signal { args } => write!(f, "({args})"),
            Self::Property { ty, read, write, emits } => {
                let access = match (read, write) {
                    (true, true) => "readwrite",
                    (false, true) => "write",
                    _ => "read",
                };
                write!(f, "{ty} {access} emits={emits}")
            }
        }
    }
}

/// Members by (kind, D-Bus name), per interface.
type Members = BTreeMap<(&'static str, String), Shape>;

/// The XML's members of every interface in `xml`.
fn xml_members(xml: &str) -> BTreeMap<String, Members> {
    let node = Node::from_reader(xml.as_bytes()).expect("the contract parses");
    let sig = |args: &mut dyn Iterator<Item = &zbus_xml::Arg>| args.map(|a| a.ty().inner().to_string()).collect();
    let mut interfaces = BTreeMap::new();
    for iface in node.interfaces() {
        let mut members = Members::new();
        for m in iface.methods() {
            let ins = sig(&mut m.args().iter().filter(|a| a.direction() != Some(ArgDirection::Out)));
            let outs = sig(&mut m.args().iter().filter(|a| a.direction() == Some(ArgDirection::Out)));
            members.insert(("method", m.name().to_string()), Shape::Method { ins, outs });
        }
        for s in iface.signals() {
            members.insert(("signal", s.name().to_string()), Shape::Signal { args: sig(&mut s.args().iter()) });
        }
        for p in iface.properties() {
            let shape = Shape::Property {
                ty: p.ty().inner().to_string(),
                read: p.access().read(),
                write: p.access().write(),
                emits: emits(p).to_owned(),
            };
            members.insert(("property", p.name().to_string()), shape);
        }
        interfaces.insert(iface.name().to_string(), members);
    }
    interfaces
}

/// The D-Bus signature of a Rust type as the proxies spell them; an error names a type
/// this reader does not know, so that nothing is skipped unread.
fn signature(ty: &syn::Type) -> Result<String, String> {
    match ty {
        syn::Type::Reference(r) => signature(&r.elem),
        syn::Type::Paren(p) => signature(&p.elem),
        syn::Type::Slice(s) => Ok(format!("a{}", signature(&s.elem)?)),
        syn::Type::Tuple(t) if t.elems.is_empty() => Ok(String::new()),
        syn::Type::Tuple(t) => Ok(format!("({})", t.elems.iter().map(signature).collect::<Result<String, String>>()?)),
        syn::Type::Path(p) => {
            let last = p.path.segments.last().ok_or("an empty type path")?;
            let args: Vec<&syn::Type> = match &last.arguments {
                syn::PathArguments::AngleBracketed(a) => a
                    .args
                    .iter()
                    .filter_map(|a| if let syn::GenericArgument::Type(t) = a { Some(t) } else { None })
                    .collect(),
                _ => Vec::new(),
            };
            let basic = match last.ident.to_string().as_str() {
                "bool" => "b",
                "u8" => "y",
                "i16" => "n",
                "u16" => "q",
                "i32" => "i",
                "u32" => "u",
                "i64" => "x",
                "u64" => "t",
                "f64" => "d",
                "str" | "String" | "Str" | "OwnedStr" => "s",
                "ObjectPath" | "OwnedObjectPath" => "o",
                "Signature" | "OwnedSignature" => "g",
                "Value" | "OwnedValue" => "v",
                "Fd" | "OwnedFd" => "h",
                "Vec" if args.len() == 1 => return Ok(format!("a{}", signature(args[0])?)),
                "HashMap" | "BTreeMap" if args.len() == 2 => {
                    return Ok(format!("a{{{}{}}}", signature(args[0])?, signature(args[1])?));
                }
                _ => return Err(format!("a type the check does not know: {}", type_name(ty))),
            };
            Ok(basic.to_owned())
        }
        _ => Err(format!("a type the check does not know: {}", type_name(ty))),
    }
}

/// A type's name for messages.
fn type_name(ty: &syn::Type) -> String {
    match ty {
        syn::Type::Path(p) => p.path.segments.iter().map(|s| s.ident.to_string()).collect::<Vec<_>>().join("::"),
        syn::Type::Reference(r) => format!("&{}", type_name(&r.elem)),
        _ => "an unnamed type".to_owned(),
    }
}

/// `T` of a `zbus::Result<T>` (or any `Result<T>`).
fn result_type(output: &syn::ReturnType) -> Result<&syn::Type, String> {
    let syn::ReturnType::Type(_, ty) = output else { return Err("no return type (zbus::Result<T>)".to_owned()) };
    let syn::Type::Path(p) = ty.as_ref() else { return Err("a return type that is not zbus::Result<T>".to_owned()) };
    let last = p.path.segments.last().filter(|s| s.ident == "Result").ok_or("a return type that is not Result<T>")?;
    let syn::PathArguments::AngleBracketed(args) = &last.arguments else { return Err("Result without T".to_owned()) };
    args.args
        .iter()
        .find_map(|a| if let syn::GenericArgument::Type(t) = a { Some(t) } else { None })
        .ok_or_else(|| "Result without T".to_owned())
}

/// The `#[zbus(...)]` attributes of a proxy method.
#[derive(Default)]
struct MemberAttrs {
    name: Option<String>,
    signal: bool,
    /// `Some(emits)` for a property.
    property: Option<String>,
    /// `object = "…"` and friends: the method returns a proxy of the object path it gets.
    object: Option<&'static str>,
}

fn string_value(meta: &syn::meta::ParseNestedMeta<'_>) -> syn::Result<String> {
    Ok(meta.value()?.parse::<syn::LitStr>()?.value())
}

fn member_attrs(attrs: &[syn::Attribute]) -> Result<MemberAttrs, String> {
    let mut out = MemberAttrs::default();
    for attr in attrs.iter().filter(|a| a.path().is_ident("zbus")) {
        attr.parse_nested_meta(|meta| {
            let key = meta.path.get_ident().map(ToString::to_string).unwrap_or_default();
            match key.as_str() {
                "name" => out.name = Some(string_value(&meta)?),
                "signal" => out.signal = true,
                "property" => {
                    let mut emits = "true".to_owned();
                    if meta.input.peek(syn::token::Paren) {
                        meta.parse_nested_meta(|inner| {
                            if inner.path.is_ident("emits_changed_signal") {
                                emits = string_value(&inner)?;
                                Ok(())
                            } else {
                                Err(inner.error("an unknown property attribute"))
                            }
                        })?;
                    }
                    out.property = Some(emits);
                }
                "object" | "async_object" | "blocking_object" => {
                    string_value(&meta)?;
                    out.object = Some("o");
                }
                "object_vec" => out.object = Some("ao"),
                // These change how a call is made, not what it sends.
                "no_reply" | "no_autostart" | "allow_interactive_auth" => {}
                _ => return Err(meta.error("an unknown zbus attribute")),
            }
            Ok(())
        })
        .map_err(|e| e.to_string())?;
    }
    Ok(out)
}

/// The interface a `#[proxy(...)]` trait declares.
fn proxy_interface(item: &syn::ItemTrait) -> Result<Option<String>, String> {
    let Some(attr) = item.attrs.iter().find(|a| a.path().is_ident("proxy")) else { return Ok(None) };
    let mut interface = None;
    attr.parse_nested_meta(|meta| {
        let value = string_value(&meta)?;
        if meta.path.is_ident("interface") || meta.path.is_ident("name") {
            interface = Some(value);
        }
        Ok(())
    })
    .map_err(|e| e.to_string())?;
    interface.map(Some).ok_or_else(|| format!("proxy {} names no interface", item.ident))
}

/// One proxy method as the member it calls, reads or receives.
fn proxy_member(f: &syn::TraitItemFn) -> Result<((&'static str, String), Shape), String> {
    let attrs = member_attrs(&f.attrs)?;
    let rust = f.sig.ident.to_string();
    let inputs: Vec<&syn::Type> = f
        .sig
        .inputs
        .iter()
        .filter_map(|a| if let syn::FnArg::Typed(t) = a { Some(t.ty.as_ref()) } else { None })
        .collect();
    let ins = inputs.iter().map(|t| signature(t)).collect::<Result<String, String>>()?;
    let setter = attrs.property.is_some() && !inputs.is_empty();
    let base = if setter { rust.strip_prefix("set_").ok_or("a property setter not named set_…")? } else { &rust };
    let name = attrs.name.clone().unwrap_or_else(|| pascal_case(base));
    let shape = if let Some(emits) = attrs.property {
        let ty = if setter { ins } else { signature(result_type(&f.sig.output)?)? };
        Shape::Property { ty, read: !setter, write: setter, emits }
    } else if attrs.signal {
        Shape::Signal { args: ins }
    } else {
        let outs = match (attrs.object, result_type(&f.sig.output)?) {
            (Some(path), _) => path.to_owned(),
            // A tuple is several out arguments (zbus reads the body as a whole).
            (None, syn::Type::Tuple(t)) => t.elems.iter().map(signature).collect::<Result<String, String>>()?,
            (None, ty) => signature(ty)?,
        };
        Shape::Method { ins, outs }
    };
    Ok(((shape.kind(), name), shape))
}

/// zbus's member name for a Rust method name: `list_models` → `ListModels`.
fn pascal_case(rust: &str) -> String {
    rust.trim_start_matches("r#")
        .split('_')
        .map(|word| {
            let mut chars = word.chars();
            chars.next().map(|c| c.to_ascii_uppercase().to_string() + chars.as_str()).unwrap_or_default()
        })
        .collect()
}

/// Whether a proxy that caches a property as `proxy` says stays correct for a server that
/// emits as `xml` says: a cache is safe only where the server keeps it fresh.
fn emits_compatible(proxy: &str, xml: &str) -> bool {
    match proxy {
        "false" => true,
        "invalidates" => ["true", "invalidates", "const"].contains(&xml),
        "true" => ["true", "const"].contains(&xml),
        "const" => xml == "const",
        _ => false,
    }
}

/// Whether a proxy's member calls, receives or reads what the XML's declares: the same
/// signatures; for a property, the same type, an access the XML allows, and caching that
/// stays correct.
fn agrees(proxy: &Shape, xml: &Shape) -> bool {
    match (proxy, xml) {
        (
            Shape::Property { ty: pty, read: pread, write: pwrite, emits: pemits },
            Shape::Property { ty, read, write, emits },
        ) => ty == pty && (!pread || *read) && (!pwrite || *write) && emits_compatible(pemits, emits),
        _ => proxy == xml,
    }
}

/// Everything in which the proxies declared in `source` (Rust) differ from the contract
/// (the XML of each interface): a member the XML lacks or declares otherwise, and a member
/// of the XML no proxy covers. Empty when they agree.
fn proxy_drift(source: &str, contracts: &BTreeMap<String, String>) -> Vec<String> {
    let file = match syn::parse_file(source) {
        Ok(file) => file,
        Err(e) => return vec![format!("the proxies do not parse: {e}")],
    };
    let mut problems = Vec::new();
    let mut covered: BTreeMap<String, Members> = BTreeMap::new();
    for item in &file.items {
        let syn::Item::Trait(item) = item else { continue };
        let interface = match proxy_interface(item) {
            Ok(Some(interface)) => interface,
            Ok(None) => continue,
            Err(e) => {
                problems.push(e);
                continue;
            }
        };
        let Some(xml) = contracts.get(&interface) else {
            problems.push(format!("{interface}: proxy {} has no XML contract in dbus/", item.ident));
            continue;
        };
        let promised = xml_members(xml).remove(&interface).unwrap_or_default();
        let mine = covered.entry(interface.clone()).or_default();
        for f in item.items.iter().filter_map(|i| if let syn::TraitItem::Fn(f) = i { Some(f) } else { None }) {
            let (key, shape) = match proxy_member(f) {
                Ok(member) => member,
                Err(e) => {
                    problems.push(format!("{interface}: proxy method {}: {e}", f.sig.ident));
                    continue;
                }
            };
            let (kind, name) = (&key.0, &key.1);
            match promised.get(&key) {
                None => problems.push(format!("{interface}: the proxy's {kind} {name} is not in the XML")),
                Some(xml) if !agrees(&shape, xml) => {
                    problems.push(format!("{interface}: {kind} {name}: the proxy has {shape}, the XML {xml}"));
                }
                Some(_) => {}
            }
            mine.insert(key, shape);
        }
    }
    // The other direction: every member of an interface with a proxy has a proxy method.
    for (interface, mine) in &covered {
        let promised = xml_members(&contracts[interface]).remove(interface).unwrap_or_default();
        for (kind, name) in promised.keys().filter(|k| !mine.contains_key(*k)) {
            problems.push(format!("{interface}: the XML's {kind} {name} has no proxy"));
        }
    }
    for interface in contracts.keys().filter(|i| !covered.contains_key(*i)) {
        problems.push(format!("{interface}: the XML contract has no proxy"));
    }
    problems
}

/// Every interface's XML contract, by interface name.
fn contracts() -> BTreeMap<String, String> {
    ["org.corral.Corral1.Manager", "org.corral.Corral1.Model", "org.corral.Corral1.Job"]
        .into_iter()
        .map(|i| (i.to_owned(), contract(i)))
        .collect()
}

fn proxies_source() -> String {
    let file = repo_root().join("src/dbus/proxy.rs");
    std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()))
}

#[test]
fn the_client_proxies_match_the_xml_contract_both_ways() {
    let problems = proxy_drift(&proxies_source(), &contracts());
    assert!(problems.is_empty(), "src/dbus/proxy.rs differs from dbus/*.xml:\n  {}", problems.join("\n  "));
}

#[test]
fn the_proxy_check_catches_each_kind_of_difference() {
    let source = proxies_source();
    let contracts = contracts();
    let altered = |from: &str, to: &str| {
        assert!(source.contains(from), "src/dbus/proxy.rs no longer has {from:?}");
        proxy_drift(&source.replacen(from, to, 1), &contracts)
    };
    // A wrong argument type.
    assert_eq!(
        altered("fn unload(&self, name: &str)", "fn unload(&self, name: u32)"),
        ["org.corral.Corral1.Manager: method Unload: the proxy has (u) -> (), the XML (s) -> ()"]
    );
    // A wrong return type.
    assert_eq!(
        altered(
            "fn get_model(&self, name: &str) -> zbus::Result<OwnedObjectPath>",
            "fn get_model(&self, name: &str) -> zbus::Result<String>"
        ),
        ["org.corral.Corral1.Manager: method GetModel: the proxy has (s) -> (s), the XML (s) -> (o)"]
    );
    // A signal argument too many, a property of another type.
    assert_eq!(
        altered(
            "fn finished(&self, success: bool, error: String)",
            "fn finished(&self, success: bool, error: String, code: u32)"
        ),
        ["org.corral.Corral1.Job: signal Finished: the proxy has (bsu), the XML (bs)"]
    );
    assert_eq!(
        altered("fn pid(&self) -> zbus::Result<u32>", "fn pid(&self) -> zbus::Result<u64>"),
        ["org.corral.Corral1.Model: property Pid: the proxy has t read emits=true, the XML u read emits=true"]
    );
    // A property the server does not signal, cached as if it did.
    assert_eq!(
        altered(
            "#[zbus(property(emits_changed_signal = \"false\"))]\n    fn queue_depth",
            "#[zbus(property)]\n    fn queue_depth"
        ),
        [
            "org.corral.Corral1.Manager: property QueueDepth: the proxy has u read emits=true, the XML u read emits=false"
        ]
    );
    // A setter of a read-only property.
    assert_eq!(
        altered(
            "fn version(&self) -> zbus::Result<String>;",
            "fn version(&self) -> zbus::Result<String>;\n    #[zbus(property)]\n    fn set_version(&self, v: &str) -> zbus::Result<()>;"
        ),
        ["org.corral.Corral1.Manager: property Version: the proxy has s write emits=true, the XML s read emits=const"]
    );
    // A member the XML lacks (a misspelt name), which also leaves the XML's uncovered.
    assert_eq!(
        altered("fn unload(&self) -> zbus::Result<()>;", "fn unload_now(&self) -> zbus::Result<()>;"),
        [
            "org.corral.Corral1.Model: the proxy's method UnloadNow is not in the XML",
            "org.corral.Corral1.Model: the XML's method Unload has no proxy"
        ]
    );
    // A type the check cannot read is reported, not skipped (so its member counts as missing).
    assert_eq!(
        altered("fn size(&self) -> zbus::Result<u64>", "fn size(&self) -> zbus::Result<Bytes>"),
        [
            "org.corral.Corral1.Model: proxy method size: a type the check does not know: Bytes",
            "org.corral.Corral1.Model: the XML's property Size has no proxy"
        ]
    );
}
