//! `rewind cluster`: hosts sharing an agent's partitions over NATS JetStream
//! (`rewind_host::cluster`), and publishing to and reading from them.

use std::collections::HashMap;
use std::io::{BufRead as _, BufReader, Write as _};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Subcommand};
use rewind_host::agent::AgentFile;
use rewind_host::agent::input::parse_line;
use rewind_host::cluster::commands::ClusterCommands;
use rewind_host::cluster::{self, HostOptions, Layout};
use rewind_host::commands::Verb;
use rewind_host::log::{JetStreamLog, NatsAuth, NatsConnect, NatsTls};
use rewind_host::sandbox::Sandbox;

use super::operator::{self, CancelVerb, ResolveVerb, SignalVerb, SkipVerb, Which};

#[derive(Debug, Args)]
pub struct ClusterArgs {
    #[command(subcommand)]
    command: ClusterCommand,
}

/// Where the cluster is.
#[derive(Debug, Args)]
struct Where {
    /// NATS URLs, comma-separated.
    #[arg(long, env = "REWIND_NATS_URL", default_value = "nats://127.0.0.1:4222")]
    nats: String,
    #[command(flatten)]
    auth: NatsArgs,
    /// The first token of the cluster's streams, subjects and buckets.
    #[arg(long, default_value = "rewind")]
    prefix: String,
    /// The tenant the agent runs for.
    #[arg(long, default_value = rewind_host::agent::DEFAULT_TENANT)]
    tenant: String,
}

#[derive(Debug, Subcommand)]
enum ClusterCommand {
    /// Run this host's share of an agent's partitions until SIGINT or SIGTERM.
    Run {
        /// The agent's agent.toml.
        agent: PathBuf,
        #[command(flatten)]
        at: Where,
        /// Partitions of the agent's keys (the first host records it; the others must agree).
        #[arg(long, default_value_t = 8)]
        partitions: u32,
        /// Replicas of every stream: 3 in production (JetStream 2.9 acknowledges before
        /// fsync; durability comes from replication).
        #[arg(long, default_value_t = 1)]
        replicas: usize,
        /// Put state, output and checkpoint records that wait for a publish in one
        /// message: more calls per second for the same NATS, and offsets counted as
        /// (sequence − 1) × 256 + place in message. Fixed for a cluster's life.
        #[arg(long)]
        group_commit: bool,
        /// This host's name, unique among the hosts (default: one made from the pid).
        #[arg(long)]
        host: Option<String>,
        /// A host that has not renewed its lease for this long loses its partitions.
        #[arg(long, default_value_t = 5_000)]
        lease_ttl_ms: u64,
        #[command(flatten)]
        crash: super::CrashHook,
    },
    /// Publish a JSONL file of inputs ({"key": ..., "payload": ...}) to an agent.
    Publish {
        /// The agent's name.
        agent: String,
        #[command(flatten)]
        at: Where,
        #[arg(long)]
        input: PathBuf,
        /// Wait up to this many seconds for the cluster to exist and a host to run the
        /// agent (default: refused at once).
        #[arg(long, value_name = "SECONDS", default_value_t = 0)]
        wait: u64,
    },
    /// Print every output of the cluster's partitions as JSON Lines.
    Outputs {
        #[command(flatten)]
        at: Where,
    },
    /// Retry a parked input (the host that holds its partition carries it out, or the next
    /// one to take the partition, which retries every parked input anyway).
    Retry {
        /// The agent's name.
        agent: String,
        #[command(flatten)]
        at: Where,
        #[command(flatten)]
        which: Which,
    },
    /// Skip a parked input, saying why: its key's next input runs.
    Skip {
        agent: String,
        #[command(flatten)]
        at: Where,
        #[command(flatten)]
        which: Which,
        #[command(flatten)]
        verb: SkipVerb,
    },
    /// Answer a call of a parked input left in doubt, then retry the input.
    Resolve {
        agent: String,
        #[command(flatten)]
        at: Where,
        #[command(flatten)]
        which: Which,
        #[command(flatten)]
        verb: ResolveVerb,
    },
    /// Cancel a key's first unfinished input: it stops at its next durable call.
    Cancel {
        agent: String,
        #[command(flatten)]
        at: Where,
        #[command(flatten)]
        which: Which,
        #[command(flatten)]
        verb: CancelVerb,
    },
    /// Send a signal to a key's input (its first unfinished one, or --sequence).
    Signal {
        agent: String,
        #[command(flatten)]
        at: Where,
        #[command(flatten)]
        which: Which,
        #[command(flatten)]
        verb: SignalVerb,
    },
}

