//! Fenced JetStream logs: once another host has taken a partition over, the host that held
//! it before cannot write to it, whatever it was doing at the time. Every test runs twice
//! (`nats/mod.rs`): on a stream of one record per message, and with group commit.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::message::PublishMessage;
use async_trait::async_trait;
use rewind_host::log::{
    Authority, IN_FLIGHT, JetStreamLog, Log, LogError, RETRY_FOR, StreamSpec, connect_nats,
};
use rewind_host::testing::nats::NatsServers;

use super::{Writer, appending_tasks, everything};

/// Whether this copy of the tests runs on streams with group commit (`nats/mod.rs`).
const GROUP_COMMIT: bool = ends_with(module_path!(), "_with_group_commit");

const fn ends_with(text: &str, suffix: &str) -> bool {
    let (text, suffix) = (text.as_bytes(), suffix.as_bytes());
    if text.len() < suffix.len() {
        return false;
    }
    let mut i = 0;
    while i < suffix.len() {
        if text[text.len() - suffix.len() + i] != suffix[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// Who holds the partition, as a lease bucket would say.
#[derive(Debug, Default)]
struct Holder(Mutex<&'static str>);

/// One host's view: it holds the partition while the holder is itself.
#[derive(Debug)]
struct Host {
    name: &'static str,
    holder: Arc<Holder>,
}

#[async_trait]
impl Authority for Host {
    async fn holds(&self) -> Result<bool, async_nats::Error> {
        Ok(*self.holder.0.lock().expect("holder") == self.name)
    }
}

fn streams() -> Vec<StreamSpec> {
    vec![StreamSpec::new("fenced-0", "fenced.0", 1).group_commit(GROUP_COMMIT)]
}

/// The offset of the (first) record of the message at `sequence`.
fn offset_at(sequence: u64) -> u64 {
    if GROUP_COMMIT {
        (sequence - 1) << 8
    } else {
        sequence - 1
    }
}

/// The sequence of the message that holds `offset`.
fn sequence_of(offset: u64) -> u64 {
    if GROUP_COMMIT {
        (offset >> 8) + 1
    } else {
        offset + 1
    }
}

async fn open(url: &str, name: &'static str, holder: &Arc<Holder>) -> JetStreamLog {
    *holder.0.lock().expect("holder") = name;
    let host = Host {
        name,
        holder: Arc::clone(holder),
    };
    open_with(url, None, Arc::new(host)).await
}

/// A log over `url` (a server, or a proxy to one) that holds the partition while
/// `authority` says so; acknowledgements time out after `ack_timeout` when one is given.
async fn open_with(
    url: &str,
    ack_timeout: Option<Duration>,
    authority: Arc<dyn Authority>,
) -> JetStreamLog {
    let client = connect_nats(url).await.expect("connects");
    let mut context = async_nats::jetstream::new(client);
    if let Some(timeout) = ack_timeout {
        context.set_timeout(timeout);
    }
    JetStreamLog::open(context, streams(), Some(authority))
        .await
        .expect("the holder opens its log")
}

/// The offset of the last fence message: that of the newest holder's fence, after which
/// nothing an earlier holder sent may land.
async fn last_fence(url: &str) -> u64 {
    let context = async_nats::jetstream::new(connect_nats(url).await.expect("connects"));
    let stream = context.get_stream("fenced-0").await.expect("stream");
    let fence = stream
        .get_last_raw_message_by_subject("fenced.0.fence")
        .await
        .expect("a fence");
    offset_at(fence.sequence)
}

/// An append a writer was told landed: where, and when it was told.
struct Landed {
    offset: u64,
    payload: Vec<u8>,
    at: std::time::Instant,
}

/// `tasks` tasks appending `a-TASK-I` to `log`, `pause` apart, until it is fenced (any
/// other error fails the test); the task returned gathers what they were told landed.
fn write_until_fenced(
    log: &Arc<JetStreamLog>,
    tasks: u32,
    pause: Duration,
) -> tokio::task::JoinHandle<Vec<Landed>> {
    let writers: Vec<_> = (0..tasks)
        .map(|task| {
            let log = Arc::clone(log);
            tokio::spawn(async move {
                let mut landed = Vec::new();
                for i in 0u32.. {
                    let payload = format!("a-{task}-{i}").into_bytes();
                    match log.append(0, payload.clone()).await {
                        Ok(offset) => landed.push(Landed {
                            offset,
                            payload,
                            at: std::time::Instant::now(),
                        }),
                        Err(LogError::Fenced { .. }) => return landed,
                        Err(other) => panic!("only fencing stops a writer: {other}"),
                    }
                    if !pause.is_zero() {
                        tokio::time::sleep(pause).await;
                    }
                }
                unreachable!()
            })
        })
        .collect();
    tokio::spawn(async move {
        let mut landed = Vec::new();
        for writer in writers {
            landed.extend(writer.await.expect("writer"));
        }
        landed
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_that_lost_its_partition_cannot_write_to_it() {
    let server = NatsServers::single().expect("nats-server starts");
    let holder = Arc::new(Holder::default());
    let zombie = open(&server.url(), "a", &holder).await;
    let before = zombie
        .append(0, b"a1".to_vec())
        .await
        .expect("the holder writes");

    // B takes over; A does not know and goes on writing.
    let successor = open(&server.url(), "b", &holder).await;
    let refused = zombie.append(0, b"a2".to_vec()).await;
    assert!(
        matches!(refused, Err(LogError::Fenced { .. })),
        "the zombie's write is refused: {refused:?}"
    );
    let error = refused.expect_err("refused").to_string();
    assert!(
        error.contains("fenced-0") && error.contains("another host"),
        "{error}"
    );
    // Fenced for good, also for appends that never reach the server.
    assert!(matches!(
        zombie.append(0, b"a3".to_vec()).await,
        Err(LogError::Fenced { .. })
    ));
    let after = successor
        .append(0, b"b1".to_vec())
        .await
        .expect("the new holder writes");

    let records = everything(&successor).await;
    assert_eq!(
        records,
        [(before, b"a1".to_vec()), (after, b"b1".to_vec())],
        "the zombie's writes are not in the log, and readers skip the fences"
    );
    assert!(
        after > before + 1,
        "the fences take offsets: {before} then {after}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_during_writes_leaves_exactly_the_acknowledged_ones() {
    let server = NatsServers::single().expect("nats-server starts");
    let holder = Arc::new(Holder::default());
    let zombie = Arc::new(open(&server.url(), "a", &holder).await);

    // A writes from 48 tasks without pause (more than a writer keeps in flight) while B
    // takes over.
    let writers = write_until_fenced(&zombie, 48, Duration::ZERO);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let successor = open(&server.url(), "b", &holder).await;
    let acknowledged: BTreeSet<(u64, Vec<u8>)> = writers
        .await
        .expect("writers")
        .into_iter()
        .map(|landed| (landed.offset, landed.payload))
        .collect();
    let fence = last_fence(&server.url()).await;
    successor.append(0, b"b".to_vec()).await.expect("B writes");

    let records = everything(&successor).await;
    let from_a: BTreeSet<(u64, Vec<u8>)> = records
        .iter()
        .filter(|(_, p)| p.starts_with(b"a-"))
        .cloned()
        .collect();
    assert!(
        acknowledged.len() > 10,
        "A wrote before the takeover: {}",
        acknowledged.len()
    );
    assert_eq!(
        from_a, acknowledged,
        "every write A was told landed is in the log, and no other"
    );
    assert!(
        from_a.iter().all(|(offset, _)| *offset < fence),
        "nothing of A's lands after B's fence (at {fence}): {:?}",
        from_a.iter().map(|(offset, _)| offset).max()
    );
}

/// A writer keeps publishes in flight, each predicting the place its predecessor lands at;
/// a new holder's fence that takes one of those places makes the next prediction true. A
/// paused zombie's full window, sent as it wakes (after the fence, or racing it), must not
/// land after the fence: it is as long as the window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombies_pipelined_writes_cannot_land_after_the_fence() {
    let server = NatsServers::single().expect("nats-server starts");
    let raw = async_nats::jetstream::new(connect_nats(&server.url()).await.expect("connects"));
    let holder = Arc::new(Holder::default());
    for round in 0..6 {
        let zombie = open(&server.url(), "a", &holder).await;
        let last = sequence_of(
            zombie
                .append(0, b"a".to_vec())
                .await
                .expect("the holder writes"),
        );
        // Its window, as its writer would have sent it: each expecting the one before.
        let window = async {
            let mut acks = Vec::new();
            for i in 0..IN_FLIGHT as u64 {
                let message = PublishMessage::build()
                    .payload(format!("zombie-{round}-{i}").into_bytes().into())
                    .message_id(format!("zombie-{round}-{i}"))
                    .expected_last_sequence(last + i);
                acks.push(raw.send_publish("fenced.0", message).await.expect("sent"));
            }
            let mut landed = Vec::new();
            for ack in acks {
                if let Ok(ack) = ack.await {
                    landed.push(offset_at(ack.sequence));
                }
            }
            landed
        };
        let url = server.url();
        let (successor, landed) = if round == 0 {
            // Wakes after the fence.
            let successor = open(&url, "b", &holder).await;
            (successor, window.await)
        } else {
            // Wakes while the fence is being written.
            tokio::join!(open(&url, "b", &holder), window)
        };
        let fence = last_fence(&url).await;
        assert!(
            landed.iter().all(|&offset| offset < fence),
            "round {round}: the zombie's writes that landed ({landed:?}) are all before the end \
             of the new holder's fence ({fence})"
        );
        successor
            .append(0, format!("b-{round}").into_bytes())
            .await
            .expect("the new holder writes");
        if round == 0 {
            assert!(
                landed.is_empty(),
                "sent after the fence, all refused: {landed:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_carry_on_across_a_server_restart() {
    let server = NatsServers::single().expect("nats-server starts");
    // Unfenced (on a stream with group commit: each append a message, its offset packed).
    let context = async_nats::jetstream::new(connect_nats(&server.url()).await.expect("connects"));
    let log = JetStreamLog::open(context, streams(), None)
        .await
        .expect("opens");
    carry_on_across_a_restart(server, log).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_appends_carry_on_across_a_server_restart() {
    let server = NatsServers::single().expect("nats-server starts");
    let log = open(&server.url(), "a", &Arc::new(Holder::default())).await;
    carry_on_across_a_restart(server, log).await;
}

/// 400 appends, one after the other, while the server restarts: each lands once, in order.
async fn carry_on_across_a_restart(mut server: NatsServers, log: JetStreamLog) {
    let log = Arc::new(log);
    let writer = {
        let log = Arc::clone(&log);
        tokio::spawn(async move {
            let mut offsets = Vec::new();
            for i in 0..400u32 {
                let offset = log
                    .append(0, i.to_be_bytes().to_vec())
                    .await
                    .unwrap_or_else(|e| panic!("append {i} retried until it landed: {e}"));
                offsets.push(offset);
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            offsets
        })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    tokio::task::block_in_place(|| server.restart(0)).expect("nats-server restarts");
    let offsets = writer.await.expect("writer");

    let records = everything(&*log).await;
    let payloads: Vec<u32> = records
        .iter()
        .map(|(_, p)| u32::from_be_bytes(p[..].try_into().expect("4 bytes")))
        .collect();
    assert_eq!(
        payloads,
        (0..400).collect::<Vec<_>>(),
        "each append once, in order"
    );
    assert_eq!(
        records.iter().map(|(o, _)| *o).collect::<Vec<_>>(),
        offsets,
        "each append's offset is where it is"
    );
}

/// The stream's leader, as the cluster reports it.
async fn leader(context: &async_nats::jetstream::Context, stream: &str) -> Option<String> {
    let mut stream = context.get_stream(stream).await.ok()?;
    let info = stream.info().await.ok()?;
    info.cluster.as_ref()?.leader.clone()
}

/// Whether every replica of `stream` is current.
async fn replicas_current(context: &async_nats::jetstream::Context, stream: &str) -> bool {
    let Ok(mut stream) = context.get_stream(stream).await else {
        return false;
    };
    let Ok(info) = stream.info().await else {
        return false;
    };
    info.cluster.as_ref().is_some_and(|cluster| {
        cluster.leader.is_some() && cluster.replicas.len() == 2 && {
            cluster.replicas.iter().all(|r| r.current)
        }
    })
}

/// A replica that was down while the stream was quiet comes back knowing only what its
/// store holds (nats-server 2.9 keeps the last message id in memory, rebuilt only within
/// the duplicate window). Once it leads, every acknowledged write is still there and the
/// holder goes on writing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_back_after_a_quiet_spell_keeps_every_write_when_it_leads() {
    let mut servers = NatsServers::cluster(3).expect("a 3-node cluster starts");
    let holder = Arc::new(Holder::default());
    *holder.0.lock().expect("holder") = "a";
    let client = connect_nats(&servers.url()).await.expect("connects");
    let context = async_nats::jetstream::new(client);
    let mut spec = StreamSpec::new("quiet-0", "quiet.0", 3);
    spec.duplicate_window = Duration::from_secs(1);
    let log = JetStreamLog::open(
        context.clone(),
        vec![spec],
        Some(Arc::new(Host {
            name: "a",
            holder: Arc::clone(&holder),
        })),
    )
    .await
    .expect("the holder opens its log");

    let mut written = Vec::new();
    let mut write = async |log: &JetStreamLog, round: &str| {
        for i in 0..10 {
            let payload = format!("{round}-{i}").into_bytes();
            let offset = log
                .append(0, payload.clone())
                .await
                .unwrap_or_else(|e| panic!("{round}: append {i}: {e}"));
            written.push((offset, payload));
        }
    };
    write(&log, "before").await;

    // A follower stops, and comes back after the stream has been quiet for longer than the
    // duplicate window.
    let leader_name = leader(&context, "quiet-0").await.expect("a leader");
    let follower = (0..3)
        .find(|&n| servers.name(n) != leader_name)
        .expect("a follower");
    tokio::task::block_in_place(|| servers.stop(follower)).expect("the follower stops");
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    tokio::task::block_in_place(|| servers.start(follower)).expect("the follower starts");
    write(&log, "while-catching-up").await;
    for _ in 0..100 {
        if replicas_current(&context, "quiet-0").await {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Leadership moves to it.
    let follower_name = servers.name(follower).to_owned();
    for _ in 0..20 {
        if leader(&context, "quiet-0").await.as_deref() == Some(&follower_name) {
            break;
        }
        let _ = context
            .client()
            .request("$JS.API.STREAM.LEADER.STEPDOWN.quiet-0", "".into())
            .await;
        tokio::time::sleep(Duration::from_millis(1_500)).await;
    }
    assert_eq!(
        leader(&context, "quiet-0").await.as_deref(),
        Some(&*follower_name),
        "the restarted replica leads"
    );
    write(&log, "after").await;

    assert_eq!(
        everything(&log).await,
        written,
        "every acknowledged write is in the log, read from the restarted replica"
    );
}

/// A TCP proxy to a NATS server that can hold back what the server sends (acknowledgements
/// among it) while the client's publishes still get through: acknowledgements are lost to
/// the client's timeout though their messages landed.
struct Proxy {
    url: String,
    hold: Arc<std::sync::atomic::AtomicBool>,
}

impl Proxy {
    async fn start(server: &str) -> Self {
        let server = server.trim_start_matches("nats://").to_owned();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("nats://{}", listener.local_addr().expect("addr"));
        let hold = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let held = Arc::clone(&hold);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(upstream) = tokio::net::TcpStream::connect(&server).await else {
                    continue;
                };
                let (mut client_read, mut client_write) = client.into_split();
                let (mut server_read, mut server_write) = upstream.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
                });
                let held = Arc::clone(&held);
                tokio::spawn(async move {
                    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
                    let mut buffer = vec![0u8; 64 * 1024];
                    loop {
                        let Ok(n) = server_read.read(&mut buffer).await else {
                            return;
                        };
                        // Also what was read while nothing was held yet.
                        while held.load(std::sync::atomic::Ordering::Acquire) {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                        if n == 0 || client_write.write_all(&buffer[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Self { url, hold }
    }

    fn hold(&self, hold: bool) {
        self.hold.store(hold, std::sync::atomic::Ordering::Release);
    }
}

/// A's log, the sole holder's, through a [`Proxy`] to `server`; acknowledgements time out
/// after half a second.
async fn behind_a_proxy(server: &NatsServers) -> (Proxy, JetStreamLog) {
    let proxy = Proxy::start(&server.url()).await;
    let holder = Arc::new(Holder::default());
    *holder.0.lock().expect("holder") = "a";
    let host = Host { name: "a", holder };
    let log = open_with(&proxy.url, Some(Duration::from_millis(500)), Arc::new(host)).await;
    (proxy, log)
}

/// Waits for `writers` (a minute each at most) and asserts that each of their `count`
/// appends is in `log` once, where it was told, and nothing else is.
async fn each_landed_once(log: &JetStreamLog, writers: Vec<Writer>, count: usize) {
    let mut written = BTreeSet::new();
    for writer in writers {
        let landed = tokio::time::timeout(Duration::from_secs(60), writer)
            .await
            .expect("the appends finish: none was lost");
        written.extend(landed.expect("writer"));
    }
    let records: BTreeSet<(u64, Vec<u8>)> = everything(log).await.into_iter().collect();
    assert_eq!(written.len(), count, "every append answered once");
    assert_eq!(
        records, written,
        "each append in the log once, at the offset it was told"
    );
}

/// Acknowledgements held back past their timeout (their messages landed): the fenced
/// writer publishes the appends again, is answered with where they landed before, mends its
/// chain, and every append is in the log once, where it was told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_whose_acknowledgements_were_lost_land_once() {
    let server = NatsServers::single().expect("nats-server starts");
    let (proxy, log) = behind_a_proxy(&server).await;
    let log = Arc::new(log);
    let writers = appending_tasks(&log, 16, 80, Duration::from_millis(10));
    for _ in 0..2 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        proxy.hold(true);
        tokio::time::sleep(Duration::from_millis(800)).await;
        proxy.hold(false);
    }
    each_landed_once(&log, writers, 16 * 80).await;
}

/// Appending tasks cancelled at any point (waiting to publish, publishing, or waiting for
/// the acknowledgement) leave the partition writable: their acknowledgements are still
/// awaited, so the window of publishes in flight never fills with answers nobody records.
/// What a cancelled append did is in the log at most once; what was answered is where it
/// was told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_cancelled_in_flight_leave_the_partition_writable() {
    let server = NatsServers::single().expect("nats-server starts");
    let holder = Arc::new(Holder::default());
    let log = Arc::new(open(&server.url(), "a", &holder).await);
    let mut answered = BTreeSet::new();
    let mut cut = 0;
    // Rounds until more were cut than a window holds: how many a round cuts depends on how
    // fast the appends go (with group commit, most of a round share a message or two).
    for round in 0..8 {
        if cut > IN_FLIGHT {
            break;
        }
        let mut cancelled = Vec::new();
        for i in 0..8 * IN_FLIGHT {
            let log = Arc::clone(&log);
            // From at once to about a round trip: every stage of an append gets cut.
            let within = Duration::from_micros(10) * u32::try_from(i % 40).expect("small");
            cancelled.push(tokio::spawn(async move {
                let payload = format!("cancelled-{round}-{i}").into_bytes();
                let answered = tokio::time::timeout(within, log.append(0, payload.clone())).await;
                (payload, answered)
            }));
        }
        for task in cancelled {
            match task.await.expect("task") {
                (payload, Ok(Ok(offset))) => {
                    answered.insert((offset, payload));
                }
                (_, Ok(Err(error))) => panic!("an append failed: {error}"),
                (_, Err(_elapsed)) => cut += 1,
            }
        }
    }
    assert!(
        cut > IN_FLIGHT,
        "more appends were cut ({cut}) than a window holds, or the test shows nothing"
    );

    let mut after = BTreeSet::new();
    for i in 0..(2 * IN_FLIGHT) {
        let payload = format!("after-{i}").into_bytes();
        let offset = tokio::time::timeout(Duration::from_secs(10), log.append(0, payload.clone()))
            .await
            .unwrap_or_else(|_| panic!("append after-{i} still waits: the partition stalled"))
            .expect("appends after the cancelled ones land");
        after.insert((offset, payload));
    }

    let records = everything(&*log).await;
    let payloads: Vec<&Vec<u8>> = records.iter().map(|(_, payload)| payload).collect();
    let distinct: BTreeSet<&Vec<u8>> = payloads.iter().copied().collect();
    assert_eq!(distinct.len(), payloads.len(), "no append landed twice");
    let records: BTreeSet<(u64, Vec<u8>)> = records.into_iter().collect();
    assert!(
        answered.is_subset(&records) && after.is_subset(&records),
        "every answered append is in the log where it was told"
    );
}

/// A client that cannot take a message at once (here: its queue of outgoing messages holds
/// one, and 16 tasks append): the appender gives its place back, and a
/// mender publishes its append and what queues behind it, waiting for the client. Every
/// append lands once, where it was told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_wait_for_a_busy_client_and_land_once() {
    let server = NatsServers::single().expect("nats-server starts");
    let client = async_nats::ConnectOptions::new()
        .client_capacity(1)
        .connect(server.url())
        .await
        .expect("connects");
    let context = async_nats::jetstream::new(client);
    let holder = Arc::new(Holder::default());
    *holder.0.lock().expect("holder") = "a";
    let host = Host { name: "a", holder };
    let log = Arc::new(
        JetStreamLog::open(context, streams(), Some(Arc::new(host)))
            .await
            .expect("opens"),
    );
    let writers = appending_tasks(&log, 16, 50, Duration::ZERO);
    each_landed_once(&log, writers, 16 * 50).await;
}

/// A record larger than the server takes is refused at once, naming its size and the
/// largest, instead of being retried for `RETRY_FOR` while the appends behind it wait; the
/// partition goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_too_large_for_the_server_is_refused_at_once() {
    let server = NatsServers::single().expect("nats-server starts");
    let holder = Arc::new(Holder::default());
    let log = open(&server.url(), "a", &holder).await;
    let client = connect_nats(&server.url()).await.expect("connects");
    client
        .flush()
        .await
        .expect("a round trip: the server's INFO is in");
    let largest = client.server_info().max_payload;
    assert!(largest > 0);
    let huge = vec![7u8; largest + 1];
    let started = std::time::Instant::now();
    let refused = log.append(0, huge.clone()).await;
    let Err(LogError::TooLarge { size, max }) = refused else {
        panic!("refused as too large: {refused:?}");
    };
    assert!(size == huge.len() && max < size, "{size} > {max}");
    assert!(
        matches!(
            log.append_many(vec![(0, b"small".to_vec()), (0, huge)])
                .await,
            Err(LogError::TooLarge { .. })
        ),
        "an append_many with one is refused too"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "at once, not retried"
    );
    let offset = log
        .append(0, b"after".to_vec())
        .await
        .expect("the partition goes on");
    assert_eq!(everything(&log).await, [(offset, b"after".to_vec())]);

    // The largest record there is room for lands, also behind another in flight (with
    // group commit: gathered into a message of its own, with the header that says so).
    let largest = vec![7u8; max];
    let (small, large) = tokio::join!(
        log.append(0, b"small".to_vec()),
        log.append(0, largest.clone())
    );
    let (small, large) = (
        small.expect("lands"),
        large.expect("the largest record lands"),
    );
    assert_eq!(
        everything(&log).await,
        [
            (offset, b"after".to_vec()),
            (small, b"small".to_vec()),
            (large, largest)
        ]
    );
}

/// One `append_many` of more records for a partition than its window holds: each record's
/// acknowledgement is awaited while the caller still publishes the next ones, so the
/// window empties as it fills. All land, in order, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_many_larger_than_the_window_lands_in_order() {
    let server = NatsServers::single().expect("nats-server starts");
    let holder = Arc::new(Holder::default());
    let log = open(&server.url(), "a", &holder).await;
    let payloads: Vec<Vec<u8>> = (0..4 * IN_FLIGHT)
        .map(|i| format!("many-{i}").into_bytes())
        .collect();
    let records = payloads.iter().map(|p| (0, p.clone())).collect();
    let offsets = tokio::time::timeout(Duration::from_secs(30), log.append_many(records))
        .await
        .expect("the append_many finishes: its window did not stall")
        .expect("appended");
    assert!(offsets.is_sorted(), "in the order given: {offsets:?}");
    let written: Vec<(u64, Vec<u8>)> = offsets.into_iter().zip(payloads).collect();
    assert_eq!(
        everything(&log).await,
        written,
        "each record once, where it was told"
    );
}

/// The acknowledgements of an `append_many`'s records are lost while the caller waits for
/// the first of them: the chain breaks at that one, and its mender waits for every record
/// in flight to settle, the later ones of the same call too. They settle without the
/// caller, the mender publishes again what failed, and every record lands once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_many_whose_acknowledgements_were_lost_lands_once() {
    let server = NatsServers::single().expect("nats-server starts");
    let (proxy, log) = behind_a_proxy(&server).await;
    proxy.hold(true);
    let payloads: Vec<Vec<u8>> = (0..8).map(|i| format!("held-{i}").into_bytes()).collect();
    let records = payloads.iter().map(|p| (0, p.clone())).collect();
    let appended = tokio::spawn(async move {
        let offsets = tokio::time::timeout(Duration::from_secs(20), log.append_many(records))
            .await
            .expect("the append_many finishes: its mender did not wait for ever")
            .expect("appended");
        (log, offsets)
    });
    tokio::time::sleep(Duration::from_millis(800)).await;
    proxy.hold(false);
    let (log, offsets) = appended.await.expect("append_many");
    let written: Vec<(u64, Vec<u8>)> = offsets.into_iter().zip(payloads).collect();
    let mut records = everything(&log).await;
    records.sort();
    let mut expected = written.clone();
    expected.sort();
    assert_eq!(records, expected, "each record once, where it was told");
}

/// A's view of the lease in the race below: while `armed`, the next answer it gives is the
/// one it read, but B takes the partition over (and fences it) between the read and the
/// answer, as when a lease expires right after its holder asked.
#[derive(Debug)]
struct Overtaken {
    url: String,
    holder: Arc<Holder>,
    armed: std::sync::atomic::AtomicBool,
    /// B's log, and when its takeover was done.
    successor: Mutex<Option<(std::time::Instant, JetStreamLog)>>,
}

#[async_trait]
impl Authority for Overtaken {
    async fn holds(&self) -> Result<bool, async_nats::Error> {
        let holds = *self.holder.0.lock().expect("holder") == "a";
        if self.armed.swap(false, std::sync::atomic::Ordering::AcqRel) {
            let successor = open(&self.url, "b", &self.holder).await;
            *self.successor.lock().expect("successor") =
                Some((std::time::Instant::now(), successor));
        }
        Ok(holds)
    }
}

/// Acknowledgements lost (their messages landed), and then, as the writer mends its chain
/// and publishes those appends again, another host fences the partition: the retries are
/// duplicates racing the fence. Every append the writer was told landed is in the log,
/// where it was told, and nothing of it lands after the fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_racing_a_takeover_land_before_the_fence_or_not_at_all() {
    let server = NatsServers::single().expect("nats-server starts");
    let proxy = Proxy::start(&server.url()).await;
    let holder = Arc::new(Holder::default());
    *holder.0.lock().expect("holder") = "a";
    let authority = Arc::new(Overtaken {
        url: server.url(),
        holder: Arc::clone(&holder),
        armed: std::sync::atomic::AtomicBool::new(false),
        successor: Mutex::new(None),
    });
    let zombie = Arc::new(
        open_with(
            &proxy.url,
            Some(Duration::from_millis(500)),
            authority.clone(),
        )
        .await,
    );
    let writers = write_until_fenced(&zombie, 16, Duration::from_millis(10));
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Acknowledgements stop reaching A; its publishes still land. Past their timeout it
    // mends its chain, and cannot read where the stream ends until they flow again.
    proxy.hold(true);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    authority
        .armed
        .store(true, std::sync::atomic::Ordering::Release);
    proxy.hold(false);

    let acknowledged = writers.await.expect("writers");
    let (taken_over, successor) = authority
        .successor
        .lock()
        .expect("successor")
        .take()
        .expect("B took the partition over while A mended its chain");
    let fence = last_fence(&server.url()).await;
    successor.append(0, b"b".to_vec()).await.expect("B writes");

    assert!(
        acknowledged.iter().any(|landed| landed.at > taken_over),
        "A was answered for appends it published again after B's fence (the duplicates)"
    );
    let records: BTreeSet<(u64, Vec<u8>)> = everything(&successor).await.into_iter().collect();
    let from_a: Vec<u64> = records
        .iter()
        .filter(|(_, p)| p.starts_with(b"a-"))
        .map(|(offset, _)| *offset)
        .collect();
    for Landed {
        offset, payload, ..
    } in &acknowledged
    {
        assert!(
            records.contains(&(*offset, payload.clone())),
            "{} is in the log at {offset}, where A was told it landed",
            String::from_utf8_lossy(payload)
        );
    }
    assert!(
        from_a.iter().all(|&offset| offset < fence),
        "nothing of A's lands after B's fence (at {fence}): {:?}",
        from_a.iter().max()
    );
}

/// A's view of the lease when the lease bucket cannot be reached: no answer while `silent`.
#[derive(Debug)]
struct Unreachable {
    holder: Arc<Holder>,
    silent: std::sync::atomic::AtomicBool,
}

#[async_trait]
impl Authority for Unreachable {
    async fn holds(&self) -> Result<bool, async_nats::Error> {
        if self.silent.load(std::sync::atomic::Ordering::Acquire) {
            return Err("the lease bucket does not answer".into());
        }
        Ok(*self.holder.0.lock().expect("holder") == "a")
    }
}

/// B fences the partition while A cannot learn whether it still holds it. A writes
/// nothing more: its appends wait, fail once they have waited for `RETRY_FOR` (saying
/// so), and once the lease answers, A is fenced. However long the lease stays silent, A
/// does not go on from where it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_that_cannot_reach_its_lease_writes_nothing_past_a_fence() {
    let server = NatsServers::single().expect("nats-server starts");
    let holder = Arc::new(Holder::default());
    *holder.0.lock().expect("holder") = "a";
    let authority = Arc::new(Unreachable {
        holder: Arc::clone(&holder),
        silent: std::sync::atomic::AtomicBool::new(false),
    });
    let zombie = Arc::new(open_with(&server.url(), None, authority.clone()).await);
    let first = zombie
        .append(0, b"a-first".to_vec())
        .await
        .expect("the holder writes");
    authority
        .silent
        .store(true, std::sync::atomic::Ordering::Release);
    let successor = open(&server.url(), "b", &holder).await;

    // Writers stop when fenced, or at the deadline (when a writer that went on would
    // never be).
    let deadline = std::time::Instant::now() + RETRY_FOR + Duration::from_secs(15);
    let mut writers = Vec::new();
    for task in 0..4u32 {
        let zombie = Arc::clone(&zombie);
        writers.push(tokio::spawn(async move {
            let (mut landed, mut gave_up) = (Vec::new(), Vec::new());
            for i in 0u32.. {
                if std::time::Instant::now() > deadline {
                    return (landed, gave_up, false);
                }
                match zombie.append(0, format!("a-{task}-{i}").into_bytes()).await {
                    Ok(offset) => landed.push(offset),
                    Err(LogError::Fenced { .. }) => return (landed, gave_up, true),
                    Err(other) => gave_up.push(other.to_string()),
                }
            }
            unreachable!()
        }));
    }
    // Longer than appends retry for.
    tokio::time::sleep(RETRY_FOR + Duration::from_secs(3)).await;
    authority
        .silent
        .store(false, std::sync::atomic::Ordering::Release);
    let (mut landed, mut gave_up) = (Vec::new(), Vec::new());
    for writer in writers {
        let (l, g, fenced) = writer.await.expect("writer");
        landed.extend(l);
        gave_up.extend(g);
        assert!(fenced, "A is fenced once the lease answers");
    }

    assert_eq!(
        landed,
        Vec::<u64>::new(),
        "no append of A's landed after the fence"
    );
    assert!(
        !gave_up.is_empty() && gave_up.iter().all(|e| e.contains("retried for")),
        "appends that waited out the silence failed, saying why: {gave_up:?}"
    );
    let after = successor.append(0, b"b".to_vec()).await.expect("B writes");
    let records = everything(&successor).await;
    assert_eq!(
        records,
        [(first, b"a-first".to_vec()), (after, b"b".to_vec())],
        "the log holds A's write from before the fence and B's after it, nothing else"
    );
}
