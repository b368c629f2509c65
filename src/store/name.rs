//! Model names: `[registry/][namespace/]model[:tag]`, as Ollama writes them.
//!
//! A parsed [`ModelName`] is always complete (defaults filled in) and safe to use as
//! a path below `manifests/`: every part is checked for length and characters, so no
//! part can be empty, `.`/`..`, or contain a separator.

use std::fmt;
use std::path::PathBuf;

/// The registry a bare name refers to.
pub const DEFAULT_REGISTRY: &str = "registry.ollama.ai";
/// The namespace a name without one refers to.
pub const DEFAULT_NAMESPACE: &str = "library";
/// The tag a name without one refers to.
pub const DEFAULT_TAG: &str = "latest";

/// A complete, validated model name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModelName {
    registry: String,
    namespace: String,
    model: String,
    tag: String,
}

/// Why a name is not valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid model name '{name}': {reason}")]
pub struct InvalidName {
    /// The name as given (cut to a readable length).
    pub name: String,
    /// What is wrong with it.
    pub reason: String,
}

impl ModelName {
    /// Parses and validates a name, filling in the default registry, namespace and tag.
    pub fn parse(input: &str) -> Result<Self, InvalidName> {
        let fail = |reason: String| InvalidName { name: input.chars().take(200).collect(), reason };
        let trimmed = input.trim();
        if trimmed.is_empty() {
            return Err(fail("the name is empty".to_owned()));
        }
        if trimmed.len() > 512 {
            return Err(fail("longer than 512 characters".to_owned()));
        }
        let (path, tag) = match trimmed.rsplit_once(':') {
            // A colon after the last slash separates the tag; one before it is a registry port.
            Some((path, tag)) if !tag.contains('/') => (path, Some(tag)),
            _ => (trimmed, None),
        };
        let parts: Vec<&str> = path.split('/').collect();
        let (registry, namespace, model) = match parts.as_slice() {
            [model] => (DEFAULT_REGISTRY, DEFAULT_NAMESPACE, *model),
            [namespace, model] => (DEFAULT_REGISTRY, *namespace, *model),
            [registry, namespace, model] => (*registry, *namespace, *model),
            _ => return Err(fail("expected at most registry/namespace/model:tag".to_owned())),
        };
        check_part("registry", registry, 253, |c| c.is_ascii_alphanumeric() || "._-:".contains(c)).map_err(fail)?;
        check_part("namespace", namespace, 80, |c| c.is_ascii_alphanumeric() || "_-".contains(c)).map_err(fail)?;
        check_part("model", model, 80, |c| c.is_ascii_alphanumeric() || "._-".contains(c)).map_err(fail)?;
        let tag = tag.unwrap_or(DEFAULT_TAG);
        check_part("tag", tag, 80, |c| c.is_ascii_alphanumeric() || "._-".contains(c)).map_err(fail)?;
        Ok(Self {
            registry: registry.to_ascii_lowercase(),
            namespace: namespace.to_owned(),
            model: model.to_owned(),
            tag: tag.to_owned(),
        })
    }

    /// The registry host (with a port, if any).
    #[must_use]
    pub fn registry(&self) -> &str {
        &self.registry
    }

    /// The namespace.
    #[must_use]
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The model.
    #[must_use]
    pub fn model(&self) -> &str {
        &self.model
    }

    /// The tag.
    #[must_use]
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// The repository path a registry knows it by: `namespace/model`.
    #[must_use]
    pub fn repository(&self) -> String {
        format!("{}/{}", self.namespace, self.model)
    }

    /// The manifest's path relative to `manifests/`: `registry/namespace/model/tag`.
    #[must_use]
    pub fn manifest_path(&self) -> PathBuf {
        [&self.registry, &self.namespace, &self.model, &self.tag].iter().collect()
    }

    /// The full form: `registry/namespace/model:tag`.
    #[must_use]
    pub fn full(&self) -> String {
        format!("{}/{}/{}:{}", self.registry, self.namespace, self.model, self.tag)
    }
}

impl fmt::Display for ModelName {
    /// The short form Ollama shows: defaults left out (`llama3.2:latest`, `me/m:1`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.registry != DEFAULT_REGISTRY {
            write!(f, "{}/{}/", self.registry, self.namespace)?;
        } else if self.namespace != DEFAULT_NAMESPACE {
            write!(f, "{}/", self.namespace)?;
        }
        write!(f, "{}:{}", self.model, self.tag)
    }
}

impl std::str::FromStr for ModelName {
    type Err = InvalidName;

    fn from_str(s: &str) -> Result<Self, InvalidName> {
        Self::parse(s)
    }
}

