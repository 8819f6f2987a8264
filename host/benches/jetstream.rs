//! Issue #7's figures: durable calls over the JetStream log, beside raw JetStream
//! publish-acks of the same run, on one node and on a 3-node cluster with 3 replicas (all on
//! loopback). A bench binary (not criterion). Throughput is measured in rounds, each
//! running every figure once, one after another, so that each round's ratios compare runs
//! that saw the same machine; each round starts with the next figure, so that none always
//! runs first or last; the summary gives the medians.
//!
//! `cargo bench -p rewind-host --bench jetstream`; results in BENCHMARKS.md. Runs both
//! setups; `-- one` or `-- R3` runs the setup whose name contains that word.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, stream};
use bytes::Bytes;
use rewind_host::event::Event;
use rewind_host::functions::Functions;
use rewind_host::log::{JetStreamLog, Log, MemoryLog, StreamSpec, connect_nats};
use rewind_host::store::{ActionState, ActionStateStore, LogStore, MarkerStrategy};
use rewind_host::testing::nats::{NatsServers, SoleHolder};

use common::{calls as calls_of, calls_per_second_64_keys, key, noop_functions};

mod common;

const PARTITIONS: u32 = 8;
const SAMPLES: usize = 1_000;
const PER_KEY: u64 = 400;
const ROUNDS: usize = 12;
/// Raw, raw with ids, fenced appends, durable calls, durable calls with group commit.
const FIGURES: usize = 5;

/// The CPU time this process (the host side: client, log, store, calls) has used so far.
fn cpu_time() -> Duration {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    Duration::from_secs(u64::try_from(now.tv_sec).expect("a CPU time is positive"))
        + Duration::from_nanos(u64::try_from(now.tv_nsec).expect("a CPU time is positive"))
}

/// One throughput figure: operations per second, and this process's CPU time per
/// operation (what the host side costs, beside the servers that share the machine).
#[derive(Clone, Copy)]
struct Rate {
    per_second: f64,
    cpu_per_op: Duration,
}

async fn rate(run: impl Future<Output = f64>) -> Rate {
    let started = cpu_time();
    let per_second = run.await;
    Rate {
        per_second,
        cpu_per_op: (cpu_time() - started).div_f64((64 * PER_KEY) as f64),
    }
}

fn median_of(mut values: Vec<f64>) -> f64 {
    values.sort_unstable_by(f64::total_cmp);
    values[values.len() / 2]
}

/// The partition of the 64-key run's `k`-th key: raw publishers and log appends load the
/// streams as the durable calls do (a key's partition is a hash of it, so some streams
/// get more keys than others).
fn partition_of(k: u64) -> u32 {
    key(&format!("key-{k}"), 0).scope.partition(PARTITIONS)
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort_unstable();
    samples[samples.len() / 2]
}

fn specs(prefix: &str, replicas: usize) -> Vec<StreamSpec> {
    (0..PARTITIONS)
        .map(|p| StreamSpec::new(format!("{prefix}-{p}"), format!("{prefix}.{p}"), replicas))
        .collect()
}

/// A fenced JetStream log of [`PARTITIONS`] streams, as a cluster host has; with group
/// commit or without.
async fn fenced_log(
    context: &jetstream::Context,
    prefix: &str,
    replicas: usize,
    group_commit: bool,
) -> Arc<dyn Log> {
    let specs = specs(prefix, replicas)
        .into_iter()
        .map(|spec| spec.group_commit(group_commit))
        .collect();
    let log = JetStreamLog::open(context.clone(), specs, Some(Arc::new(SoleHolder)))
        .await
        .expect("log");
    Arc::new(log)
}

/// A store over a [`fenced_log`].
async fn open_store(
    context: &jetstream::Context,
    prefix: &str,
    replicas: usize,
    group_commit: bool,
) -> Arc<dyn ActionStateStore> {
    let log = fenced_log(context, prefix, replicas, group_commit).await;
    Arc::new(LogStore::new(
        log,
        MarkerStrategy::Offsets,
        rewind_host::store::Incarnation::random(),
    ))
}

