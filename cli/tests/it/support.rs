//! Shared helpers: guest components built from source, one sandbox, counting functions.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use async_trait::async_trait;
use rewind_host::agent::{Agent, AgentFile};
use rewind_host::event::Input;
use rewind_host::functions::{CallRequest, Function, FunctionError};
use rewind_host::sandbox::Sandbox;
use rewind_host::store::{ActionStateStore, InMemoryStore};

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("cli/ has a parent")
        .to_owned()
}

/// Path of the component of test guest `name`, building the guests first: "caller" is
/// tests/guests/caller (Rust), "caller_py" and "caller_js" its Python and JavaScript twins.
pub fn guest(name: &str) -> PathBuf {
    guests().join(format!("guest_{name}.wasm"))
}

/// Runs each named test (an `async fn(caller: &str)`) once per guest language, against the
/// caller guest in that language: `rust::name`, `python::name`, `javascript::name`.
macro_rules! in_every_language {
    ($($test:ident),* $(,)?) => {
        mod rust {
            $(#[tokio::test]
            async fn $test() {
                super::$test("caller").await
            })*
        }
        mod python {
            $(#[tokio::test]
            async fn $test() {
                super::$test("caller_py").await
            })*
        }
        mod javascript {
            $(#[tokio::test]
            async fn $test() {
                super::$test("caller_js").await
            })*
        }
    };
}

/// Builds every guest (tests/guests/ and the examples' actions, in all three languages)
/// once per test binary, as scripts/guests.sh does: `rewind build` of each agent, Rust into
/// target/guests; the directory their components are in.
fn guests() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        let root = workspace_root();
        let target = root.join("target").join("guests");
        let mut agents = vec![root.join("tests/guests/agent.toml")];
        let examples = std::fs::read_dir(root.join("examples")).expect("examples/");
        let mut examples: Vec<PathBuf> = examples
            .map(|entry| entry.expect("an entry").path().join("agent.toml"))
            .filter(|agent| agent.is_file())
            .collect();
        examples.sort();
        agents.extend(examples);
        for agent in agents {
            let status = Command::new(env!("CARGO_BIN_EXE_rewind"))
                .arg("build")
                .arg(&agent)
                .env("CARGO_TARGET_DIR", &target)
                .status()
                .expect("rewind runs");
            assert!(status.success(), "building {} failed", agent.display());
        }
        target.join("wasm32-wasip2").join("release")
    })
}

/// The directory guest components are built into (after building them).
pub fn guests_dir() -> PathBuf {
    guest("caller").parent().expect("a directory").to_owned()
}

/// One sandbox for the whole test binary, caching compiled components under target/.
pub fn sandbox() -> Arc<Sandbox> {
    static SANDBOX: OnceLock<Arc<Sandbox>> = OnceLock::new();
    SANDBOX
        .get_or_init(|| {
            let cache = workspace_root().join("target").join("rewind-test-cache");
            Arc::new(
                Sandbox::builder()
                    .cache_dir(Some(cache))
                    .instances(128)
                    .build()
                    .expect("sandbox"),
            )
        })
        .clone()
}

/// An agent.toml with one action `work` running test guest `guest_name` on inputs; `top`
/// goes before the tables (agent-level keys), `tables` after them.
pub fn agent_toml(guest_name: &str, top: &str, tables: &str) -> String {
    format!(
        "name = \"test\"\n{top}\n[[actions]]\nname = \"work\"\ncomponent = {path:?}\non = [\"input\"]\n{tables}",
        path = guest(guest_name).display().to_string(),
    )
}

pub fn agent_file(toml: &str) -> AgentFile {
    AgentFile::parse(Path::new("agent.toml"), toml).expect("valid agent.toml")
}

/// Loads `toml` with `store` and the given custom functions, declaring each of them
/// (`kind = "custom"`) unless `toml` already does.
pub fn agent_with(
    toml: &str,
    store: Arc<dyn ActionStateStore>,
    functions: &[(&str, Arc<dyn Function>)],
) -> Agent {
    let mut toml = toml.to_owned();
    for (name, _) in functions {
        if !toml.contains(&format!("[functions.{name}]")) {
            toml.push_str(&format!("\n[functions.{name}]\nkind = \"custom\"\n"));
        }
    }
    let mut builder = Agent::builder(agent_file(&toml), sandbox()).store(store);
    for (name, function) in functions {
        builder = builder.function(*name, Arc::clone(function));
    }
    builder.build().expect("agent loads")
}

pub fn memory_store() -> Arc<InMemoryStore> {
    Arc::new(InMemoryStore::default())
}

pub fn input(key: &str, sequence: u64, payload: serde_json::Value) -> Input {
    Input {
        key: key.to_owned(),
        sequence,
        payload: payload.to_string(),
    }
}