pub async fn cluster(
    args: ClusterArgs,
    sandbox: impl FnOnce() -> anyhow::Result<Sandbox>,
) -> anyhow::Result<ExitCode> {
    match args.command {
        ClusterCommand::Run {
            agent,
            at,
            partitions,
            replicas,
            group_commit,
            host,
            lease_ttl_ms,
            crash,
        } => {
            crash.arm()?;
            let file = AgentFile::load(&agent)?;
            let options = HostOptions {
                nats: at.connect()?,
                layout: Layout {
                    prefix: at.prefix,
                    partitions,
                    replicas,
                    group_commit,
                },
                host: host.unwrap_or_else(|| {
                    format!("pid{}-{:04x}", std::process::id(), rand::random::<u16>())
                }),
                tenant: at.tenant,
                lease_ttl: Duration::from_millis(lease_ttl_ms),
            };
            eprintln!(
                "rewind cluster: host {} joining {}",
                options.host,
                options.nats.shown()
            );
            cluster::run_host(
                options,
                file,
                Arc::new(sandbox()?),
                super::shutdown_signal(),
            )
            .await?;
            eprintln!("rewind cluster: left");
            Ok(ExitCode::SUCCESS)
        }
        ClusterCommand::Publish {
            agent,
            at,
            input,
            wait,
        } => publish(&agent, &at, &input, Duration::from_secs(wait)).await,
        ClusterCommand::Outputs { at } => outputs(&at).await,
        ClusterCommand::Retry { agent, at, which } => {
            command(&agent, &at, which, Verb::Retry).await
        }
        ClusterCommand::Skip {
            agent,
            at,
            which,
            verb,
        } => command(&agent, &at, which, verb.verb()?).await,
        ClusterCommand::Resolve {
            agent,
            at,
            which,
            verb,
        } => command(&agent, &at, which, verb.verb()?).await,
        ClusterCommand::Cancel {
            agent,
            at,
            which,
            verb,
        } => command(&agent, &at, which, verb.verb()).await,
        ClusterCommand::Signal {
            agent,
            at,
            which,
            verb,
        } => command(&agent, &at, which, verb.verb()?).await,
    }
}

/// Leaves `verb` for `which` input of `agent`, for the host that holds its partition.
async fn command(agent: &str, at: &Where, which: Which, verb: Verb) -> anyhow::Result<ExitCode> {
    let context = async_nats::jetstream::new(at.connect()?.connect().await?);
    let layout = Layout::load(&context, &at.prefix).await?;
    layout.check_runs(&context, &at.tenant, agent).await?;
    let commands = ClusterCommands::open(&context, &layout, &at.tenant, agent).await?;
    let command = commands
        .submit(which.key(), which.sequence(), &which.by(), verb)
        .await?;
    let left = format!(
        "the host that holds the key's partition of cluster `{}` carries it out within a \
         second, or the next one to take the partition does",
        at.prefix
    );
    let nobody = "no host holds the key's partition (the next one carries it out)";
    operator::wait(&command, which.wait(), &left, nobody, || async {
        Ok(commands.outcome(&command.id).await?)
    })
    .await
}

/// Credentials and TLS for NATS. Secrets come from the environment only (a command line is
/// visible to every user of the machine) and are never printed.
#[derive(Debug, Args)]
struct NatsArgs {
    /// The NATS user; its password is read from $REWIND_NATS_PASSWORD.
    #[arg(long, env = "REWIND_NATS_USER")]
    nats_user: Option<String>,
    /// A file holding a user NKey seed (SU…).
    #[arg(long, env = "REWIND_NATS_NKEY_FILE")]
    nats_nkey_file: Option<PathBuf>,
    /// A .creds file (a user JWT and its NKey seed).
    #[arg(long, env = "REWIND_NATS_CREDS")]
    nats_creds: Option<PathBuf>,
    /// PEM certificates of the authorities to trust for the servers' certificates.
    #[arg(long, env = "REWIND_NATS_CA")]
    nats_ca: Option<PathBuf>,
    /// This client's PEM certificate chain, for servers that verify clients (with
    /// --nats-key).
    #[arg(long, env = "REWIND_NATS_CERT", requires = "nats_key")]
    nats_cert: Option<PathBuf>,
    /// The private key of --nats-cert, PEM.
    #[arg(long, env = "REWIND_NATS_KEY", requires = "nats_cert")]
    nats_key: Option<PathBuf>,
    /// Refuse to talk to a server without TLS (implied by --nats-ca and --nats-cert).
    #[arg(long)]
    nats_tls: bool,
}

/// The token, read from the environment only.
const TOKEN_ENV: &str = "REWIND_NATS_TOKEN";
/// The password of --nats-user, read from the environment only.
const PASSWORD_ENV: &str = "REWIND_NATS_PASSWORD";