/// The mean size of the states a store wrote to `log`'s partitions.
async fn mean_record_size(log: &MemoryLog) -> usize {
    let (mut bytes, mut records) = (0, 0);
    for partition in 0..log.partitions() {
        let mut from = 0;
        loop {
            let batch = log.read(partition, from, 1_000).await.expect("read");
            let Some(last) = batch.last() else { break };
            from = last.offset + 1;
            records += batch.len();
            bytes += batch.iter().map(|r| r.payload.len()).sum::<usize>();
        }
    }
    bytes / records.max(1)
}

/// What durable calls write, measured on an in-memory log: the size of a state with one
/// call (the latency figure's), and the mean size of the states of
/// [`calls_per_second_64_keys`] (one to four calls each). Raw publishes carry as many
/// bytes.
async fn state_sizes(functions: &Arc<Functions>) -> (usize, usize) {
    let in_memory = async |calls: u64| {
        let log = Arc::new(MemoryLog::new(PARTITIONS));
        let store: Arc<dyn ActionStateStore> = Arc::new(LogStore::new(
            Arc::clone(&log) as Arc<dyn Log>,
            MarkerStrategy::Offsets,
            rewind_host::store::Incarnation::random(),
        ));
        if calls == 1 {
            let state = ActionState::new(key("one", 0), Event::new("input", "{}"));
            let mut run = calls_of(&store, functions, state);
            let result = run.call("noop", r#"{"q":"where is my order?"}"#).await;
            assert!(matches!(result, Ok(Ok(_))));
        } else {
            calls_per_second_64_keys(&store, functions, calls).await;
        }
        mean_record_size(&log).await
    };
    (in_memory(1).await, in_memory(8).await)
}

/// The server that leads stream `name`'s replicas, once it has one (`None` on one node).
async fn leader(context: &jetstream::Context, name: &str) -> Option<String> {
    let started = Instant::now();
    loop {
        let mut stream = context.get_stream(name).await.expect("stream");
        let cluster = stream.info().await.expect("stream info").cluster.clone();
        match cluster {
            None => return None,
            Some(cluster) if cluster.leader.is_some() => return cluster.leader,
            Some(_) => {
                assert!(
                    started.elapsed() < Duration::from_secs(10),
                    "{name} has no leader"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// The subject of a raw stream led by the server that leads `stream`: a raw publish and a
/// durable call then take the same way through the cluster. (Leaders are placed at random;
/// a publish to a stream led by another server than the client's crosses one more route
/// each way, which costs about as much as the durable call's own work.)
async fn raw_subject_led_like(
    context: &jetstream::Context,
    stream: &str,
    prefix: &str,
    replicas: usize,
) -> String {
    let wanted = leader(context, stream).await;
    for n in 0..64 {
        let (name, subject) = (format!("{prefix}-{n}"), format!("{prefix}.{n}"));
        create_stream(context, &name, &subject, replicas).await;
        if leader(context, &name).await == wanted {
            return subject;
        }
    }
    panic!("none of 64 streams is led by {wanted:?}, which leads {stream}");
}

/// For each of `stores` (named by their streams' prefix): the median of a live durable call
/// (no-op handler, one key), and that of a raw publish and its acknowledgement to a stream
/// led by the server that leads the call's. Sampled in turn, so that all see the same
/// cluster.
async fn latencies(
    bytes: usize,
    context: &jetstream::Context,
    stores: &[(&str, &Arc<dyn ActionStateStore>)],
    functions: &Arc<Functions>,
    prefix: &str,
    replicas: usize,
) -> Vec<(Duration, Duration)> {
    let partition = key("one", 0).scope.partition(PARTITIONS);
    let mut subjects = Vec::with_capacity(stores.len());
    for (name, _) in stores {
        let stream = format!("{name}-{partition}");
        subjects.push(raw_subject_led_like(context, &stream, prefix, replicas).await);
    }
    let payload = Bytes::from(vec![7u8; bytes]);
    let mut samples =
        vec![(Vec::with_capacity(SAMPLES), Vec::with_capacity(SAMPLES)); stores.len()];
    for n in 0..SAMPLES as u64 {
        for (((_, store), subject), (raw, calls)) in stores.iter().zip(&subjects).zip(&mut samples)
        {
            let started = Instant::now();
            context
                .publish(subject.clone(), payload.clone())
                .await
                .expect("publish")
                .await
                .expect("ack");
            raw.push(started.elapsed());

            let state = ActionState::new(key("one", n), Event::new("input", "{}"));
            let mut run = calls_of(store, functions, state);
            let started = Instant::now();
            let result = run.call("noop", r#"{"q":"where is my order?"}"#).await;
            calls.push(started.elapsed());
            assert!(matches!(result, Ok(Ok(_))));
        }
    }
    samples
        .into_iter()
        .map(|(raw, calls)| (median(raw), median(calls)))
        .collect()
}

/// Raw publish-acks per second from 64 publishers, each waiting for its ack before its
/// next publish, over [`PARTITIONS`] streams (publisher `k` to [`partition_of`] `k`).
async fn raw_throughput(
    bytes: usize,
    context: &jetstream::Context,
    prefix: &str,
    replicas: usize,
    with_ids: bool,
) -> f64 {
    create_streams(context, prefix, replicas).await;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for k in 0..64u64 {
        let context = context.clone();
        let subject = format!("{prefix}.{}", partition_of(k));
        tasks.push(tokio::spawn(async move {
            let payload = Bytes::from(vec![7u8; bytes]);
            for _ in 0..PER_KEY {
                let mut message = PublishMessage::build().payload(payload.clone());
                if with_ids {
                    message = message.message_id(format!("{:032x}", rand::random::<u128>()));
                }
                context
                    .send_publish(subject.clone(), message)
                    .await
                    .expect("publish")
                    .await
                    .expect("ack");
            }
        }));
    }
    for task in tasks {
        task.await.expect("task");
    }
    (64 * PER_KEY) as f64 / started.elapsed().as_secs_f64()
}

async fn create_streams(context: &jetstream::Context, prefix: &str, replicas: usize) {
    for spec in specs(prefix, replicas) {
        create_stream(context, &spec.name, &spec.subject, replicas).await;
    }
}

async fn create_stream(context: &jetstream::Context, name: &str, subject: &str, replicas: usize) {
    context
        .get_or_create_stream(stream::Config {
            name: name.to_owned(),
            subjects: vec![subject.to_owned()],
            num_replicas: replicas,
            duplicate_window: Duration::from_secs(40),
            ..stream::Config::default()
        })
        .await
        .expect("stream");
}

/// Appends per second to a fenced log from 64 tasks, over [`PARTITIONS`] streams (task `k`
/// to [`partition_of`] `k`): the log alone, without the durable call around it.
async fn log_appends(
    bytes: usize,
    context: &jetstream::Context,
    prefix: &str,
    replicas: usize,
) -> f64 {
    let log = fenced_log(context, prefix, replicas, false).await;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for k in 0..64 {
        let log = Arc::clone(&log);
        tasks.push(tokio::spawn(async move {
            for _ in 0..PER_KEY {
                log.append(partition_of(k), vec![7u8; bytes])
                    .await
                    .expect("append");
            }
        }));
    }
    for task in tasks {
        task.await.expect("task");
    }
    (64 * PER_KEY) as f64 / started.elapsed().as_secs_f64()
}

fn main() {
    // What follows `--` (cargo bench adds `--bench`).
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|arg| !arg.starts_with("--"))
        .collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let functions = noop_functions();
    runtime.block_on(async {
        let (one_call, mean) = state_sizes(&functions).await;
        println!("a state with one call: {one_call} bytes; 64 keys' states, mean: {mean} bytes");
        for (setup, nodes, replicas) in [("one node", 1, 1), ("3 nodes, R3", 3, 3)] {
            if !only.is_empty() && !only.iter().any(|word| setup.contains(word.as_str())) {
                continue;
            }
            let servers = if nodes == 1 {
                NatsServers::single()
            } else {
                NatsServers::cluster(nodes)
            }
            .expect("nats-server starts");
            let context = jetstream::new(connect_nats(&servers.url()).await.expect("connects"));
            let store = open_store(&context, "calls", replicas, false).await;
            let grouped = open_store(&context, "grouped", replicas, true).await;
            let stores = [("calls", &store), ("grouped", &grouped)];
            // Warm up first: a cluster just started is still settling its leaders.
            latencies(one_call, &context, &stores, &functions, "raw", replicas).await;
            let medians = latencies(one_call, &context, &stores, &functions, "raw", replicas).await;
            for (name, (raw, call)) in ["", ", group commit"].iter().zip(medians) {
                println!(
                    "{setup}: live durable call{name}, one key, median of {SAMPLES}: {call:>8.1?}  \
                     ({:.2}x raw publish-ack to a stream with the same leader: {raw:.1?})",
                    call.as_secs_f64() / raw.as_secs_f64()
                );
            }
            let mut rounds = Vec::with_capacity(ROUNDS);
            for round in 1..=ROUNDS {
                // Each round starts with the next figure: none always runs after the
                // others (and pays for the servers' collecting what they left).
                let mut figures = [None; FIGURES];
                for turn in 0..FIGURES {
                    let figure = (round + turn) % FIGURES;
                    figures[figure] = Some(match figure {
                        0 => rate(raw_throughput(mean, &context, "raw64", replicas, false)).await,
                        1 => rate(raw_throughput(mean, &context, "raw64ids", replicas, true)).await,
                        2 => rate(log_appends(mean, &context, "appends", replicas)).await,
                        3 => {
                            let store = open_store(&context, "calls64", replicas, false).await;
                            rate(calls_per_second_64_keys(&store, &functions, PER_KEY)).await
                        }
                        _ => {
                            let store = open_store(&context, "grouped64", replicas, true).await;
                            rate(calls_per_second_64_keys(&store, &functions, PER_KEY)).await
                        }
                    });
                }
                let figures = figures.map(|figure| figure.expect("every figure ran"));
                let raw = figures[0];
                let shown: Vec<String> = figures
                    .iter()
                    .map(|f| {
                        format!(
                            "{:>6.0}/s {:>4.2}x ({:>4.1?} CPU/op)",
                            f.per_second,
                            raw.per_second / f.per_second,
                            f.cpu_per_op
                        )
                    })
                    .collect();
                println!("{setup}: round {round}: {}", shown.join(" | "));
                rounds.push(figures);
            }
            let names = [
                "raw publish-acks, 64 publishers:      ",
                "the same with Nats-Msg-Id:            ",
                "fenced log appends, 64 tasks:         ",
                "durable calls, 64 keys:               ",
                "durable calls, 64 keys, group commit: ",
            ];
            for (i, name) in names.iter().enumerate() {
                let per_second = median_of(rounds.iter().map(|r| r[i].per_second).collect());
                let ratio = median_of(
                    rounds
                        .iter()
                        .map(|r| r[0].per_second / r[i].per_second)
                        .collect(),
                );
                let cpu = median_of(
                    rounds
                        .iter()
                        .map(|r| r[i].cpu_per_op.as_secs_f64())
                        .collect(),
                );
                println!(
                    "{setup}: {name} {per_second:>7.0} /s  {ratio:.2}x raw's time  \
                     (host CPU {:.1} µs/op; medians of {ROUNDS} rounds)",
                    cpu * 1e6
                );
            }
        }
    });
}