/// A custom function that counts its calls and remembers their idempotency keys.
#[derive(Debug, Default)]
pub struct Counting {
    calls: AtomicU64,
    keys: Mutex<Vec<String>>,
    /// When set, every call fails with this message.
    fail_with: Option<String>,
    /// The args of every call, in order.
    args: Mutex<Vec<String>>,
    /// Calls answered "unavailable" before the function starts answering: an outage that
    /// ends the run without a record, as a crash would.
    unavailable_first: u64,
    /// When set, only calls whose args contain this count toward `unavailable_first`.
    down_for: Option<String>,
    matched: AtomicU64,
}

impl Counting {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    pub fn failing(message: &str) -> Arc<Self> {
        Arc::new(Self {
            fail_with: Some(message.to_owned()),
            ..Self::default()
        })
    }

    /// Unavailable for the first `n` calls, then answers.
    pub fn unavailable_first(n: u64) -> Arc<Self> {
        Arc::new(Self {
            unavailable_first: n,
            ..Self::default()
        })
    }

    /// Unavailable for the first `n` calls whose args contain `fragment`; answers the rest.
    pub fn unavailable_first_of(n: u64, fragment: &str) -> Arc<Self> {
        Arc::new(Self {
            unavailable_first: n,
            down_for: Some(fragment.to_owned()),
            ..Self::default()
        })
    }

    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    pub fn keys(&self) -> Vec<String> {
        self.keys.lock().expect("lock").clone()
    }

    /// The args of every call, in order.
    pub fn args(&self) -> Vec<String> {
        self.args.lock().expect("lock").clone()
    }
}

#[async_trait]
impl Function for Counting {
    async fn call(&self, request: CallRequest<'_>) -> Result<String, FunctionError> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        self.keys
            .lock()
            .expect("lock")
            .push(request.idempotency_key.to_owned());
        self.args
            .lock()
            .expect("lock")
            .push(request.args.to_owned());
        let down_for = self.down_for.as_deref();
        if down_for.is_none_or(|fragment| request.args.contains(fragment))
            && self.matched.fetch_add(1, Ordering::SeqCst) < self.unavailable_first
        {
            return Err(FunctionError::Unavailable("the service is down".to_owned()));
        }
        match &self.fail_with {
            Some(message) => Err(FunctionError::Failed(message.clone())),
            None => Ok(serde_json::json!({ "n": n, "args": serde_json::from_str::<serde_json::Value>(request.args).unwrap_or_default() }).to_string()),
        }
    }
}

/// The payload of the first output, parsed.
/// Why the input failed; panics when it did not.
pub fn error_of(report: &rewind_host::agent::InputReport) -> String {
    report
        .error
        .as_ref()
        .map(ToString::to_string)
        .unwrap_or_else(|| panic!("the run should fail: {report:?}"))
}

pub fn first_output(report: &rewind_host::agent::InputReport) -> serde_json::Value {
    let output = report
        .outputs
        .first()
        .unwrap_or_else(|| panic!("no output: {report:?}"));
    serde_json::from_str(&output.payload).expect("output is JSON")
}

/// A certificate authority made for a test, and the certificates it signs, as PEM files in
/// a directory.
pub struct TestCa {
    dir: PathBuf,
    ca: rcgen::Certificate,
    key: rcgen::KeyPair,
    /// The authority's certificate, for clients and servers to trust.
    pub ca_pem: PathBuf,
}

impl TestCa {
    pub fn new(dir: &Path) -> Self {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "Rewind test CA");
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
        ];
        let key = rcgen::KeyPair::generate().expect("key");
        let ca = params.self_signed(&key).expect("self-signed");
        let ca_pem = dir.join("ca.pem");
        std::fs::write(&ca_pem, ca.pem()).expect("write the CA");
        Self {
            dir: dir.to_owned(),
            ca,
            key,
            ca_pem,
        }
    }

    /// A certificate for `localhost` and 127.0.0.1, good for a server and a client: the
    /// paths of its PEM chain and its key, `NAME.pem` and `NAME.key`.
    pub fn issue(&self, name: &str) -> (PathBuf, PathBuf) {
        let mut params =
            rcgen::CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
                .expect("params");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.ca, &self.key).expect("signed");
        let (cert_path, key_path) = (
            self.dir.join(format!("{name}.pem")),
            self.dir.join(format!("{name}.key")),
        );
        std::fs::write(&cert_path, cert.pem()).expect("write the certificate");
        std::fs::write(&key_path, key.serialize_pem()).expect("write the key");
        (cert_path, key_path)
    }

    /// A client that trusts this authority only.
    pub fn client(&self) -> reqwest::Client {
        let pem = std::fs::read(&self.ca_pem).expect("the CA");
        reqwest::Client::builder()
            .tls_built_in_root_certs(false)
            .add_root_certificate(reqwest::Certificate::from_pem(&pem).expect("a certificate"))
            .https_only(true)
            .build()
            .expect("client")
    }
}
