//! NATS servers for tests and benchmarks: one node or a cluster on loopback, each a
//! nats-server process with JetStream, its config written here, stopped and started by PID.
//!
//! Debian's nats-server (2.9) is what the project's tooling installs (`scripts/test.sh`).

use std::fmt::Write as _;
use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use async_trait::async_trait;

use crate::log::Authority;

/// The only host there is: it holds every partition, so a fenced log's checks run and
/// always pass.
#[derive(Debug)]
pub struct SoleHolder;

#[async_trait]
impl Authority for SoleHolder {
    async fn holds(&self) -> Result<bool, async_nats::Error> {
        Ok(true)
    }
}

/// How long a node may take to answer that it is healthy (JetStream ready, a cluster's
/// meta leader elected).
const READY_WITHIN: Duration = Duration::from_secs(30);

/// nats-server processes on loopback, killed when dropped.
#[derive(Debug)]
pub struct NatsServers {
    nodes: Vec<Node>,
    _dir: tempfile::TempDir,
}

#[derive(Debug)]
struct Node {
    name: String,
    port: u16,
    monitor_port: u16,
    config: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

/// The program: Debian puts it in /usr/sbin, which is not on every user's PATH.
fn program() -> &'static str {
    ["/usr/sbin/nats-server", "/usr/bin/nats-server"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .unwrap_or("nats-server")
}

/// `count` distinct free ports: each held until all are chosen, so that none is handed
/// out twice. (Another process may still take one before a server binds it: starting
/// retries with new ports.)
fn free_ports(count: usize) -> anyhow::Result<Vec<u16>> {
    let listeners = (0..count)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<Vec<_>>>()?;
    listeners
        .iter()
        .map(|l| Ok(l.local_addr()?.port()))
        .collect()
}

/// The largest message of the servers, unless a test asks for another: 8 MiB.
const MAX_PAYLOAD: u64 = 8 << 20;

/// Attempts at starting the servers, each with new ports.
const START_ATTEMPTS: usize = 3;

impl NatsServers {
    /// One node with JetStream.
    pub fn single() -> anyhow::Result<Self> {
        Self::start_nodes(1, MAX_PAYLOAD, "")
    }

    /// One node with JetStream and `more` lines in its config (a `tls` block, an
    /// `authorization` block).
    pub fn single_with_config(more: &str) -> anyhow::Result<Self> {
        Self::start_nodes(1, MAX_PAYLOAD, more)
    }

    /// One node with JetStream whose largest message is `max_payload` bytes (the NATS
    /// default is 1 MiB).
    pub fn single_with_max_payload(max_payload: u64) -> anyhow::Result<Self> {
        Self::start_nodes(1, max_payload, "")
    }

    /// A cluster of `nodes` nodes with JetStream (3 for streams of 3 replicas).
    pub fn cluster(nodes: usize) -> anyhow::Result<Self> {
        Self::start_nodes(nodes, MAX_PAYLOAD, "")
    }

