//! Leases in a JetStream KV bucket: taken by one host at a time, kept while renewed, taken
//! over once they expire, at once when released.

use std::time::{Duration, Instant};

use rewind_host::cluster::Layout;
use rewind_host::cluster::lease::{Leases, Renewal};
use rewind_host::log::{Authority, connect_nats};
use rewind_host::testing::nats::NatsServers;

const TTL: Duration = Duration::from_millis(500);

/// A host's leases, opened as a host starts (`Layout::join`): the bucket made, or found,
/// and written to before any lease is taken.
async fn leases(url: &str, host: &str) -> Leases {
    let context = async_nats::jetstream::new(connect_nats(url).await.expect("connects"));
    let layout = Layout {
        prefix: "leases".to_owned(),
        partitions: 4,
        replicas: 1,
        group_commit: false,
    };
    layout
        .join(&context, host, TTL)
        .await
        .expect("the bucket opens")
        .0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_lease_stays_with_its_holder() {
    let server = NatsServers::single().expect("nats-server starts");
    let mut a = leases(&server.url(), "a").await;
    let mut b = leases(&server.url(), "b").await;
    let lease = a
        .try_acquire(0)
        .await
        .expect("acquire")
        .expect("free: A takes it");
    assert!(
        b.try_acquire(0).await.expect("acquire").is_none(),
        "held: B does not"
    );
    let until = Instant::now() + 3 * TTL;
    while Instant::now() < until {
        assert_eq!(lease.renew().await, Renewal::Renewed);
        assert!(
            b.try_acquire(0).await.expect("acquire").is_none(),
            "a lease renewed within its TTL is not taken over"
        );
        tokio::time::sleep(TTL / 4).await;
    }
    assert!(lease.holds().await.expect("the lease bucket answers"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_is_taken_over_and_its_old_holder_learns_it() {
    let server = NatsServers::single().expect("nats-server starts");
    let mut a = leases(&server.url(), "a").await;
    let mut b = leases(&server.url(), "b").await;
    let old = a
        .try_acquire(3)
        .await
        .expect("acquire")
        .expect("A takes it");
    // A stops renewing; B looks until the lease has not moved for a TTL.
    let started = Instant::now();
    let new = loop {
        if let Some(lease) = b.try_acquire(3).await.expect("acquire") {
            break lease;
        }
        assert!(
            started.elapsed() < 10 * TTL,
            "B never took the expired lease"
        );
        tokio::time::sleep(TTL / 10).await;
    };
    assert!(
        started.elapsed() >= TTL,
        "not before a TTL: {:?}",
        started.elapsed()
    );
    assert_eq!(old.renew().await, Renewal::Lost);
    assert!(
        !old.holds().await.expect("the lease bucket answers"),
        "the old holder is fenced"
    );
    assert!(new.holds().await.expect("the lease bucket answers"));
    assert_eq!(
        a.holders(4).await.expect("holders"),
        [None, None, None, Some("b".to_owned())]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_lease_is_free_at_once() {
    let server = NatsServers::single().expect("nats-server starts");
    let mut a = leases(&server.url(), "a").await;
    let mut b = leases(&server.url(), "b").await;
    let lease = a
        .try_acquire(1)
        .await
        .expect("acquire")
        .expect("A takes it");
    lease.release().await;
    assert!(!lease.holds().await.expect("the lease bucket answers"));
    assert!(
        b.try_acquire(1).await.expect("acquire").is_some(),
        "B takes a released lease without waiting for a TTL"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_hosts_racing_for_a_lease_one_wins() {
    let server = NatsServers::single().expect("nats-server starts");
    let mut racers = Vec::new();
    for host in 0..8 {
        let url = server.url();
        racers.push(tokio::spawn(async move {
            let mut leases = leases(&url, &format!("h{host}")).await;
            leases.try_acquire(0).await.expect("acquire").is_some()
        }));
    }
    let mut winners = 0;
    for racer in racers {
        winners += u32::from(racer.await.expect("racer"));
    }
    assert_eq!(winners, 1, "compare-and-set lets exactly one host take it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_hosts_counts_every_host_that_beats_and_forgets_one_that_stopped() {
    let server = NatsServers::single().expect("nats-server starts");
    let mut a = leases(&server.url(), "a").await;
    let mut b = leases(&server.url(), "b").await;
    let mut c = leases(&server.url(), "c").await;
    a.heartbeat().await.expect("beats");
    b.heartbeat().await.expect("beats");
    c.heartbeat().await.expect("beats");
    assert_eq!(a.live_hosts().await.expect("counted"), 3, "A, B and C");
    // C leaves; B stops beating and, after a TTL of A's watching, is no longer counted.
    c.leave().await;
    let until = Instant::now() + 2 * TTL;
    while Instant::now() < until {
        a.heartbeat().await.expect("beats");
        a.live_hosts().await.expect("counted");
        tokio::time::sleep(TTL / 4).await;
    }
    assert_eq!(a.live_hosts().await.expect("counted"), 1, "only A");
    b.heartbeat().await.expect("beats");
    assert_eq!(a.live_hosts().await.expect("counted"), 2, "B beats again");
}

/// A host whose beats stopped for a TTL is taken for dead, and a host started under its
/// name takes the name over: the first learns it at its next beat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_whose_name_was_taken_over_is_told_at_its_next_beat() {
    let server = NatsServers::single().expect("nats-server starts");
    let mut first = leases(&server.url(), "a").await;
    first.heartbeat().await.expect("its own name");
    let mut second = leases(&server.url(), "a").await;
    second
        .heartbeat()
        .await
        .expect("the name is the second's now");
    let error = first
        .heartbeat()
        .await
        .expect_err("the name is taken")
        .to_string();
    assert!(
        error.contains("another process goes by this host's name `a` now"),
        "{error}"
    );
    second.heartbeat().await.expect("the second's still");
}