fn check_part(what: &str, part: &str, max: usize, allowed: impl Fn(char) -> bool) -> Result<(), String> {
    if part.is_empty() {
        return Err(format!("the {what} is empty"));
    }
    if part.len() > max {
        return Err(format!("the {what} is longer than {max} characters"));
    }
    if let Some(bad) = part.chars().find(|c| !allowed(*c)) {
        return Err(format!("the {what} '{part}' contains {bad:?}"));
    }
    if !part.starts_with(|c: char| c.is_ascii_alphanumeric()) {
        return Err(format!("the {what} '{part}' must start with a letter or digit"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::ModelName;

    fn parse(s: &str) -> ModelName {
        ModelName::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn defaults_are_filled_in_and_left_out_when_shown() {
        let cases = [
            ("llama3.2", "registry.ollama.ai/library/llama3.2:latest", "llama3.2:latest"),
            ("llama3.2:3b", "registry.ollama.ai/library/llama3.2:3b", "llama3.2:3b"),
            ("me/tiny:v1", "registry.ollama.ai/me/tiny:v1", "me/tiny:v1"),
            ("localhost:5000/me/tiny", "localhost:5000/me/tiny:latest", "localhost:5000/me/tiny:latest"),
            ("hf.co/Org_x/Model-GGUF:Q4_K_M", "hf.co/Org_x/Model-GGUF:Q4_K_M", "hf.co/Org_x/Model-GGUF:Q4_K_M"),
            ("  padded:1  ", "registry.ollama.ai/library/padded:1", "padded:1"),
            ("Registry.Example/ns/m", "registry.example/ns/m:latest", "registry.example/ns/m:latest"),
        ];
        for (input, full, short) in cases {
            let name = parse(input);
            assert_eq!(name.full(), full, "{input}");
            assert_eq!(name.to_string(), short, "{input}");
            assert_eq!(parse(&name.to_string()), name, "{input}: the short form parses back");
        }
        let name = parse("localhost:5000/me/tiny:q8");
        assert_eq!(name.manifest_path(), Path::new("localhost:5000/me/tiny/q8"));
        assert_eq!(name.repository(), "me/tiny");
    }

    #[test]
    fn bad_names_are_refused_with_the_reason() {
        let cases = [
            ("", "empty"),
            ("   ", "empty"),
            ("a/b/c/d", "at most registry/namespace/model:tag"),
            ("../etc/passwd", "the registry '..' must start"),
            ("ns/..", "the model '..' must start"),
            ("model:", "the tag is empty"),
            ("/model", "the namespace is empty"),
            ("model:tag/x", "contains ':'"),
            ("mo del", "contains ' '"),
            ("model:ta g", "contains ' '"),
            ("model:.hidden", "must start with a letter or digit"),
            ("ns/-m", "must start with a letter or digit"),
            ("mödel", "contains 'ö'"),
            ("a\0b", "contains '\\0'"),
            ("m:t\\x", "contains '\\\\'"),
        ];
        for (input, reason) in cases {
            let err = ModelName::parse(input).expect_err(input).to_string();
            assert!(err.contains(reason), "{input:?}: {err}");
            assert!(err.starts_with("invalid model name"), "{err}");
        }
        let long = "m".repeat(81);
        assert!(ModelName::parse(&long).expect_err("long").to_string().contains("longer than 80"));
        assert!(ModelName::parse(&"x/".repeat(300)).expect_err("huge").to_string().contains("longer than 512"));
    }
    /// A valid part: a letter or digit, then up to `max` allowed characters.
    fn part(rest: &'static str, max: usize) -> impl proptest::strategy::Strategy<Value = String> {
        proptest::string::string_regex(&format!("[a-zA-Z0-9][{rest}]{{0,{max}}}")).expect("a regex")
    }

    /// Every component of the manifest path is one plain name: no separator, no NUL, not
    /// `.` or `..`, not empty.
    fn assert_safe(name: &ModelName) {
        let path = name.manifest_path();
        let parts: Vec<_> = path.components().collect();
        assert_eq!(parts.len(), 4, "{path:?}");
        for part in parts {
            let std::path::Component::Normal(part) = part else { panic!("{path:?}: {part:?}") };
            let part = part.to_str().expect("UTF-8");
            assert!(!part.is_empty() && part != "." && part != ".." && !part.contains(['/', '\\', '\0']), "{part:?}");
        }
    }

    proptest::proptest! {
        /// A valid name parses, its short and full forms parse back to it, and its path
        /// is four plain components.
        #[test]
        fn valid_names_round_trip(
            registry in proptest::option::of(part("a-zA-Z0-9._:-", 40)),
            namespace in proptest::option::of(part("a-zA-Z0-9_-", 30)),
            model in part("a-zA-Z0-9._-", 40),
            tag in proptest::option::of(part("a-zA-Z0-9._-", 30)),
        ) {
            let prefix = match (&registry, &namespace) {
                // A registry needs a namespace after it.
                (Some(registry), namespace) => format!("{registry}/{}/", namespace.as_deref().unwrap_or("library")),
                (None, Some(namespace)) => format!("{namespace}/"),
                (None, None) => String::new(),
            };
            let suffix = tag.as_ref().map(|tag| format!(":{tag}")).unwrap_or_default();
            let text = format!("{prefix}{model}{suffix}");
            let name = ModelName::parse(&text).map_err(|e| proptest::test_runner::TestCaseError::fail(e.to_string()))?;
            proptest::prop_assert_eq!(name.model(), model.as_str());
            proptest::prop_assert_eq!(name.tag(), tag.as_deref().unwrap_or(super::DEFAULT_TAG));
            proptest::prop_assert_eq!(&ModelName::parse(&name.to_string()).expect("short form"), &name);
            proptest::prop_assert_eq!(&ModelName::parse(&name.full()).expect("full form"), &name);
            proptest::prop_assert_eq!(name.to_string().parse::<ModelName>().expect("FromStr"), name.clone());
            assert_safe(&name);
        }

        /// Whatever is accepted from any text (separators, dots, colons, NUL and non-ASCII
        /// included) is a safe path and round-trips.
        #[test]
        fn anything_accepted_is_safe(text in "[a-c./:\\\\\\x00 é_-]{0,24}") {
            if let Ok(name) = ModelName::parse(&text) {
                assert_safe(&name);
                proptest::prop_assert_eq!(&ModelName::parse(&name.to_string()).expect("short form"), &name);
            }
        }
    }
}