    fn start_nodes(count: usize, max_payload: u64, more: &str) -> anyhow::Result<Self> {
        let mut attempt = 1;
        loop {
            match Self::try_start_nodes(count, max_payload, more) {
                Ok(servers) => return Ok(servers),
                Err(e) if attempt < START_ATTEMPTS => {
                    tracing::warn!("starting nats-server (attempt {attempt}): {e:#}");
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn try_start_nodes(count: usize, max_payload: u64, more: &str) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir().context("a directory for the NATS servers")?;
        let ports: Vec<(u16, u16, u16)> = free_ports(3 * count)?
            .chunks(3)
            .map(|p| (p[0], p[1], p[2]))
            .collect();
        let mut nodes = Vec::with_capacity(count);
        for (i, &(port, cluster_port, monitor_port)) in ports.iter().enumerate() {
            let name = format!("n{}", i + 1);
            let store = dir.path().join(&name);
            let mut config = format!(
                "server_name: {name}\nlisten: 127.0.0.1:{port}\nhttp: 127.0.0.1:{monitor_port}\n\
                 max_payload: {max_payload}\njetstream {{ store_dir: {store:?} }}\n{more}\n"
            );
            if count > 1 {
                let routes: Vec<String> = ports
                    .iter()
                    .enumerate()
                    .filter(|&(j, _)| j != i)
                    .map(|(_, &(_, cluster, _))| format!("nats-route://127.0.0.1:{cluster}"))
                    .collect();
                writeln!(
                    config,
                    "cluster {{ name: rewind, listen: 127.0.0.1:{cluster_port}, routes: [{}] }}",
                    routes.join(", ")
                )?;
            }
            let path = dir.path().join(format!("{name}.conf"));
            std::fs::write(&path, config).with_context(|| format!("writing {path:?}"))?;
            nodes.push(Node {
                log: dir.path().join(format!("{name}.log")),
                name,
                port,
                monitor_port,
                config: path,
                child: None,
            });
        }
        let mut servers = Self { nodes, _dir: dir };
        for node in 0..count {
            servers.spawn(node)?;
        }
        for node in 0..count {
            servers.wait_ready(node)?;
        }
        Ok(servers)
    }

    /// The client URLs of every node, comma-separated (what `log::jetstream_client` takes).
    pub fn url(&self) -> String {
        self.nodes
            .iter()
            .map(|node| format!("nats://127.0.0.1:{}", node.port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The server name of `node` (what stream info gives as a leader or replica).
    pub fn name(&self, node: usize) -> &str {
        &self.nodes[node].name
    }

    /// The process id of `node`, while it runs.
    pub fn pid(&self, node: usize) -> Option<u32> {
        self.nodes[node].child.as_ref().map(Child::id)
    }

    fn spawn(&mut self, node: usize) -> anyhow::Result<()> {
        let node = &mut self.nodes[node];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&node.log)
            .with_context(|| format!("opening {:?}", node.log))?;
        let child = Command::new(program())
            .arg("-c")
            .arg(&node.config)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting nats-server (scripts/test.sh installs it)")?;
        node.child = Some(child);
        Ok(())
    }

    /// Waits until `node` says it is healthy (its JetStream is ready).
    fn wait_ready(&mut self, node: usize) -> anyhow::Result<()> {
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            if let Some(child) = &mut self.nodes[node].child
                && let Some(status) = child.try_wait()?
            {
                let log = std::fs::read_to_string(&self.nodes[node].log).unwrap_or_default();
                bail!(
                    "nats-server {} exited ({status}):\n{log}",
                    self.nodes[node].name
                );
            }
            if healthy(self.nodes[node].monitor_port) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "nats-server {} was not healthy within {READY_WITHIN:?}",
                    self.nodes[node].name
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills `node` with SIGKILL and waits for it to exit.
    pub fn kill(&mut self, node: usize) -> anyhow::Result<()> {
        if let Some(mut child) = self.nodes[node].child.take() {
            child.kill().context("killing nats-server")?;
            child.wait()?;
        }
        Ok(())
    }

    /// Stops `node` with SIGTERM (it flushes its store and leaves) and waits for it to exit.
    pub fn stop(&mut self, node: usize) -> anyhow::Result<()> {
        if let Some(mut child) = self.nodes[node].child.take() {
            let pid = rustix::process::Pid::from_raw(i32::try_from(child.id())?)
                .context("nats-server's pid")?;
            rustix::process::kill_process(pid, rustix::process::Signal::TERM)
                .context("stopping nats-server")?;
            child.wait()?;
        }
        Ok(())
    }

    /// Starts `node` (stopped or killed before) again, with the same config, ports and
    /// store, and waits until it is healthy.
    pub fn start(&mut self, node: usize) -> anyhow::Result<()> {
        if self.nodes[node].child.is_some() {
            bail!("nats-server {} is running", self.nodes[node].name);
        }
        self.spawn(node)?;
        self.wait_ready(node)
    }

    /// Stops `node` and starts it again.
    pub fn restart(&mut self, node: usize) -> anyhow::Result<()> {
        self.stop(node)?;
        self.start(node)
    }
}

/// Whether the monitoring endpoint's `/healthz` answers 200.
fn healthy(monitor_port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", monitor_port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let request = "GET /healthz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer.starts_with("HTTP/1.1 200") || answer.starts_with("HTTP/1.0 200")
}

impl Drop for NatsServers {
    fn drop(&mut self) {
        for node in 0..self.nodes.len() {
            let _ = self.kill(node);
        }
    }
}