impl Where {
    /// How to reach NATS; an error names what does not fit together (never a secret).
    fn connect(&self) -> anyhow::Result<NatsConnect> {
        let args = &self.auth;
        let secret = |name: &str| -> anyhow::Result<Option<String>> {
            match std::env::var(name) {
                Ok(value) if !value.is_empty() => Ok(Some(value)),
                Ok(_) | Err(std::env::VarError::NotPresent) => Ok(None),
                Err(std::env::VarError::NotUnicode(_)) => {
                    anyhow::bail!("{name} is not UTF-8")
                }
            }
        };
        let mut kinds = Vec::new();
        let mut auth = NatsAuth::None;
        if let Some(user) = &args.nats_user {
            let Some(password) = secret(PASSWORD_ENV)? else {
                anyhow::bail!("--nats-user {user} needs its password in ${PASSWORD_ENV}");
            };
            kinds.push("--nats-user");
            auth = NatsAuth::UserPassword {
                user: user.clone(),
                password,
            };
        }
        if let Some(token) = secret(TOKEN_ENV)? {
            kinds.push(TOKEN_ENV);
            auth = NatsAuth::Token(token);
        }
        if let Some(path) = &args.nats_nkey_file {
            let seed = std::fs::read_to_string(path)
                .map_err(|e| anyhow::anyhow!("--nats-nkey-file {}: {e}", path.display()))?;
            kinds.push("--nats-nkey-file");
            auth = NatsAuth::NKey(seed.trim().to_owned());
        }
        if let Some(path) = &args.nats_creds {
            kinds.push("--nats-creds");
            auth = NatsAuth::CredsFile(path.clone());
        }
        if kinds.len() > 1 {
            anyhow::bail!(
                "NATS takes one kind of credentials, and {} are given",
                kinds.join(" and ")
            );
        }
        Ok(NatsConnect {
            urls: self.nats.clone(),
            auth,
            tls: NatsTls {
                ca: args.nats_ca.clone(),
                client: args.nats_cert.clone().zip(args.nats_key.clone()),
                require: args.nats_tls,
            },
        })
    }
}

async fn publish(
    agent: &str,
    at: &Where,
    input: &PathBuf,
    wait: Duration,
) -> anyhow::Result<ExitCode> {
    // Until `wait` has passed: the NATS server up, the cluster made, a host running the
    // agent.
    let deadline = std::time::Instant::now() + wait;
    let (context, layout) = loop {
        let ready = async {
            let context = async_nats::jetstream::new(at.connect()?.connect().await?);
            let layout = Layout::load(&context, &at.prefix).await?;
            layout.check_runs(&context, &at.tenant, agent).await?;
            anyhow::Ok((context, layout))
        };
        match ready.await {
            Ok(ready) => break ready,
            Err(error) if std::time::Instant::now() >= deadline => return Err(error),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    let reader = BufReader::new(
        std::fs::File::open(input).with_context(|| format!("cannot open {}", input.display()))?,
    );
    let (mut published, mut repeated, mut malformed) = (0u64, 0u64, 0u64);
    // Per (key, payload) without an id: how many such lines came before.
    let mut earlier: HashMap<(String, String), u64> = HashMap::new();
    for (index, line) in reader.lines().enumerate() {
        let number = index + 1;
        let line = line.with_context(|| format!("{}: line {number}", input.display()))?;
        match parse_line(number, &line) {
            Ok(None) => {}
            Ok(Some(parsed)) => {
                let count = match &parsed.id {
                    Some(_) => 0,
                    None => {
                        let count = earlier
                            .entry((parsed.key.clone(), parsed.payload.clone()))
                            .or_default();
                        *count += 1;
                        *count - 1
                    }
                };
                let id = cluster::inputs::event_id(&parsed, count);
                let published_as = cluster::inputs::publish(
                    &context,
                    &layout,
                    &at.tenant,
                    agent,
                    &id,
                    &parsed.key,
                    &parsed.payload,
                )
                .await
                .with_context(|| format!("{}: line {number}", input.display()))?;
                if published_as.duplicate {
                    repeated += 1;
                } else {
                    published += 1;
                }
            }
            Err(error) => {
                eprintln!("skipping {}: {error}", input.display());
                malformed += 1;
            }
        }
    }
    eprintln!(
        "published {published} inputs, {repeated} published before (dropped), skipped \
         {malformed} malformed lines; an event published again, under the same id, runs once"
    );
    Ok(if malformed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

async fn outputs(at: &Where) -> anyhow::Result<ExitCode> {
    let context = async_nats::jetstream::new(at.connect()?.connect().await?);
    let layout = Layout::load(&context, &at.prefix).await?;
    let streams = (0..layout.partitions)
        .map(|p| layout.output_stream(p))
        .collect();
    let log = JetStreamLog::open(context, streams, None).await?;
    let mut stdout = std::io::stdout().lock();
    for partition in 0..layout.partitions {
        let outputs = cluster::outputs::read_outputs(&log, partition, 0).await?;
        for (_, output) in outputs {
            let mut line = serde_json::to_vec(&output)?;
            line.push(b'\n');
            match stdout.write_all(&line) {
                Ok(()) => {}
                // The reader stopped reading (`| head`): nothing more to do.
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                    return Ok(ExitCode::SUCCESS);
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
