//! The conformance suite every [`CheckpointStore`] must pass.
//!
//! Each case takes a factory that makes a fresh, empty store. A backend runs the whole suite
//! with [`checkpoint_conformance_tests!`].
//!
//! [`checkpoint_conformance_tests!`]: crate::checkpoint_conformance_tests

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::Arc;

use super::{
    Checkpoint, CheckpointId, CheckpointStore, Ended, KeyProgress, ParkedInput, PendingInput,
    SkippedInput,
};
use crate::store::{Marker, Wait, Waiting};

/// A fresh store, and whatever must live as long as it (a directory, a server).
pub struct Fresh {
    pub store: Arc<dyn CheckpointStore>,
    pub guard: Box<dyn Any + Send>,
}

impl std::fmt::Debug for Fresh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fresh")
            .field("store", &self.store)
            .finish_non_exhaustive()
    }
}

/// Makes a fresh, empty checkpoint store.
pub trait Factory: Fn() -> Fresh {}
impl<F: Fn() -> Fresh> Factory for F {}

/// Generates one `#[tokio::test]` per conformance case for the store `$factory` makes.
#[macro_export]
macro_rules! checkpoint_conformance_tests {
    ($factory:expr) => {
        $crate::checkpoint_conformance_tests!(@cases $factory;
            an_empty_store_has_no_checkpoint,
            the_newest_is_read_back_and_only_the_newest_k_are_kept,
            keeping_one_keeps_only_the_newest,
            a_large_checkpoint_round_trips,
        );
    };
    (@cases $factory:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let factory = $factory;
                $crate::checkpoint::conformance::$case(&factory).await;
            }
        )*
    };
}

/// A checkpoint whose every field depends on `id`.
pub fn checkpoint(id: CheckpointId) -> Checkpoint {
    Checkpoint {
        id,
        input_position: id * 10,
        keys: [(
            "ana".to_owned(),
            KeyProgress {
                next_sequence: id + 4,
                last_completed: id + 2,
                memory: [("seen".to_owned(), id.to_string())].into(),
            },
        )]
        .into(),
        pending: vec![
            PendingInput {
                key: "ana".to_owned(),
                sequence: id + 3,
                payload: format!("{{\"n\": {id}}}"),
                parked: Some(ParkedInput {
                    attempts: 3,
                    error: format!("attempt {id} trapped"),
                }),
                waiting: None,
            },
            PendingInput {
                key: "bo".to_owned(),
                sequence: 1,
                payload: "{}".to_owned(),
                parked: None,
                waiting: Some(Waiting {
                    action: "approve".to_owned(),
                    wait: Wait {
                        until: Some(1_796_000_000_000 + id),
                        signals: vec!["approve".to_owned(), "reject".to_owned()],
                    },
                }),
            },
        ],
        marker: Marker::at(vec![id, 0]),
        output_position: Some(id * 7),
        skipped: vec![
            SkippedInput {
                key: "ana".to_owned(),
                sequence: id + 1,
                ended: Ended::Skipped,
                by: "alice".to_owned(),
                reason: format!("checkpoint {id}"),
                command: format!("{id}-00"),
                also: Vec::new(),
            },
            SkippedInput {
                key: "bo".to_owned(),
                sequence: id + 2,
                ended: Ended::Cancelled,
                by: "bob".to_owned(),
                reason: String::new(),
                command: format!("{id}-01"),
                also: vec![format!("{id}-02")],
            },
        ],
    }
}

pub async fn an_empty_store_has_no_checkpoint(factory: &dyn Factory) {
    let fresh = factory();
    let store = &fresh.store;
    assert_eq!(store.latest().await.expect("latest"), None);
    assert_eq!(store.oldest().await.expect("oldest"), None);
    assert!(store.list().await.expect("list").is_empty());
}

pub async fn the_newest_is_read_back_and_only_the_newest_k_are_kept(factory: &dyn Factory) {
    let fresh = factory();
    let store = &fresh.store;
    for id in 1..=5 {
        store.save(&checkpoint(id), 3).await.expect("save");
        assert_eq!(
            store.latest().await.expect("latest"),
            Some(checkpoint(id)),
            "a saved checkpoint is the newest at once"
        );
    }
    assert_eq!(store.list().await.expect("list"), [3, 4, 5]);
    assert_eq!(store.oldest().await.expect("oldest"), Some(checkpoint(3)));
}

pub async fn keeping_one_keeps_only_the_newest(factory: &dyn Factory) {
    let fresh = factory();
    let store = &fresh.store;
    store.save(&checkpoint(1), 1).await.expect("save");
    store.save(&checkpoint(2), 1).await.expect("save");
    assert_eq!(store.list().await.expect("list"), [2]);
    assert_eq!(store.oldest().await.expect("oldest"), Some(checkpoint(2)));
}

pub async fn a_large_checkpoint_round_trips(factory: &dyn Factory) {
    let fresh = factory();
    let store = &fresh.store;
    // About 1.5 MB: 5,000 keys with 300 bytes of memory each.
    let mut large = checkpoint(1);
    large.keys = (0..5_000)
        .map(|k| {
            let progress = KeyProgress {
                next_sequence: k + 1,
                last_completed: k,
                memory: BTreeMap::from([("notes".to_owned(), format!("{k:0>300}"))]),
            };
            (format!("key-{k}"), progress)
        })
        .collect();
    store.save(&large, 2).await.expect("save");
    assert_eq!(store.latest().await.expect("latest"), Some(large));
}
